"""Memory-efficient optimizers: opt-in, measured, and a clear error when a library is missing."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

import autotune
from autotune.config import TrainConfig
from autotune.measure._tracker import state_tensors
from autotune.models import gpt_batch, tiny_gpt
from autotune.train._optimizers import available, build_optimizer


def state_bytes(optimizer_name: str) -> tuple[int, int]:
    model = tiny_gpt(n_layer=2, n_embd=128, n_head=2, block_size=16, vocab_size=64)
    runner = autotune.prepare(
        copy.deepcopy(model),
        TrainConfig(micro_batch_size=2, optimizer=optimizer_name),
        device="cpu",
    )
    batch = gpt_batch(model.config, 2)
    first = runner.step(batch).item()
    for _ in range(3):
        last = runner.step(batch).item()
    assert last < first  # it trains
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    return sum(t.untyped_storage().nbytes() for t in state_tensors(runner.optimizer)), params


@pytest.mark.skipif(not available("adamw8bit"), reason="bitsandbytes is not installed")
def test_adamw8bit_trains_with_about_a_quarter_of_adamw_state() -> None:
    eight, params = state_bytes("adamw8bit")
    full, _ = state_bytes("adamw")
    assert full >= 2 * params
    # Two uint8 states per quantised parameter plus per-block scales; small tensors stay fp32.
    assert eight < 0.45 * full


def test_adafactor_keeps_factored_state() -> None:
    small, params = state_bytes("adafactor")
    assert small < 0.5 * params


def test_fused_adamw_is_adamw_in_one_kernel_searched_where_the_device_has_it() -> None:
    from autotune.measure._profiler import Profiler
    from autotune.tuning._options import TuneOptions
    from autotune.tuning._problem import make_problem

    model = tiny_gpt(n_layer=2, n_embd=128, n_head=2, block_size=16, vocab_size=64)
    batch = gpt_batch(model.config, 2)
    blocks = autotune.find_blocks(model)
    measured = {}
    for name in ("adamw", "adamw_fused"):
        profiler = Profiler(
            copy.deepcopy(model), batch, blocks, device=torch.device("cpu"), loss_fn=None
        )
        measured[name] = profiler.optimizer(name, 2)
    foreach, fused = measured["adamw"], measured["adamw_fused"]
    assert fused.state_bytes == foreach.state_bytes  # the same two fp32 states
    # Measured, as every optimizer: the fused step holds no more than the foreach one.
    assert 0 < fused.step_peak_bytes <= foreach.step_peak_bytes
    # The same math: the weights after a few steps agree to rounding.
    runs = []
    for name in ("adamw", "adamw_fused"):
        runner = autotune.prepare(
            copy.deepcopy(model), TrainConfig(micro_batch_size=2, optimizer=name), device="cpu"
        )
        for _ in range(3):
            runner.step(batch)
        runs.append(torch.cat([p.detach().flatten() for p in runner.model.parameters()]))
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=1e-5)
    # The CPU has torch's fused kernel: the default space's AdamW is searched fused.
    problem = make_problem(model, batch, TuneOptions(budget_gb=1.0, device="cpu"))
    assert problem.space.optimizers == ("adamw_fused",)


def test_the_default_space_never_swaps_the_optimizer() -> None:
    assert autotune.SearchSpace().optimizers == ("adamw",)
    widened = autotune.SearchSpace(optimizers=["adamw", "adamw8bit", "adafactor"])
    assert widened.optimizers == ("adamw", "adamw8bit", "adafactor")


def test_adamw8bit_without_bitsandbytes_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails
    assert not available("adamw8bit")
    with pytest.raises(autotune.ConfigError, match=r"pip install 'autotune\[8bit\]'"):
        build_optimizer("adamw8bit", [torch.nn.Parameter(torch.zeros(2))], 1e-3)
    model = tiny_gpt(n_layer=1, n_embd=16, n_head=2, block_size=8, vocab_size=32)
    space = autotune.SearchSpace(optimizers=["adamw", "adamw8bit"])
    with pytest.raises(autotune.ConfigError, match="bitsandbytes"):
        autotune.autotune(model, gpt_batch(model.config, 2), budget_gb=1, space=space, device="cpu")
