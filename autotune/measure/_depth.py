"""A model deeper than one device holds, profiled on two shallow copies and extrapolated.

Sharded over several ranks, a model may not fit one device whole, and the profile runs on
one. Where its blocks are the uniform layers of one container (a transformer's), the
profile is measured on copies that keep 3 and 4 of them (the first, one or two from the
middle, the last) and extended to the full depth. One more middle layer adds:

- the same own phases: its forward, the stretch after it, its backward (the copies of 4
  show a middle layer after a middle layer, and before one in the backward);
- the same bytes to every other phase, to the step's base, to the optimizer's state and
  transient: these extrapolate linearly from 3 to 4 layers, which also covers what grows
  with depth outside the layers (autocast's weight casts, dropped when the forward ends);
- a middle layer's share of the forward time, timed once on the copy of 4.

Bytes are exact, so the extrapolated timelines are too; the time is an estimate that
verification, on the whole sharded model, corrects.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from autotune._profile_data import (
    Line,
    OptimizerProfile,
    Phase,
    PhaseKey,
    PrecisionProfile,
    Profile,
    TimeCurve,
)
from autotune.measure._parameters import block_parameter_bytes, parameter_bytes, parameter_layout
from autotune.train import copy_model

__all__ = ["MIN_BLOCKS", "Shallow", "deepen", "deepen_time", "shallow_copies", "whole_fits"]

T = TypeVar("T")

MIN_BLOCKS = 6
"""Fewer blocks than this are profiled whole: copies of 3 and 4 would save little."""


_WHOLE_SHARE = 0.5
"""The whole model is profiled where its parameters, gradients and two states per
parameter (AdamW's) take at most this share of the device's free memory; the rest holds
the activations of the profiled micro-batches."""


def whole_fits(model: nn.Module, free_bytes: int, world: int) -> bool:
    """Whether ``model``, to be trained on ``world`` ranks, is profiled whole on a device
    with ``free_bytes`` free: on one rank always (it has to train whole there)."""
    every, _ = parameter_bytes(model)
    return world == 1 or 4 * every <= _WHOLE_SHARE * free_bytes


def shallow_copies(model: nn.Module, blocks: Sequence[str]) -> Shallow | None:
    """What makes copies of ``model`` keeping 3 and 4 of its blocks; ``None`` where the
    blocks are not a container's uniform layers (all its children, of one class and the
    same parameter shapes) or fewer than :data:`MIN_BLOCKS`."""
    container = _container(model, blocks)
    return None if container is None else Shallow(model, *container)


@dataclass(frozen=True)
class Shallow:
    """Makes the shallow copies of a model, one at a time (each as it is measured)."""

    model: nn.Module
    parent: str
    """The qualified name of the container of the blocks ("": the model itself)."""
    layers: nn.ModuleList | nn.Sequential

    def copy(self, depth: int) -> tuple[nn.Module, tuple[str, ...]]:
        """A copy with ``depth`` (3 or 4) of the blocks (the first, ``depth - 2`` after
        it, the last), on the model's device, and its blocks' names. The dropped blocks
        are never copied."""
        n = len(self.layers)
        kept = (*range(depth - 1), n - 1)
        memo: dict[int, Any] = {id(self.layers[i]): None for i in range(n) if i not in kept}
        shallow = copy_model(self.model, memo)
        inner = shallow.get_submodule(self.parent)
        left = [m for m in inner._modules.values() if m is not None]
        inner._modules = {str(i): m for i, m in enumerate(left)}
        prefix = f"{self.parent}." if self.parent else ""
        return shallow, tuple(f"{prefix}{i}" for i in range(depth))


def _container(
    model: nn.Module, blocks: Sequence[str]
) -> tuple[str, nn.ModuleList | nn.Sequential] | None:
    if len(blocks) < MIN_BLOCKS:
        return None
    parent = blocks[0].rpartition(".")[0]
    layers = model.get_submodule(parent)
    prefix = f"{parent}." if parent else ""
    if not isinstance(layers, (nn.ModuleList, nn.Sequential)) or tuple(blocks) != tuple(
        f"{prefix}{name}" for name in layers._modules
    ):
        return None
    shapes = {
        (type(m), tuple((n, p.shape, p.dtype, p.requires_grad) for n, p in m.named_parameters()))
        for m in layers
    }
    return (parent, layers) if len(shapes) == 1 else None


def deepen(three: Profile, four: Profile, model: nn.Module, blocks: Sequence[str]) -> Profile:
    """The memory profile of ``model`` (its full ``blocks``) from those of its copies with 3
    and 4 blocks; the time curves and weights are :func:`deepen_time`'s."""
    n = len(blocks)
    params, trainable = parameter_bytes(model)
    precisions = {
        p: _precision(three.precisions[p], four.precisions[p], n)
        for p in four.precisions
        if p in three.precisions
    }
    sharded = {
        p: _precision(three.sharded[p], four.sharded[p], n)
        for p in four.sharded
        if p in three.sharded
    }
    scale = trainable / max(four.grad_bytes, 1)
    optimizers = {
        name: OptimizerProfile(
            name,
            int(_linear(three.optimizers[name].state_bytes, o.state_bytes, n)),
            int(_linear(three.optimizers[name].step_peak_bytes, o.step_peak_bytes, n)),
            o.step_s * scale,
            None if o.host_step_s is None else o.host_step_s * scale,
        )
        for name, o in four.optimizers.items()
        if name in three.optimizers
    }
    note = (
        f"profiled on copies with 3 and 4 of the {n} blocks (the whole model does not fit "
        "the device); the full depth is extrapolated"
    )
    return dataclasses.replace(
        four,
        blocks=tuple(blocks),
        block_weights=tuple(1.0 / n for _ in blocks),
        param_bytes=params,
        grad_bytes=trainable,
        precisions=precisions,
        optimizers=optimizers,
        notes=(*four.notes, note),
        block_bytes=block_parameter_bytes(model, blocks),
        host_param_bytes=int(_linear(three.host_param_bytes, four.host_param_bytes, n)),
        sharded=sharded,
        layout=parameter_layout(model, blocks),
        written=_written(four.written, blocks),
        snapshot_bytes=int(_linear(three.snapshot_bytes, four.snapshot_bytes, n)),
    )


