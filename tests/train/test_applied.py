"""``autotune.apply``: the tuned config in a loop of one's own trains exactly as Runner does."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_fallback import peak, result_for
from torch import nn

import autotune
from autotune import TrainConfig
from autotune.errors import AutotuneWarning, ConfigError
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import state_tensors
from autotune.models import gpt_batch, tiny_gpt

CPU = torch.device("cpu")


def gpt(dropout: float = 0.1) -> nn.Module:
    return tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64, dropout=dropout)


def batches(model: nn.Module, n: int = 4, size: int = 8) -> list[tuple[torch.Tensor, ...]]:
    return [gpt_batch(model.config, size, seed=i) for i in range(n)]


def own_loop(handle: autotune.Applied, batch: object, **step: object) -> torch.Tensor:
    """The README's recipe: what a user writes around the handle."""
    total = torch.zeros(())
    for chunk, weight in handle.micro_batches(batch):
        with handle.autocast():
            loss = handle.model(*chunk) * weight
        handle.backward(loss)
        total += loss.detach().float()
    handle.optimizer_step(**step)  # type: ignore[arg-type]
    return total


CONFIGS = [
    TrainConfig(micro_batch_size=2, grad_accum_steps=4, checkpoint=("blocks.1",)),
    TrainConfig(micro_batch_size=4, grad_accum_steps=2, precision="bf16"),
    TrainConfig(micro_batch_size=4, grad_accum_steps=2, precision="fp16", optimizer="sgd"),
    TrainConfig(micro_batch_size=8, checkpoint=("blocks.0", "blocks.1"), optimizer="adafactor"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe().replace(" ", "-"))
def test_the_readme_recipe_trains_exactly_as_the_runner(config: TrainConfig) -> None:
    model, data = gpt(), batches(gpt())
    torch.manual_seed(3)  # dropout draws the same masks in both
    runner = autotune.prepare(copy.deepcopy(model), config, lr=0.01)
    expected = [runner.step(b) for b in data]

    torch.manual_seed(3)
    handle = autotune.apply(copy.deepcopy(model), config, lr=0.01)
    handle.model.train()
    losses = [handle.run(own_loop, handle, b) for b in data]

    assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True))
    for a, b in zip(handle.model.parameters(), runner.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert (handle.scaler is None) == (config.precision != "fp16")


def test_clipping_and_a_scheduler_match_plain_pytorch() -> None:
    model, data = gpt(dropout=0.0), batches(gpt())
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2)
    runner = autotune.prepare(copy.deepcopy(model), config, lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(runner.optimizer, step_size=1, gamma=0.5)

    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    expected_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for batch in data:
        runner.step(batch, max_grad_norm=0.5, scheduler=scheduler)
        for half in (tuple(t[:4] for t in batch), tuple(t[4:] for t in batch)):
            (reference(*half) * 0.5).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        expected_scheduler.step()

    assert runner.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
    for a, b in zip(runner.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_clipping_bounds_the_norm_and_returns_it() -> None:
    model, (batch, *_) = gpt(dropout=0.0), batches(gpt())
    handle = autotune.apply(model, TrainConfig(micro_batch_size=8, precision="fp16"), lr=0.0)
    for chunk, weight in handle.micro_batches(batch):
        with handle.autocast():
            handle.backward(handle.model(*chunk) * weight)
    scale = handle.scaler.get_scale()  # type: ignore[union-attr]
    norm = handle.optimizer_step(max_grad_norm=1e-3)
    assert norm is not None and norm.item() > 1e-3  # unscaled: the scale is 65536
    assert scale > 1 and norm.item() < scale
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads == []  # the step frees them


def test_undo_restores_the_model_and_the_hugging_face_cache() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    assert model.config.use_cache
    before = {n: m.forward for n, m in model.named_modules()}

    handle = autotune.apply(model, TrainConfig(checkpoint=("transformer.h.1",)))
    assert model.config.use_cache is False
    assert "forward" in vars(model.transformer.h[1])  # wrapped on the instance
    handle.undo()

    assert model.config.use_cache is True
    assert {n: m.forward for n, m in model.named_modules()} == before
    assert "forward" not in vars(model.transformer.h[1])
    with pytest.raises(ConfigError, match="apply it again"):
        next(iter(handle.micro_batches({"input_ids": torch.zeros(2, 4, dtype=torch.long)})))


def test_apply_leaves_the_mode_and_builds_no_optimizer_until_asked() -> None:
    model = gpt()
    model.eval()
    handle = autotune.apply(model, TrainConfig(offload_optimizer=False))
    assert not model.training and handle._optimizer is None
    assert isinstance(handle.optimizer, torch.optim.AdamW)
    assert handle.optimizer is handle.optimizer


def test_the_handle_falls_back_on_an_oom_and_runs_the_same_batch_again() -> None:
    model, data = gpt(), batches(gpt(), n=3)
    blocks = autotune.find_blocks(model)
    fast = TrainConfig(micro_batch_size=8, optimizer="sgd")
    frugal = TrainConfig(micro_batch_size=2, grad_accum_steps=4, checkpoint=blocks, optimizer="sgd")
    budget = (peak(model, data[0], fast) + peak(model, data[0], frugal)) // 2

    torch.manual_seed(5)
    handle = autotune.apply(copy.deepcopy(model), result_for(model, fast, frugal), lr=0.05)
    handle.model.train()
    losses = [handle.run(own_loop, handle, data[0])]
    existing = state_tensors(handle.model, handle.optimizer, handle.scaler)
    with (
        pytest.warns(AutotuneWarning, match="runs again with fallback"),
        measure_peak(CPU, existing=existing, budget_bytes=budget),
    ):
        losses.append(handle.run(own_loop, handle, data[1]))
    assert handle.config == frugal and handle.fallbacks == []
    losses.append(handle.run(own_loop, handle, data[2]))

    torch.manual_seed(5)
    reference = autotune.prepare(copy.deepcopy(model), fast, lr=0.05)
    expected = [reference.step(data[0])]
    reference.switch(frugal)
    expected += [reference.step(b) for b in data[1:]]
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=0)


def test_without_fallbacks_run_is_a_plain_call_and_the_oom_is_raised() -> None:
    model, data = gpt(), batches(gpt(), n=1)
    handle = autotune.apply(model, TrainConfig(micro_batch_size=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(torch.OutOfMemoryError), measure_peak(CPU, budget_bytes=1):
            handle.run(own_loop, handle, data[0])
    assert all(p.grad is None for p in model.parameters())


def test_apply_refuses_what_is_not_a_model_or_a_config() -> None:
    with pytest.raises(ConfigError, match=r"apply\(\) takes a TrainConfig"):
        autotune.apply(gpt(), {"micro_batch_size": 2})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"torch.nn.Module"):
        autotune.apply("gpt2", TrainConfig())  # type: ignore[arg-type]
