"""The bytes a quantized model holds beside its parameters and buffers.

bitsandbytes' quantized layers keep their weights as ``Parameter`` subclasses with a
plain storage (``Params4bit``: packed uint8; ``Int8Params``: int8), and the tensors that
dequantize them outside both ``parameters()`` and ``buffers()``: a 4-bit weight's
``quant_state`` (``absmax``, ``code``, ``offset`` and, with double quantization, the
nested ``state2``'s ``absmax`` and ``code``), an 8-bit layer's row scales (``SCB``, moved
from the weight to the layer's ``state`` by its first forward). They are memory the model
holds for as long as it lives, like its parameters. Read by attribute name, so that
bitsandbytes is never imported here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from autotune.train._compiled import decompile

__all__ = ["copy_model", "model_tensors", "one_per_storage", "quantization_state"]

_QUANT_STATE = ("absmax", "code", "offset")
_LT_STATE = ("CB", "SCB")


def quantization_state(module: nn.Module) -> list[torch.Tensor]:
    """The quantization-state tensors of ``module`` and its submodules, each storage once."""
    return one_per_storage(t for m in module.modules() for t in _own_state(m))


def model_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and quantization state of ``module``: what it holds, one tensor
    per storage (an 8-bit layer's ``CB`` is its weight's storage)."""
    return one_per_storage((*module.parameters(), *module.buffers(), *quantization_state(module)))


def one_per_storage(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The first of ``tensors`` on each storage, in order: a storage's bytes count once."""
    out: dict[int, torch.Tensor] = {}
    for t in tensors:
        out.setdefault(id(t.untyped_storage()), t)
    return list(out.values())


def copy_model(model: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """``copy.deepcopy(model, memo)``, each 4-bit layer's weight and quantization state
    linked as in the original.

    bitsandbytes' ``Params4bit.__deepcopy__`` ignores the memo: the copied weight gets a
    quantization state of its own beside the one its copied layer holds (memory the
    original does not hold), and its ``module`` is the original layer, not the copy's.
    The copy runs eagerly: what ``torch.compile`` compiled in ``model`` is not in it. A
    traced model's copy shares its fake tensors.
    """
    memo = dict(memo or {})
    for t in (*model.parameters(), *model.buffers()):
        if isinstance(t, FakeTensor):  # a traced model's hold no memory: shared, not copied
            memo.setdefault(id(t), t)  # (a deep copy would belong to another fake mode)
    copied: nn.Module = copy.deepcopy(model, memo)
    decompile(copied)  # autotune's copies run eagerly
    for m in copied.modules():
        w: Any = getattr(m, "weight", None)
        state = getattr(w, "quant_state", None)
        if state is None or not hasattr(m, "quant_state"):
            continue
        m.quant_state = state
        if hasattr(w, "module"):
            w.module = m
    return copied


def _own_state(m: nn.Module) -> Iterator[torch.Tensor]:
    """The quantization-state tensors ``m`` itself holds (not its submodules')."""
    for p in m.parameters(recurse=False):
        yield from _quant_state(getattr(p, "quant_state", None))
        yield from _tensors(p, _LT_STATE)
    yield from _quant_state(getattr(m, "quant_state", None))  # Linear4bit's own reference
    state = getattr(m, "state", None)  # Linear8bitLt's MatmulLtState
    if state is not None and not isinstance(state, (dict, torch.Tensor)):
        yield from _tensors(state, _LT_STATE)


def _quant_state(qs: object) -> Iterator[torch.Tensor]:
    """The tensors of a 4-bit ``QuantState`` and of the states nested in it."""
    for _ in range(4):  # a nested state (double quantization) holds one more level
        if qs is None:
            return
        yield from _tensors(qs, _QUANT_STATE)
        qs = getattr(qs, "state2", None)


def _tensors(obj: object, names: tuple[str, ...]) -> Iterator[torch.Tensor]:
    """The attributes of ``obj`` called ``names`` that are tensors."""
    for name in names:
        t = getattr(obj, name, None)
        if isinstance(t, torch.Tensor):
            yield t
