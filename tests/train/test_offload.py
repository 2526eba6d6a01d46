"""Offload on CPU: the same math as without it, and the accounting the cost model relies on.

On a real CPU host memory is device memory and offload saves nothing (the last tests
here). The rest runs the CPU as a device with separate host memory (``SeparateHost``):
the offload code runs all the same (plain copies), and what it keeps on the host is left
out of the tracker, as on CUDA it is not device memory.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random
from collections.abc import Iterator

import pytest
import torch

import autotune
from autotune._profile_data import Profile, Transfer
from autotune.config import Timeline, TrainConfig
from autotune.cost._candidates import too_small
from autotune.cost._chooser import Chooser
from autotune.cost._cost_model import CHECKPOINT, KEEP, OFFLOAD, CostModel
from autotune.cost._cost_model import min_cost_choice as _min_cost_choice
from autotune.cost._knobs import Knobs
from autotune.device._target import discover
from autotune.measure._collectives import measure_transfer
from autotune.measure._memory_profile import memory_profile
from autotune.measure._profiler import Profiler
from autotune.measure._tracker import LiveBytesTracker, state_tensors
from autotune.models import gpt_batch, tiny_gpt
from autotune.space import SearchSpace
from autotune.verify._verifier import Verifier

CPU = torch.device("cpu")
BLOCKS = ("blocks.0", "blocks.1", "blocks.2")
FAST = Transfer(d2h_bytes_per_s=1e12, h2d_bytes_per_s=1e12, host_limit_bytes=2**40)


@pytest.fixture(scope="module", autouse=True)
def separate_host() -> Iterator[None]:
    from simulated_cuda import SeparateHost

    from autotune.device import _backend

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(_backend._BACKENDS, "cpu", SeparateHost)
        yield


@pytest.fixture
def real_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from autotune.device import _backend

    monkeypatch.setitem(_backend._BACKENDS, "cpu", _backend.Backend)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_gpt(n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64)


@pytest.fixture(scope="module")
def sample(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt_batch(model.config, 4)


@pytest.fixture(scope="module")
def offload_profile(model: torch.nn.Module, sample: object) -> Profile:
    profiler = Profiler(copy.deepcopy(model), sample, BLOCKS, device=CPU, loss_fn=None)
    profile, _ = memory_profile(
        profiler,
        (Timeline("fp32"), Timeline("bf16")),
        ("adamw", "sgd"),
        device_name="cpu",
        context_bytes=0,
        transfer=FAST,
    )
    return profile


def train(model: torch.nn.Module, config: TrainConfig, steps: int = 3, switch=None):
    torch.manual_seed(1)
    work = copy.deepcopy(model)
    runner = autotune.prepare(work, config, lr=1e-3, device="cpu")
    batch = gpt_batch(work.config, config.effective_batch_size, seed=3)
    losses = []
    for i in range(steps):
        if switch is not None and i == steps // 2:
            runner.switch(switch)
        losses.append(runner.step(batch).item())
    return losses, [p.detach().clone() for p in work.parameters()]


SAME_MATH = [
    TrainConfig(micro_batch_size=4, grad_accum_steps=2, offload_activations=("blocks.1",)),
    TrainConfig(micro_batch_size=4, offload_activations=BLOCKS),
    TrainConfig(micro_batch_size=4, grad_accum_steps=2, offload_optimizer=True),
    TrainConfig(
        micro_batch_size=2,
        grad_accum_steps=3,
        precision="bf16",
        checkpoint=("blocks.0",),
        offload_activations=("blocks.1", "blocks.2"),
        offload_optimizer=True,
    ),
    TrainConfig(micro_batch_size=4, precision="fp16", offload_optimizer=True),
    TrainConfig(
        micro_batch_size=4,
        optimizer="sgd",
        offload_optimizer=True,
        offload_activations=("blocks.0",),
    ),
]


@pytest.mark.parametrize("config", SAME_MATH, ids=lambda c: c.describe())
def test_offload_trains_exactly_like_no_offload(model, config: TrainConfig) -> None:
    plain = config.replace(offload_activations=(), offload_optimizer=False)
    losses, weights = train(model, config)
    ref_losses, ref_weights = train(model, plain)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights, strict=True))


@pytest.mark.parametrize("config", SAME_MATH, ids=lambda c: c.describe())
def test_offload_on_streams_trains_exactly_like_no_offload(
    model, config: TrainConfig, simulated_cuda
) -> None:
    """The CUDA branch of offload (side streams, events, record_stream, the in-flight
    bound) on the stand-in, where streams run in order: the same math, and it ran."""
    plain = config.replace(offload_activations=(), offload_optimizer=False)
    losses, weights = train(model, config)
    ref_losses, ref_weights = train(model, plain)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights, strict=True))
    side = simulated_cuda.streams[1:]
    assert any(s.calls.get("wait_stream", 0) > 0 for s in side)  # copies went on side streams
    if config.offload_activations:
        copies = sum(s.calls.get("record_stream", 0) for s in side)
        events = sum(s.calls.get("record_event", 0) for s in side)
        assert copies > 0 and events > 0
        assert simulated_cuda.compute.calls.get("wait_event", 0) > 0


def test_switching_the_optimizer_to_and_from_the_host_keeps_its_state(model) -> None:
    base = TrainConfig(micro_batch_size=4)
    host = base.replace(offload_optimizer=True, offload_activations=("blocks.2",))
    ref = train(model, base, steps=4)
    for first, then in ((base, host), (host, base)):
        losses, weights = train(model, first, steps=4, switch=then)
        assert losses == ref[0]
        assert all(torch.equal(a, b) for a, b in zip(weights, ref[1], strict=True))


def test_the_optimizer_state_leaves_the_device(model, sample) -> None:
    runner = autotune.prepare(
        copy.deepcopy(model), TrainConfig(offload_optimizer=True), device="cpu"
    )
    runner.step(sample)
    assert runner.host is not None
    assert runner.optimizer.state  # it has state, on the host
    tracker = LiveBytesTracker("cpu")
    tracker.track(state_tensors(runner.model, runner.optimizer, runner.scaler))
    params = sum(p.untyped_storage().nbytes() for p in runner.model.parameters())
    assert tracker.live == params  # no gradients, no optimizer state on the device
    # Host: master weights and two AdamW states (and step counts); gradients are freed.
    assert runner.host.host_bytes() >= 3 * params


def test_activation_offload_moves_saved_tensors_to_the_host(model, sample) -> None:
    peaks = {}
    for name, config in {
        "kept": TrainConfig(micro_batch_size=4),
        "offloaded": TrainConfig(micro_batch_size=4, offload_activations=BLOCKS),
    }.items():
        runner = autotune.prepare(copy.deepcopy(model), config, device="cpu")
        tracker = LiveBytesTracker("cpu")
        tracker.track(state_tensors(runner.model))
        with tracker:
            loss = runner.forward_loss(sample)
            peaks[name] = tracker.live  # what the forward leaves for the backward
            runner.backward(loss)
        if name == "offloaded":
            moved = runner.offloader.moved_bytes
            assert set(moved) == set(BLOCKS) and all(v > 0 for v in moved.values())
            assert peaks["kept"] - peaks[name] >= 0.9 * sum(moved.values())


class GatedBlock(torch.nn.Module):
    """Saves two strided views of one projection (a gated MLP's gate and up halves)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(32, 128)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # views of one storage, row stride 128
        return x + self.down(torch.nn.functional.silu(gate) * up)


def test_offloaded_views_come_back_as_the_same_views_of_one_storage_copy() -> None:
    """A view restored as a contiguous copy would send backward down other kernels, which
    round differently; and each view copied apart would move their storage twice."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(GatedBlock(), GatedBlock())
    x = torch.randn(64, 32)
    grads = []
    for config in (TrainConfig(), TrainConfig(offload_activations=("0", "1"))):
        work = copy.deepcopy(model)
        with autotune.apply(work, config, device="cpu") as handle:
            handle.backward(work(x).square().mean())
            grads.append([p.grad.clone() for p in work.parameters()])
            if config.offload_activations:
                copies = handle.offloader.copies
                # per block: the input x, the projection's storage once, silu(gate)*up's parts
                assert all(64 * 128 * 4 in sizes for sizes in copies.values())
                assert all(sizes.count(64 * 128 * 4) == 1 for sizes in copies.values())
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


class LastPosition(torch.nn.Module):
    """Saves a small view of a large activation and of a buffer, and a lazy conjugate."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(32, 512)
        self.register_buffer("table", torch.randn(4096, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.up(x)  # (64, 512): 128 KiB
        last = wide[-8:] * x[-8:, :1]  # saves x's slice and an 8-row slice of ``wide``
        z = torch.complex(last, last)
        return (z.conj() * z).real.sum() * self.table[:8].sum()


def test_a_small_view_moves_only_its_bytes_and_a_buffer_or_conjugate_stays() -> None:
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(LastPosition()), torch.randn(64, 32, requires_grad=True)
    grads = []
    for config in (TrainConfig(), TrainConfig(offload_activations=("0",))):
        work = copy.deepcopy(model)
        with autotune.apply(work, config, device="cpu") as handle:
            handle.backward(work(x))
            grads.append([p.grad.clone() for p in work.parameters()])
            if config.offload_activations:
                moved = handle.offloader.copies["0"]
                assert 64 * 512 * 4 not in moved  # ``wide`` whole: 16 times the slice
                assert sum(moved) < 64 * 512 * 4
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_bandwidth_probe_measures_both_directions() -> None:
    facts = measure_transfer(discover("cpu"), nbytes=8 * 2**20)
    assert facts.d2h_bytes_per_s > 1e7 and facts.h2d_bytes_per_s > 1e7
    assert 0 < facts.host_limit_bytes < discover("cpu").host_available_bytes


# --- the cost model --------------------------------------------------------------------


def measured_peak(model, sample, config: TrainConfig) -> int:
    verifier = Verifier(copy.deepcopy(model), sample, device=CPU, budget_bytes=2**40, loss_fn=None)
    measured, error = verifier.trial(config)
    assert error is None and measured is not None
    return measured.peak_bytes


@pytest.mark.parametrize(
    ("config", "rel"),
    [
        (TrainConfig(micro_batch_size=4, offload_activations=BLOCKS), 0.001),
        (TrainConfig(micro_batch_size=2, offload_activations=("blocks.1",)), 0.001),
        (
            TrainConfig(
                micro_batch_size=16, offload_activations=("blocks.0",), checkpoint=("blocks.2",)
            ),
            0.03,
        ),
        (
            TrainConfig(
                micro_batch_size=6,
                grad_accum_steps=3,
                precision="bf16",
                offload_activations=("blocks.1",),
            ),
            0.03,
        ),
        (TrainConfig(micro_batch_size=8, offload_optimizer=True), 0.001),
        (TrainConfig(micro_batch_size=8, grad_accum_steps=3, offload_optimizer=True), 0.001),
        (
            TrainConfig(
                micro_batch_size=12,
                grad_accum_steps=2,
                precision="bf16",
                optimizer="sgd",
                checkpoint=BLOCKS[:2],
                offload_optimizer=True,
            ),
            0.001,
        ),
    ],
    ids=lambda v: v.describe() if isinstance(v, TrainConfig) else "",
)
def test_offload_peak_is_predicted(offload_profile, model, sample, config, rel) -> None:
    predicted, parts = CostModel(offload_profile).memory(config)
    measured = measured_peak(model, sample, config)
    assert abs(predicted - measured) <= rel * measured, (predicted, measured)
    assert min(dataclasses.astuple(parts)) >= 0  # nothing holds negative bytes
    if config.offload_optimizer:
        assert parts.optimizer == 0


def test_host_bytes_match_what_offload_holds(offload_profile, model, sample) -> None:
    config = TrainConfig(micro_batch_size=4, offload_activations=BLOCKS[1:], offload_optimizer=True)
    runner = autotune.prepare(copy.deepcopy(model), config, device="cpu")
    runner.step(sample)
    assert runner.host is not None
    runner.last_micro_batch(True)
    runner.forward_backward(sample)
    runner.host.gather()  # the most the host holds: weights, gradients, state, activations
    real = runner.host.host_bytes() + runner.offloader.host_bytes()
    assert real == runner.host.host_bytes() + sum(runner.offloader.moved_bytes.values())
    assert CostModel(offload_profile).host_bytes(config) == pytest.approx(real, rel=0.02)


def test_host_bytes_are_planned_as_the_pinned_allocator_takes_them(
    model, sample, simulated_cuda
) -> None:
    # On CUDA each pinned host buffer is rounded up to a power of two: up to twice its bytes.
    work = copy.deepcopy(model)
    profiler = Profiler(work, sample, BLOCKS, device=CPU, loss_fn=None)
    transfer = measure_transfer(discover("cpu"), nbytes=2**20)
    assert transfer.rounds_host  # the stand-in takes host buffers as CUDA does
    profile, _ = memory_profile(
        profiler,
        (Timeline("fp32"),),
        ("adamw",),
        device_name="sim",
        context_bytes=0,
        transfer=transfer,
    )
    del profiler
    cost = CostModel(profile)
    for b in (3, 6):  # profiled at 2 and 4: each copy's size is fitted, then rounded
        config = TrainConfig(
            micro_batch_size=b, offload_activations=BLOCKS[1:], offload_optimizer=True
        )
        with autotune.prepare(copy.deepcopy(model), config, device="cpu") as runner:
            assert runner.host is not None
            runner.step(gpt_batch(model.config, b))
            runner.last_micro_batch(True)
            runner.forward_backward(gpt_batch(model.config, b))
            runner.host.gather()
            real = runner.host.host_bytes() + runner.offloader.host_bytes()
            exact = sum(runner.offloader.moved_bytes.values())
            assert cost.host_bytes(config) == real
            assert runner.offloader.host_bytes() > exact  # the rounding is not nothing


def test_copy_stalls_follow_the_bandwidth(offload_profile) -> None:
    import dataclasses

    from autotune._profile_data import TimeCurve

    curve = TimeCurve((1, 16), (0.01, 0.16), (1, 16), (0.3, 0.3))
    precisions = {
        k: dataclasses.replace(v, time=curve) for k, v in offload_profile.precisions.items()
    }
    timed = dataclasses.replace(offload_profile, precisions=precisions)
    fast = CostModel(timed)
    mask = (OFFLOAD,) * 3
    plain = fast.step_s_of(Knobs.given("fp32", "adamw", 8, 1, (KEEP,) * 3))
    assert fast.step_s_of(Knobs.given("fp32", "adamw", 8, 1, mask)) == pytest.approx(
        plain, rel=1e-4
    )
    moved = sum(line(8) for line in timed.precisions[Timeline("fp32")].moved)
    slow = CostModel(dataclasses.replace(timed, transfer=Transfer(1e6, 1e6, 2**40)))
    stall = slow.step_s_of(Knobs.given("fp32", "adamw", 8, 1, mask)) - plain
    # Every byte goes down and comes back at 1 MB/s; little of it hides behind compute.
    assert 2 * moved / 1e6 - 0.1 <= stall <= 2 * moved / 1e6


# --- the plan and the search -----------------------------------------------------------


def test_multiple_choice_knapsack_is_exact() -> None:
    rng = random.Random(0)
    for _ in range(30):
        options = [
            [(0.0, 0.0)] + [(rng.uniform(0, 10), rng.uniform(0, 5)) for _ in range(2)]
            for _ in range(5)
        ]
        need = rng.uniform(1, 30)
        pick = _min_cost_choice(options, need)
        covers = [
            combo
            for combo in itertools.product(range(3), repeat=5)
            if sum(options[i][v][0] for i, v in enumerate(combo)) >= need
        ]
        if not covers:
            assert pick is None
            continue
        assert pick is not None
        cost = sum(options[i][v][1] for i, v in enumerate(pick))
        best = min(sum(options[i][v][1] for i, v in enumerate(c)) for c in covers)
        assert sum(options[i][v][0] for i, v in enumerate(pick)) >= need
        assert cost == pytest.approx(best)


def study(profile, limit: int, *, offload: bool) -> Chooser:
    return Chooser(
        cost=CostModel(profile),
        sizes=(1, 2, 4, 8, 16),
        timelines=(Timeline("fp32"),),
        optimizers=("adamw",),
        global_batch_size=16,
        limit=limit,
        offload_optimizer=(False, True) if offload else (False,),
        offload_activations=offload,
    )


def test_offload_lets_the_search_fit_a_budget_nothing_else_fits(offload_profile) -> None:
    cost = CostModel(offload_profile)
    full = cost.peak_of(Knobs.given("fp32", "adamw", 1, 16, (CHECKPOINT,) * 3))
    limit = full - 1  # below the most frugal config without offload
    assert study(offload_profile, limit, offload=False).config(Timeline("fp32"), "adamw", 1) is None
    s = study(offload_profile, limit, offload=True)
    found = [
        c
        for b in s.sizes
        for h in (False, True)
        if (c := s.config(Timeline("fp32"), "adamw", b, h))
    ]
    assert found
    for c in found:
        assert c.offload_optimizer or c.offload_activations
        assert cost.memory(c)[0] <= limit


def test_host_memory_limits_offload(offload_profile) -> None:
    import dataclasses

    tiny_host = dataclasses.replace(offload_profile, transfer=Transfer(1e12, 1e12, 1024))
    limit = (
        CostModel(offload_profile).peak_of(Knobs.given("fp32", "adamw", 1, 16, (CHECKPOINT,) * 3))
        - 1
    )
    s = study(tiny_host, limit, offload=True)
    assert all(
        s.config(Timeline("fp32"), "adamw", b, h) is None for b in s.sizes for h in (False, True)
    )


def test_too_small_accounts_for_offload_and_says_what_to_allow(offload_profile) -> None:
    space = SearchSpace(offload_optimizer=False, offload_activations=False)
    without = too_small(study(offload_profile, 1, offload=False), space, 1, headroom=0.01)
    assert "SearchSpace(offload_optimizer=True)" in str(without)
    assert "adamw8bit" in str(without)
    with_offload = too_small(
        study(offload_profile, 1, offload=True), SearchSpace(), 1, headroom=0.01
    )
    assert with_offload.minimum_bytes < without.minimum_bytes
    assert "optimizer on the host" in str(with_offload)


def test_default_space_offloads_on_cuda_only() -> None:
    assert SearchSpace().offloads("cuda") == (True, True)
    assert SearchSpace().offloads("cpu") == (False, False)
    assert SearchSpace(offload_optimizer=True).offloads("cpu") == (True, False)
    with pytest.raises(autotune.ConfigError, match="offload_activations"):
        SearchSpace(offload_activations="yes")  # type: ignore[arg-type]


def test_tune_with_offload_on_a_separate_host_verifies_what_it_picks(model, sample) -> None:
    cost = CostModel(
        memory_profile(
            Profiler(copy.deepcopy(model), sample, BLOCKS, device=CPU, loss_fn=None),
            (Timeline("fp32"),),
            ("adamw",),
            device_name="cpu",
            context_bytes=0,
        )[0]
    )
    frugal = cost.peak_of(Knobs.given("fp32", "adamw", 1, 8, (CHECKPOINT,) * 3))
    budget_gb = frugal * 0.97 / 2**30
    space = SearchSpace(precisions=("fp32",), offload_optimizer=True, offload_activations=True)
    result = autotune.autotune(
        model,
        sample,
        budget_gb=budget_gb,
        global_batch_size=8,
        space=space,
        device="cpu",
        n_trials=20,
    )
    assert result.config.offload_optimizer or result.config.offload_activations
    assert result.measured.peak_bytes <= result.budget_bytes
    assert result.measured.peak_bytes == pytest.approx(result.predicted.peak_bytes, rel=0.05)


def test_the_fp16_scale_moves_with_the_optimizer_and_keeps_its_value(model) -> None:
    config = TrainConfig(micro_batch_size=4, precision="fp16")
    runner = autotune.prepare(copy.deepcopy(model), config, device="cpu")
    assert runner.scaler is not None
    runner.scaler.update(1024.0)  # as after overflows
    for offload in (True, False):  # the scale is made where the optimizer steps
        runner.switch(config.replace(offload_optimizer=offload))
        assert runner.scaler is not None and runner.scaler.get_scale() == 1024.0
        runner.step(gpt_batch(model.config, 4))
    runner.close()


def test_on_the_real_cpu_offload_saves_nothing_and_is_not_searched(model, sample, real_cpu) -> None:
    plain = TrainConfig(micro_batch_size=8)
    offloaded = plain.replace(offload_optimizer=True, offload_activations=BLOCKS[1:])
    kept, _ = autotune.estimate(model, sample, plain, device="cpu")
    moved, _ = autotune.estimate(model, sample, offloaded, device="cpu")
    assert moved > kept  # the host copies are in the same memory, on top
    measured = measured_peak(model, sample, offloaded)
    assert measured >= measured_peak(model, sample, plain)  # it really saves nothing
    assert abs(moved - measured) <= 0.01 * measured  # the master weights included
    space = SearchSpace(offload_optimizer=True, offload_activations=True)
    saves_nothing = pytest.warns(autotune.AutotuneWarning, match="offload saves nothing on cpu")
    with saves_nothing, pytest.raises(autotune.BudgetTooSmallError) as caught:
        autotune.autotune(model, sample, 1e-4, space=space, device="cpu", n_trials=4)
    assert "offload" not in str(caught.value)  # and it is not what the error suggests
