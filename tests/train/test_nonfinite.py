"""A non-finite loss never reaches the weights: the step raises NonFiniteError, the
weights keep their last finite values, and training can go on with the next batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autotune
from autotune import NonFiniteError, TrainConfig


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 1))


def loss_fn(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def batch(poisoned: bool = False) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    if poisoned:
        x[2, 3] = float("nan")
    return x


@pytest.mark.parametrize(
    "config",
    [
        TrainConfig(micro_batch_size=2, grad_accum_steps=2),
        TrainConfig(micro_batch_size=4, precision="bf16", checkpoint=("0",)),
        TrainConfig(micro_batch_size=4, precision="fp16"),
        TrainConfig(micro_batch_size=4, offload_optimizer=True),
    ],
    ids=["fp32", "bf16", "fp16", "offloaded"],
)
def test_a_nan_batch_leaves_the_weights_as_they_were(config: TrainConfig) -> None:
    model = net()
    with autotune.prepare(model, config, lr=1e-2, loss_fn=loss_fn, device="cpu") as runner:
        runner.step(batch())
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(NonFiniteError, match="weights keep their last finite values"):
            runner.step(batch(poisoned=True))
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        assert all(p.grad is None for p in model.parameters())
        assert torch.isfinite(runner.step(batch()))  # the next batch trains as usual
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_own_loop_with_the_handle_is_refused_the_same_way() -> None:
    model = net()
    with autotune.apply(model, TrainConfig(micro_batch_size=4), lr=1e-2, device="cpu") as handle:
        before = copy.deepcopy(model.state_dict())
        for chunk, weight in handle.micro_batches(batch(poisoned=True)):
            handle.backward(loss_fn(handle.model(chunk), chunk) * weight)
        with pytest.raises(NonFiniteError):
            handle.optimizer_step()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
