"""The error for a budget no configuration fits: the minimum, what holds it, what would help."""

from __future__ import annotations

import itertools

from autotune._format import format_bytes
from autotune._spelling import option
from autotune.cost._chooser import Chooser
from autotune.errors import BudgetTooSmallError
from autotune.space import SearchSpace

__all__ = ["too_small"]

_LIGHTER = "SearchSpace(optimizers=['adamw', 'adamw8bit'])"
"""The option that allows a lighter optimizer, as a Python caller passes it."""


def too_small(
    chooser: Chooser, space: SearchSpace, budget: int, *, offload_helps: bool = True
) -> BudgetTooSmallError:
    """The error for a budget under the cheapest configuration, with what would lower it
    (offload only where it helps: not where host memory is device memory)."""
    cost = chooser.cost
    micro_batch = chooser.sizes[0]
    settings = itertools.product(chooser.precisions, chooser.optimizers, chooser.offload_optimizer)
    # The first of the least (ties keep the order of the space: the user's choices first).
    peak, p, o, h = min(
        ((chooser.frugal_peak(p, o, micro_batch, h), p, o, h) for p, o, h in settings),
        key=lambda x: x[0],
    )
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
    return BudgetTooSmallError(
        f"the budget of {format_bytes(budget)} is below the minimum this model needs, "
        f"{format_bytes(peak)} (micro-batch {micro_batch}, {p}, {o}"
        f"{', ' + ', '.join(where) if where else ''}): parameters "
        f"{format_bytes(parts.parameters)}, gradients {format_bytes(parts.gradients)}, "
        f"optimizer state {format_bytes(parts.optimizer)}, activations "
        f"{format_bytes(parts.activations)}, other {format_bytes(parts.other)}. "
        f"To fit: {'; '.join(hints)}.",
        minimum_bytes=peak,
        budget_bytes=budget,
    )
