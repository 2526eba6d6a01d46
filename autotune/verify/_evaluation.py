"""The evaluation batch of each verified config: the largest no-grad forward that fits the
budget beside its training state (a trainer's evaluation loop runs between its steps, with
its own batch size, on the device the training state fills)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from autotune.config import TrainConfig
from autotune.errors import warn
from autotune.verify._verifier import Verifier

__all__ = ["with_eval_batches"]

log = logging.getLogger("autotune")

_BEYOND = 4
"""The evaluation batch is looked for up to this many times the micro-batch (and at least
up to 8, the Hugging Face Trainer's default): beyond, an evaluation gains little speed and
the search would run forwards larger than any training step."""


def with_eval_batches(
    verifier: Verifier, configs: Sequence[TrainConfig], wanted: int | None, most: int
) -> list[TrainConfig]:
    """``configs`` with their evaluation batch sizes, the largest that fits up to
    :data:`_BEYOND` times the micro-batch (and ``most``), measured once per precision,
    optimizer, placement and attention (what an evaluation holds: the parameters, the
    optimizer's state and one forward; not the checkpoint mask). ``wanted``: the user's
    size, kept where it fits (a warning says where it does not)."""
    sizes: dict[tuple[object, ...], int | None] = {}
    out = []
    for c in configs:
        if c.parallel != "none":  # each rank evaluates its own shard of the batch: not run
            out.append(c)
            continue
        key = (c.timeline, c.optimizer, c.offload_optimizer, c.attention)
        if key not in sizes:
            bound = min(most, max(8, _BEYOND * c.micro_batch_size))
            sizes[key] = size = verifier.eval_batch(c, wanted, bound)
            log.info("evaluation batch beside %s: %s", c.describe(), size)
            if wanted is not None and size != wanted:
                warn(
                    f"an evaluation batch of {wanted} does not fit the budget beside the "
                    f"training state of {c.describe()}; the largest that does is {size or 0}. "
                    "Evaluate with that (the exports set it), or raise the budget.",
                )
        out.append(c.replace(eval_batch_size=sizes[key]))
    return out
