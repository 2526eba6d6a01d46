"""The outcome of tuning: measurements, trial records, :class:`TuneResult` and its YAML.

YAML is read safely and bounded (:mod:`autotune._yaml`) and decoded against the dataclass fields:
an unknown key, a missing required key or a value of the wrong type is a
:class:`~autotune.errors.ConfigError` that names the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import stat
from pathlib import Path
from typing import Any

import yaml

from autotune._files import write_atomic
from autotune._plain_data import from_plain, to_plain
from autotune._yaml import MAX_BYTES, read_yaml, too_large
from autotune.config import TrainConfig
from autotune.errors import ConfigError

__all__ = [
    "PARTS",
    "PLANNED",
    "SCHEMA_VERSION",
    "Breakdown",
    "Costs",
    "LengthRow",
    "Measurement",
    "ModelInfo",
    "Spent",
    "TargetInfo",
    "TrialRecord",
    "TuneResult",
    "compile_cache_path",
    "load",
]

SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Peak device memory and speed of one configuration, predicted or measured."""

    peak_bytes: int
    """Peak device memory, as defined in docs/memory.md (CUDA: reserved + context)."""
    step_s: float
    """Seconds per optimizer step (``effective_batch_size`` samples)."""
    samples_per_s: float
    """Training throughput."""


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """The predicted peak split by what holds the memory (bytes at the peak)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    other: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.other


PARTS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Breakdown))
"""The fields of :class:`Breakdown`, in order: what holds memory at the peak."""
OTHER = "the batch, buffers and, on a GPU, the CUDA context and the allocator's reserve"
"""What a breakdown's ``other`` holds, in words."""


@dataclasses.dataclass(frozen=True)
class Costs:
    """What each part of training one config costs on the device, each at its own most
    (a :class:`Breakdown` is what holds memory at the one moment of the peak: there the
    gradients may not exist yet, or the activations be gone). The parts peak at different
    moments, so their sum is more than the peak."""

    micro_batch: int
    parameters: int
    gradients: int
    """Held from the first backward to the optimizer step (trained parameters only)."""
    optimizer: int
    """The optimizer's state, held for the whole run (0: on the host)."""
    optimizer_step: int
    """What the optimizer's step takes beside its state while it runs."""
    activations: int
    """The most one micro-batch's forward and backward hold at ``micro_batch``: grows with it."""
    activations_per_sample: int
    """What one more sample in the micro-batch adds to ``activations``."""
    batch: int
    """The step's input batch on the device (every micro-batch): grows with the micro-batch."""
    other: int
    """Buffers, precision copies and, on a GPU, the CUDA context and the allocator's reserve
    at the peak."""


@dataclasses.dataclass(frozen=True)
class TargetInfo:
    """Facts about the device a result was tuned on."""

    device: str
    """``cpu`` or ``cuda:N``."""
    name: str
    """Human name of the device (GPU model or CPU)."""
    total_bytes: int
    """Device memory (host RAM for the CPU)."""
    torch_version: str
    """The torch version the tuning ran with."""
    context_bytes: int = 0
    """Device memory outside the allocator (the CUDA context) when it was tuned."""


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a result was tuned for, to detect a config used on another model."""

    class_name: str
    fingerprint: str
    """Hash of the module structure: names, classes, parameter shapes and dtypes."""
    n_parameters: int
    blocks: tuple[str, ...]
    block_classes: tuple[str, ...] = ()
    """The class names of the blocks (what a trainer's FSDP wrap policy names)."""
    written: tuple[str, ...] | None = None
    """The buffers a training step writes (BatchNorm's running statistics, counters),
    which a runner with fallbacks copies before each step to put them back after an
    out-of-memory error (``None``: not recorded, every buffer is copied)."""


PLANNED = "planned, not run"
"""A plan's trial's ``error``: a candidate ranked on predictions alone (``autotune plan``)."""


@dataclasses.dataclass(frozen=True)
class TrialRecord:
    """One candidate that was run for real during verification."""

    config: TrainConfig
    predicted: Measurement
    measured: Measurement | None
    """``None`` when the run failed (see ``error``)."""
    error: str | None = None
    """Why the candidate was rejected (e.g. out of memory), or ``None``."""
    timings: tuple[float, ...] = ()
    """Seconds per step of each timing whose median is ``measured`` (the first run's and
    every re-timing), when it was timed again; empty when timed once."""
    peak_only: bool = False
    """Only its peak was measured (a fallback's, kept for its memory: steps of two
    micro-batches, the whole batch held); ``measured``'s speed is then 0, not a figure."""


@dataclasses.dataclass(frozen=True)
class Spent:
    """Where a tuning run's seconds went."""

    profile_s: float = 0.0
    """Profiling memory and time on the device."""
    search_s: float = 0.0
    """Searching the space on the cost model."""
    verification_s: float = 0.0
    """Running candidates and fallbacks for real, and re-timing the contenders."""

    def __add__(self, other: Spent) -> Spent:
        """The seconds of two tuning runs together."""
        return Spent(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self))
        )


