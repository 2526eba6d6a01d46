"""The CUDA logic of autotune, run on CPU against the caching-allocator stand-in.

On a device with a caching allocator, peaks are the allocator's reserved peak plus the
context; the profile's timeline is still in live bytes, counted by the tracker; the
allocator is capped at the budget during verification and the user's cap comes back
after. These tests run that code in CI (see tests/simulated_cuda.py); tests/device/test_cuda.py
runs it on a real GPU.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch

import autotune
from autotune._profile_data import PhaseKey
from autotune.config import Timeline
from autotune.cost._knobs import Knobs
from autotune.measure._memory_profile import memory_profile
from autotune.measure._peak import measure_peak
from autotune.measure._profiler import Profiler
from autotune.measure._tracker import LiveBytesTracker
from autotune.models import gpt_batch, tiny_gpt
from autotune.space import SearchSpace
from autotune.tuning._options import TuneOptions
from autotune.tuning._problem import make_problem

CPU = torch.device("cpu")
MIB = 2**20


def test_the_peak_is_the_reserved_peak_and_the_tracker_still_counts(simulated_cuda) -> None:
    tracker = LiveBytesTracker("cpu")
    with measure_peak(CPU, tracker=tracker, context_bytes=1000) as reading:
        tracker.phase(PhaseKey(1, "a"))
        x = torch.empty(11 * MIB // 4)  # 11 MiB live: a 12 MiB segment (2 MiB steps)
        del x
    assert reading.peak_bytes == 12 * MIB + 1000
    assert reading.live_peak_bytes == 11 * MIB
    (phase,) = reading.phases  # the phase records are there: the profile can divide by them
    assert phase.peak - phase.entry == 11 * MIB


def test_foreign_bytes_are_left_out(simulated_cuda) -> None:
    held = torch.empty(11 * MIB // 4)  # another tensor of the process: a 12 MiB segment
    with measure_peak(CPU, foreign_bytes=simulated_cuda.reserved) as reading:
        x = torch.empty(MIB)  # 4 MiB more: a 20 MiB segment (requests of 1 to 10 MiB)
        del x
    assert reading.peak_bytes == 20 * MIB
    del held


def test_the_cap_raises_and_the_users_cap_comes_back(simulated_cuda) -> None:
    simulated_cuda.cap = 512 * MIB  # what the user had set
    with pytest.raises(torch.OutOfMemoryError), measure_peak(CPU, budget_bytes=8 * MIB):
        torch.empty(16 * MIB // 4)
    assert simulated_cuda.cap == 512 * MIB


FP32 = autotune.SearchSpace(precisions=("fp32",), selective_checkpointing=False)
"""The space of the end-to-end runs here: what they check is the device, not the knobs."""


def test_the_context_is_read_again_once_training_has_loaded_its_kernels(
    simulated_cuda, monkeypatch
) -> None:
    from autotune.train._runner import Runner

    simulated_cuda.context = 10 * MIB  # what a fresh context holds
    step = Runner.step

    def first_step_loads_kernels(self: Runner, batch: object) -> object:
        simulated_cuda.context = 30 * MIB  # cuBLAS workspaces, lazily loaded kernels
        return step(self, batch)

    monkeypatch.setattr(Runner, "step", first_step_loads_kernels)
    model = tiny_gpt()
    result = autotune.autotune(
        model,
        gpt_batch(model.config, 4),
        128 * MIB / 2**30,
        global_batch_size=32,
        device="cpu",
        n_trials=12,
        space=FP32,
    )
    assert result.target.context_bytes == 30 * MIB
    assert result.breakdown.other >= 30 * MIB  # the prediction holds the whole context
    assert result.measured.peak_bytes <= result.budget_bytes
    peak, parts = autotune.estimate(model, gpt_batch(model.config, 4), device="cpu")
    assert parts.other >= 30 * MIB and peak > parts.other


def test_verification_releases_pinned_host_memory_between_configs(simulated_cuda) -> None:
    from autotune.config import TrainConfig
    from autotune.verify._verifier import Verifier

    model = tiny_gpt()
    verifier = Verifier(
        model, gpt_batch(model.config, 4), device=CPU, budget_bytes=2**30, loss_fn=None
    )
    measured, error = verifier.trial(TrainConfig(micro_batch_size=4, offload_optimizer=True))
    assert error is None and measured is not None
    assert simulated_cuda.host_cache_releases >= 2  # before the config and after it


def test_the_profile_timeline_is_in_live_bytes_as_on_cpu(simulated_cuda, gpt_profile) -> None:
    # gpt_profile was measured on the plain CPU (a session fixture, made before this test).
    model = tiny_gpt(n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    blocks = tuple(f"blocks.{i}" for i in range(3))
    profiler = Profiler(model, gpt_batch(model.config, 4), blocks, device=CPU, loss_fn=None)
    profile, _ = memory_profile(
        profiler,
        (Timeline("fp32"), Timeline("bf16")),
        ("adamw", "sgd"),
        device_name="sim",
        context_bytes=0,
        selective=True,  # as gpt_profile
    )
    for p in (Timeline("fp32"), Timeline("bf16")):
        mine, cpu = profile.precisions[p], gpt_profile.precisions[p]
        assert [ph.key for ph in mine.phases] == [ph.key for ph in cpu.phases]
        assert [ph.delta for ph in mine.phases] == [ph.delta for ph in cpu.phases]
        # A reserve per variant: kept, checkpointed, (offload: not run) and selective.
        assert len(mine.reserve) == 4 and all(line(16) >= 0 for line in mine.reserve)
    for o in ("adamw", "sgd"):
        # The optimizer step's transient is live bytes, not the whole reserved peak.
        assert profile.optimizers[o].step_peak_bytes == gpt_profile.optimizers[o].step_peak_bytes
        assert profile.optimizers[o].state_bytes == gpt_profile.optimizers[o].state_bytes


def test_foreign_is_what_the_allocator_already_holds(simulated_cuda) -> None:
    held = torch.empty(3 * MIB // 4)
    model = tiny_gpt()
    problem = make_problem(
        model, gpt_batch(model.config, 4), TuneOptions(budget_gb=1.0, device="cpu")
    )
    assert problem.foreign_bytes == simulated_cuda.reserved > 4 * MIB  # segments, not tensor bytes
    del held


def test_a_cache_left_by_earlier_work_is_not_foreign(simulated_cuda) -> None:
    """Measured on an H200: an estimate after an earlier run read that run's cached blocks
    as foreign, so the profile's growth into them went unseen (predicted 12% under)."""
    held = torch.empty(3 * MIB // 4)
    model = tiny_gpt()
    sample = gpt_batch(model.config, 4)
    spare = torch.empty(32 * MIB // 4)
    del spare  # its segment stays cached, unused
    cached = simulated_cuda.reserved
    problem = make_problem(model, sample, TuneOptions(budget_gb=1.0, device="cpu"))
    assert problem.foreign_bytes == simulated_cuda.reserved <= cached - 32 * MIB
    assert problem.foreign_bytes > 3 * MIB  # the live tensor's segment stays foreign
    del held


def test_autotune_end_to_end_on_a_caching_device(simulated_cuda) -> None:
    model = tiny_gpt(n_layer=4, n_embd=128, n_head=4, block_size=256, vocab_size=256)
    sample = gpt_batch(model.config, 4)
    simulated_cuda.context = 8 * MIB
    foreign = simulated_cuda.reserved  # the user's model: the tuner measures a copy
    simulated_cuda.high_water = simulated_cuda.reserved
    # Uncapped, profiling at micro-batch 4 with every block kept reserved 68 MiB here.
    budget_gb = 40 * MIB / 2**30
    result = autotune.autotune(
        model, sample, budget_gb, global_batch_size=16, device="cpu", n_trials=20, space=FP32
    )
    # The budget held from the first byte: what the driver would see (context included)
    # never passed it, profiling included.
    assert simulated_cuda.high_water - foreign + simulated_cuda.context <= result.budget_bytes
    assert result.measured.peak_bytes <= result.budget_bytes
    fitted = [t for t in result.trials if t.measured is not None]
    assert fitted and all(t.measured.peak_bytes <= result.budget_bytes for t in fitted)
    # Reserved bytes: whole segments, more than the live bytes a CPU run measures.
    assert result.measured.peak_bytes % (512) == 0
    assert simulated_cuda.cap is None  # verification's cap is gone
    assert isinstance(result.predicted.peak_bytes, int)
    # prepare() trains within the budget verification held it to, until the runner closes.
    work = copy.deepcopy(model)
    simulated_cuda.cap = 4 * 2**30  # what the user had set
    own = sum(p.untyped_storage().nbytes() for p in {*work.parameters(), *work.buffers()})
    foreign = simulated_cuda.reserved - own
    with autotune.prepare(work, result, device="cpu") as runner:
        assert simulated_cuda.cap == result.budget_bytes - simulated_cuda.context + foreign
        runner.step(gpt_batch(model.config, 16))
    assert simulated_cuda.cap == 4 * 2**30


def _profiler() -> Profiler:
    model = tiny_gpt(n_layer=2, n_embd=64, n_head=2, block_size=256, vocab_size=64)
    blocks = ("blocks.0", "blocks.1")
    return Profiler(model, gpt_batch(model.config, 4), blocks, device=CPU, loss_fn=None)


def _need(simulated_cuda, b1: int, b2: int) -> int:
    """Bytes the allocator reserves above a fresh model's to profile at ``b1`` and ``b2``."""
    profiler = _profiler()
    base = simulated_cuda.high_water = simulated_cuda.reserved
    profiler.optimizer("adamw", b1)
    profiler.memory(Timeline("fp32"), "adamw", b1, b2)
    need = simulated_cuda.high_water - base
    del profiler
    gc.collect()
    simulated_cuda.empty_cache()
    return need


def test_a_device_too_small_for_micro_batch_4_is_profiled_at_1_and_2(simulated_cuda) -> None:
    small, large = _need(simulated_cuda, 1, 2), _need(simulated_cuda, 2, 4)
    assert small < large
    profiler = _profiler()
    simulated_cuda.cap = simulated_cuda.reserved + small  # room for 1 and 2, not for 2 and 4
    profile, notes = memory_profile(
        profiler, (Timeline("fp32"),), ("adamw",), device_name="sim", context_bytes=0
    )
    assert Timeline("fp32") in profile.precisions
    assert notes == ["fp32: out of device memory while profiling at micro-batch 4"]
    assert {ph.key.micro for ph in profile.precisions[Timeline("fp32")].phases} == {1, 2}


def test_a_budget_below_every_block_kept_at_micro_batch_1_lifts_the_cap_and_says_so(
    simulated_cuda,
) -> None:
    small = _need(simulated_cuda, 1, 2)
    profiler = _profiler()
    cap = simulated_cuda.cap = simulated_cuda.reserved + small // 2  # a budget, not the device
    profile, notes = memory_profile(
        profiler, (Timeline("fp32"),), ("adamw",), device_name="sim", context_bytes=0
    )
    assert {ph.key.micro for ph in profile.precisions[Timeline("fp32")].phases} == {1, 2}
    assert any("above the budget" in n for n in notes), notes
    assert simulated_cuda.cap == cap  # lifted for those steps only


def test_a_device_too_small_for_micro_batch_2_is_a_profile_error(simulated_cuda) -> None:
    small = _need(simulated_cuda, 1, 2)
    profiler = _profiler()
    simulated_cuda.total = simulated_cuda.reserved + small // 2  # a device this small
    with pytest.raises(autotune.ProfileError, match="does not fit sim even at micro-batch 2"):
        memory_profile(
            profiler, (Timeline("fp32"),), ("adamw",), device_name="sim", context_bytes=0
        )


def test_what_the_allocator_reserves_is_predicted_at_sizes_never_profiled(simulated_cuda) -> None:
    from autotune.config import TrainConfig
    from autotune.cost._memory_model import MemoryModel

    profile, verifier, blocks, _user = _profiled_beside_the_user_s_model(simulated_cuda, ("adamw",))
    assert all(
        r is not None for r in profile.precisions[Timeline("fp32")].requests
    )  # both variants'
    memory = MemoryModel(profile)
    fit_error = live_error = 0
    for checkpoint in ((), blocks):
        for b in (8, 32):  # profiled at 2 and 4
            config = TrainConfig(micro_batch_size=b, checkpoint=checkpoint)
            predicted = memory.memory(config)[0]
            measured, error = verifier.trial(config)
            assert error is None and measured is not None
            # The allocator's model fed the profiled step's requests at this size: within
            # 0.1% (the line fitted over the profiled sizes was 26% under here: the 20 MiB
            # segments of requests between 1 and 10 MiB come and go with the size).
            assert abs(predicted - measured.peak_bytes) <= 0.001 * measured.peak_bytes
            live = memory.peaks_of(Knobs.given("fp32", "adamw", b, 1, memory.mask_of(checkpoint)))[
                1
            ]
            fit_error += abs(predicted - measured.peak_bytes)
            live_error += abs(live - measured.peak_bytes)
    assert fit_error < live_error / 2  # the fit, not the live bytes, makes the prediction


def test_the_other_expandable_segments_setting_is_predicted_as_it_runs(
    simulated_cuda, monkeypatch
) -> None:
    """Tuned with the allocator as it is, the model predicts the winner's peak with
    ``expandable_segments`` too; a stand-in whose allocator has it on runs that config."""
    import functools

    from simulated_cuda import SimulatedAllocator, SimulatedCuda

    from autotune.config import TrainConfig
    from autotune.cost._memory_model import MemoryModel
    from autotune.device import _backend
    from autotune.verify._verifier import Verifier

    model = tiny_gpt(n_layer=4, n_embd=128, n_head=4, block_size=128, vocab_size=256)
    sample = gpt_batch(model.config, 4)
    blocks = tuple(f"blocks.{i}" for i in range(4))
    profiler = Profiler(copy.deepcopy(model), sample, blocks, device=CPU, loss_fn=None)
    profile, _ = memory_profile(
        profiler, (Timeline("fp32"),), ("adamw",), device_name="sim", context_bytes=0
    )
    del profiler
    config = TrainConfig(micro_batch_size=8)
    other, _, predicted = MemoryModel(profile).other_allocator_mode(config)
    assert other == "expandable_segments:True"
    expandable = SimulatedAllocator(total=8 * 2**30, settings=other)
    monkeypatch.setitem(
        _backend._BACKENDS, "cpu", functools.partial(SimulatedCuda, allocator=expandable)
    )
    with expandable:  # the user's model and the tuner's copy, as when profiled
        held, work = copy.deepcopy(model), copy.deepcopy(model)
        verifier = Verifier(work, sample, device=CPU, budget_bytes=2**30, loss_fn=None)
        measured, error = verifier.trial(config)
    assert error is None and measured is not None
    assert abs(predicted - measured.peak_bytes) <= 0.001 * measured.peak_bytes
    del held


def test_a_gpu_is_discovered_through_its_backend(simulated_cuda, monkeypatch) -> None:
    from autotune.device import _backend
    from autotune.device._target import discover

    monkeypatch.setitem(_backend._BACKENDS, "cuda", _backend._BACKENDS["cpu"])
    simulated_cuda.context = 300 * MIB
    held = torch.empty(MIB)  # 4 MiB: a segment the allocator reserves
    target = discover("cuda")
    assert target.device == torch.device("cuda", 0) and target.name == "Simulated GPU"
    assert target.total_bytes == 8 * 2**30 and target.context_bytes == 300 * MIB
    assert target.free_bytes == target.total_bytes - simulated_cuda.reserved - 300 * MIB
    del held


def test_a_gpu_without_bf16_is_not_searched_in_bf16(simulated_cuda, monkeypatch) -> None:
    from simulated_cuda import SimulatedCuda

    monkeypatch.setattr(SimulatedCuda, "supports_bf16", lambda self: False)
    model = tiny_gpt()
    space = SearchSpace(precisions=("fp32", "bf16"))
    args = (model, gpt_batch(model.config, 4))
    problem = make_problem(*args, TuneOptions(budget_gb=1.0, device="cpu", space=space))
    assert problem.precisions == ("fp32",)
    with pytest.raises(autotune.BudgetError, match="none of the precisions"):
        only_bf16 = SearchSpace(precisions=("bf16",))
        make_problem(*args, TuneOptions(budget_gb=1.0, device="cpu", space=only_bf16))


class _Widening(torch.nn.Module):
    """Two transients a step, the second larger than the first: uncapped, the allocator
    keeps the first's segment cached while it takes the second's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            first = torch.ones(x.shape[0], 3 * 2**20, device=x.device).sum()  # 12 MiB each
            second = torch.ones(x.shape[0], 4 * 2**20, device=x.device).sum()  # 16 MiB each
        return self.a(x).sum() + 0 * (first + second)


def test_a_capped_replay_accepts_what_the_capped_allocator_runs(simulated_cuda) -> None:
    """The runner caps the allocator at the budget: before passing it the allocator gives
    back cached segments and retries. Replayed uncapped, this config is over the budget;
    replayed under the cap, it fits, and the stand-in allocator capped at the budget runs
    it at the peak the capped replay predicts."""
    import dataclasses

    from autotune.config import TrainConfig
    from autotune.cost._memory_model import MemoryModel
    from autotune.verify._verifier import Verifier

    def loss(out: torch.Tensor, batch: object) -> torch.Tensor:
        return out

    torch.manual_seed(0)
    work, sample = _Widening(), torch.randn(4, 64)
    profiler = Profiler(work, sample, (), device=CPU, loss_fn=loss)
    profile, _ = memory_profile(
        profiler, (Timeline("fp32"),), ("sgd",), device_name="sim", context_bytes=0
    )
    del profiler
    config = TrainConfig(micro_batch_size=4, optimizer="sgd")
    uncapped = MemoryModel(profile).memory(config)[0]
    budget = int(0.7 * uncapped)
    capped = MemoryModel(dataclasses.replace(profile, reserve_cap=budget)).memory(config)[0]
    measured, error = Verifier(work, sample, device=CPU, budget_bytes=budget, loss_fn=loss).trial(
        config
    )
    assert error is None and measured is not None
    assert uncapped > budget >= capped
    assert abs(capped - measured.peak_bytes) <= 0.001 * measured.peak_bytes


def test_each_optimizer_s_step_is_replayed_with_its_own_state(simulated_cuda) -> None:
    """The timelines are tracked with the first optimizer; another one's step and state
    take its place in the replay (each optimizer's step is recorded as it is profiled):
    SGD and Adafactor peaks within 0.1% of the stand-in's. Replayed with AdamW's, they
    were 1.3% and 2.8% over, and 0.45% under at one point."""
    from autotune.config import TrainConfig
    from autotune.cost._memory_model import MemoryModel

    optimizers = ("adamw", "sgd", "adafactor")
    profile, verifier, blocks, _user = _profiled_beside_the_user_s_model(simulated_cuda, optimizers)
    assert all(profile.optimizers[o].requests is not None for o in optimizers)
    memory = MemoryModel(profile)
    # No optimizer named (a data-parallel layout's caller): the timelines' own step.
    shares = memory.variant_shares(memory.mask_of(()))
    own = memory.device_bytes(0, Timeline("fp32"), 8, shares, optimizer="adamw")
    assert memory.device_bytes(0, Timeline("fp32"), 8, shares) == own
    assert memory.device_bytes(0, Timeline("fp32"), 8, shares, optimizer="sgd") != own
    for optimizer in optimizers[1:]:
        for b, checkpoint in ((8, ()), (32, blocks)):
            config = TrainConfig(micro_batch_size=b, checkpoint=checkpoint, optimizer=optimizer)
            measured, error = verifier.trial(config)
            assert error is None and measured is not None
            predicted = memory.memory(config)[0]
            assert abs(predicted - measured.peak_bytes) <= 0.001 * measured.peak_bytes, config


def _profiled_beside_the_user_s_model(
    allocator: object, optimizers: tuple[str, ...]
) -> tuple[Any, Any, tuple[str, ...], torch.nn.Module]:
    """A 4-block GPT's fp32 memory profile with ``optimizers``, measured on the tuner's
    copy while the user's model holds its own segments (left out as foreign), the
    verifier of that copy, its blocks, and the user's model (held by the caller as long
    as the foreign segments must stay)."""
    from autotune.verify._verifier import Verifier

    model = tiny_gpt(n_layer=4, n_embd=128, n_head=4, block_size=128, vocab_size=256)
    blocks = tuple(f"blocks.{i}" for i in range(4))
    sample = gpt_batch(model.config, 4)
    foreign = allocator.reserved  # type: ignore[attr-defined]  # the user's model
    work = copy.deepcopy(model)
    profiler = Profiler(work, sample, blocks, device=CPU, loss_fn=None, foreign_bytes=foreign)
    profile, _ = memory_profile(
        profiler, (Timeline("fp32"),), optimizers, device_name="sim", context_bytes=0
    )
    del profiler
    verifier = Verifier(
        work, sample, device=CPU, budget_bytes=2**30, loss_fn=None, foreign_bytes=foreign
    )
    return profile, verifier, blocks, model
