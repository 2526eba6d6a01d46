"""Naming a model, a batch or a loss on the command line: ``package.module:attr`` or
``path/to/file.py:attr``, an object or a zero-argument factory."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from autotune.errors import AutotuneError, ConfigError

__all__ = ["inputs", "resolve"]


def inputs(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The model, the sample batch and the loss function named on the command line."""
    model = resolve(args.model, "MODEL")
    batch = resolve(args.batch, "--batch")
    loss = resolve(args.loss, "--loss", call=False) if args.loss else None
    return model, batch, loss


def resolve(spec: str, what: str, *, call: bool = True) -> Any:
    """Import ``module:attr`` or ``file.py:attr``; call it if it is a zero-argument factory."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ConfigError(
            f"{what} must look like package.module:attr or path/file.py:attr, got {spec!r}."
        )
    module = _import(target, what)
    if not hasattr(module, attr):
        raise ConfigError(f"{what}: {target!r} has no attribute {attr!r}.")
    obj = getattr(module, attr)
    import torch

    if call and callable(obj) and not isinstance(obj, torch.nn.Module):
        try:
            obj = obj()
        except Exception as exc:
            raise ConfigError(f"{what}: {spec}() failed: {type(exc).__name__}: {exc}") from exc
    return obj


_FILES: dict[Path, ModuleType] = {}
"""Python files a command imported, by path: each runs once, however many specs name it."""


def _import(target: str, what: str) -> Any:
    """A module by dotted name (the working directory first on the path) or by file."""
    try:
        if not target.endswith(".py"):
            with _cwd_on_path():
                return importlib.import_module(target)
        file = Path(target)
        key = file.resolve()
        if key in _FILES:  # MODEL and --batch in one file: its top level runs once
            return _FILES[key]
        module_spec = importlib.util.spec_from_file_location(file.stem, file)
        if module_spec is None or module_spec.loader is None or not file.is_file():
            raise ConfigError(f"{what}: no Python file at {target!r}.")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        _FILES[key] = module
        return module
    except ImportError as exc:
        raise ConfigError(f"{what}: cannot import {target!r}: {exc}.") from None
    except AutotuneError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"{what}: importing {target!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    """``module:attr`` finds modules in the working directory, as ``python -m`` would."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def optimizer_of(spec: str, flag: str) -> str:
    """A named optimizer as it is; a factory's ``module:name`` (or ``file.py:name``)
    imported and registered, its name returned."""
    if ":" not in spec:
        return spec
    from autotune.train import factory_name

    return factory_name(resolve(spec, flag, call=False))
