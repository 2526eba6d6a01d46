"""The error for a budget no configuration fits: the minimum, what holds it, what would help."""

from __future__ import annotations

import itertools
import math

from autotune._format import format_bytes
from autotune._spelling import option
from autotune.cost._chooser import Chooser
from autotune.errors import BudgetTooSmallError
from autotune.space import SearchSpace

__all__ = ["too_small"]

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
        chooser.sizes, chooser.precisions, chooser.optimizers, chooser.offload_optimizer
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