def _written(names: Sequence[str], blocks: Sequence[str]) -> tuple[str, ...]:
    """The buffers a step writes in the model of ``blocks``, from those it writes in its
    copy of 4 (the first block, two middle ones, the last): a middle block's stand for
    every middle block's."""
    n, out = len(blocks), []
    parent = blocks[0].rpartition(".")[0]
    prefix = f"{parent}." if parent else ""
    for name in names:
        index, dot, rest = name.removeprefix(prefix).partition(".")
        if not name.startswith(prefix) or not dot or not index.isdigit():
            out.append(name)  # outside the blocks
            continue
        copied = int(index)
        kept = {0: [0], 3: [n - 1]}.get(copied, range(1, n - 1))
        out += [f"{blocks[i]}.{rest}" for i in kept]
    return tuple(dict.fromkeys(out))


def deepen_time(profile: Profile, seconds: Sequence[float], forward_s: float) -> Profile:
    """``profile`` (deepened, with time curves timed on the copy of 4 blocks) with its time
    at the full depth, from ``seconds`` (each of the 4 blocks' forward) of one forward of
    ``forward_s`` seconds: every middle block adds a middle block's share of it."""
    n = len(profile.blocks)
    middle = (seconds[1] + seconds[2]) / 2
    grown = 1 + (n - 4) * middle / max(forward_s, 1e-12)
    blocks_grown = (sum(seconds) + (n - 4) * middle) / max(sum(seconds), 1e-12)
    spent = (seconds[0], *(middle for _ in range(n - 2)), seconds[3])
    total = sum(spent)
    weights = tuple(s / total for s in spent) if total > 0 else tuple(1.0 / n for _ in spent)

    def curve(t: TimeCurve | None) -> TimeCurve | None:
        if t is None:
            return None
        return TimeCurve(
            t.batch_sizes,
            tuple(s * grown for s in t.seconds),
            t.ckpt_batch_sizes,
            tuple(r * blocks_grown / grown for r in t.ckpt_ratio),
        )

    precisions = {
        p: dataclasses.replace(pp, time=curve(pp.time)) for p, pp in profile.precisions.items()
    }
    return dataclasses.replace(profile, block_weights=weights, precisions=precisions)


