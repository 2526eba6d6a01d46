"""Enumerating configurations: micro-batch sizes, the largest that fits, the exhaustive best,
and the candidates of the fallback ladder.

The error for a budget no configuration fits: the minimum, what holds it, what would help.
"""

from __future__ import annotations

import itertools
import math

from autotune._format import format_bytes
from autotune._spelling import option
from autotune.config import Timeline, TrainConfig
from autotune.cost._chooser import Candidate, Chooser
from autotune.errors import BudgetTooSmallError, ConfigError
from autotune.space import SearchSpace

__all__ = [
    "best_config",
    "enumerate_candidates",
    "fallback_candidates",
    "largest_fitting",
    "micro_batch_candidates",
    "space_points",
    "too_small",
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
    chooser: Chooser, timeline: Timeline, optimizer: str, offload: bool | None = None
) -> int | None:
    """The largest allowed micro-batch size for which some configuration fits.

    ``offload``: the optimizer placement; ``None``: any the chooser allows. Every size is
    tried from the largest down: what fits is not monotonic in the micro-batch where the
    global batch is fixed (a smaller one accumulates, holding every gradient through the
    later micro-batches, where a larger one held none in its forward).
    """
    if offload is None:
        found = [
            largest_fitting(chooser, timeline, optimizer, h) for h in chooser.offload_optimizer
        ]
        return max((b for b in found if b is not None), default=None)
    return next(
        (
            b
            for b in reversed(chooser.sizes)
            if chooser.config(timeline, optimizer, b, offload) is not None
        ),
        None,
    )


def space_points(chooser: Chooser) -> list[tuple[int, Timeline, str, bool]]:
    """Every setting of the searched knobs that can fit: ``(micro-batch, timeline,
    optimizer, optimizer offload)``, the micro-batch no larger than the largest that fits
    with those other knobs (a larger one cannot fit)."""
    points = []
    for p, o, h in itertools.product(
        chooser.timelines, chooser.optimizers, chooser.offload_optimizer
    ):
        top = largest_fitting(chooser, p, o, h)
        if top is not None:
            points += [(b, p, o, h) for b in chooser.sizes if b <= top]
    return points


def enumerate_candidates(
    chooser: Chooser, points: list[tuple[int, Timeline, str, bool]] | None = None
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
        timelines=chooser.timelines,
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
    eager = [p for p in chooser.timelines if not p.compiled] or chooser.timelines
    frugal = [
        c
        for p, h, (ckpt, off) in itertools.product(eager, chooser.offload_optimizer, placements)
        if not (off and p.compiled)  # a compiled block is never offloaded
        and chooser.host_fits(
            c := cost.layout.apply(
                TrainConfig(
                    micro_batch_size=smallest,
                    grad_accum_steps=effective // smallest,
                    **p.knobs(cost.profile.blocks),
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


_LIGHTER = "SearchSpace(optimizers=['adamw', 'adamw8bit'])"
"""The option that allows a lighter optimizer, as a Python caller passes it."""


def too_small(
    chooser: Chooser,
    space: SearchSpace,
    budget: int,
    *,
    headroom: float,
    offload_helps: bool = True,
) -> BudgetTooSmallError:
    """The error for a budget under the cheapest configuration of the space, with the
    least budget that tunes and what would lower it (offload only where it helps: not
    where host memory is device memory).

    The cheapest configuration is the least of every setting the search could choose,
    each micro-batch included: with the global batch fixed, the smallest micro-batch is
    not always the least (it accumulates, holding every gradient through the micro-batches
    after the first). ``headroom``: the share of the budget the search keeps free, which
    the least budget adds to that configuration's peak.
    """
    cost = chooser.cost
    settings = itertools.product(
        chooser.sizes, chooser.timelines, chooser.optimizers, chooser.offload_optimizer
    )
    # The first of the least (ties keep the order of the space: the user's choices first).
    peak, micro_batch, p, o, h = min(
        ((chooser.frugal_peak(p, o, b, h), b, p, o, h) for b, p, o, h in settings),
        key=lambda x: x[0],
    )
    least = math.ceil(peak / (1 - headroom))
    config = chooser.config_of(chooser.frugal(chooser.knobs(p, o, micro_batch, h)))
    _, parts = cost.memory(config)
    hints = [f"raise {option('budget_gb')}"]
    light = [
        x for x in ("adamw8bit", "paged_adamw8bit", "adafactor", "sgd") if x in space.optimizers
    ]
    if parts.optimizer > parts.parameters / 2 and not light:
        hints.append(f"allow a lighter optimizer, e.g. {option(_LIGHTER)} or 'adafactor'")
    if offload_helps and not h and True not in chooser.offload_optimizer:
        hints.append(f"allow optimizer offload ({option('SearchSpace(offload_optimizer=True)')})")
    if offload_helps and not chooser.offload_activations and cost.n_blocks:
        hints.append(
            f"allow activation offload ({option('SearchSpace(offload_activations=True)')})"
        )
    if not space.checkpointing:
        hints.append(f"allow checkpointing ({option('SearchSpace(checkpointing=True)')})")
    hints.append("tune with shorter sequences or a smaller model")
    where = []
    if config.checkpoint:
        where.append(f"{len(config.checkpoint)} of {cost.n_blocks} blocks checkpointed")
    if config.offload_activations:
        where.append(f"{len(config.offload_activations)} of {cost.n_blocks} blocks offloaded")
    if h:
        where.append("optimizer on the host")
    if config.parallel != "none":
        where.append(f"{config.parallel} over {config.world_size} ranks")
    accumulated = f" x {config.grad_accum_steps}" if config.grad_accum_steps > 1 else ""
    return BudgetTooSmallError(
        f"the budget of {format_bytes(budget)} is below the minimum this model needs, "
        f"{format_bytes(least)}: its least-memory config (micro-batch {micro_batch}"
        f"{accumulated}, {p}, {o}{', ' + ', '.join(where) if where else ''}) peaks at "
        f"{format_bytes(peak)}, and the search keeps {headroom:.0%} of the budget free. "
        f"At the peak: parameters "
        f"{format_bytes(parts.parameters)}, gradients {format_bytes(parts.gradients)}, "
        f"optimizer state {format_bytes(parts.optimizer)}, activations "
        f"{format_bytes(parts.activations)}, other {format_bytes(parts.other)}. "
        f"To fit: {'; '.join(hints)}.",
        minimum_bytes=least,
        budget_bytes=budget,
        peak_bytes=peak,
    )
