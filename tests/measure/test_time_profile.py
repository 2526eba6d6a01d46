"""The time half of a profile: the ladder of micro-batch sizes, on a real profiler."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from autotune.config import Timeline
from autotune.device._backend import Backend
from autotune.errors import BatchError
from autotune.measure._memory_profile import memory_profile
from autotune.measure._profiler import Profiler
from autotune.measure._time_profile import fast_precisions, time_profile
from autotune.models import gpt_batch, tiny_gpt

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup() -> tuple[Profiler, object]:
    model = tiny_gpt()
    blocks = ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    profiler = Profiler(
        copy.deepcopy(model), gpt_batch(model.config, 4), blocks, device=CPU, loss_fn=None
    )
    draft, _ = memory_profile(
        profiler, (Timeline("fp32"),), ("adamw",), device_name="cpu", context_bytes=0
    )
    return profiler, draft


@pytest.mark.parametrize("limit", [16, 4])  # past the speed probe (micro-batch 8), and at it
def test_an_oom_while_timing_ends_the_ladder_with_a_note(setup, monkeypatch, limit: int) -> None:
    profiler, draft = setup
    timed = profiler.fwd_bwd_times

    def fwd_bwd_times(timeline: Timeline, b: int, variants: tuple[int, ...]) -> dict[int, float]:
        if b >= limit and 0 in variants:  # the kept pass runs out, where it is timed
            raise torch.OutOfMemoryError("CUDA out of memory. (injected: a shared device)")
        return timed(timeline, b, variants)

    monkeypatch.setattr(profiler, "fwd_bwd_times", fwd_bwd_times)
    profile = time_profile(
        profiler, draft, {Timeline("fp32"): 32}, tuple(range(1, 33)), device_name="cpu"
    )
    curve = profile.precisions[Timeline("fp32")].time
    assert curve is not None and max(curve.batch_sizes) == limit // 2
    assert any(f"out of device memory timing micro-batch {limit};" in n for n in profile.notes)


def test_an_oom_at_the_first_size_is_not_hidden(setup, monkeypatch) -> None:
    profiler, draft = setup

    def fwd_bwd_times(timeline: Timeline, b: int, variants: tuple[int, ...]) -> dict[int, float]:
        raise torch.OutOfMemoryError("CUDA out of memory. (injected)")

    monkeypatch.setattr(profiler, "fwd_bwd_times", fwd_bwd_times)
    with pytest.raises(torch.OutOfMemoryError):
        time_profile(
            profiler, draft, {Timeline("fp32"): 32}, tuple(range(1, 33)), device_name="cpu"
        )


@pytest.mark.parametrize(
    ("slowdown", "kept"), [({"bf16": 1.2, "fp16": 5.0}, ("fp32", "bf16")), ({}, None)]
)
def test_a_precision_much_slower_at_micro_batch_1_is_dropped_first(
    setup, monkeypatch, slowdown: dict[str, float], kept: tuple[str, ...] | None
) -> None:
    """A pass's time fixed (a timed one varies with the machine's load), slower for the
    precisions a device would only emulate."""
    profiler, _ = setup
    asked: list[tuple[str, int]] = []

    def fwd_bwd_time(timeline: Timeline, b: int, *, every: int = 0) -> float:
        asked.append((str(timeline), b))
        return 0.01 * b * slowdown.get(str(timeline), 1.0)

    monkeypatch.setattr(profiler, "fwd_bwd_time", fwd_bwd_time)
    monkeypatch.setattr(Backend, "emulates", lambda self, precision: False)  # any CPU's flags
    found, untrainable, notes, _ = fast_precisions(
        profiler, ("fp32", "bf16", "fp16"), (1, 2, 4), device_name="cpu"
    )
    assert asked == [("fp32", 1), ("bf16", 1), ("fp16", 1)]  # one small pass each
    assert untrainable == ()
    if kept is None:  # as fast as fp32 at 1: kept, for the time profile to judge
        assert found == ("fp32", "bf16", "fp16") and notes == []
    else:
        assert found == kept
        assert len(notes) == 1 and notes[0].startswith("fp16: ") and "not searched" in notes[0]


def test_a_precision_the_cpu_has_no_arithmetic_for_is_not_timed(setup, monkeypatch) -> None:
    """On an x86 CPU without AVX-512 FP16 or AMX-FP16, fp16 is converted to fp32 and back
    around every op: not one pass of it is timed, and a note says why."""
    profiler, _ = setup
    asked: list[str] = []
    monkeypatch.setattr(
        profiler, "fwd_bwd_time", lambda p, b, every=0: asked.append(str(p)) or 0.01
    )  # fmt: skip
    flags = {**torch.cpu.get_capabilities(), "architecture": "x86_64"}
    monkeypatch.setattr(
        torch.cpu, "get_capabilities", lambda: {**flags, "avx512_fp16": False, "amx_fp16": False}
    )  # fmt: skip
    found, _, notes, _ = fast_precisions(profiler, ("fp32", "fp16"), (1, 2), device_name="cpu")
    assert found == ("fp32",) and asked == ["fp32"]
    assert notes == ["fp16: cpu has no fp16 arithmetic of its own, not searched"]


def test_without_fp32_or_with_one_precision_one_pass_finds_the_smallest_size(
    setup, monkeypatch
) -> None:
    profiler, _ = setup
    timed = profiler.fwd_bwd_time
    asked: list[tuple[str, int]] = []

    def fwd_bwd_time(timeline: Timeline, b: int, *, every: int = 0) -> float:
        asked.append((str(timeline), b))
        return timed(Timeline("fp32"), b)

    monkeypatch.setattr(profiler, "fwd_bwd_time", fwd_bwd_time)
    found = fast_precisions(profiler, ("bf16", "fp16"), (2, 4), device_name="cpu")
    assert found[:3] == (("bf16", "fp16"), (), []) and asked == [("bf16", 2)]
    bf16 = Timeline("bf16")
    assert set(found.seconds) == {bf16} and set(found.seconds[bf16]) == {2}
    again = fast_precisions(profiler, ("fp32",), (3, 6), device_name="cpu")
    assert again[:3] == (("fp32",), (), [])
    assert asked == [("bf16", 2), ("fp32", 3)]  # the space's smallest size, never 1


def test_a_size_the_model_cannot_train_on_is_left_out_not_fatal(setup, monkeypatch) -> None:
    """The real pass fails at micro-batch 1 as BatchNorm does on one value per channel."""
    profiler, draft = setup
    model = profiler.model
    forward = model.forward

    def one_sample_fails(idx, targets=None):  # type: ignore[no-untyped-def]
        if idx.shape[0] == 1:
            raise ValueError("Expected more than 1 value per channel when training")
        return forward(idx, targets)

    monkeypatch.setattr(model, "forward", one_sample_fails)
    precisions, untrainable, notes, _ = fast_precisions(
        profiler, ("fp32",), (1, 2, 4, 8), device_name="cpu"
    )
    assert precisions == ("fp32",) and untrainable == (1,)
    assert len(notes) == 1 and notes[0].startswith("micro-batch 1: the model does not train")
    assert "Expected more than 1 value per channel" in notes[0]

    draft = dataclasses.replace(draft, untrainable=untrainable)
    profile = time_profile(profiler, draft, {Timeline("fp32"): 8}, (1, 2, 4, 8), device_name="cpu")
    assert profile.untrainable == (1,)
    assert 1 not in profile.precisions[Timeline("fp32")].time.batch_sizes  # never timed


def test_a_model_that_trains_on_no_size_is_a_batch_error(setup, monkeypatch) -> None:
    profiler, _ = setup
    calls: list[int] = []

    def broken(idx, targets=None):  # type: ignore[no-untyped-def]
        calls.append(idx.shape[0])
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(profiler.model, "forward", broken)
    with pytest.raises(BatchError, match=r"forward failed on the sample batch \(cut to 1 sample\)"):
        fast_precisions(profiler, ("fp32",), (1, 2, 4, 8, 16), device_name="cpu")
    assert calls == [1, 2, 4]  # a few sizes, then the model is at fault, not a size


def test_checkpointed_and_selective_passes_are_timed_on_the_kept_pass_runner(
    setup, monkeypatch
) -> None:
    """At the ladder's second and last sizes the three variants share one runner (one
    warm-up): the ratios come from passes timed in turn, and nothing is timed twice."""
    profiler, _ = setup
    draft, _ = memory_profile(
        profiler,
        (Timeline("fp32"),),
        ("adamw",),
        device_name="cpu",
        context_bytes=0,
        selective=True,
    )
    assert draft.precisions[Timeline("fp32")].selective
    timed = profiler.fwd_bwd_times
    asked: list[tuple[int, tuple[int, ...]]] = []

    def fwd_bwd_times(timeline: Timeline, b: int, variants: tuple[int, ...]) -> dict[int, float]:
        asked.append((b, tuple(variants)))
        return timed(timeline, b, variants)

    monkeypatch.setattr(profiler, "fwd_bwd_times", fwd_bwd_times)
    profile = time_profile(
        profiler, draft, {Timeline("fp32"): 16}, (1, 2, 4, 8, 16), device_name="cpu"
    )
    curve = profile.precisions[Timeline("fp32")].time
    assert curve is not None and curve.ckpt_batch_sizes == (2, 16)
    assert len(curve.ckpt_ratio) == len(curve.selective_ratio) == 2
    assert (2, (0, 1, 3)) in asked and (16, (0, 1, 3)) in asked
    sizes = [b for b, _ in asked]
    assert len(sizes) == len(set(sizes))  # every size timed once


@pytest.mark.parametrize(("bf16", "dropped"), [((1.55, 1.7, 1.7), True), ((1.7, 1.5, 1.5), False)])
def test_a_precision_near_the_slow_line_is_timed_again_before_it_is_dropped(
    setup, monkeypatch, bf16: tuple[float, ...], dropped: bool
) -> None:
    """One timing near 1.6x fp32's must not decide: the median of three pairs does."""
    profiler, _ = setup
    ratios = iter(bf16)
    monkeypatch.setattr(
        profiler,
        "fwd_bwd_time",
        lambda timeline, b: 1.0 if timeline == Timeline("fp32") else next(ratios),
    )
    fast = fast_precisions(profiler, ("fp32", "bf16"), (1, 2, 4), device_name="cpu")
    assert ("bf16" not in fast.precisions) is dropped
    assert next(ratios, None) is None  # all three timed


