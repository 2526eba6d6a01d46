"""``TuneOptions``: everything a tuning run is asked for besides the model and its batch.

:func:`autotune.autotune` takes these as keyword arguments (documented there), the
Lightning callback from its own arguments and the command line from its flags; each
builds one record and passes it on, so that an option is added in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.space import SearchSpace

if TYPE_CHECKING:
    import torch

    from autotune.result import TuneResult
    from autotune.train import LossFn

__all__ = ["TuneOptions"]


@dataclass(frozen=True, kw_only=True)
class TuneOptions:
    """The arguments of :func:`autotune.autotune` after the model and the sample batch."""

    budget_gb: float = 24.0
    loss_fn: LossFn | None = None
    global_batch_size: int | None = None
    global_batch_tokens: int | None = None
    sequence_lengths: Sequence[int] | None = None
    device: torch.device | str | None = None
    space: SearchSpace = field(default_factory=SearchSpace)
    n_trials: int | None = None
    timeout_s: float | None = None
    seed: int = 0
    storage: str | None = None
    study_name: str | None = None
    world_size: int | None = None
    start_from: TuneResult | None = None
    """A plan (or an earlier result) whose config is verified first."""
    eval_batch_size: int | None = None
    """The evaluation batch the user wants, checked against each config; ``None``: the
    largest that fits."""
    progress: bool | None = None
    """Show progress on stderr; ``None``: where a person watches (a terminal, a notebook)
    and no logging is set up."""

    @property
    def table(self) -> bool:
        """Whether a table per sequence length is asked for."""
        return self.sequence_lengths is not None or self.global_batch_tokens is not None

    @property
    def parallel(self) -> bool:
        """Whether a world size other than one is asked for (a process group's is not)."""
        return self.world_size not in (None, 1)

    def replace(self, **changes: Any) -> TuneOptions:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)
