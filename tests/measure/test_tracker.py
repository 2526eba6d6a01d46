"""The live-bytes tracker, the CPU budget guard and measure_peak (autotune.measure)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

from autotune import TrainConfig, prepare
from autotune._profile_data import PhaseKey
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import LiveBytesTracker, state_tensors
from autotune.models import GPT

CPU = torch.device("cpu")


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each storage once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


# --- counting new storages -----------------------------------------------------------------


def test_new_storage_is_counted_exactly_and_freed() -> None:
    tracker = LiveBytesTracker()
    with tracker:
        a = torch.empty(1000)
        assert tracker.live == 4000
        b = torch.zeros(10, dtype=torch.float64)
        assert tracker.live == 4080
        del a
        assert tracker.live == 80
        del b
        assert tracker.live == 0
    assert tracker.peak == 4080


def test_views_in_place_ops_and_same_device_to_add_nothing() -> None:
    tracker = LiveBytesTracker()
    with tracker:
        a = torch.ones(1000)
        assert tracker.live == 4000
        views = [a.view(10, 100), a[10:], a.reshape(100, 10).t(), a.detach(), a.expand(2, 1000)]
        a.add_(1)
        a.mul_(2)
        same = [a.to("cpu"), a.to(torch.float32), a.cpu(), a.contiguous()]
        assert all(s.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() for s in same)
        assert tracker.live == 4000
        double = a.to(torch.float64)  # a real conversion: a new storage of 8000 bytes
        assert tracker.live == 12000
        del views, same, double
    assert tracker.peak == 12000


def test_peak_is_the_maximum_not_the_final_value() -> None:
    tracker = LiveBytesTracker()
    with tracker:
        big = torch.empty(1000)
        del big
        small = torch.empty(500)
        assert tracker.live == 2000
    assert tracker.peak == 4000
    del small


def test_other_devices_and_meta_tensors_are_not_counted() -> None:
    tracker = LiveBytesTracker()
    with tracker:
        meta = torch.empty(10_000, device="meta")
        assert tracker.live == 0
        cpu = torch.empty(10)
        assert tracker.live == 40
    assert meta.is_meta and cpu.numel() == 10
    cuda_tracker = LiveBytesTracker("cuda")
    with cuda_tracker:
        x = torch.empty(1000)
    assert cuda_tracker.live == 0 and cuda_tracker.peak == 0
    del x


def test_storages_freed_after_the_region_are_harmless() -> None:
    tracker = LiveBytesTracker()
    with tracker:
        kept = torch.empty(250)
        gone = torch.empty(100)
        del gone
    assert tracker.live == 1000
    after = torch.empty(1000)  # outside the mode: not seen
    del kept  # freed after the region: the finalizer only lowers live
    gc.collect()
    assert tracker.live == 0
    assert tracker.peak == 1400
    del after
    with tracker:  # the tracker can be entered again
        again = torch.empty(10)
        assert tracker.live == 40
    del again


def test_out_variant_that_resizes_a_storage_counts_the_growth() -> None:
    src = torch.randn(1000)
    out = torch.empty(0)
    tracker = LiveBytesTracker()
    tracker.track([src, out])
    assert tracker.live == 4000
    with tracker:
        torch.mul(src, 2, out=out)  # resizes out's storage in place: no new storage
        assert tracker.live == 8000
    assert tracker.peak == 8000
    del out
    assert tracker.live == 4000  # the grown size is what is released


# --- track(): storages that exist already ---------------------------------------------------


def test_track_counts_each_storage_once() -> None:
    a = torch.empty(100)
    tracker = LiveBytesTracker()
    tracker.track([a, a, a[10:], a.view(10, 10)])
    assert tracker.live == 400
    assert tracker.peak == 400
    tracker.track([a])
    assert tracker.live == 400


def test_track_parameters_and_gradients() -> None:
    model = nn.Linear(10, 5)
    model(torch.randn(3, 10)).sum().backward()
    tracker = LiveBytesTracker()
    tracker.track(state_tensors(model))
    assert tracker.live == 2 * (10 * 5 + 5) * 4  # weights and their grads, fp32


def test_track_counts_tied_weights_once(tiny_gpt_model: GPT) -> None:
    model = tiny_gpt_model
    assert model.head.weight is model.wte.weight
    params = list(model.parameters())  # parameters() already skips the duplicate
    tracker = LiveBytesTracker()
    tracker.track([model.head.weight, model.wte.weight, *params])
    assert tracker.live == sum(p.numel() * 4 for p in params)
    assert tracker.live == storage_bytes(params)


def test_tracked_storage_is_released_when_freed() -> None:
    a = torch.empty(100)
    tracker = LiveBytesTracker()
    tracker.track([a])
    with tracker:
        del a
        assert tracker.live == 0


# --- phases ------------------------------------------------------------------------------


def test_phases_record_entry_peak_and_exit() -> None:
    tracker = LiveBytesTracker()
    with tracker:
        base = torch.empty(100)  # 400 bytes before any phase
        tracker.phase(PhaseKey(1, "a"))
        tmp = torch.empty(1000)  # +4000
        del tmp
        keep = torch.empty(50)  # +200
        tracker.phase(PhaseKey(1, "b"))
        del keep
        tracker.phase(PhaseKey(1, "c"))
    tracker.close()
    a, b, c = tracker.phases
    assert (a.key, a.entry, a.peak, a.exit) == (PhaseKey(1, "a"), 400, 4400, 600)
    assert (b.key, b.entry, b.peak, b.exit) == (PhaseKey(1, "b"), 600, 600, 400)
    assert (c.key, c.entry, c.peak, c.exit) == (PhaseKey(1, "c"), 400, 400, 400)
    del base


# --- the budget guard --------------------------------------------------------------------


def test_budget_guard_raises_torch_out_of_memory_error() -> None:
    tracker = LiveBytesTracker(budget_bytes=3000)
    caught = None
    try:
        with tracker:
            ok = torch.empty(750)  # exactly 3000 bytes: at the budget is fine
            assert tracker.live == 3000
            torch.empty(1)
    except torch.OutOfMemoryError as exc:  # the real type, so user code catches it as such
        caught = exc
    assert caught is not None
    assert "3000" in str(caught)
    assert tracker.live == 3004  # the tensor that passed the budget was allocated ...
    del caught  # ... and its traceback holds it until the exception is gone
    gc.collect()
    assert tracker.live == 3000
    del ok


def test_the_guards_error_is_an_oom_to_the_tools_that_retry_smaller_batches() -> None:
    """accelerate's ``find_executable_batch_size`` (Hugging Face's ``auto_find_batch_size``)
    and Lightning's ``BatchSizeFinder`` recognise an OOM by its message."""
    accelerate = pytest.importorskip("accelerate.utils.memory")
    lightning = pytest.importorskip("lightning.pytorch.utilities.memory")
    with pytest.raises(torch.OutOfMemoryError) as caught, LiveBytesTracker(budget_bytes=0):
        torch.empty(1)
    assert accelerate.should_reduce_batch_size(caught.value)
    assert lightning.is_oom_error(caught.value)


