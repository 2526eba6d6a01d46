"""The memory half of a profile: what every precision and optimizer holds, no timing.

Cheap (a few tracked steps at micro-batch 2 and 4), and enough to decide what can fit:
``autotune()`` runs it first, ``estimate()`` only it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Sequence

import torch
from torch import nn

from autotune._profile_data import OptimizerProfile, PrecisionProfile, Profile, Transfer
from autotune.config import Timeline
from autotune.errors import BlockError, NonFiniteError, ProfileError
from autotune.measure._parameters import block_parameter_bytes, parameter_bytes, parameter_layout
from autotune.measure._profiler import Profiler
from autotune.train import bytes_per_sample, copy_model, widest_bytes, written_buffers

__all__ = ["memory_profile", "working_copy"]


def working_copy(model: nn.Module, device: torch.device) -> nn.Module:
    """A deep copy of ``model`` on ``device``: every measurement runs on one."""
    try:
        work = copy_model(model)
    except Exception as exc:
        raise ProfileError(
            f"autotune measures a copy of the model, and copy.deepcopy failed: {exc}. "
            "Make the model deep-copyable (e.g. drop non-picklable attributes)."
        ) from exc
    return work.to(device)


def memory_profile(
    profiler: Profiler,
    timelines: Sequence[Timeline],
    optimizers: Sequence[str],
    *,
    device_name: str,
    context_bytes: int,
    transfer: Transfer | None = None,
    selective: bool = False,
    compiled: Sequence[str] = (),
    whole: Sequence[str] = (),
    chunked: bool = False,
    sharded: bool = False,
) -> tuple[Profile, list[str]]:
    """The memory half of a profile (no time curves), and notes on what was left out.

    Optimizers are measured at micro-batch 2, ``timelines`` (eager) at 2 and 4; at 1 and
    2 when the device cannot hold those. A timeline that runs out of device memory is left
    out. With ``transfer`` (offload is searched), the offloaded variant and each
    optimizer's host step are measured too; with ``selective``, the selectively
    checkpointed variant; for each of the precisions ``compiled``, its timeline with every
    block compiled (kept and checkpointed), for each of ``whole``, with the model compiled
    whole with its loss (every block kept, and checkpointed), unless compiling fails (a
    note says why). ``chunked``: the compiled timelines with the chunked loss (as
    ``timelines`` then have); each compiled timeline is profiled where its eager twin
    fitted. ``sharded`` (FSDP2 searched or asked for): FSDP2's own bf16 timeline too
    (:func:`_sharded_precisions`, with the first optimizer).

    Raises:
        ProfileError: nothing fits the device.
    """
    notes: list[str] = []
    loss = " with the chunked loss" if chunked else ""
    extra = {
        f"compiled blocks{loss}": tuple(Timeline(p, "blocks", chunked) for p in compiled),
        f"the model compiled whole{loss}": tuple(Timeline(p, "model", chunked) for p in whole),
    }
    with written_buffers(profiler.model) as written:
        memory, measured = _measure(
            profiler, timelines, optimizers, transfer, selective, extra, notes
        )
    if not memory:
        raise ProfileError(
            f"the model does not fit {device_name} even at micro-batch 2 without "
            "checkpointing; use a larger device or a smaller model."
        )
    profile = _profile(profiler, memory, measured, context_bytes, transfer)
    profile = _with_written(profile, profiler.model, written)
    if sharded:
        profile = _sharded_precisions(profiler, profile, optimizers[0])
    return profile, notes


def _with_written(profile: Profile, model: nn.Module, written: Sequence[str]) -> Profile:
    """``profile`` with the buffers of ``model`` a training step writes, and the bytes of
    the copy a runner with fallbacks takes of them before each step (one tensor each)."""
    named = dict(model.named_buffers())
    copied = sum(named[n].numel() * named[n].element_size() for n in written)
    return dataclasses.replace(profile, written=tuple(written), snapshot_bytes=copied)


def _measure(
    profiler: Profiler,
    timelines: Sequence[Timeline],
    optimizers: Sequence[str],
    transfer: Transfer | None,
    selective: bool,
    extra: dict[str, tuple[Timeline, ...]],
    notes: list[str],
) -> tuple[dict[Timeline, PrecisionProfile], dict[str, OptimizerProfile]]:
    """Each of ``timelines`` (and those of ``extra``: the timelines of other ways to
    train, by what they are, each of a precision measured) and each optimizer's step, at
    micro-batches 2 and 4 (1 and 2 where those do not fit); what is left out is said in
    ``notes``.

    Where not even 1 and 2 fit under the cap in force (the budget, while tuning: every
    block kept at micro-batch 1 can need more than a config that checkpoints them), they
    are profiled with the cap lifted, and a note says so: the tuner can then still search
    the configs that fit.
    """
    backend = profiler.backend
    for b1, b2, lift in ((2, 4, False), (1, 2, False), (1, 2, True)):
        if lift and not backend.capped():
            break
        if b1 == 1:  # what the attempt at 2 and 4 left (an out-of-memory step's graph) goes
            gc.collect()
            backend.empty_cache()
        with backend.lifted() if lift else contextlib.nullcontext():
            memory, measured = _attempt(
                profiler, timelines, optimizers, transfer, selective, b1, b2, notes
            )
            for what, compiled in extra.items():
                if memory and (twinned := [t for t in compiled if t.eager in memory]):
                    sizes = (b1, b2)
                    memory.update(_compiled(profiler, twinned, what, optimizers[0], sizes, notes))
        if memory:
            if lift:
                notes.append(
                    "profiled at micro-batch 1 and 2 above the budget: every block kept does "
                    "not fit it even at micro-batch 1"
                )
            return memory, measured
    return {}, {}


def _attempt(
    profiler: Profiler,
    timelines: Sequence[Timeline],
    optimizers: Sequence[str],
    transfer: Transfer | None,
    selective: bool,
    b1: int,
    b2: int,
    notes: list[str],
) -> tuple[dict[Timeline, PrecisionProfile], dict[str, OptimizerProfile]]:
    """The timelines and optimizer steps at ``b1`` and ``b2`` (none where the optimizers'
    steps do not fit)."""
    memory: dict[Timeline, PrecisionProfile] = {}
    try:
        measured = {o: profiler.optimizer(o, b1) for o in optimizers}
        if transfer is not None:
            measured = {
                o: dataclasses.replace(m, host_step_s=profiler.host_step(o, b1))
                for o, m in measured.items()
            }
    except torch.OutOfMemoryError:
        return memory, {}
    for p in timelines:
        try:
            try:
                memory[p] = profiler.memory(
                    p, optimizers[0], b1, b2, offload=transfer is not None, selective=selective
                )
            except BlockError as exc:
                if not selective:
                    raise
                # A block that cannot be checkpointed selectively (an op changes a kept
                # output in place): the other choices stay, for every precision.
                notes.append(f"selective checkpointing: not searched, {_why(exc)}")
                selective = False
                memory[p] = profiler.memory(p, optimizers[0], b1, b2, offload=transfer is not None)
        except torch.OutOfMemoryError:
            notes.append(f"{p}: out of device memory while profiling at micro-batch {b2}")
        except NonFiniteError:
            notes.append(f"{p}: the loss is not finite on the sample batch; not searched")
    return memory, measured


def _profile(
    profiler: Profiler,
    memory: dict[Timeline, PrecisionProfile],
    measured: dict[str, OptimizerProfile],
    context_bytes: int,
    transfer: Transfer | None,
) -> Profile:
    """The memory profile of ``profiler``'s model from its measurements."""
    params = {id(p): p for p in profiler.model.parameters()}
    every, trainable = parameter_bytes(profiler.model)
    blocks = profiler.blocks
    # An offloaded optimizer's master weights and gradient buffers, one host buffer each,
    # of the trained parameters (a frozen one, a LoRA base, has neither).
    host = [p.untyped_storage().nbytes() for p in params.values() if p.requires_grad] * 2
    return Profile(
        profiler.device.type,
        blocks,
        tuple(1.0 / max(len(blocks), 1) for _ in blocks),  # time shares: measured later
        param_bytes=every,
        grad_bytes=trainable,
        precisions=memory,
        optimizers=measured,
        context_bytes=context_bytes,
        block_bytes=block_parameter_bytes(profiler.model, blocks),
        transfer=transfer,
        host_param_bytes=sum(profiler.backend.host_bytes(n) for n in host) if transfer else 0,
        host_is_device=profiler.backend.host_is_device,
        input_bytes_per_sample=bytes_per_sample(profiler.sample, profiler.device),
        input_bytes_widest=widest_bytes(profiler.sample, profiler.device),
        layout=parameter_layout(profiler.model, blocks),
    )


