"""The fallback ladder at training time: an OOM mid-job switches config, loses nothing."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import autotune
from autotune.config import TrainConfig
from autotune.device._target import discover
from autotune.errors import AutotuneWarning, ConfigError
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import state_tensors
from autotune.models import gpt_batch, tiny_gpt
from autotune.result import Breakdown, Measurement, ModelInfo, TuneResult
from autotune.train import written_buffers
from autotune.train._identity import fingerprint
from autotune.verify._verifier import Verifier

CPU = torch.device("cpu")


def result_for(
    model: nn.Module,
    config: TrainConfig,
    *fallbacks: TrainConfig,
    written: tuple[str, ...] | None = None,
) -> TuneResult:
    m = Measurement(1, 1.0, 1.0)
    return TuneResult(
        config=config,
        predicted=m,
        measured=m,
        budget_bytes=2**40,
        target=discover("cpu").info(),
        model=ModelInfo(type(model).__name__, fingerprint(model), 0, (), written=written),
        breakdown=Breakdown(0, 0, 0, 0, 1),
        fallbacks=fallbacks,
    )


def peak(model: nn.Module, sample: object, config: TrainConfig, loss_fn=None) -> int:
    verifier = Verifier(
        copy.deepcopy(model), sample, device=CPU, budget_bytes=2**40, loss_fn=loss_fn, steps=1
    )
    measured, _ = verifier.trial(config)
    assert measured is not None
    return measured.peak_bytes


def gpt_case():
    model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64, dropout=0.1)
    batches = [gpt_batch(model.config, 8, seed=i) for i in range(5)]
    return model, batches, None


def bn_case():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(8 * 8 * 8, 4),
    )
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, 3, 8, 8, generator=g), torch.randint(4, (8,), generator=g))
        for _ in range(5)
    ]
    return model, batches, lambda out, batch: nn.functional.cross_entropy(out, batch[1])


@pytest.mark.parametrize("case", [gpt_case, bn_case], ids=["gpt-dropout", "cnn-batchnorm"])
def test_oom_at_step_k_switches_to_the_fallback_and_loses_nothing(case) -> None:
    model, batches, loss_fn = case()
    blocks = autotune.find_blocks(model)
    fast = TrainConfig(micro_batch_size=8, optimizer="sgd")
    frugal = TrainConfig(micro_batch_size=2, grad_accum_steps=4, checkpoint=blocks, optimizer="sgd")
    budget = (
        peak(model, batches[0], fast, loss_fn) + peak(model, batches[0], frugal, loss_fn)
    ) // 2
    k = 2
    # The buffers a step writes, found as the tuner finds them: only those are copied.
    probe = autotune.prepare(copy.deepcopy(model), fast, loss_fn=loss_fn)
    with probe, written_buffers(probe.model) as written:
        probe.step(batches[0])
    assert written == (["1.running_mean", "1.running_var", "1.num_batches_tracked",
                        "4.running_mean", "4.running_var", "4.num_batches_tracked"]
                       if case is bn_case else [])  # fmt: skip

    torch.manual_seed(5)
    result = result_for(model, fast, frugal, written=tuple(written))
    runner = autotune.prepare(copy.deepcopy(model), result, lr=0.05, loss_fn=loss_fn)
    losses = []
    for i, batch in enumerate(batches):
        if i == k:
            existing = state_tensors(runner.model, runner.optimizer, runner.scaler)
            with (
                pytest.warns(AutotuneWarning, match="runs again with fallback"),
                measure_peak(CPU, existing=existing, budget_bytes=budget),
            ):
                losses.append(runner.step(batch).item())
            assert runner.config == frugal and runner.fallbacks == []
        else:
            losses.append(runner.step(batch).item())

    torch.manual_seed(5)
    reference = autotune.prepare(copy.deepcopy(model), fast, lr=0.05, loss_fn=loss_fn)
    expected = []
    for i, batch in enumerate(batches):
        if i == k:
            reference.switch(frugal)
        expected.append(reference.step(batch).item())

    assert losses == pytest.approx(expected, rel=1e-5)
    for a, b in zip(
        runner.model.state_dict().values(), reference.model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_without_fallbacks_the_oom_is_raised() -> None:
    model, batches, _ = gpt_case()
    runner = autotune.prepare(model, TrainConfig(micro_batch_size=8), lr=0.01)
    with pytest.raises(torch.OutOfMemoryError), measure_peak(CPU, budget_bytes=1):
        runner.step(batches[0])


def test_an_oom_in_the_optimizer_step_is_not_retried(monkeypatch) -> None:
    model, batches, _ = gpt_case()
    fast, frugal = (
        TrainConfig(micro_batch_size=8),
        TrainConfig(micro_batch_size=4, grad_accum_steps=2),
    )
    runner = autotune.prepare(model, result_for(model, fast, frugal), lr=0.01)

    def oom(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(runner.optimizer, "step", oom)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        runner.step(batches[0])
    assert runner.config == fast and runner.fallbacks == [frugal]


def test_switch_keeps_optimizer_state_and_changes_precision() -> None:
    model, batches, _ = gpt_case()
    runner = autotune.prepare(model, TrainConfig(micro_batch_size=8), lr=0.01)
    runner.step(batches[0])
    state = {
        k: v.clone() for k, v in runner.optimizer.state[next(iter(runner.optimizer.state))].items()
    }
    runner.switch(TrainConfig(micro_batch_size=4, grad_accum_steps=2, precision="fp16"))
    assert runner.scaler is not None
    kept = runner.optimizer.state[next(iter(runner.optimizer.state))]
    assert all(torch.equal(state[k], kept[k]) for k in state)
    runner.step(batches[1])
    runner.switch(TrainConfig(micro_batch_size=8))
    assert runner.scaler is None
    with pytest.raises(ConfigError, match="cannot switch from optimizer"):
        runner.switch(TrainConfig(micro_batch_size=8, optimizer="sgd"))


def test_a_result_used_on_another_model_or_torch_warns_or_raises_when_strict() -> None:
    model, _, _ = gpt_case()
    result = result_for(model, TrainConfig(micro_batch_size=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autotune.prepare(copy.deepcopy(model), result)  # its own model: silent
    other = tiny_gpt(n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    with pytest.warns(AutotuneWarning, match="structure differs"):
        autotune.prepare(other, result)
    with pytest.raises(ConfigError, match="structure differs"):
        autotune.prepare(other, result, strict=True)
    old_torch = dataclasses.replace(
        result, target=dataclasses.replace(result.target, torch_version="2.4.0")
    )
    with pytest.warns(AutotuneWarning, match="torch 2.4.0"):
        autotune.prepare(copy.deepcopy(model), old_torch)
    elsewhere = dataclasses.replace(
        result, target=dataclasses.replace(result.target, name="Other CPU")
    )
    with pytest.raises(ConfigError, match="Other CPU"):
        autotune.prepare(copy.deepcopy(model), elsewhere, strict=True)


def test_an_oom_raised_to_the_caller_leaves_no_partial_gradients() -> None:
    model, batches, _ = gpt_case()
    config = TrainConfig(micro_batch_size=4)  # two micro-batches per step of 8
    reference = autotune.prepare(copy.deepcopy(model), config, lr=0.01)
    runner = autotune.prepare(model, config, lr=0.01)
    calls = []

    def second_micro_batch_ooms(module: nn.Module, args: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("injected")

    hook = model.blocks[0].register_forward_pre_hook(second_micro_batch_ooms)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        runner.step(batches[0])  # micro-batch 1's gradients exist when 2 runs out
    hook.remove()
    assert all(p.grad is None for p in model.parameters())
    # The caller retries the batch: it trains as if the failed attempt never happened.
    torch.manual_seed(0)
    retried = runner.step(batches[0])
    torch.manual_seed(0)
    assert torch.equal(retried, reference.step(batches[0]))
    for a, b in zip(model.parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_oom_in_the_optimizer_step_leaves_no_gradients(monkeypatch) -> None:
    model, batches, _ = gpt_case()
    runner = autotune.prepare(model, TrainConfig(micro_batch_size=8), lr=0.01)

    def oom(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(runner.optimizer, "step", oom)
    with pytest.raises(torch.OutOfMemoryError):
        runner.step(batches[0])
    assert all(p.grad is None for p in model.parameters())


def test_fallbacks_naming_missing_blocks_are_refused_by_prepare() -> None:
    from autotune.errors import BlockError

    model, _, _ = gpt_case()
    fast = TrainConfig(micro_batch_size=8)
    bad = TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint=("blocks.9",))
    with pytest.raises(BlockError, match=r"'blocks\.9'"):
        autotune.prepare(model, result_for(model, fast, bad))
    assert all("forward" not in m.__dict__ for m in model.modules())  # nothing wrapped


def test_an_empty_batch_is_refused_before_any_step() -> None:
    from autotune.errors import BatchError

    model, batches, _ = gpt_case()
    runner = autotune.prepare(model, TrainConfig(micro_batch_size=8), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    empty = tuple(t[:0] for t in batches[0])
    with pytest.raises(BatchError, match="empty"):
        runner.step(empty)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(BatchError, match="empty"):
        autotune.autotune(model, empty, 0.1, device="cpu")
