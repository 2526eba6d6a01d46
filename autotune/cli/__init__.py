"""The ``autotune`` command line (``tune``, ``show``, ``estimate``, ``verify``, ``export``,
``report``); see :func:`main`."""

from autotune.cli._main import main

__all__ = ["main"]
