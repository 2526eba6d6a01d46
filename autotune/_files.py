"""Writing the files autotune produces so that nothing is lost: the result YAML, exports,
reports.

A file is written whole or not at all: to a temporary file beside it, flushed to disk,
then renamed over the target, so that a process killed while writing leaves the previous
file intact (``Path.write_text`` empties it first). Where a file goes is checked before
the work that makes it (a tuning run of minutes), not after.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from autotune.errors import ConfigError

__all__ = ["check_writable", "write_atomic"]


def check_writable(path: str | Path, what: str = "the output") -> Path:
    """Raise ConfigError now if ``path`` cannot be written later.

    Args:
        path: Where a file will be written.
        what: How the message names the file (e.g. ``-o``).

    Returns:
        ``path`` as a ``Path``.
    """
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a directory; name a file in it.")
    if not parent.is_dir():
        raise ConfigError(
            f"{what} {str(path)!r} cannot be written: directory {str(parent)!r} does not "
            "exist. Create it first, or name a file in an existing directory."
        )
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{what} {str(path)!r} cannot be written: permission denied.")
    return path


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path``: the whole new file, or the old one.

    A target that is not a regular file (``/dev/null``, a pipe) is written in place.

    Raises:
        ConfigError: the file cannot be written (says why).
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        if path.exists() and not path.is_file():
            path.write_bytes(payload)
            return path
        check_writable(path)
        _replace(path, payload)
    except OSError as exc:
        raise ConfigError(f"cannot write {str(path)!r}: {exc.strerror or exc}.") from exc
    return path


def _replace(path: Path, payload: bytes) -> None:
    """Write ``payload`` beside ``path``, flush it to disk, and rename it over ``path``."""
    _sweep(path)
    temporary = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(payload)
            file.flush()
            os.fsync(file.fileno())
        if path.exists():  # keep the mode the file had
            os.chmod(temporary, stat.S_IMODE(path.stat().st_mode))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    with contextlib.suppress(OSError):  # the rename itself, on disk (not on every system)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def _sweep(path: Path) -> None:
    """Remove the temporaries of ``path`` that a writer killed mid-write left (its process
    is gone: ``kill -9`` runs no clean-up); a live writer's stay."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        pid = stale.name.removeprefix(f".{path.name}.").split(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                stale.unlink()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, and is not ours to signal
        return True
    return True
