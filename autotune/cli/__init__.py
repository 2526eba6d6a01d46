"""The ``autotune`` command line (``tune``, ``show``, ``estimate``, ``verify``, ``export``,
``report``); see :func:`main`.

* ``_main``: the parser and ``main``; ``_commands``, ``_verify``: the commands;
  ``_inputs``: the model and batch a command names; ``_ranks``: ``torchrun``.
* ``_report``, ``_chart``, ``_sureness``: what a command prints (its progress is
  ``autotune.tuning``'s); ``_types``: flag values
  checked as parsed; ``_flag_messages``: the library's advice in the flags' words.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune._interface import interface

if TYPE_CHECKING:
    from autotune.cli._main import main

INTERFACE = {
    "main": "autotune.cli._main",
}
"""The entry point, loaded on first use."""

__all__ = [
    "main",
]

__getattr__, __dir__ = interface(__name__, INTERFACE)
