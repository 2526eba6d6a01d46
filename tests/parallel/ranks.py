"""Start a program on several real processes, as torchrun would, and collect their results.

Each rank is a Python process with the environment ``torch.distributed`` reads (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and one thread; it prints its result as
one JSON line starting with ``RESULT``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(world: int, job: dict[str, Any]) -> list[subprocess.Popen[str]]:
    """Start ``world`` ranks of the worker on ``job``."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(job)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def run(world: int, job: dict[str, Any], timeout: float = 600) -> list[Any]:
    """Run ``job`` on ``world`` ranks; every rank's result, by rank.

    Raises:
        AssertionError: a rank failed (with its error output).
    """
    procs = start(world, job)
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:  # killed and reaped: nothing left running into the next test
                p.kill()
                p.communicate()
            raise AssertionError(f"rank {rank} did not finish in {timeout} s") from None
        assert proc.returncode == 0, f"rank {rank} failed:\n{err[-4000:]}"
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return results
