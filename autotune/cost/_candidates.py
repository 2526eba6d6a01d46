"""Enumerating configurations: micro-batch sizes, the largest that fits, the exhaustive best,
and the candidates of the fallback ladder.
"""

from __future__ import annotations

import itertools

from autotune._spelling import option
from autotune.config import TrainConfig, timeline_knobs, timeline_parts
from autotune.cost._chooser import Candidate, Chooser
from autotune.errors import ConfigError
from autotune.space import SearchSpace

__all__ = [
    "best_config",
    "enumerate_candidates",
    "fallback_candidates",
    "largest_fitting",
    "micro_batch_candidates",
    "space_points",
]

_MAX_ACCUM = 64
"""The most frugal fallback accumulates at most this many micro-batches."""
_LADDER_STEP = 0.75
"""The middle fallback aims at this share of the winner's measured peak."""


def micro_batch_candidates(space: SearchSpace, global_batch_size: int | None) -> tuple[int, ...]:
    """Micro-batch sizes the search may pick, ascending.

    With a global batch size only its divisors qualify, so that micro-batch times
    accumulation equals it exactly.
    """
    cap = space.max_micro_batch_size
    if global_batch_size is not None:
        cap = min(cap, global_batch_size)
    if space.micro_batch_sizes is not None:
        sizes = [s for s in space.micro_batch_sizes if s <= cap]
    else:
        sizes = list(range(1, cap + 1))
    if global_batch_size is not None:
        sizes = [s for s in sizes if global_batch_size % s == 0]
    if not sizes:
        raise ConfigError(
            f"no micro-batch size in the search space divides {option('global_batch_size')} "
            f"{global_batch_size}; widen {option('SearchSpace.micro_batch_sizes')}."
        )
    return tuple(sizes)


def largest_fitting(
    chooser: Chooser, precision: str, optimizer: str, offload: bool | None = None
) -> int | None:
    """The largest allowed micro-batch size for which some configuration fits.

    ``offload``: the optimizer placement; ``None``: any the chooser allows. Every size is
    tried from the largest down: what fits is not monotonic in the micro-batch where the
    global batch is fixed (a smaller one accumulates, holding every gradient through the
    later micro-batches, where a larger one held none in its forward).
    """
    if offload is None:
        found = [
            largest_fitting(chooser, precision, optimizer, h) for h in chooser.offload_optimizer
        ]
        return max((b for b in found if b is not None), default=None)
    return next(
        (
            b
            for b in reversed(chooser.sizes)
            if chooser.config(precision, optimizer, b, offload) is not None
        ),
        None,
    )


def space_points(chooser: Chooser) -> list[tuple[int, str, str, bool]]:
    """Every setting of the searched knobs that can fit: ``(micro-batch, precision,
    optimizer, optimizer offload)``, the micro-batch no larger than the largest that fits
    with those other knobs (a larger one cannot fit)."""
    points = []
    for p, o, h in itertools.product(
        chooser.precisions, chooser.optimizers, chooser.offload_optimizer
    ):
        top = largest_fitting(chooser, p, o, h)
        if top is not None:
            points += [(b, p, o, h) for b in chooser.sizes if b <= top]
    return points


def enumerate_candidates(
    chooser: Chooser, points: list[tuple[int, str, str, bool]] | None = None
) -> list[Candidate]:
    """The cheapest fitting configuration of every point of the space (``points``:
    :func:`space_points`), fastest predicted first (ties: smaller peak, then the order
    of the space): the exact answer of the search."""
    found = [
        c
        for b, p, o, h in (space_points(chooser) if points is None else points)
        if (c := chooser.candidate(p, o, b, h)) is not None
    ]
    found.sort(key=Candidate.order)
    return found


def best_config(chooser: Chooser) -> Candidate | None:
    """The fastest predicted candidate by exhaustive enumeration."""
    found = enumerate_candidates(chooser)
    return found[0] if found else None


def fallback_candidates(chooser: Chooser, config: TrainConfig, peak_bytes: int) -> list[Candidate]:
    """Configurations to verify for the fallback ladder below ``config`` (measured at
    ``peak_bytes``): same effective batch and optimizer.

    Two: the fastest predicted config at 3/4 of the winner's peak, and the most frugal
    one (the smallest micro-batch with at most 64 accumulation steps, every block
    checkpointed or offloaded, the precision and optimizer placement that need least,
    eager where an eager precision is searched).
    """
    effective = config.effective_batch_size
    sizes = [b for b in chooser.sizes if effective % b == 0] or [effective]
    ladder = Chooser(
        cost=chooser.cost,
        sizes=sizes,
        precisions=chooser.precisions,
        optimizers=(config.optimizer,),
        global_batch_size=effective,
        limit=int(peak_bytes * _LADDER_STEP),
        checkpointing=chooser.checkpointing,
        selective=chooser.selective,
        offload_optimizer=chooser.offload_optimizer,
        offload_activations=chooser.offload_activations,
    )
    out = [c for c in (best_config(ladder),) if c is not None]
    cost = chooser.cost
    names = cost.profile.blocks if chooser.checkpointing else ()
    # The smallest micro-batch that keeps accumulation sane (at most 64 micro-batches).
    smallest = next((b for b in sizes if effective // b <= _MAX_ACCUM), sizes[-1])
    placements: list[tuple[tuple[str, ...], tuple[str, ...]]] = [(names, ())]
    if chooser.offload_activations:
        placements.append(((), cost.profile.blocks))
    # The last resort runs eagerly where it can: no graph of its own to compile at the
    # smallest micro-batch, mid-training, when the fallback is taken.
    eager = [p for p in chooser.precisions if not timeline_parts(p)[1]] or chooser.precisions
    frugal = [
        c
        for p, h, (ckpt, off) in itertools.product(eager, chooser.offload_optimizer, placements)
        if not (off and timeline_parts(p)[1])  # a compiled block is never offloaded
        and chooser.host_fits(
            c := cost.layout.apply(
                TrainConfig(
                    micro_batch_size=smallest,
                    grad_accum_steps=effective // smallest,
                    **timeline_knobs(p, cost.profile.blocks),
                    checkpoint=ckpt,
                    offload_activations=off,
                    optimizer=config.optimizer,
                    offload_optimizer=h,
                )
            )
        )
    ]
    if frugal:
        out.append(
            min(
                (Candidate(c, cost.predict(c)) for c in frugal),
                key=lambda c: c.prediction.measurement.peak_bytes,
            )
        )
    return out
