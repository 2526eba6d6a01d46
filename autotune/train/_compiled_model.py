"""The whole model compiled (``TrainConfig.compile_model``): its forward and its loss as one
graph, as nanoGPT and torchtitan train, shapes static at the micro-batch.

Compiling each block (:mod:`~autotune.train._compiled`) leaves the embedding, the output
layer and the loss eager: over a large vocabulary the loss alone reads and writes the
logits several times op by op, in fp32. Here the runner compiles one function, the model
called on a micro-batch under autocast and its loss taken (``output.loss``, or the user's
``loss_fn``), so that the loss fuses with the output layer, and a checkpointed block's
recomputation is part of the graph (a plain non-reentrant checkpoint, which dynamo traces:
:func:`~autotune.train._checkpoint.apply_checkpointing` with ``plain``). The loss's weight
(its share of the step's samples) multiplies it outside: a float inside would be a graph
per value. :class:`ShapeRouted` compiles the forward alone, for a loop of one's own
(:func:`autotune.apply`), whose loss is its own.

Each micro-batch shape a handle meets first is a static graph of its own, compiled at its
first call, as a config is verified and as it trains. A tuning run profiles many sizes:
inside :func:`any_batch_size` the batch dimension is dynamic instead, one graph for every
size. A training run meets a stream of shapes (padded lengths, an epoch's shorter last
micro-batch): every shape but its first runs one more graph, its batch and sequence
dimensions symbolic, so that no stream of lengths reaches dynamo's recompile limit, past
which steps would run eagerly. Each kind is a function of its own (a code object of its
own), so that dynamo keeps their graphs apart.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autotune.train._chunked_loss import chunked_loss
from autotune.train._loss import LossFn, call_model, compute_loss

__all__ = [
    "CompiledLoss",
    "ShapeRouted",
    "any_batch_size",
    "forget_graphs",
]

_dynamic_depth = 0


@contextlib.contextmanager
def any_batch_size() -> Iterator[None]:
    """Inside, a compiled model's graphs take any micro-batch size (the batch dimension
    dynamic): one graph per variant for all the sizes a profile measures."""
    global _dynamic_depth
    _dynamic_depth += 1
    try:
        yield
    finally:
        _dynamic_depth -= 1


class CompiledLoss:
    """A micro-batch's forward and loss through one compiled graph.

    Args:
        device_type: Where autocast runs (``cuda``, ``cpu``).
        dtype: Autocast's dtype (``None``: fp32, no autocast).
        loss_fn: The user's loss, or ``None`` (the output's own).
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None,
        loss_fn: LossFn | None,
        *,
        chunked: bool = False,
    ) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self.loss_fn = loss_fn
        self.chunked = chunked
        self.first: tuple[Any, ...] | None = None
        """The shapes of the first micro-batch, which runs the static graph."""

    def __call__(self, module: nn.Module, chunk: Any) -> torch.Tensor:
        """The loss of ``module`` on ``chunk`` (on the device already), compiled."""
        args = (module, chunk, self.loss_fn, self.device_type, self.dtype, self.chunked)
        shapes = _shapes(chunk)
        if self.first is None:
            self.first = shapes
        kind = "any_size" if _dynamic_depth else "static" if shapes == self.first else "other"
        with _logging_ignored():
            if kind != "static":
                _mark_dynamic(chunk, sequence=kind == "other")
            return _compiled(kind)(*args)  # type: ignore[no-any-return]


def _loss(
    module: nn.Module,
    chunk: Any,
    loss_fn: LossFn | None,
    device_type: str,
    dtype: torch.dtype | None,
    chunked: bool,
) -> torch.Tensor:
    # Autocast inside the graph: outside, dynamo would guard on its state and compile again
    # where a caller's autocast differs.
    with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
        if chunked:
            return chunked_loss(module, chunk)
        output = call_model(module, chunk, has_loss_fn=loss_fn is not None)
        return compute_loss(output, chunk, loss_fn)


def _static_loss(*args: Any) -> torch.Tensor:
    return _loss(*args)


def _any_size_loss(*args: Any) -> torch.Tensor:
    return _loss(*args)


def _other_shapes_loss(*args: Any) -> torch.Tensor:
    return _loss(*args)


@functools.cache
def _compiled(kind: str) -> Any:
    """The compiled loss function: ``"static"`` (a handle's first shape), ``"other"``
    (every other shape: the batch and sequence dimensions symbolic) or ``"any_size"`` (a
    profile's: the batch dimension symbolic). Three functions, three code objects: dynamo
    keeps the graphs of each apart, so that a dynamic graph never stands in for a
    config's static one."""
    if kind == "any_size":
        return torch.compile(_any_size_loss)
    if kind == "other":
        return torch.compile(_other_shapes_loss)
    return torch.compile(_static_loss, dynamic=False)


def forget_graphs() -> None:
    """Drop the compiled loss's graphs (a tuning run's: every size, mask and precision it
    measured). Dynamo allows a function few graphs (8) outside a tuning run, and one past
    them runs eagerly: a runner made after tuning, in the same process, compiles its own
    (from inductor's cache where it has it) instead."""
    for fn in (_static_loss, _any_size_loss, _other_shapes_loss):
        torch._dynamo.eval_frame.remove_from_cache(fn)


def _shapes(chunk: Any) -> tuple[Any, ...]:
    """The shapes of ``chunk``'s tensors, in order."""
    return tuple(t.shape if isinstance(t, torch.Tensor) else None for t in tree_flatten(chunk)[0])


def _mark_dynamic(chunk: Any, *, sequence: bool) -> None:
    """Mark dimension 0 of every tensor of ``chunk`` dynamic, and dimension 1 of those of
    two dimensions or more where ``sequence`` (hints dynamo may refuse)."""
    for t in tree_flatten(chunk)[0]:
        if isinstance(t, torch.Tensor) and t.dim():
            torch._dynamo.maybe_mark_dynamic(t, 0)
            if sequence and t.dim() > 1:
                torch._dynamo.maybe_mark_dynamic(t, 1)


@contextlib.contextmanager
def _logging_ignored() -> Iterator[None]:
    """Dynamo steps over a ``warning_once`` (Hugging Face's logger method: its loss warns
    through it where a model has no ``loss_type``) instead of breaking the graph there."""
    ignored = torch._dynamo.config.ignore_logging_functions
    warn = getattr(logging.Logger, "warning_once", None)
    added = warn is not None and warn not in ignored
    if warn is not None and added:
        ignored.add(warn)
    try:
        yield
    finally:
        if added:
            ignored.discard(warn)


class ShapeRouted:
    """A model's ``forward`` compiled, for a loop of one's own (the loss its own code
    takes): its first call's shapes a static graph, every other shape one graph of
    symbolic batch and sequence dimensions, as a runner's compiled loss (one graph where
    Hugging Face's loss warns)."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward
        self.first: tuple[Any, ...] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        shapes = _shapes((args, kwargs))
        if self.first is None:
            self.first = shapes
        static = shapes == self.first
        if not static:
            _mark_dynamic((args, kwargs), sequence=True)
        run = _static_forward if static else _other_forward
        with _logging_ignored():
            return _compiled_forward(run)(self.forward, *args, **kwargs)


def _static_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return forward(*args, **kwargs)


def _other_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return forward(*args, **kwargs)


@functools.cache
def _compiled_forward(run: Any) -> Any:
    """A forward's trampoline compiled, each its own code object, so that dynamo keeps
    the static graphs and the dynamic ones apart."""
    return torch.compile(run, dynamic=False if run is _static_forward else None)
