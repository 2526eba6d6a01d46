"""The ``autotune`` command line (``tune``, ``show``, ``estimate``, ``verify``, ``export``,
``report``); see :func:`main`.

* ``_main``: the parser and ``main``; ``_commands``, ``_verify``: the commands;
  ``_inputs``: the model and batch a command names; ``_ranks``: ``torchrun``.
* ``_report``, ``_chart``, ``_figures``: what a command prints (its progress is
  ``autotune.tuning``'s); ``_types``: flag values
  checked as parsed; ``_flag_spelling``: the options as the flags spell them.
"""

from __future__ import annotations

from autotune.cli._main import main

__all__ = ["main"]