def _linear(three: float, four: float, n: int) -> float:
    """The value at depth ``n`` of what is ``three`` at 3 blocks and ``four`` at 4."""
    return four + (four - three) * (n - 4)


def _line(three: Line, four: Line, n: int) -> Line:
    return Line(_linear(three.const, four.const, n), _linear(three.slope, four.slope, n))


def _precision(three: PrecisionProfile, four: PrecisionProfile, n: int) -> PrecisionProfile:
    reserve = tuple(
        Line(max(b.const, e.const), max(b.slope, e.slope))
        for a, b in zip(three.reserve, four.reserve, strict=False)
        for e in (_line(a, b, n),)
    )
    return PrecisionProfile(
        four.timeline,
        int(_linear(three.base_bytes, four.base_bytes, n)),
        _phases(three.phases, four.phases, n),
        four.time,
        reserve,
        _per_block(four.moved, n),
        _per_block(four.copies, n),
    )


def _per_block(values: tuple[T, ...], n: int) -> tuple[T, ...]:
    """Per-block values of the copy of 4 at the full depth (the second middle one repeated)."""
    if not values:
        return values
    return (values[0], values[1], *(values[2] for _ in range(n - 3)), values[3])


def _role(key: PhaseKey, depth: int) -> tuple[int, str, str]:
    """A phase of a block outside the middle, named the same at every depth."""
    where = {None: "", 0: "first", depth - 1: "last"}.get(key.block, "middle")
    return key.micro, key.label, where


def _phases(three: Sequence[Phase], four: Sequence[Phase], n: int) -> tuple[Phase, ...]:
    """The phases at depth ``n``: each middle block's run of phases of the copy of 4
    repeated, every other phase extrapolated (gradient bytes included)."""
    same = {_role(ph.key, 3): ph for ph in three}
    # A middle block's gradients: what one more block adds to those alive in micro-batch 2.
    later = [ph for ph in four if ph.key.micro == 2]
    grad = later[0].grads - same[_role(later[0].key, 3)].grads if later else 0
    out: list[Phase] = []
    for (micro, block), run in itertools.groupby(four, lambda ph: (ph.key.micro, ph.key.block)):
        phases = list(run)
        if block not in (1, 2):
            last = n - 1 if block == 3 else block
            out.extend(_extended(same.get(_role(ph.key, 4), ph), ph, n, last) for ph in phases)
            continue
        backward = phases[0].key.label == "bwd"
        # Forward: the middle block after the first stays, the one after a middle block
        # repeats; backward: the one below the last stays, the one below a middle repeats.
        if block == (1 if backward else 2):
            targets = range(n - 3, 0, -1) if backward else range(2, n - 1)
        else:
            targets = range(n - 2, n - 1) if backward else range(1, 2)
        for j in targets:
            if micro == 2:
                extra = (n - 4) * grad
            else:
                extra = (n - 3 - j) * grad if backward and block == 1 else 0
            out.extend(_renumbered(ph, j, extra) for ph in phases)
    return tuple(out)


def _extended(three: Phase, four: Phase, n: int, block: int | None) -> Phase:
    return Phase(
        four.key._replace(block=block),
        None if four.block is None else block,
        tuple(_line(a, b, n) for a, b in zip(three.delta, four.delta, strict=True)),
        tuple(_line(a, b, n) for a, b in zip(three.peak, four.peak, strict=True)),
        int(_linear(three.grads, four.grads, n)),
        _bends(three.bends, four.bends, n),
    )


def _bends(
    three: tuple[tuple[Line, ...], ...], four: tuple[tuple[Line, ...], ...], n: int
) -> tuple[tuple[Line, ...], ...]:
    """Each variant's bends at depth ``n`` where the two copies bend alike (as many
    lines), else none (the peak's line alone)."""
    if len(three) != len(four) or any(len(a) != len(b) for a, b in zip(three, four, strict=True)):
        return ()
    return tuple(
        tuple(_line(x, y, n) for x, y in zip(a, b, strict=True))
        for a, b in zip(three, four, strict=True)
    )


def _renumbered(phase: Phase, block: int, extra_grads: int) -> Phase:
    return Phase(
        phase.key._replace(block=block),
        None if phase.block is None else block,
        phase.delta,
        phase.peak,
        phase.grads + extra_grads,
        phase.bends,
    )