def _compiled(
    profiler: Profiler,
    compiled: Sequence[Timeline],
    what: str,
    optimizer: str,
    sizes: tuple[int, int],
    notes: list[str],
) -> dict[Timeline, PrecisionProfile]:
    """Each of the ``compiled`` timelines (``what`` they are, for notes), kept and
    checkpointed; none once one fails, with a note that says why (no compiler, an op the
    compiler rejects, a block checkpointed inside the graph that cannot be, ...)."""
    out = {}
    b1, b2 = sizes
    for timeline in compiled:
        try:
            out[timeline] = profiler.memory(timeline, optimizer, b1, b2)
        except torch.OutOfMemoryError:
            notes.append(f"{timeline}: out of device memory profiling up to micro-batch {2 * b2}")
        except NonFiniteError:
            notes.append(f"{timeline}: the loss is not finite on the sample batch; not searched")
        except BlockError as exc:  # a block the compiled model cannot checkpoint
            notes.append(f"{what}: not searched, {_why(exc)}")
            return {}
        except Exception as exc:  # the compiler's own failure, say: not searched
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            why = f"{type(exc).__name__}: {first}"
            notes.append(f"{what}: not searched, it failed ({why})")
            return {}
    return out


def _why(exc: BlockError) -> str:
    """The first sentence of ``exc``: which block, and why it was refused."""
    return str(exc).split(". ")[0]


def _sharded_precisions(profiler: Profiler, profile: Profile, optimizer: str) -> Profile:
    """``profile`` with the bf16 timeline of the parameters themselves in bf16, as FSDP2's
    ``MixedPrecisionPolicy`` computes: the activations differ from autocast's over fp32
    parameters wherever an op's dtype follows a parameter's (an embedding's output, a
    residual stream). Nothing is added where bf16 was not profiled."""
    bf16 = Timeline("bf16")
    if bf16 not in profile.precisions:
        return profile
    inner = profiler.over(copy_model(profiler.model).to(torch.bfloat16))
    try:
        for b1, b2 in ((2, 4), (1, 2)):
            try:
                selective = profile.precisions[bf16].selective
                timeline = inner.memory(bf16, optimizer, b1, b2, selective=selective)
                return dataclasses.replace(profile, sharded={bf16: timeline})
            except torch.OutOfMemoryError:
                continue
        return profile
    finally:
        del inner