@dataclasses.dataclass(frozen=True)
class LengthRow:
    """One row of a result tuned per sequence length: how batches up to ``length`` train."""

    length: int
    """The longest (padded) length this row trains; the row before it holds the shorter."""
    config: TrainConfig
    """The fastest verified configuration at ``length``."""
    predicted: Measurement
    measured: Measurement | None
    """``None``: planned for a world size not here, not run."""
    fallbacks: tuple[TrainConfig, ...] = ()
    """Verified at ``length``, with this row's effective batch, fastest to most frugal."""


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """The outcome of :func:`autotune.autotune`: the winner, its evidence and fallbacks."""

    config: TrainConfig
    """The fastest verified configuration under the budget."""
    predicted: Measurement
    """What the cost model predicted for ``config``."""
    measured: Measurement | None
    """What the verification run measured for ``config``; ``None`` when nothing ran (a
    plan, or a world size tuned in one process: see ``unverified``)."""
    budget_bytes: int
    target: TargetInfo
    model: ModelInfo
    breakdown: Breakdown
    """The predicted peak of ``config`` split by owner."""
    fallbacks: tuple[TrainConfig, ...] = ()
    """Verified configurations with the same effective batch, fastest to most frugal."""
    trials: tuple[TrialRecord, ...] = ()
    """Every verification run, including the rejected ones."""
    tuning_s: float = 0.0
    """Wall time of the tuning run."""
    spent: Spent = Spent()
    """Where ``tuning_s`` went."""
    unverified: tuple[str, ...] = ()
    """What of this result was predicted and not run for real (a plan for a world size
    tuned in one process); empty when everything was verified."""
    by_length: tuple[LengthRow, ...] = ()
    """Tuned per sequence length (``sequence_lengths=``): a row per length, ascending; the
    last is the longest, whose config is ``config``. Empty: one config for every batch."""
    tied: tuple[TrainConfig, ...] = ()
    """Verified configurations whose measured speed is within the timing noise of the
    winner's: as fast as far as this machine could tell (the winner is the simplest of
    them, so the same inputs give it again, or one of these). Empty: its lead is known."""
    noise: float = 0.0
    """The relative noise of one timing while verifying, as estimated from the re-timings
    (with a prior of 3%; 0: nothing was timed). A measured speed is this sure, per timing."""
    busy: str | None = None
    """Why the machine counted as busy while tuning (others' load, scattered timings), and
    what to do; ``None``: it did not."""
    expert: TrialRecord | None = None
    """The expert's recipe (on a GPU: bf16, the whole model compiled with its loss, the
    optimizer fused, the largest micro-batch that fits with no block or every block
    checkpointed, the faster of the two; on a CPU: the faster precision, eager),
    verified in the same run and timed the same way, the config to beat; ``None``: not
    run (a plan: nothing ran; else ``expert_note`` says why)."""
    expert_note: str = ""
    """Why there is no expert's recipe (data parallelism, nothing of it fitted), or how
    the one run differs from the expert's (eager where the compiled model was not
    searched); empty: nothing to say."""
    skipped: tuple[str, ...] = ()
    """What verification did not run for the run's time budget (``max_tuning_s``): more
    candidates, the expert's recipe, re-timing, fallbacks, the evaluation batch; empty:
    nothing was skipped."""
    compile_cache: bytes = dataclasses.field(
        default=b"", compare=False, repr=False, metadata={"plain": False}
    )
    """The code the tuning run compiled (torch's cache artifacts), where the config or a
    fallback compiles: :meth:`save` writes it beside the YAML (:func:`compile_cache_path`),
    :func:`load` reads it back, and ``prepare()`` and ``apply()`` start from it; empty:
    none. Not in the YAML."""
    figures_for: str = dataclasses.field(default="", compare=False)
    """The digest of the config the figures were made for (:meth:`TrainConfig.digest`),
    written with the file; empty: the config in hand."""
    version: int = SCHEMA_VERSION
    """Schema version of the YAML file."""

    @property
    def edited(self) -> bool:
        """Whether ``config`` was edited after its figures were made (in the file, by
        hand): ``predicted``, ``measured`` and the breakdown are then another config's."""
        return bool(self.figures_for) and self.figures_for != self.config.digest()

    def save(self, path: str | Path) -> Path:
        """Write the result as YAML and return the path.

        The file is written whole or not at all: a process killed while saving leaves the
        previous file as it was.

        Raises:
            ConfigError: the file cannot be written (says why).
        """
        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        header = "# autotune result; train with autotune.prepare(model, autotune.load(path))\n"
        written = write_atomic(path, header + text)
        if not written.is_file():  # /dev/null, a pipe: no place beside it
            return written
        beside = compile_cache_path(written)
        if self.compile_cache and self.compiles:
            write_atomic(beside, self.compile_cache)
        elif beside.is_file():  # an earlier run's, for a config this file no longer holds
            with contextlib.suppress(OSError):
                beside.unlink()
        return written

    @property
    def compiles(self) -> bool:
        """Whether the config or a fallback runs compiled code."""
        return any(c.compile_level != "none" for c in (self.config, *self.fallbacks))

    def to_dict(self) -> dict[str, Any]:
        """The plain-data form written to YAML (with the digest of the config its figures
        are for, see :attr:`edited`)."""
        signed = dataclasses.replace(self, figures_for=self.figures_for or self.config.digest())
        result = to_plain(signed)
        assert isinstance(result, dict)
        return result

    @classmethod
    def from_dict(cls, data: Any) -> TuneResult:
        """Decode and validate the plain-data form; raises ConfigError naming the bad key."""
        result = from_plain(cls, data)
        assert isinstance(result, TuneResult)
        return result


