"""Opening a study's database: a server that never answers is an error in seconds.

An Optuna URL (``postgresql+psycopg://...``, ``mysql://...``) opens with SQLAlchemy's
defaults, which wait for a connection for ever: a server that accepts the TCP connection
and never answers hangs the tuner before any work. autotune connects with a timeout (the
URL's own ``connect_timeout`` where it gives one) and turns a connection that fails into
one line that names the server and says what to check.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import optuna
from optuna.storages import BaseStorage

from autotune.errors import ConfigError

__all__ = ["CONNECT_TIMEOUT_S", "open_database"]

CONNECT_TIMEOUT_S = 10
"""Seconds to wait for a database server, where the URL does not say
(``?connect_timeout=N``)."""

_TIMEOUT_ARG = {"postgresql": "connect_timeout", "mysql": "connect_timeout"}
"""The driver argument that bounds the wait for a connection, by URL scheme."""


def open_database(url: str) -> BaseStorage | None:
    """Optuna's storage on the database ``url`` names, connected with a timeout; ``None``
    for a URL of another kind (SQLite, a journal), which opens as Optuna opens it.

    Raises:
        ConfigError: the server cannot be reached in time, or refuses the connection.
    """
    parts = urlsplit(url)
    dialect = parts.scheme.split("+")[0]
    arg = _TIMEOUT_ARG.get(dialect)
    if arg is None:
        return None
    given = parse_qs(parts.query).get(arg)
    timeout = int(given[0]) if given and given[0].isdigit() else CONNECT_TIMEOUT_S
    connect = {} if given else {arg: timeout}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": connect})
    except Exception as exc:
        if type(exc).__name__ != "OperationalError":  # SQLAlchemy's: no connection
            raise
        server = f"{parts.hostname or 'localhost'}:{parts.port or 'default port'}"
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0][:160]
        raise ConfigError(
            f"cannot open the study database at {server} within {timeout} s ({reason}). "
            "Check that the server runs and accepts connections there, the user and the "
            f"database name; set a longer wait with ?{arg}=SECONDS in the URL."
        ) from None
