"""Configurations and results: :class:`TrainConfig`, :class:`TuneResult`, and YAML I/O.

YAML is read with ``yaml.safe_load`` only and decoded against the dataclass fields:
an unknown key, a missing required key or a value of the wrong type is a
:class:`~autotune.errors.ConfigError` that names the key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from .errors import ConfigError

__all__ = [
    "PRECISIONS",
    "Breakdown",
    "Measurement",
    "ModelInfo",
    "TargetInfo",
    "TrainConfig",
    "TrialRecord",
    "TuneResult",
    "load",
]

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training configuration: every knob autotune searches, each with a safe default."""

    micro_batch_size: int = 1
    """Samples per forward/backward pass."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated before each optimizer step."""
    precision: str = "fp32"
    """``fp32``; ``bf16`` (autocast); or ``fp16`` (autocast with a GradScaler)."""
    checkpoint: tuple[str, ...] = ()
    """Blocks (qualified module names) whose activations are recomputed in backward."""
    offload_activations: tuple[str, ...] = ()
    """Blocks whose saved activations go to pinned host memory."""
    optimizer: str = "adamw"
    """Optimizer name, see ``autotune.optimizers.OPTIMIZERS``."""
    offload_optimizer: bool = False
    """Keep optimizer states and run the step on the host."""

    def __post_init__(self) -> None:
        from .optimizers import OPTIMIZERS  # local: optimizers imports torch lazily

        for name in ("micro_batch_size", "grad_accum_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}.")
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}."
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}."
            )
        for name in ("checkpoint", "offload_activations"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{name} must be a list of block names, got {value!r}.")
            object.__setattr__(self, name, tuple(value))
        both = set(self.checkpoint) & set(self.offload_activations)
        if both:
            raise ConfigError(
                f"blocks {sorted(both)} are both checkpointed and offloaded; "
                "a block is kept, checkpointed or offloaded, not two of these."
            )
        if not isinstance(self.offload_optimizer, bool):
            raise ConfigError(
                f"offload_optimizer must be true or false, got {self.offload_optimizer!r}."
            )

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step: ``micro_batch_size * grad_accum_steps``."""
        return self.micro_batch_size * self.grad_accum_steps

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some knobs changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A one-line human summary of the knobs."""
        parts = [
            f"micro_batch={self.micro_batch_size}",
            f"accum={self.grad_accum_steps}",
            self.precision,
            f"checkpoint={len(self.checkpoint)}",
            self.optimizer,
        ]
        if self.offload_activations:
            parts.append(f"offload_act={len(self.offload_activations)}")
        if self.offload_optimizer:
            parts.append("offload_opt")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Peak device memory and speed of one configuration, predicted or measured."""

    peak_bytes: int
    """Peak device memory, as defined in the README (CUDA: reserved + context)."""
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


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a result was tuned for, to detect a config used on another model."""

    class_name: str
    fingerprint: str
    """Hash of the module structure: names, classes, parameter shapes and dtypes."""
    n_parameters: int
    blocks: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TrialRecord:
    """One candidate that was run for real during verification."""

    config: TrainConfig
    predicted: Measurement
    measured: Measurement | None
    """``None`` when the run failed (see ``error``)."""
    error: str | None = None
    """Why the candidate was rejected (e.g. out of memory), or ``None``."""


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """The outcome of :func:`autotune.autotune`: the winner, its evidence and fallbacks."""

    config: TrainConfig
    """The fastest verified configuration under the budget."""
    predicted: Measurement
    """What the cost model predicted for ``config``."""
    measured: Measurement
    """What the verification run measured for ``config``."""
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
    version: int = SCHEMA_VERSION
    """Schema version of the YAML file."""

    def save(self, path: str | Path) -> Path:
        """Write the result as YAML and return the path."""
        path = Path(path)
        text = yaml.safe_dump(_encode(self), sort_keys=False, default_flow_style=None)
        path.write_text(
            "# autotune result; train with autotune.prepare(model, autotune.load(path))\n" + text
        )
        return path

    def to_dict(self) -> dict[str, Any]:
        """The plain-data form written to YAML."""
        result = _encode(self)
        assert isinstance(result, dict)
        return result

    @classmethod
    def from_dict(cls, data: Any) -> TuneResult:
        """Decode and validate the plain-data form; raises ConfigError naming the bad key."""
        result = _decode(cls, data, "")
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
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if isinstance(data, dict) and data.get("version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise ConfigError(
            f"{path} has schema version {data.get('version')!r}; this autotune reads "
            f"version {SCHEMA_VERSION}. Tune again with this version."
        )
    try:
        return TuneResult.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def to_plain(value: Any) -> Any:
    """Any of this module's dataclasses as plain data (dicts, lists, numbers, strings)."""
    return _encode(value)


def from_plain(cls: type[Any], data: Any) -> Any:
    """Decode and validate plain data as ``cls``; ConfigError names a bad key."""
    return _decode(cls, data, "")


def config_from_dict(data: Any) -> TrainConfig:
    """Decode a plain mapping of knobs into a validated :class:`TrainConfig`."""
    result = _decode(TrainConfig, data, "")
    assert isinstance(result, TrainConfig)
    return result


# --- plain-data encoding --------------------------------------------------------------


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, TrainConfig):
            out["effective_batch_size"] = value.effective_batch_size
        return out
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    return value


def _decode(tp: Any, value: Any, key: str) -> Any:
    """Decode ``value`` as type ``tp``; ``key`` is the dotted path for messages."""
    where = key or "the top level"
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, value, key)
    if dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, value, key)
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {_kind(value)}.")
        (inner, _) = get_args(tp)
        return tuple(_decode(inner, v, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {_kind(value)}.")
        return float(value)
    if tp in (int, str, bool):
        if type(value) is not tp:
            raise ConfigError(f"{where} must be {tp.__name__}, got {_kind(value)}.")
        return value
    raise TypeError(f"no decoder for {tp!r}")  # a bug in autotune, not in the file


def _decode_dataclass(cls: Any, value: Any, key: str) -> Any:
    where = key or "the top level"
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {_kind(value)}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    data = dict(value)
    # TrainConfig's YAML also shows the derived effective batch, checked once decoded.
    effective = data.pop("effective_batch_size", None) if cls is TrainConfig else None
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        name = f"{key}.{unknown[0]}" if key else str(unknown[0])
        raise ConfigError(f"unknown key {name!r}; known keys here: {', '.join(fields)}.")
    kwargs = {}
    for name, field in fields.items():
        sub = f"{key}.{name}" if key else name
        if name in data:
            kwargs[name] = _decode(hints[name], data[name], sub)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing key {sub!r}.")
    try:
        decoded = cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if effective is not None and effective != decoded.effective_batch_size:
        raise ConfigError(
            f"{key}.effective_batch_size is {effective!r} but micro_batch_size x "
            f"grad_accum_steps is {decoded.effective_batch_size}; fix one of them or drop the key."
        )
    return decoded


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"
