"""``Recompiles``: a compiled config's steps that dynamo ran eagerly, said once.

Dynamo compiles a graph per shape it has not seen (where a shape is not symbolic) up to
its recompile limit per function (8 by default); past it, the function runs eagerly, with
one line in dynamo's log, and a tuned compiled config loses its speed without a word. A
training run's compiled loss and forward take new shapes as one dynamic graph (see
:mod:`~autotune.train._compiled_model`), so a stream of padded lengths stays far below the
limit; what still reaches it (shapes dynamo must specialise, a loop that compiles other
code) is said here, as an :class:`~autotune.errors.AutotuneWarning` with what to do,
once per handle.
"""

from __future__ import annotations

import logging

import torch

from autotune.errors import warn

__all__ = ["Recompiles"]


class _LimitHits(logging.Handler):
    """Counts dynamo's lines that say a function reached its recompile limit."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.last = ""
        """The function of the last one, as dynamo names it."""

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("torch._dynamo hit config.") and len(record.args or ()) > 2:
            self.count += 1
            self.last = str(record.args[2])  # type: ignore[index]


_HITS = _LimitHits()
logging.getLogger("torch._dynamo.convert_frame").addHandler(_HITS)


class Recompiles:
    """Whether dynamo has reached its recompile limit since this handle began."""

    def __init__(self) -> None:
        self._seen = _HITS.count
        self._said = False

    def check(self) -> None:
        """Say once (an :class:`AutotuneWarning`) that steps ran eagerly, if dynamo
        reached its recompile limit since the last check."""
        if _HITS.count == self._seen:
            return
        self._seen = _HITS.count
        if self._said:
            return
        self._said = True
        limit = torch._dynamo.config.recompile_limit
        warn(
            f"torch.compile reached dynamo's recompile limit ({limit} graphs) for "
            f"{_HITS.last}: calls with a shape it has no graph for now run eagerly, slower "
            "than tuned. Feed fewer shapes (pad batches to a few lengths: "
            "DataCollatorWithPadding(pad_to_multiple_of=64), or drop_last=True for the "
            "shorter last batch), or raise torch._dynamo.config.recompile_limit before "
            "training."
        )
