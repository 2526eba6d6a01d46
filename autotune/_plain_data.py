"""Plain data (dicts, lists, numbers, strings) to and from autotune's frozen dataclasses.

Decoding validates against the dataclass fields and their type hints: an unknown key, a
missing required key, a value of the wrong type or a number out of range (every number
autotune records is a count, a size or a time: finite and not negative) is a
:class:`~autotune.errors.ConfigError` that names the key by its dotted path and shows
at most a short prefix of the value.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from typing import Any, Union, get_args, get_origin

from autotune.config import TrainConfig
from autotune.errors import ConfigError

__all__ = ["MAX_INT", "config_from_dict", "from_plain", "to_plain"]

MAX_INT = 2**62
"""The largest integer read (bytes, counts); anything larger is a corrupt file."""
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxdict = 3
_SHORT.maxlevel = 2


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


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _encode(getattr(value, f.name)) for f in _plain_fields(value)}
        if isinstance(value, TrainConfig):
            out["effective_batch_size"] = value.effective_batch_size
        return out
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    return value


def _plain_fields(cls: Any) -> list[dataclasses.Field[Any]]:
    """The fields of a dataclass (or instance) that its plain form holds (not those
    marked ``metadata={"plain": False}``, kept elsewhere)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("plain", True)]


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
        if not (isinstance(value, float) or 0 <= value <= MAX_INT):
            raise ConfigError(f"{where} must be a number from 0 up, got {_kind(value)}.")
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{where} must be a finite number from 0 up, got {_kind(value)}.")
        return float(value)
    if tp in (int, str, bool):
        if type(value) is not tp:
            raise ConfigError(f"{where} must be {tp.__name__}, got {_kind(value)}.")
        if tp is int and not 0 <= value <= MAX_INT:
            raise ConfigError(f"{where} must be between 0 and 2**62, got {_kind(value)}.")
        return value
    raise TypeError(f"no decoder for {tp!r}")  # a bug in autotune, not in the file


def _decode_dataclass(cls: Any, value: Any, key: str) -> Any:
    where = key or "the top level"
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {_kind(value)}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in _plain_fields(cls)}
    data = dict(value)
    # TrainConfig's YAML also shows the derived effective batch, checked once decoded.
    effective = data.pop("effective_batch_size", None) if cls is TrainConfig else None
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        name = f"{key}.{unknown[0]}" if key else str(unknown[0])
        raise ConfigError(f"unknown key {_SHORT.repr(name)}; known keys here: {', '.join(fields)}.")
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
    """The value's type and a short prefix of it: never the whole of a huge value."""
    if value is None:
        return "nothing"
    if type(value) is int and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return f"{type(value).__name__} {_SHORT.repr(value)}"