def test_budget_guard_does_not_count_tracked_state_as_an_overflow() -> None:
    state = torch.empty(1000)
    tracker = LiveBytesTracker(budget_bytes=100)
    tracker.track([state])  # already above the budget: recorded, not raised
    assert tracker.live == 4000
    with pytest.raises(torch.OutOfMemoryError), tracker:
        torch.empty(1)


def _forward_backward(model: nn.Module, x: torch.Tensor, progress: list[str]) -> None:
    loss = model(x).square().mean()
    progress.append("forward")
    loss.backward()
    progress.append("backward")


@pytest.fixture
def mlp_peaks() -> tuple[int, int]:
    """(peak of the forward, peak of forward + backward) of ``mlp()`` on 32 samples."""
    model, x = mlp(), torch.randn(32, 64)
    tracker = LiveBytesTracker()
    tracker.track(state_tensors(model))
    with tracker:
        loss = model(x).square().mean()
        forward_peak = tracker.peak
        loss.backward()
    assert tracker.peak > forward_peak  # gradients are allocated in backward
    return forward_peak, tracker.peak


@pytest.mark.parametrize("where", ["forward", "backward", "nowhere"])
def test_budget_guard_in_forward_and_backward(where: str, mlp_peaks: tuple[int, int]) -> None:
    forward_peak, full_peak = mlp_peaks
    budget = {"forward": forward_peak - 1, "backward": forward_peak, "nowhere": full_peak}[where]
    model, x = mlp(), torch.randn(32, 64)
    tracker = LiveBytesTracker(budget_bytes=budget)
    tracker.track(state_tensors(model))
    progress: list[str] = []
    if where == "nowhere":
        with tracker:
            _forward_backward(model, x, progress)
        assert tracker.peak == full_peak
    else:
        with pytest.raises(torch.OutOfMemoryError), tracker:
            _forward_backward(model, x, progress)
        assert tracker.peak > budget
    expected = {"forward": [], "backward": ["forward"], "nowhere": ["forward", "backward"]}
    assert progress == expected[where]


# --- measure_peak on a real training step ---------------------------------------------------