@pytest.mark.parametrize(
    ("at_8", "fits", "outrun"), [(1.3, True, True), (1.1, True, False), (1.3, False, False)]
)
def test_a_precision_outrun_where_the_other_fits_is_timed_no_further(
    setup, monkeypatch, at_8: float, fits: bool, outrun: bool
) -> None:
    """fp32 alike at micro-batch 1 (a pass of overheads) and ``at_8`` times bf16's at the
    probe: outrun by more than the noise where bf16 fits wherever fp32 does, it is not
    timed up its ladder nor searched, and a note says why; nearer, or where it fits
    configs bf16 does not, its ladder is timed."""
    profiler, draft = setup
    fp32, bf16 = Timeline("fp32"), Timeline("bf16")
    draft = dataclasses.replace(
        draft, precisions={**draft.precisions, bf16: draft.precisions[fp32]}
    )
    asked: list[tuple[str, int]] = []

    def fwd_bwd_times(timeline: Timeline, b: int, variants: tuple[int, ...]) -> dict[int, float]:
        asked.append((str(timeline), b))
        slower = at_8 if timeline == fp32 and b > 1 else 1.0
        return {v: 0.01 * b * slower * (1.5 if v else 1.0) for v in variants}

    monkeypatch.setattr(profiler, "fwd_bwd_times", fwd_bwd_times)
    timed = {fp32: {1: 0.01}, bf16: {1: 0.01}}  # as fast_precisions left them
    profile = time_profile(
        profiler, draft, {fp32: 32, bf16: 32}, (1, 2, 4, 8, 16, 32), device_name="cpu",
        timed=timed, fits_wherever=lambda q, p: fits,
    )  # fmt: skip
    at = [b for p, b in asked if p == "fp32"]
    if outrun:
        assert list(profile.precisions) == [bf16] and at == [8]
        assert any(n.startswith("fp32: the time of bf16 times 1.00x at 1, 1.30x at 8 (micro-batch)") for n in profile.notes)  # fmt: skip
    else:
        assert set(profile.precisions) == {fp32, bf16} and 32 in at


def test_a_precision_compiled_too_is_not_outrun_by_its_eager_times() -> None:
    """Its compiled timeline was not compared with the other's: both stay."""
    from autotune.measure._time_profile import _drop_outrun

    fp32, compiled, bf16 = Timeline("fp32"), Timeline("fp32", "blocks"), Timeline("bf16")
    feasible = {fp32: 32, compiled: 32, bf16: 32}
    times = {fp32: {1: 0.01, 8: 0.13}, compiled: {1: 0.01, 8: 0.09}, bf16: {1: 0.01, 8: 0.1}}
    notes: list[str] = []
    _drop_outrun(feasible, times, notes, lambda q, p: True, "cpu")
    assert set(feasible) == {fp32, compiled, bf16} and notes == []
    del feasible[compiled], times[compiled]
    _drop_outrun(feasible, times, notes, lambda q, p: True, "cpu")
    assert set(feasible) == {bf16} and len(notes) == 1
