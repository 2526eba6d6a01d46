"""The compile cache: the code a tuning run compiled, handed to the job that trains its
config (torch's portable cache artifacts, :func:`torch.compiler.save_cache_artifacts`).

A tuning run that searches compiled blocks or the model compiled whole compiles the
winner's graphs while it verifies them. Their artifacts (inductor's FX graph cache and
AOTAutograd's cache entries, keyed by the graph, torch's version and inductor's config)
are saved beside the tuned YAML, and :func:`~autotune.train.prepare` and
:func:`~autotune.train.apply` load them into torch's caches before the first step
compiles: the job's graphs come out of the cache instead of being compiled anew (on a
CPU inductor still builds each graph's C++ kernels; on a GPU its Triton kernels come
with the artifacts). An artifact of another torch, another graph or, on a CPU, another
thread count (inductor's CPU code is made for one) is never used: torch's cache keys
differ, and the job compiles that graph anew.
"""

from __future__ import annotations

import hashlib
import logging

import torch

__all__ = ["compile_artifacts", "load_compile_cache"]

log = logging.getLogger("autotune")

_loaded: set[str] = set()
"""The digests of the artifacts loaded in this process (each is loaded once)."""


def compile_artifacts() -> bytes:
    """Every cache artifact this process compiled or loaded so far, serialized (empty:
    none)."""
    saved = torch.compiler.save_cache_artifacts()
    return saved[0] if saved is not None else b""


def load_compile_cache(artifacts: bytes) -> None:
    """Put ``artifacts`` (from :func:`compile_artifacts`) into torch's caches, once per
    process; artifacts torch cannot read (another torch's) are skipped with a warning:
    the job compiles anew, as it would without them."""
    digest = hashlib.sha256(artifacts).hexdigest()
    if not artifacts or digest in _loaded:
        return
    try:
        info = torch.compiler.load_cache_artifacts(artifacts)
    except Exception as exc:  # torch's format changes between releases: never fatal
        log.warning("the tuner's compile cache was not loaded (%s); compiling anew", exc)
        return
    _loaded.add(digest)
    if info is not None:
        count = sum(len(keys) for keys in info.artifacts.values())
        log.info("compile cache: %d artifacts of the tuning run loaded", count)
