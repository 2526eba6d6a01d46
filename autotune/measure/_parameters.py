"""What a model's parameters weigh: in all, per block, and per parameter for sharding.

Read from the model wherever it lives (the device or the host); nothing runs. A quantized
weight weighs its packed storage and its quantization state (see
:mod:`autotune.train._quantized`), which is frozen.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from autotune.train import one_per_storage, quantization_state

__all__ = ["block_parameter_bytes", "parameter_bytes", "parameter_layout"]


def parameter_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of every parameter with its quantization state, bytes of the trainable ones),
    each storage once."""
    params = {id(p): p for p in model.parameters()}.values()
    return _bytes(model), sum(p.untyped_storage().nbytes() for p in params if p.requires_grad)


def block_parameter_bytes(model: nn.Module, blocks: Sequence[str]) -> tuple[int, ...]:
    """Parameter bytes (quantization state included) of each named block of ``model``."""
    return tuple(_bytes(model.get_submodule(name)) for name in blocks)


def _bytes(module: nn.Module) -> int:
    """Bytes of the parameters and quantization state of ``module``, each storage once."""
    tensors = one_per_storage((*module.parameters(), *quantization_state(module)))
    return sum(t.untyped_storage().nbytes() for t in tensors)


def parameter_layout(
    model: nn.Module, blocks: Sequence[str]
) -> tuple[tuple[int, int, int, int, int], ...]:
    """Each parameter once as ``(unit, rows, bytes per row, element size, trainable)``: the
    index of the first block holding it (-1: none), its first dimension, the bytes of one
    row, of one element, and whether it is trained."""
    owner: dict[int, int] = {}
    for i, name in enumerate(blocks):
        for p in model.get_submodule(name).parameters():
            owner.setdefault(id(p), i)
    out = []
    for p in {id(p): p for p in model.parameters()}.values():
        rows = p.shape[0] if p.dim() else 1
        row = p.untyped_storage().nbytes() // max(rows, 1)
        out.append((owner.get(id(p), -1), rows, row, p.element_size(), int(p.requires_grad)))
    return tuple(out)
