"""The user's own optimizer: tuned, estimated, prepared and applied as it is, its state
and step measured, its import path recorded, another one refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from user_optimizers import decoupled_adamw, sign_momentum

import autotune
from autotune._format import GIB
from autotune.errors import ConfigError
from autotune.models import gpt_batch, tiny_gpt

MIB = 2**20


def plain_losses(model: nn.Module, build: Any, batches: list[Any], accum: int = 1) -> list[float]:
    """A plain loop with the optimizer ``build`` makes: mean loss over ``accum`` chunks."""
    optimizer = build(model) if build is decoupled_adamw else build(list(model.parameters()))
    losses = []
    for batch in batches:
        chunks = [tuple(t.chunk(accum)[i] for t in batch) for i in range(accum)]
        total = 0.0
        for chunk in chunks:
            loss = model(*chunk) / accum
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


@pytest.fixture(scope="module")
def gpt() -> nn.Module:
    return tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)


@pytest.fixture(scope="module")
def tuned(gpt: nn.Module) -> autotune.TuneResult:
    space = autotune.SearchSpace(precisions=("fp32",))
    return autotune.autotune(
        gpt,
        gpt_batch(gpt.config, 4),
        256 * MIB / GIB,
        optimizer=decoupled_adamw,
        global_batch_size=8,
        space=space,
        device="cpu",
        n_trials=20,
    )


def test_tuned_with_the_users_adamw_trains_as_a_plain_loop(gpt, tuned, tmp_path) -> None:
    assert tuned.config.optimizer == "user_optimizers:decoupled_adamw"
    assert all(t.config.optimizer == tuned.config.optimizer for t in tuned.trials)
    assert tuned.measured is not None
    assert tuned.predicted.peak_bytes == tuned.measured.peak_bytes  # the CPU: to the byte
    path = tuned.save(tmp_path / "tuned.yaml")
    assert "optimizer: user_optimizers:decoupled_adamw" in path.read_text()
    loaded = autotune.load(path)
    batches = [gpt_batch(gpt.config, 8, seed=s) for s in range(3)]
    ours = copy.deepcopy(gpt)
    with autotune.prepare(ours, loaded, optimizer=decoupled_adamw, device="cpu") as runner:
        assert isinstance(runner.optimizer, torch.optim.AdamW)
        assert [g["betas"] for g in runner.optimizer.param_groups] == [(0.9, 0.95)] * 2
        losses = [runner.step(b).item() for b in batches]
    expected = plain_losses(
        copy.deepcopy(gpt), decoupled_adamw, batches, loaded.config.grad_accum_steps
    )
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(ours.parameters(), gpt.parameters(), strict=True):
        assert not torch.equal(p, q)  # it trained the copy, not the tuned model


def test_exports_say_how_to_pass_your_optimizer(tuned) -> None:
    from autotune.integrations import export

    hf = export(tuned, "hf")
    assert "optim" not in hf.settings
    assert any("Trainer(optimizers=(optimizer, None))" in w for w in hf.warnings)
    lightning = export(tuned, "lightning")
    assert any("build it with your factory" in w for w in lightning.warnings)


def test_a_result_refuses_another_optimizer_unless_told(gpt, tuned) -> None:
    with pytest.raises(ConfigError, match="tuned with optimizer user_optimizers:decoupled_adamw"):
        autotune.prepare(copy.deepcopy(gpt), tuned, optimizer=sign_momentum, device="cpu")
    with pytest.raises(ConfigError, match="sets its own: leave lr out"):
        autotune.prepare(copy.deepcopy(gpt), tuned, lr=1e-3, device="cpu")
    handle = autotune.apply(
        copy.deepcopy(gpt), tuned, optimizer=sign_momentum, other_optimizer=True, device="cpu"
    )
    assert handle.config.optimizer == "user_optimizers:sign_momentum"
    assert type(handle.optimizer).__name__ == "SignMomentum"
    handle.undo()


def test_an_unknown_optimizer_is_measured_and_applied(gpt) -> None:
    config = autotune.TrainConfig(micro_batch_size=2, grad_accum_steps=2)
    sample = gpt_batch(gpt.config, 4)
    predicted = autotune.estimate(gpt, sample, config, optimizer=sign_momentum, device="cpu")
    adamw = autotune.estimate(gpt, sample, config, device="cpu")
    params = sum(p.numel() * 4 for p in gpt.parameters())
    # One momentum per parameter, measured (AdamW's two and its step counters: more).
    assert predicted.costs.optimizer == params < adamw.costs.optimizer // 2
    ours = copy.deepcopy(gpt)
    batches = [gpt_batch(gpt.config, 4, seed=s) for s in range(4)]
    losses = []

    def step(handle: autotune.Applied, batch: Any) -> None:
        total = 0.0
        for chunk, weight in handle.micro_batches(batch):
            loss = handle.model(*chunk) * weight
            handle.backward(loss)
            total += loss.item()
        handle.optimizer_step()
        losses.append(total)

    with autotune.apply(ours, config, optimizer="user_optimizers:sign_momentum") as handle:
        step(handle, batches[0])  # the state is made
        with autotune.peak_memory(handle) as reading:
            for seed in range(1, len(batches)):  # made inside, as a loader makes them
                step(handle, gpt_batch(gpt.config, 4, seed=seed))
    # The CPU: to the byte, but for a loss scalar the runner keeps and this loop does not.
    assert reading.peak_bytes == pytest.approx(predicted.peak_bytes, abs=4)
    torch.testing.assert_close(losses, plain_losses(copy.deepcopy(gpt), sign_momentum, batches, 2))


def test_a_factory_of_the_model_offloads_to_host_masters(gpt) -> None:
    batches = [gpt_batch(gpt.config, 4, seed=s) for s in range(3)]
    losses = {}
    for offload in (False, True):
        config = autotune.TrainConfig(micro_batch_size=4, offload_optimizer=offload)
        with autotune.prepare(copy.deepcopy(gpt), config, optimizer=decoupled_adamw) as runner:
            losses[offload] = [runner.step(b).item() for b in batches]
            if offload:
                assert runner.host is not None
                held = {id(p) for g in runner.optimizer.param_groups for p in g["params"]}
                assert held == {id(m) for m in runner.host.masters}
    assert losses[True] == losses[False]


def test_a_factory_that_is_not_at_hand_says_how_to_pass_it(gpt) -> None:
    config = autotune.TrainConfig(optimizer="somewhere_else:make_optimizer")
    with pytest.raises(ConfigError, match=r"pass it: optimizer=<that function> \(or its import"):
        autotune.prepare(copy.deepcopy(gpt), config, device="cpu")
    with pytest.raises(ConfigError, match="cannot be imported here"):
        autotune.prepare(copy.deepcopy(gpt), config, optimizer="somewhere_else:make_optimizer")
    with pytest.raises(ConfigError, match="left 18 of the model's 28 trainable"):
        autotune.prepare(
            copy.deepcopy(gpt), autotune.TrainConfig(), optimizer=_without_biases, device="cpu"
        )


def _without_biases(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in params if p.dim() >= 2], lr=0.1)
