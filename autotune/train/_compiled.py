"""Compiled blocks (``TrainConfig.compile_blocks``): each block's forward through
``torch.compile`` (regional compilation), and the allocations of compiled code made
visible to autotune's live-bytes tracker.

Regional compilation compiles each block's own ``forward``, not the model: identical
blocks share one graph, compile once, and a block's checkpoint or offload wrapper stays
outside the graph, in eager code, so the recomputation of a checkpointed block runs the
compiled forward again. Compile a block before wrapping it (:func:`compile_blocks` refuses
a wrapped one). A compiled block is checkpointed whole, never selectively: its code writes
matrix products into buffers of its own (``out=``), which the selective policy's cache of
kept outputs reads as mutated when it recomputes.

Inductor's generated code allocates its buffers through a fast path that bypasses
torch's dispatcher (``empty_strided_cpu``, ``empty_strided_cuda``), so a
``TorchDispatchMode`` never sees them: a compiled block's saved activations would count
as nothing. :func:`counted_allocations` routes those allocations through the dispatcher
while a step is tracked, and only then: each generated module binds its allocators as
globals, read at every call, so they are bound to the counted route on the way in and
back to the fast path on the way out (code loaded inside included). The tracker, which
lets compiled code run under it (``ignore_compile_internals``), counts every buffer as it
counts an eager op's output; outside it the code runs as inductor made it (the counted
route costs about 2 microseconds a buffer).

The compile cache: the code a tuning run compiled, handed to the job that trains its
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

``Recompiles``: a compiled config's steps that dynamo ran eagerly, said once.

Dynamo compiles a graph per shape it has not seen (where a shape is not symbolic) up to
its recompile limit per function (8 by default); past it, the function runs eagerly, with
one line in dynamo's log, and a tuned compiled config loses its speed without a word. A
training run's compiled loss and forward take new shapes as one dynamic graph (see
:mod:`~autotune.train._compiled_model`), so a stream of padded lengths stays far below the
limit; what still reaches it (shapes dynamo must specialise, a loop that compiles other
code) is said here, as an :class:`~autotune.errors.AutotuneWarning` with what to do,
once per handle.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from autotune._blocks import eager_module, is_compile_wrapper
from autotune.errors import BlockError, warn
from autotune.train._checkpoint import COMPILED, is_wrapped, replace_forward, restore_forwards
from autotune.train._compiled_model import forget_graphs

__all__ = [
    "Recompiles",
    "compile_artifacts",
    "compile_blocks",
    "compiled_parts",
    "counted_allocations",
    "decompile",
    "is_compiled",
    "load_compile_cache",
    "measured_compiling",
    "uncompile_blocks",
]

log = logging.getLogger("autotune")


def compile_blocks(model: nn.Module, names: Sequence[str]) -> None:
    """Compile the forward of each block in ``names`` in place (a block compiled already
    stays as it is), the first dimension of its tensor arguments (the batch) dynamic from
    the first call: one graph for every micro-batch size but one (a single sample is
    specialised), so that a size profiled and a size trained run the same code.

    Raises:
        BlockError: a name is no block of ``model``, or a block is wrapped already
            (checkpointed or offloaded): compile it first, then wrap it.
    """
    modules = []
    for name in names:  # resolve every name first: an error leaves the model as it was
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise BlockError(f"cannot compile block {name!r}: the model has none") from None
        if is_wrapped(module):
            raise BlockError(
                f"block {name!r} is checkpointed or offloaded already; compile the blocks "
                "first, then wrap them, so that the wrapper stays outside the graph."
            )
        modules.append(module)
    for module in modules:
        if COMPILED in module.__dict__:
            continue
        compiled = torch.compile(module.forward)
        replace_forward(module, functools.partial(_batch_dynamic, compiled), COMPILED)


def _batch_dynamic(compiled: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``compiled(*args, **kwargs)``, each tensor argument's first dimension marked
    dynamic (a hint: dynamo specialises it where the code needs a fixed size)."""
    for t in itertools.chain(args, kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim():
            torch._dynamo.maybe_mark_dynamic(t, 0)
    return compiled(*args, **kwargs)


def uncompile_blocks(model: nn.Module) -> None:
    """Undo :func:`compile_blocks` on every block of ``model`` (its wrappers removed first)."""
    restore_forwards(model, COMPILED)


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_blocks` compiled ``module``'s forward."""
    return COMPILED in module.__dict__


def compiled_parts(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that the user compiled with ``torch.compile``
    (a wrapper, or a module's own ``compile()``); ``""`` is the model itself."""
    return [
        name
        for name, m in model.named_modules()
        if is_compile_wrapper(m) or getattr(m, "_compiled_call_impl", None) is not None
    ]


def decompile(model: nn.Module) -> None:
    """Make ``model`` (a copy of the tuner's) run eagerly: each ``torch.compile`` wrapper
    inside it replaced by its module, each module's own ``compile()`` undone.

    autotune measures its copies eagerly; a compiled part run under its live-bytes tracker
    would have dynamo skip that code for good, the user's compiled model included.
    """
    for m in list(model.modules()):
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
        for name, child in list(m.named_children()):
            if is_compile_wrapper(child):
                setattr(m, name, eager_module(child))


_GUARDS = torch._C._dynamo.guards
_ROUTES = {
    "empty_strided_cpu": "cpu",
    "empty_strided_cuda": "cuda",
    "empty_strided_cpu_pinned": "cpu",
}
"""The allocators inductor's generated code binds that bypass the dispatcher (each the
name of a global in the code and, prefixed ``_``, of torch's fast path), by device."""
_FAST: dict[str, Callable[..., torch.Tensor]] = {
    name: getattr(_GUARDS, "_" + name) for name in _ROUTES if hasattr(_GUARDS, "_" + name)
}
"""The fast paths, taken when this module loads (before any rerouting)."""
_calls: weakref.WeakSet[Any] = weakref.WeakSet()
"""The ``call`` functions of the generated modules seen so far: their globals are rebound
(inductor's cache may forget a module whose code still runs)."""
_depth = 0


@contextlib.contextmanager
def counted_allocations() -> Iterator[None]:
    """While inside, the code that inductor compiled, compiles or loads allocates its
    buffers with ``torch.empty_strided``, through the dispatcher, where the live-bytes
    tracker sees them; outside, by inductor's fast path. Nests; process-wide (a thread
    running compiled code meanwhile takes the counted route, uncounted)."""
    global _depth
    if _depth == 0:
        _route(counted=True)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _route(counted=False)


def _route(*, counted: bool) -> None:
    """Bind every allocator of :data:`_ROUTES`, in torch's fast paths (what code loaded
    from now on binds) and in each generated module loaded so far, to the counted route
    or back to the fast path."""
    table = {
        name: _dispatched(_ROUTES[name], pinned=name.endswith("_pinned")) if counted else fast
        for name, fast in _FAST.items()
    }
    for name, allocate in table.items():
        setattr(_GUARDS, "_" + name, allocate)
    codecache = sys.modules.get("torch._inductor.codecache")  # nothing compiled: no modules
    if codecache is not None:
        for module in list(codecache.PyCodeCache.modules):
            call = module.__dict__.get("call")
            if call is not None and "empty_strided_cpu" in module.__dict__:
                _calls.add(getattr(call, "__func__", call))
    for call in list(_calls):
        code_globals = call.__globals__
        for name, allocate in table.items():
            if name in code_globals:
                code_globals[name] = allocate


_RECOMPILES = 64
"""Graphs of one block class a tuning run may compile: per precision, with and without
gradients into its input (the first block), the first micro-batch size then any (a
dynamic batch dimension), one sample (a size of its own), several sequence lengths.
Past torch's default (8) dynamo would run the block eagerly, and the measurements would
be of eager code."""


@contextlib.contextmanager
def measured_compiling(enabled: bool = True) -> Iterator[None]:
    """A tuning run that measures compiled code: dynamo's per-function limit of graphs
    raised to :data:`_RECOMPILES` (their allocations are counted where a step is tracked:
    :func:`counted_allocations`), and the compiled loss's graphs of the run dropped at its
    end (:func:`~autotune.train._compiled_model.forget_graphs`); nothing where not
    ``enabled``."""
    if not enabled:
        yield
        return
    config = torch._dynamo.config
    limit = max(config.recompile_limit, _RECOMPILES)
    try:
        with config.patch(recompile_limit=limit):
            yield
    finally:
        forget_graphs()


def _dispatched(device: str, *, pinned: bool = False) -> Callable[..., torch.Tensor]:
    """An allocation on ``device`` as inductor's fast path makes it, through the dispatcher."""

    def empty_strided(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=device, pin_memory=pinned)

    return empty_strided


class _LimitHits(logging.Handler):
    """Counts dynamo's lines that say a function reached its recompile limit."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.last = ""
        """The function of the last one, as dynamo names it."""

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("torch._dynamo hit config.") and len(record.args or ()) > 2:
            self.count += 1
            self.last = str(record.args[2])  # type: ignore[index]


_HITS = _LimitHits()
logging.getLogger("torch._dynamo.convert_frame").addHandler(_HITS)


class Recompiles:
    """Whether dynamo has reached its recompile limit since this handle began."""

    def __init__(self) -> None:
        self._seen = _HITS.count
        self._said = False

    def check(self) -> None:
        """Say once (an :class:`AutotuneWarning`) that steps ran eagerly, if dynamo
        reached its recompile limit since the last check."""
        if _HITS.count == self._seen:
            return
        self._seen = _HITS.count
        if self._said:
            return
        self._said = True
        limit = torch._dynamo.config.recompile_limit
        warn(
            f"torch.compile reached dynamo's recompile limit ({limit} graphs) for "
            f"{_HITS.last}: calls with a shape it has no graph for now run eagerly, slower "
            "than tuned. Feed fewer shapes (pad batches to a few lengths: "
            "DataCollatorWithPadding(pad_to_multiple_of=64), or drop_last=True for the "
            "shorter last batch), or raise torch._dynamo.config.recompile_limit before "
            "training."
        )


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