def _warm_runner(model: GPT, batch: Any, optimizer: str = "adamw", precision: str = "fp32") -> Any:
    config = TrainConfig(
        micro_batch_size=4, grad_accum_steps=2, optimizer=optimizer, precision=precision
    )
    runner = prepare(model, config, lr=1e-3, device="cpu")
    runner.step(batch)  # optimizer state now exists: the next step is at steady state
    return runner


def test_measure_peak_of_a_training_step_holds_the_state(
    tiny_gpt_model: GPT, tiny_gpt_batch: Any
) -> None:
    runner = _warm_runner(tiny_gpt_model, tiny_gpt_batch)
    params = list(runner.model.parameters())
    param_bytes = storage_bytes(params)
    state = [v for s in runner.optimizer.state.values() for v in s.values()]
    state_bytes = storage_bytes(state)
    assert state_bytes >= 2 * param_bytes  # AdamW: exp_avg and exp_avg_sq
    with measure_peak(CPU, existing=state_tensors(runner.model, runner.optimizer)) as reading:
        runner.step(tiny_gpt_batch)
    floor = param_bytes + param_bytes + state_bytes  # weights + gradients + optimizer state
    assert reading.peak_bytes >= floor
    assert reading.peak_bytes < floor + 2_000_000  # activations of this tiny model are small

    # The same step again measures the same peak, to the byte, and fits that budget ...
    with measure_peak(
        CPU, existing=state_tensors(runner.model, runner.optimizer), budget_bytes=reading.peak_bytes
    ) as again:
        runner.step(tiny_gpt_batch)
    assert again.peak_bytes == reading.peak_bytes
    # ... while a budget below the persistent state cannot hold the step.
    with (
        pytest.raises(torch.OutOfMemoryError),
        measure_peak(
            CPU, existing=state_tensors(runner.model, runner.optimizer), budget_bytes=floor - 1
        ),
    ):
        runner.step(tiny_gpt_batch)


def test_measure_peak_without_existing_misses_the_state(
    tiny_gpt_model: GPT, tiny_gpt_batch: Any
) -> None:
    runner = _warm_runner(tiny_gpt_model, tiny_gpt_batch, optimizer="sgd")
    existing = state_tensors(runner.model, runner.optimizer)
    with measure_peak(CPU, existing=existing) as full:
        runner.step(tiny_gpt_batch)
    with measure_peak(CPU) as bare:
        runner.step(tiny_gpt_batch)
    # Parameters and momentum buffers were alive throughout: exactly their bytes differ.
    assert full.peak_bytes - bare.peak_bytes == storage_bytes(existing)


def test_measure_peak_with_a_tracker_returns_its_phases() -> None:
    tracker = LiveBytesTracker()
    kept = torch.empty(10)
    with measure_peak(CPU, existing=[kept], tracker=tracker) as reading:
        tracker.phase(PhaseKey(1, "alloc"))
        tmp = torch.empty(100)
        del tmp
    assert reading.peak_bytes == 440
    assert [(p.key, p.entry, p.peak, p.exit) for p in reading.phases] == [
        (PhaseKey(1, "alloc"), 40, 440, 40)
    ]


# --- state_tensors ---------------------------------------------------------------------------


def _ids(tensors: list[torch.Tensor]) -> set[int]:
    return {id(t) for t in tensors}


def test_state_tensors_collects_params_grads_buffers_and_optimizer_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = state_tensors(model, optimizer)
    assert _ids(before) == _ids(list(model.parameters()) + list(model.buffers()))
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    after = state_tensors(model, optimizer)
    grads = [p.grad for p in model.parameters()]
    opt_state = [v for s in optimizer.state.values() for v in s.values()]
    assert len(opt_state) == 3 * len(grads)  # step, exp_avg, exp_avg_sq per parameter
    expected = list(model.parameters()) + grads + list(model.buffers()) + opt_state
    assert _ids(after) == _ids(expected)
    assert len(list(model.buffers())) == 3  # BatchNorm's running mean, var and count


def test_state_tensors_collects_grad_scaler_state() -> None:
    param = nn.Parameter(torch.randn(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    assert state_tensors(scaler) == []  # lazily created on first use
    scaler.scale(param.sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    tensors = state_tensors(scaler)
    assert _ids(tensors) >= {id(scaler._scale), id(scaler._growth_tracker)}
    assert all(isinstance(t, torch.Tensor) for t in tensors)


def test_state_tensors_skips_none_and_sparse() -> None:
    sparse = nn.Embedding(10, 4, sparse=True)
    sparse(torch.tensor([1, 2])).sum().backward()
    assert sparse.weight.grad is not None and sparse.weight.grad.is_sparse
    assert _ids(state_tensors(sparse, None)) == {id(sparse.weight)}