def load(path: str | Path) -> TuneResult:
    """Read a result written by :meth:`TuneResult.save`.

    Raises:
        ConfigError: the file is missing, is not valid YAML, has unknown keys or a value
            of the wrong type (the message names the key).
    """
    path = Path(path)
    try:
        status = path.stat()
        if not stat.S_ISREG(status.st_mode):  # a FIFO would block for ever, a device stream
            raise ConfigError(f"{path} is not a regular file; pass the YAML file autotune wrote.")
        if (size := status.st_size) > MAX_BYTES:  # its size, not what would be read
            raise too_large(str(path), size)
        with path.open(encoding="utf-8", errors="replace") as f:
            text = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}.") from None
    data = read_yaml(text, str(path))
    if isinstance(data, dict) and data.get("version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise ConfigError(
            f"{path} has schema version {str(data.get('version'))[:20]}; this autotune reads "
            f"version {SCHEMA_VERSION}. Tune again with this version."
        )
    try:
        result = TuneResult.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    cache = compile_cache_path(path)
    if result.compiles and cache.is_file():
        try:
            return dataclasses.replace(result, compile_cache=cache.read_bytes())
        except OSError:  # unreadable: the job compiles anew, as it would without it
            pass
    return result


def compile_cache_path(path: str | Path) -> Path:
    """Where the compile cache of the result at ``path`` is kept: beside it, named
    after it (``tuned.yaml``: ``tuned.compile-cache``)."""
    return Path(path).with_suffix(".compile-cache")
