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
per value. :func:`compile_forward` compiles the forward alone, in place, for a loop of
one's own (:func:`autotune.apply`), whose loss is its own.

Each micro-batch size is a graph of its own, compiled at its first call. A tuning run
profiles many sizes: inside :func:`any_batch_size` the batch dimension is dynamic instead,
one graph for every size, in a function of its own so that the static graphs a config
trains with are never the dynamic ones.
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

from autotune.train._checkpoint import COMPILED_MODEL, replace_forward, restore_forwards
from autotune.train._chunked_loss import chunked_loss
from autotune.train._loss import LossFn, call_model, compute_loss

__all__ = [
    "CompiledLoss",
    "any_batch_size",
    "compile_forward",
    "forget_graphs",
    "uncompile_forward",
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

    def __call__(self, module: nn.Module, chunk: Any) -> torch.Tensor:
        """The loss of ``module`` on ``chunk`` (on the device already), compiled."""
        args = (module, chunk, self.loss_fn, self.device_type, self.dtype, self.chunked)
        with _logging_ignored():
            if _dynamic_depth:
                _mark_batch_dynamic(chunk)
            return _compiled(bool(_dynamic_depth))(*args)  # type: ignore[no-any-return]


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


@functools.cache
def _compiled(dynamic: bool) -> Any:
    """The compiled loss function, static or of any batch size. Two functions, two code
    objects: dynamo keeps the graphs of each apart, so that a dynamic graph made while
    profiling never stands in for a config's static one."""
    if dynamic:
        return torch.compile(_any_size_loss)
    return torch.compile(_static_loss, dynamic=False)


def forget_graphs() -> None:
    """Drop the compiled loss's graphs (a tuning run's: every size, mask and precision it
    measured). Dynamo allows a function few graphs (8) outside a tuning run, and one past
    them runs eagerly: a runner made after tuning, in the same process, compiles its own
    (from inductor's cache where it has it) instead."""
    for fn in (_static_loss, _any_size_loss):
        torch._dynamo.eval_frame.remove_from_cache(fn)


def _mark_batch_dynamic(chunk: Any) -> None:
    """Mark dimension 0 of every tensor of ``chunk`` dynamic (a hint dynamo may refuse)."""
    for t in tree_flatten(chunk)[0]:
        if isinstance(t, torch.Tensor) and t.dim():
            torch._dynamo.maybe_mark_dynamic(t, 0)


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


def compile_forward(model: nn.Module) -> None:
    """Compile ``model``'s forward in place, shapes static (a loop of one's own: the loss
    its own code takes); undone by :func:`uncompile_forward`."""
    if COMPILED_MODEL in model.__dict__:
        return
    compiled = torch.compile(model.forward, dynamic=False)
    replace_forward(model, functools.partial(_logging_stepped_over, compiled), COMPILED_MODEL)


def _logging_stepped_over(compiled: Any, *args: Any, **kwargs: Any) -> Any:
    """``compiled(*args, **kwargs)``, one graph where Hugging Face's loss warns."""
    with _logging_ignored():
        return compiled(*args, **kwargs)


def uncompile_forward(model: nn.Module) -> None:
    """Undo :func:`compile_forward`."""
    restore_forwards(model, COMPILED_MODEL)
