"""Naming a model, batch or loss on the command line: what goes wrong says what to fix."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from autotune.cli._inputs import _import, resolve
from autotune.errors import ConfigError


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="MODEL: no Python file at"):
        _import(str(tmp_path / "nope.py"), "MODEL")


def test_a_file_that_fails_to_import_says_how(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(ConfigError, match=r"importing .* failed: RuntimeError: no GPU here"):
        _import(str(broken), "--batch")


def test_a_missing_module_and_a_missing_attribute_are_named() -> None:
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_here'"):
        resolve("no_such_module_here:x", "MODEL")
    with pytest.raises(ConfigError, match=r"'autotune\.models' has no attribute 'nope'"):
        resolve("autotune.models:nope", "MODEL")
    with pytest.raises(ConfigError, match=r"must look like package\.module:attr"):
        resolve("autotune.models", "MODEL")


def test_a_factory_that_fails_is_named() -> None:
    with pytest.raises(ConfigError, match=r"--batch: autotune.models:gpt_batch\(\) failed"):
        resolve("autotune.models:gpt_batch", "--batch")  # needs arguments


def test_python_dash_m_runs_the_command_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["autotune", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("autotune.cli", run_name="__main__")
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: autotune")
