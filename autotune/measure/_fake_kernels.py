"""Where torch's fake kernels and initialisers differ from what a CPU step runs.

A traced step runs torch's fake (meta) kernels, which mirror the CUDA kernels' checks, on
the CPU's ops. Two of them refuse what the CPU runs, and :func:`as_the_cpu_runs` (part
of :func:`~autotune.measure._fake.traced`) makes them take it as the CPU does:

* ``aten._grouped_mm`` (mixture-of-experts layers: Mixtral, Qwen-MoE, DeepSeek-V3, ...):
  the meta kernel accepts bf16 only, as CUDA's does; the CPU's runs fp32 and fp16 too,
  into a new contiguous output of the same shape and dtype rules.
* torch's truncated-normal initialisation (ViT, DeiT) redraws until every value lies
  within its bounds, which reads them; a fake tensor's values are never read, so they
  are not drawn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["as_the_cpu_runs"]

_CPU_ONLY = (torch.float32, torch.float16)
"""The dtypes the CPU's ``_grouped_mm`` runs that the meta kernel refuses."""


@contextlib.contextmanager
def as_the_cpu_runs() -> Iterator[None]:
    """Inside, the fake kernels and initialisers above behave as a CPU step does."""
    with _grouped_mm_in_any_float(), _values_not_drawn():
        yield


@contextlib.contextmanager
def _grouped_mm_in_any_float() -> Iterator[None]:
    """The meta ``_grouped_mm``'s checks, with the CPU kernel's dtypes: an unscaled
    grouped matmul of float32 or float16 matrices gives the output the CPU gives."""
    from torch import _meta_registrations as meta

    common = getattr(meta, "_meta_grouped_mm_common", None)
    create = getattr(meta, "_create_grouped_mm_output_tensor", None)
    if common is None or create is None:  # another torch: its own checks stand
        yield
        return

    def checked(
        mat_a: torch.Tensor,
        mat_b: torch.Tensor,
        scale_a: torch.Tensor | None = None,
        scale_b: torch.Tensor | None = None,
        offs: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale_result: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        use_fast_accum: bool = False,
    ) -> torch.Tensor:
        unscaled = scale_a is None and scale_b is None
        if not unscaled or mat_a.dtype not in _CPU_ONLY or mat_b.dtype != mat_a.dtype:
            out: torch.Tensor = common(
                mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum
            )
            return out
        torch._check(
            mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
            lambda: "grouped_mm: multiplicands must be 2D or 3D",
        )
        made: torch.Tensor = create(mat_a, mat_b, offs, out_dtype)
        return made.contiguous()  # the CPU kernel's layout: no CUDA row padding

    meta._meta_grouped_mm_common = checked
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = common


@contextlib.contextmanager
def _values_not_drawn() -> Iterator[None]:
    """torch's truncated-normal initialisation of a fake tensor left as it is."""
    draw = nn.init._no_grad_trunc_normal_

    def trunc_normal(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor if isinstance(tensor, FakeTensor) else draw(tensor, *args, **kwargs)

    nn.init._no_grad_trunc_normal_ = trunc_normal
    try:
        yield
    finally:
        nn.init._no_grad_trunc_normal_ = draw
