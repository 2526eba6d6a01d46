"""A study database that never answers is a one-line error within its timeout, not a hang."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

import autotune
from autotune.errors import AutotuneError
from autotune.models import gpt_batch, tiny_gpt

pytest.importorskip("psycopg")


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port on this machine whose server accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not done.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        done.set()
        thread.join()
        for connection in accepted:
            connection.close()
        server.close()


def test_a_database_that_never_answers_fails_in_seconds_naming_it(silent_server: int) -> None:
    model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    url = f"postgresql+psycopg://user@127.0.0.1:{silent_server}/db?connect_timeout=2"
    started = time.perf_counter()
    with pytest.raises(AutotuneError) as caught:
        autotune.autotune(model, gpt_batch(model.config, 4), 0.004, device="cpu", storage=url)
    assert time.perf_counter() - started < 30  # psycopg alone waits for ever
    message = str(caught.value)
    assert f"127.0.0.1:{silent_server}" in message and "within 2 s" in message
    assert "connect_timeout" in message and "\n" not in message
    assert model.training and all(p.grad is None for p in model.parameters())


def test_the_default_wait_applies_where_the_url_gives_none(
    silent_server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from autotune.jobs import _claims

    monkeypatch.setattr(_claims, "CONNECT_TIMEOUT_S", 1)
    with pytest.raises(AutotuneError, match="within 1 s"):
        _claims.open_database(f"postgresql+psycopg://user@127.0.0.1:{silent_server}/db")
    assert _claims.open_database("sqlite:///x.db") is None  # opened as Optuna opens it
