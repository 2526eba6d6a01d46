"""CUDA paths, run for real on a GPU (skipped without one; see conftest)."""

from __future__ import annotations

import copy

import pytest
import torch

import autotune
from autotune.memory import measure_peak
from autotune.models import gpt_batch, tiny_gpt
from autotune.target import GIB, discover

pytestmark = pytest.mark.cuda
MIB = 2**20


def test_discover_reads_the_device() -> None:
    target = discover("cuda")
    assert target.device.type == "cuda"
    assert target.total_bytes > 1 * GIB
    assert 0 < target.context_bytes < 4 * GIB
    assert target.name


def test_measure_peak_counts_reserved_memory_and_context() -> None:
    device = torch.device("cuda")
    with measure_peak(device, context_bytes=123) as reading:
        x = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
        del x
    assert reading.peak_bytes >= 64 * MIB + 123


def test_budget_cap_raises_out_of_memory_by_type() -> None:
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    with pytest.raises(torch.OutOfMemoryError), measure_peak(device, budget_bytes=256 * MIB):
        torch.empty(512 * MIB, dtype=torch.uint8, device=device)
    # The cap is lifted afterwards.
    y = torch.empty(512 * MIB, dtype=torch.uint8, device=device)
    del y
    torch.cuda.empty_cache()


def test_checkpointing_on_cuda_trains_like_the_original() -> None:
    model = tiny_gpt(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=128)
    batch = gpt_batch(model.config, 8)
    losses = []
    for mask in ((), ("blocks.0", "blocks.1")):
        config = autotune.TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint=mask)
        runner = autotune.prepare(copy.deepcopy(model), config, device="cuda", lr=1e-3)
        losses.append([runner.step(batch).item() for _ in range(3)])
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_on_cuda(precision: str) -> None:
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    model = tiny_gpt(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=128)
    runner = autotune.prepare(
        model, autotune.TrainConfig(micro_batch_size=8, precision=precision), device="cuda"
    )
    loss = runner.step(gpt_batch(model.config, 8))
    assert loss.device.type == "cuda" and torch.isfinite(loss)
    assert (runner.scaler is not None) == (precision == "fp16")


def test_autotune_on_cuda_fits_and_predicts() -> None:
    model = tiny_gpt(n_layer=4, n_embd=256, n_head=4, block_size=256, vocab_size=1024)
    sample = gpt_batch(model.config, 8)
    target = discover("cuda")
    budget = target.context_bytes + 512 * MIB
    result = autotune.autotune(model, sample, budget / GIB, global_batch_size=64, device="cuda")
    assert result.measured.peak_bytes <= result.budget_bytes
    assert result.config.effective_batch_size == 64
    err = abs(result.predicted.peak_bytes - result.measured.peak_bytes) / result.measured.peak_bytes
    assert err <= 0.08, (result.predicted, result.measured)
    assert next(model.parameters()).device.type == "cpu"  # the user's model stayed put


def test_budget_below_the_context_is_too_small() -> None:
    model = tiny_gpt(n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    with pytest.raises(autotune.BudgetTooSmallError):
        autotune.autotune(model, gpt_batch(model.config, 4), 0.01, device="cuda")
