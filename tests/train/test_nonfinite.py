"""A non-finite loss never reaches the weights: the step raises NonFiniteError, the
weights keep their last finite values, and training can go on with the next batch."""

from __future__ import annotations

import copy

import pytest
import torch
from counted_ops import SYNCS, CountedOps
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


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_fused_optimizers_step_reads_nothing_off_the_device(precision: str) -> None:
    config = TrainConfig(micro_batch_size=2, grad_accum_steps=2, precision=precision)
    config = config.replace(optimizer="adamw_fused")
    model = net()
    with autotune.prepare(model, config, lr=1e-2, loss_fn=loss_fn, device="cpu") as runner:
        runner.step(batch())
        with CountedOps(SYNCS.__contains__) as syncs:
            runner.step(batch())
        assert syncs.count == 0  # the plain AdamW's check reads one flag a step
        before = copy.deepcopy(model.state_dict())
        # On the CPU the device's verdict has arrived by the end of the step.
        with pytest.raises(NonFiniteError, match="step 3 was not applied"):
            runner.step(batch(poisoned=True))
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        assert all(p.grad is None for p in model.parameters())
        runner.step(batch())
        assert not all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_refusal_reaches_a_host_ahead_of_the_device_within_two_steps(simulated_cuda) -> None:
    simulated_cuda.compute.lags = True  # the device's verdicts arrive only when waited for
    config = TrainConfig(micro_batch_size=4, optimizer="adamw_fused")
    model = net()
    with autotune.prepare(model, config, lr=1e-2, loss_fn=loss_fn, device="cpu") as runner:
        runner.step(batch())
        before = copy.deepcopy(model.state_dict())
        runner.step(batch(poisoned=True))  # step 2: refused on the device, not yet known
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        runner.step(batch())  # step 3: applied; step 2's verdict is one step old
        with pytest.raises(NonFiniteError, match=r"step 2 was not applied.*2 steps after it"):
            runner.step(batch())  # two steps old: waited for
        runner.step(batch(poisoned=True))
        with pytest.raises(NonFiniteError, match="step 5 was not applied"):
            runner.check_steps()
        runner.check_steps()  # said once
    assert all(torch.isfinite(p).all() for p in model.parameters())
