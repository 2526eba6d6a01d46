"""The verifier leaves the tuner's model clean after every configuration it runs."""

from __future__ import annotations

import copy

import pytest
import torch

from autotune.config import TrainConfig
from autotune.measure import measure_peak, state_tensors
from autotune.models import gpt_batch, tiny_gpt
from autotune.train import prepare, step_batch, tensors_on
from autotune.train._runner import Runner
from autotune.verify._verifier import Verifier

CPU = torch.device("cpu")


def verifier() -> Verifier:
    model = tiny_gpt()
    return Verifier(
        copy.deepcopy(model),
        gpt_batch(model.config, 4),
        device=CPU,
        budget_bytes=2**40,
        loss_fn=None,
    )


def test_an_offloaded_optimizer_leaves_no_hooks_behind() -> None:
    v = verifier()
    for _ in range(2):
        measured, error = v.trial(TrainConfig(micro_batch_size=4, offload_optimizer=True))
        assert error is None and measured is not None
    assert not any(p._post_accumulate_grad_hooks for p in v.model.parameters())
    assert all(p.grad is None for p in v.model.parameters())


def test_an_oom_mid_step_leaves_no_gradient_on_either_side(monkeypatch) -> None:
    # The second micro-batch runs out of memory while the first one's gradients are still
    # on the device (an offloaded optimizer takes them to the host only in the last one).
    calls = {"n": 0}
    forward_loss = Runner.forward_loss

    def failing(self: Runner, chunk: object, weight: float = 1.0) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CPU out of memory. (injected)")
        return forward_loss(self, chunk, weight)

    monkeypatch.setattr(Runner, "forward_loss", failing)
    v = verifier()
    config = TrainConfig(micro_batch_size=2, grad_accum_steps=2, offload_optimizer=True)
    measured, error = v.trial(config)
    assert measured is None and error is not None and "out of memory" in error
    assert all(p.grad is None for p in v.model.parameters())
    assert not any(p._post_accumulate_grad_hooks for p in v.model.parameters())


def _whole_step_peak(v: Verifier, config: TrainConfig) -> int:
    """The peak of a whole step of ``config`` (every micro-batch of its accumulation)
    after a whole step that made the optimizer's state, measured directly."""
    batch = step_batch(v.sample, config.effective_batch_size, config.micro_batch_size)
    runner = prepare(v.model, config, lr=1e-6, device=CPU)
    try:
        runner.step(batch)
        state = state_tensors(runner.model, runner.optimizer)
        if runner.host is not None:  # an offloaded optimizer's host copies: the CPU's memory
            state += runner.host.pinned_tensors()
        with measure_peak(CPU, existing=[*state, *tensors_on(batch, CPU)]) as reading:
            runner.step(batch)
        return reading.peak_bytes
    finally:
        runner.close()


@pytest.mark.parametrize(
    "config",
    [
        TrainConfig(micro_batch_size=2, grad_accum_steps=8, checkpoint=("blocks.0",)),
        TrainConfig(micro_batch_size=2, grad_accum_steps=8, offload_optimizer=True),
    ],
    ids=["checkpointed", "optimizer-offloaded"],
)
def test_a_peak_is_measured_over_two_micro_batches_a_step_and_is_the_whole_steps(
    config: TrainConfig,
) -> None:
    """Every config's peak is measured over one micro-batch (the optimizer's state made),
    then two and a step under the tracker, with the step's whole batch held; that peak is
    the whole accumulation's. A fallback (kept for its memory) runs those alone and claims
    no speed; a timed config's timed steps are whole."""
    v = verifier()
    rows: list[int] = []
    hook = v.model.register_forward_pre_hook(lambda m, args: rows.append(len(args[0])))
    alone, error = v.trial(config, timed=False)
    assert error is None and alone is not None
    assert rows == [2, 2, 2]  # one micro-batch, then two and the step
    assert alone.samples_per_s == 0.0 and alone.step_s == 0.0
    rows.clear()
    timed, error = v.trial(config)
    assert error is None and timed is not None and timed.samples_per_s > 0
    assert rows[:3] == [2, 2, 2] and len(rows) >= 3 + 3 * 8  # then whole steps, timed
    rows.clear()
    whole = _whole_step_peak(v, config)
    hook.remove()
    assert len(rows) == 2 * 8
    assert alone.peak_bytes == timed.peak_bytes == whole


def test_a_config_slower_than_the_best_so_far_stops_after_two_timed_steps() -> None:
    """Timed against a speed it cannot reach, a config runs two timed steps after its
    peak's (its fastest already far behind), and its speed is still measured; against
    none, at least three."""
    v = verifier()
    steps: list[int] = []
    hook = v.model.register_forward_pre_hook(lambda m, args: steps.append(1))
    config = TrainConfig(micro_batch_size=4)
    lost, error = v.trial(config, beat=1e9)
    assert error is None and lost is not None and lost.samples_per_s > 0
    assert len(steps) == 2 + 2  # the warm-up and the peak's step (one micro-batch), two timed
    steps.clear()
    plain, error = v.trial(config)
    hook.remove()
    assert error is None and plain is not None and len(steps) >= 2 + 3
