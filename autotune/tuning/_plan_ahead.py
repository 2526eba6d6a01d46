"""Planning before the hardware: a model of any size, for a GPU and a number of ranks that
are not here (issue 27).

The model is built and its sample made on fake tensors (:func:`autotune.measure.traced`),
so an 8B or 70B model costs this machine no memory. Its memory profile is traced on the
CPU's kernels, byte for byte the timeline a real CPU step has, and translated to the
target GPU explicitly: the CUDA context and the caching allocator's reserve are the
table's stated defaults (:mod:`autotune.device._catalog`). Its time profile runs on a
roofline clock (FLOPs and bytes of each op against the GPU's datasheet), and the
collectives of several ranks on the table's links. The cost model, choosers and search
are the tuner's; the result is the tuner's too, marked planned: every assumption is in
its ``unverified``, and ``autotune tune`` on the real device verifies it.

A plan's rank traced: the FSDP2 winner of a plan run as one rank of its world size.

A plan's per-rank peak comes from one process's profile, through the cost model's account of
shards, gathered units and reduce-scatter buffers. Checking it, one rank of the plan is
traced (:func:`autotune.measure.traced_rank_peak`: the model on fake tensors, wrapped by
FSDP2 itself, in a process group of ``world`` ranks that sends nothing), which is what a
real rank holds byte for byte. The plan's peak becomes the traced one plus the same GPU
translation (context, the allocator's reserve); a plan the trace puts over the budget
gives way to the next FSDP2 plan.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autotune._format import format_bytes
from autotune._profile_data import Collectives, Line, PrecisionProfile, Profile
from autotune.config import FUSED_OPTIMIZERS
from autotune.cost import Candidate, CostModel
from autotune.device import (
    CONTEXT_BYTES,
    INTER_NODE_BYTES_PER_S,
    RESERVE_SHARE,
    DeviceSpec,
    Target,
    device_spec,
    host_peak_bytes,
)
from autotune.errors import AutotuneError, ConfigError, ProfileError, warn
from autotune.jobs import LocalJobs
from autotune.measure import TRACED_ASSUMPTIONS, Roofline, is_traced, traced, traced_rank_peak
from autotune.result import PLANNED, TrialRecord, TuneResult
from autotune.space import SearchSpace
from autotune.train import LossFn, map_tensors
from autotune.tuning._data_parallel import planned_result, shortlist
from autotune.tuning._options import TuneOptions
from autotune.tuning._problem import make_problem, twinned
from autotune.tuning._profiling import profile_model
from autotune.tuning._progress import Stopwatch

__all__ = ["RANK_TRIES", "plan_ahead", "plan_options", "plan_with", "rank_checked"]

CANDIDATES_KEPT = 10
"""Candidates a plan keeps, fastest predicted first (its ``trials``, none of them run)."""

_LATENCY_S = 30e-6
"""A collective's fixed cost (stated): a ring's launch and first hop."""


def plan_ahead(
    build: Callable[[], nn.Module],
    sample_batch: Any,
    budget_gb: float,
    *,
    device: str = "H100-80GB",
    global_batch_size: int | None = None,
    world_size: int | None = None,
    space: SearchSpace | None = None,
    loss_fn: LossFn | None = None,
    seed: int = 0,
    trace_rank: bool = False,
) -> TuneResult:
    """Plan training ``build()``'s model on a GPU that is not here, for any number of ranks.

    The model is built and trained for a few steps on fake tensors, which hold no
    memory, so an 8B or 70B model is planned on a laptop. Memory is the tuner's own
    timeline, traced; time is a roofline of each op on the GPU's datasheet, NOT
    VERIFIED. The result is a tuned result marked planned: ``unverified`` names every
    assumption, ``trials`` the ranked plans (none run). Train or ``autotune verify`` it on
    the real GPU to check it.

    Args:
        build: A zero-argument callable that builds the model (called under tracing; e.g.
            ``lambda: AutoModelForCausalLM.from_config(config)``).
        sample_batch: One batch as :func:`autotune.autotune` takes it, or a zero-argument
            callable that makes one (called under tracing).
        budget_gb: Device memory per rank the run may use, GiB.
        device: The GPU by its name in ``autotune.device.DEVICES`` (e.g. ``RTX4090-24GB``).
        global_batch_size: Samples per optimizer step over all ranks (``None``: no
            accumulation).
        world_size: Ranks of data parallelism (DDP or FSDP2 per rank); default 1.
        space: What may be searched, as for :func:`autotune.autotune` (offload and
            compiled blocks are not planned).
        loss_fn: ``loss_fn(output, batch) -> scalar`` (``None``: the model's own loss).
        seed: Seed of the search.
        trace_rank: With an FSDP2 plan, trace rank 0 of it with FSDP2 itself (a process
            group of ``world_size`` ranks that sends nothing): the per-rank peak exact
            where the choosers' is modelled; a plan it puts over the budget gives way to
            the next FSDP2 plan. Costs a traced step of the whole model (12-59 s for
            Llama 3 8B and 70B on a 2-core CPU).

    Raises:
        ConfigError: no such device; a batch that does not split over the ranks.
        BudgetTooSmallError: nothing fits a rank; the message says what to change.
    """
    options = TuneOptions(
        budget_gb=budget_gb,
        loss_fn=loss_fn,
        global_batch_size=global_batch_size,
        space=space or SearchSpace(),
        seed=seed,
        world_size=world_size,
    )
    return plan_with(build, sample_batch, options, device, trace_rank=trace_rank)


def plan_with(
    build: Callable[[], nn.Module],
    sample_batch: Any,
    options: TuneOptions,
    device: str,
    *,
    trace_rank: bool = False,
) -> TuneResult:
    """:func:`plan_ahead` with the tuner's options record (``options.device`` unread):
    the model traced on fake tensors and profiled as the GPU ``device`` holds it, searched
    for it, and its winner predicted (with ``trace_rank``, an FSDP2 winner's rank traced
    in the place of verification); nothing runs on a device."""
    watch, spec = Stopwatch(), device_spec(device)
    with watch.stage("profile"), traced() as mode:
        model = _built(build)
        made = sample_batch() if callable(sample_batch) else sample_batch
        sample = map_tensors(made, lambda t: t if is_traced(t) else mode.from_tensor(t))
        problem = make_problem(model, sample, plan_options(options), _target(spec), planned=True)
        # Deeper than 4 blocks: copies of 3 and 4 blocks, extrapolated (exact where the
        # blocks are alike; a traced model costs no memory, but time per op).
        with Roofline(spec):
            profile = profile_model(
                model,
                problem,
                whole=len(problem.blocks) <= 4,
                on_target=functools.partial(on_the_gpu, world=problem.world, spec=spec),
            )
        del model, sample, made
    problem = problem.with_context(profile.context_bytes)
    with watch.stage("search"):
        candidates = shortlist(problem, profile, options, LocalJobs()).candidates
    with watch.stage("verification"):
        result = planned_result(problem, profile, candidates)
        if trace_rank:  # the rank's trace in the place of verification
            result = rank_checked(
                result, candidates, profile, build, sample_batch, options.loss_fn, problem.limit
            )
    kept = tuple(
        TrialRecord(
            c.config,
            result.predicted if c.config == result.config else c.prediction.measurement,
            None,
            PLANNED,
        )
        for c in candidates[:CANDIDATES_KEPT]
    )
    return dataclasses.replace(
        result,
        trials=kept,
        tuning_s=watch.elapsed(),
        spent=watch.spent(),
        unverified=(*planning_notes(spec), *result.unverified),
    )


_REAL_BYTES = 512 * 2**20
"""Host memory a builder may take for real while it runs (its peak above what the process
held when it began) before the plan says so: a traced model holds none."""


def _built(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on fake tensors; what goes wrong in it said in planning's terms, and a
    builder that took real memory (weights loaded, arrays made) named.

    Raises:
        ConfigError: the builder failed (it read a value, moved to a device, ...).
        ProfileError: it returned no module.
    """
    before = host_peak_bytes(reset=True)
    try:
        model = build()
    except AutotuneError:
        raise
    except Exception as exc:
        first = " ".join(str(exc).split())[:200]
        raise ConfigError(
            f"building the model on fake tensors failed: {type(exc).__name__}: {first}. A "
            "builder for planning makes the model on the default device and reads no value "
            "(no .item(), .tolist() or printing a tensor; no .cuda() or .to('cuda')); give "
            "plan_ahead such a builder."
        ) from exc
    if not isinstance(model, nn.Module):
        raise ProfileError(f"build() must return a torch.nn.Module, got {type(model)}.")
    if (grown := host_peak_bytes() - before) > _REAL_BYTES:
        warn(
            f"building the model took {grown / 2**30:.1f} GiB of this machine's memory for "
            "real (weights loaded, or arrays made outside torch): the plan is right, but a "
            "builder that makes the model with torch's constructors plans without memory.",
        )
    return model


def plan_options(options: TuneOptions) -> TuneOptions:
    """``options`` as a plan searches them on a GPU that is not here, traced on the CPU's
    kernels: no offload (a traced step copies nothing to the host) and nothing compiled."""
    space = dataclasses.replace(
        options.space,
        # fp16 runs at bf16's peak on every GPU of the table, and needs a loss scaler
        precisions=_without_fp16(options.space.precisions),
        # every GPU of the table has torch's fused AdamW kernel, which an expert sets
        optimizers=twinned(options.space.optimizers, FUSED_OPTIMIZERS),
        offload_optimizer=False,
        offload_activations=False,
        compile_blocks=False,
        compile_model=False,
    )
    return options.replace(space=space, device=None)


def _target(spec: DeviceSpec) -> Target:
    """The GPU ``spec`` as a plan's target: measured on the CPU's kernels, its memory
    and context the table's."""
    return Target(
        torch.device("cpu"), spec.name, spec.memory_bytes, spec.memory_bytes, CONTEXT_BYTES, 0
    )


def _without_fp16(precisions: tuple[str, ...]) -> tuple[str, ...]:
    """The precisions to plan: fp16 only where bf16 is not asked for."""
    return tuple(p for p in precisions if p != "fp16" or "bf16" not in precisions)


def on_the_gpu(profile: Profile, world: int, spec: DeviceSpec) -> Profile:
    """A profile traced on the CPU's kernels, as the GPU ``spec`` holds it: its context
    and the caching allocator's reserve (the table's defaults), its host separate from
    its memory, and with several ranks, the collectives on the table's links."""
    precisions = {p: _reserved(pp) for p, pp in profile.precisions.items()}
    sharded = {p: _reserved(pp) for p, pp in profile.sharded.items()}
    return dataclasses.replace(
        profile,
        device_type="cuda",
        host_is_device=False,
        context_bytes=CONTEXT_BYTES,
        precisions=precisions,
        sharded=sharded,
        comm=_collectives(spec, world) if world > 1 else None,
    )


def _reserved(pp: Any) -> Any:
    """``pp`` with the allocator's reserve: :data:`RESERVE_SHARE` of the activations the
    first micro-batch's forward leaves alive, per block variant."""
    forward = []
    for phase in pp.phases:
        if phase.key.micro != 1 or phase.key.label == "head_bwd":
            break
        forward.append(phase)
    variants = len(forward[0].delta) if forward else 0
    reserve = tuple(
        Line(
            RESERVE_SHARE * max(sum(ph.delta[v].const for ph in forward), 0.0),
            RESERVE_SHARE * max(sum(ph.delta[v].slope for ph in forward), 0.0),
        )
        for v in range(variants)
    )
    return dataclasses.replace(pp, reserve=reserve)


def _collectives(spec: DeviceSpec, world: int) -> Collectives:
    """Ring collectives over ``world`` ranks on the table's links (NVLink or PCIe within
    a server, the network beyond it): each rank sends (N-1)/N of the bytes, twice for an
    all-reduce."""
    link = spec.peer_link if world <= spec.per_server else INTER_NODE_BYTES_PER_S
    share = (world - 1) / world / link
    return Collectives(
        world_size=world,
        all_gather=Line(_LATENCY_S, share),
        reduce_scatter=Line(_LATENCY_S, share),
        all_reduce=Line(2 * _LATENCY_S, 2 * share),
    )


def planning_notes(spec: DeviceSpec) -> tuple[str, ...]:
    """What a plan for ``spec`` assumes, each checked by a real GPU's profile."""
    return (
        f"planned for {spec.name} without it: memory traced on fake tensors with the CPU's "
        "kernels (autocast's CPU op lists, CPU attention kernels' saved tensors)",
        f"CUDA context taken as {CONTEXT_BYTES / 1e9:.2f} GB and the caching allocator's "
        f"reserve as {RESERVE_SHARE:.0%} of the activations (stated defaults)",
        "time NOT VERIFIED: each op's FLOPs and bytes against the datasheet's dense peaks "
        f"({spec.source}), at stated efficiencies; for ranking only",
        *TRACED_ASSUMPTIONS,
    )


RANK_TRIES = 3
"""Plans traced at most, fastest first, before the last traced one is kept over budget."""


def rank_checked(
    result: TuneResult,
    candidates: list[Candidate],
    profile: Profile,
    build: Callable[[], nn.Module],
    sample_batch: Any,
    loss_fn: LossFn | None,
    limit: int,
) -> TuneResult:
    """``result`` with its FSDP2 winner's rank traced (``result`` itself otherwise).

    Args:
        result: The plan.
        candidates: Its candidates, fastest predicted first (the first is the winner).
        profile: The plan's profile, as the GPU holds it.
        build: The model's factory (called under tracing).
        sample_batch: A sample batch, or a factory of one (called under tracing).
        loss_fn: The loss (``None``: the model's own).
        limit: The most a rank's peak may be (the budget less the tuner's head-room).
    """
    fsdp = [c for c in candidates if c.config.parallel == "fsdp"][:RANK_TRIES]
    if candidates[0].config.parallel != "fsdp":
        return result
    live = CostModel(_live(profile))
    for candidate in fsdp:
        config = candidate.config
        rank_peak = traced_rank_peak(build, sample_batch, config, loss_fn=loss_fn)
        predicted = candidate.prediction.measurement
        expected, _ = live.memory(config)
        peak = rank_peak + predicted.peak_bytes - expected  # the same translation to the GPU
        if peak <= limit or candidate is fsdp[-1]:
            break
    note = (
        f"rank 0 of {config.world_size} traced with FSDP2 itself (fake tensors, a process "
        f"group that sends nothing): {format_bytes(rank_peak)} live at its peak where the "
        f"one-process plan said {format_bytes(expected)} "
        f"({(rank_peak - expected) / expected:+.2%}); "
        "the peak per rank is the traced one, with the GPU's context and reserve"
    )
    if peak > limit:
        note += f"; {format_bytes(peak - limit)} above the budget less its head-room, as traced"
    return dataclasses.replace(
        result,
        config=config,
        predicted=dataclasses.replace(predicted, peak_bytes=peak),
        breakdown=candidate.prediction.breakdown,
        unverified=(*result.unverified, note),
    )


def _live(profile: Profile) -> Profile:
    """``profile`` as traced, before the GPU's translation: live bytes only, with no
    context, allocator reserve or links (what a traced rank counts)."""

    def unreserved(pp: PrecisionProfile) -> PrecisionProfile:
        return dataclasses.replace(pp, reserve=())

    return dataclasses.replace(
        profile,
        device_type="cpu",
        host_is_device=True,
        context_bytes=0,
        precisions={p: unreserved(pp) for p, pp in profile.precisions.items()},
        sharded={p: unreserved(pp) for p, pp in profile.sharded.items()},
        comm=None,
    )
