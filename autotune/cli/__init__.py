"""The ``autotune`` command line (``tune``, ``show``, ``estimate``, ``verify``, ``export``,
``report``); see :func:`main`.

* ``_main``: the parser and ``main``; ``_commands``, ``_verify``: the commands (and
  ``torchrun``'s group joined); ``_inputs``: the model and batch a command names.
* ``_report``, ``_figures``: what a command prints (its progress is
  ``autotune.tuning``'s), the report and its chart; ``_types``: flag values checked as
  parsed, and the options as the flags spell them.
"""

from __future__ import annotations

from autotune.cli._main import main

__all__ = ["main"]
