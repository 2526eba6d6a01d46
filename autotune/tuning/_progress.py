"""Progress of a tuning run where a person watches, drawn from the ``autotune`` logger.

The library only logs (nothing is configured at import); ``autotune()`` attaches
:class:`Progress` for the length of a run where a person is watching (a terminal or a
notebook, :func:`watched`), unless told not to, and so does the command line. The
seconds each stage of a run took (:class:`Stopwatch`) go into its result and its last
progress line.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from collections.abc import Iterator
from typing import TextIO

from autotune.result import Spent

__all__ = ["Progress", "Stopwatch", "showing_progress", "shown", "watched"]


def watched() -> bool:
    """Whether a person watches this process's stderr: a terminal, or a notebook's cell
    (a Jupyter kernel shows stderr under the cell and redraws a line on ``\\r``)."""
    if "ipykernel" in sys.modules:
        return True
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def shown(asked: bool | None) -> bool:
    """Whether to show progress: as ``asked``, or (``None``) where a person watches and
    has not set up logging (whose handlers would show the records again, or where the
    user sent them on purpose)."""
    if asked is not None:
        return asked
    return watched() and not logging.getLogger("autotune").hasHandlers()


@contextlib.contextmanager
def showing_progress(*, quiet: bool) -> Iterator[None]:
    """Show the ``autotune`` logger's progress on stderr while tuning (nothing when quiet,
    or where progress is shown already: the command line's around ``autotune()``)."""
    logger = logging.getLogger("autotune")
    if quiet or any(isinstance(h, Progress) for h in logger.handlers):
        yield
        return
    handler = Progress(sys.stderr, tty=watched())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)  # DEBUG records may carry per-trial progress
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.finish()


class Progress(logging.Handler):
    """The tuning pipeline's log records as progress on a stream.

    Every INFO record is a line. On a terminal a status line stays under them, redrawn:
    a bar over the pipeline's stages, the stage, how many configurations were verified,
    and the best verified so far (by its latest timing). A DEBUG record with ``trial``
    and ``n_trials`` attributes (``log.debug(..., extra={"trial": i, "n_trials": n})``)
    moves the bar through the search stage.
    """

    STAGES = ("starting", "profiling memory", "profiling time", "searching", "verifying")
    _STAGE_OF = (  # message prefix -> stage; the first match wins
        ("profiling memory", 1),
        ("profile read", 2),
        ("profiling time", 2),
        ("searching", 3),
        ("verifying", 4),
    )

    def __init__(self, stream: TextIO, *, tty: bool, width: int = 24) -> None:
        super().__init__(logging.DEBUG)
        self.stream, self.tty, self.width = stream, tty, width
        self.stage, self.trial, self.n_trials = 0, 0, 0
        self.verified, self.fitted = 0, 0
        self.current = ""
        self.speeds: dict[str, float] = {}  # config -> its latest samples/s
        self._drawn = False
        self.started = time.monotonic()

    @property
    def best(self) -> tuple[float, str] | None:
        """The fastest configuration by its latest timing (re-timing may lower it)."""
        if not self.speeds:
            return None
        config = max(self.speeds, key=lambda c: self.speeds[c])
        return self.speeds[config], config

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._update(record)
            if record.levelno >= logging.INFO:
                self._line("  " + record.getMessage())
            if self.tty:
                self._draw()
        except Exception:
            self.handleError(record)

    def _update(self, record: logging.LogRecord) -> None:
        msg, args = str(record.msg), record.args if isinstance(record.args, tuple) else ()
        trial, n_trials = getattr(record, "trial", None), getattr(record, "n_trials", None)
        if isinstance(trial, int) and isinstance(n_trials, int) and n_trials > 0:
            self.stage, self.trial, self.n_trials = max(self.stage, 3), trial, n_trials
        stage = next((s for prefix, s in self._STAGE_OF if msg.startswith(prefix)), None)
        if stage is not None:
            self.stage = max(self.stage, stage)
        if msg.startswith("verifying") and args:
            self.current, self.verified = str(args[0]), self.verified + 1
        elif msg.strip().startswith("measured") and args and isinstance(args[0], (int, float)):
            self.fitted += 1
            self.speeds[self.current] = float(args[0])
        elif msg.startswith("re-timed") and len(args) >= 2 and isinstance(args[1], (int, float)):
            self.speeds[str(args[0])] = float(args[1])

    def status(self) -> str:
        """The status line: bar, seconds so far, stage, verified count and the best so
        far (the stages' seconds are a line of their own once the run ends)."""
        done = self.stage / len(self.STAGES)
        if self.stage == 3 and self.n_trials:
            done += min(self.trial / self.n_trials, 1) / len(self.STAGES)
        if self.stage == 4:
            done += min(self.fitted / 3, 1) / len(self.STAGES)  # the tuner verifies ~3
        filled = round(done * self.width)
        elapsed = time.monotonic() - self.started
        text = f"[{'#' * filled}{'.' * (self.width - filled)}] {elapsed:.0f} s"
        text += f" {self.STAGES[self.stage]}"
        if self.stage == 3 and self.n_trials:
            text += f" {self.trial}/{self.n_trials}"
        if self.verified:
            text += f"; {self.verified} run, {self.fitted} fit"
        if self.best is not None:
            text += f"; best {self.best[0]:.1f} samples/s: {self.best[1]}"
        return text

    def finish(self) -> None:
        """Clear the status line."""
        if self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False

    def _line(self, text: str) -> None:
        self.finish()
        self.stream.write(text + "\n")
        self.stream.flush()

    def _draw(self) -> None:
        columns = shutil.get_terminal_size((100, 20)).columns
        self.stream.write("\r\033[K" + self.status()[: max(columns - 1, 20)])
        self.stream.flush()
        self._drawn = True


class Stopwatch:
    """The seconds of a run since it was made, and of each of its stages: a stage runs
    from the end of the one before (or the start) to its own end, so that the stages add
    up to the run."""

    def __init__(self) -> None:
        self.started = self._mark = time.perf_counter()
        self._seconds = {"profile": 0.0, "search": 0.0, "verification": 0.0}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the stage ``name`` (``profile``, ``search`` or ``verification``)."""
        try:
            yield
        finally:
            now = time.perf_counter()
            self._seconds[name] += now - self._mark
            self._mark = now

    def spent(self) -> Spent:
        """The seconds of each stage so far."""
        return Spent(**{f"{name}_s": s for name, s in self._seconds.items()})

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.started
