"""``TuneOptions``: everything a tuning run is asked for besides the model and its batch.

:func:`autotune.autotune` takes these as keyword arguments (documented there), the
Lightning callback from its own arguments and the command line from its flags; each
builds one record and passes it on, so that an option is added in one place. A record
checks itself once, when it is built: what can be wrong with the options alone is an
error before the model is looked at; what depends on the model, the sample or the
process group is the problem's to check (:func:`~autotune.tuning._problem.make_problem`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune._spelling import option
from autotune.config import MAX_BATCH, is_factory
from autotune.errors import ConfigError, ProfileError
from autotune.space import SearchSpace
from autotune.train import available, build_optimizer, factory_name

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
    max_tuning_s: float | None = None
    """Seconds the whole run may take (see :func:`autotune.autotune`); ``None``: no limit."""
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

    def __post_init__(self) -> None:
        """Check the options that need nothing else to check.

        Raises:
            ConfigError: what is wrong, and what to pass instead.
            ProfileError: a loss that cannot be called.
        """
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ProfileError(
                f"{option('loss_fn')} must be callable as loss_fn(output, batch) -> scalar tensor."
            )
        if self.global_batch_size is not None and not _count(self.global_batch_size):
            raise ConfigError(
                f"{option('global_batch_size')} must be a positive integer up to {MAX_BATCH}, got "
                f"{str(self.global_batch_size)[:40]}; pass the number of samples per "
                "optimizer step, or None for no accumulation."
            )
        if self.eval_batch_size is not None and not _count(self.eval_batch_size):
            raise ConfigError(
                f"{option('eval_batch_size')} must be a positive integer, got "
                f"{str(self.eval_batch_size)[:40]}; or None for the largest that fits."
            )
        limit = self.max_tuning_s
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0
        ):
            raise ConfigError(
                f"{option('max_tuning_s')} must be a positive number of seconds, got "
                f"{str(limit)[:40]}; or None for no limit."
            )
        if self.world_size is not None and not _count(self.world_size, most=2**20):
            raise ConfigError(
                f"world_size must be a positive integer, got {self.world_size!r:.40}."
            )
        self._check_table()
        self._check_storage()
        for name in self.space.optimizers:
            if is_factory(name):
                factory_name(name)  # named in the space: imported, or a clear ConfigError
            elif not available(name):
                build_optimizer(name, [], 0.0)  # raises the ConfigError that says what to install

    def _check_table(self) -> None:
        """A table's lengths and its optimizer step (what the sample decides is
        :class:`~autotune.tuning._autotune.Lengths`')."""
        lengths, tokens = self.sequence_lengths, self.global_batch_tokens
        if self.global_batch_size is not None and tokens is not None:
            raise ConfigError(
                f"pass {option('global_batch_size')} (samples per step) or "
                f"{option('global_batch_tokens')}, not both."
            )
        if lengths is not None and (
            isinstance(lengths, (str, bytes))
            or not isinstance(lengths, Sequence)
            or not lengths
            or not all(_count(n, most=MAX_BATCH**2) for n in lengths)
        ):
            raise ConfigError(
                f"{option('sequence_lengths')} must be a list of positive integers, got "
                f"{lengths!r:.60}."
            )
        if tokens is not None and not _count(tokens, most=MAX_BATCH**2):
            raise ConfigError(
                f"{option('global_batch_tokens')} must be a positive integer, got {tokens!r:.40}."
            )

    def _check_storage(self) -> None:
        """What a kept study does not hold yet."""
        if self.storage is None:
            return
        if self.space.attention:
            raise ConfigError(
                "SearchSpace.attention is not supported with storage yet; leave one of them out."
            )
        if self.table:
            raise ConfigError(
                f"{option('sequence_lengths')} and {option('global_batch_tokens')} are not "
                "supported with storage yet; leave storage out."
            )

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


def _count(value: Any, most: int = MAX_BATCH) -> bool:
    """Whether ``value`` is a whole number from 1 to ``most`` (``True`` is not one)."""
    return not isinstance(value, bool) and isinstance(value, int) and 1 <= value <= most
