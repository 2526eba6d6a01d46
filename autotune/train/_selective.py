"""Selective activation checkpointing: which ops a selectively checkpointed block keeps.

A checkpointed block keeps only its input and recomputes its whole forward in backward.
A selectively checkpointed one (torch's ``create_selective_checkpoint_contexts``, the
op-level policy torchtitan uses) keeps the outputs of its expensive ops, the matrix
products, convolutions and attention kernels, and recomputes only the cheap ones between
them (norms, activations, dropout, casts, elementwise arithmetic). Its memory lies
between keeping the block and checkpointing it; its recomputation costs a fraction of a
forward. The profile measures both, like every other choice of a block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["SAVED_OPS", "selective_contexts"]

_EXPENSIVE = (
    # Matrix products: nn.Linear (addmm, or mm and an add), matmul's bmm, Conv1D's addmm.
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "_int_mm",
    # Convolutions of every dimension and their transposes.
    "convolution",
    # Fused attention kernels (the math path is plain bmm and softmax, covered above).
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
"""aten ops whose outputs a selectively checkpointed block keeps (those this torch has)."""


def _overloads(names: tuple[str, ...]) -> frozenset[Any]:
    """Every overload of the named aten ops that this build of torch has."""
    found = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        found += [getattr(packet, o) for o in packet.overloads()]
    return frozenset(found)


SAVED_OPS: frozenset[Any] = _overloads(_EXPENSIVE)
"""The op overloads whose outputs are kept; every other op is recomputed in backward."""


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


selective_contexts: Callable[[], tuple[Any, Any]] = functools.partial(
    create_selective_checkpoint_contexts, _policy
)
"""The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for a selective block."""
