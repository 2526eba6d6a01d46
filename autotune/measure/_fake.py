"""Tracing on fake tensors: a model's training step run for its shapes, never its data.

Under :func:`traced`, a model built (and a sample made) holds fake tensors: each reports
the device, dtype and shape a real one would, and its storage is on the ``meta`` device,
which allocates nothing. The live-bytes tracker counts a fake tensor's storage bytes under
the device the tensor reports (see :mod:`autotune.measure._tracker`), so the
phase-labelled memory timeline of a model of any size is traced within this machine's
memory, and equals, byte for byte, the timeline of the same model trained for real on
that device (checked in the tests on every model that fits here).

What a traced step cannot do, it does not do: read a value (the non-finite check of the
gradients is skipped, see :mod:`autotune.train._steps`), move a model (a model already on
the device is left be, by autotune and, under :func:`traced`, by ``Module.to``), copy a
block's saved tensors to the host (offload is not traced).

Models that read their inputs' values to choose a code path choose as they would on
data they cannot read: Hugging Face's masks take a padding mask or positions they cannot
read as padded or packed, and build a full attention mask (which SDPA's flash kernel
cannot take). Under :func:`traced` those helpers read a real mask with nothing padded and
real positions of one sequence per row (a plain sample batch of a language model), of
the fake one's shape, and take the path the same model takes on such data, their own
ops counted as a real run's; :data:`TRACED_ASSUMPTIONS` says so. A model whose own
code branches on tracing elsewhere may trace another path than it runs: the tests and
``benchmarks/traced.py`` say which models trace byte for byte. Where torch's fake kernels
refuse what the CPU runs (a grouped matmul in float32, a truncated-normal initialisation
that reads its values), :mod:`autotune.measure._fake` makes them run as the CPU.

Where torch's fake kernels and initialisers differ from what a CPU step runs.

A traced step runs torch's fake (meta) kernels, which mirror the CUDA kernels' checks, on
the CPU's ops. Two of them refuse what the CPU runs, and :func:`as_the_cpu_runs` (part
of :func:`~autotune.measure._fake.traced`) makes them take it as the CPU does:

* ``aten._grouped_mm`` (mixture-of-experts layers: Mixtral, Qwen-MoE, DeepSeek-V3, ...):
  the meta kernel accepts bf16 only, as CUDA's does; the CPU's runs fp32 and fp16 too,
  into a new contiguous output of the same shape and dtype rules.
* torch's truncated-normal initialisation (ViT, DeiT) redraws until every value lies
  within its bounds, which reads them; a fake tensor's values are never read, so they
  are not drawn.

Time on a device that is not here: each op's FLOPs and bytes against a datasheet.

Under :class:`Roofline` every op run (on fake tensors, typically: a traced step) adds
the longer of its FLOPs at the peak rate of its inputs' precision and the bytes it reads
and writes at the memory bandwidth, each at a stated efficiency (see
:mod:`autotune.device._catalog`). FLOPs come from torch's own counter
(``torch.utils.flop_counter``: matmuls, convolutions, attention); every other op is
counted by its bytes. The profiler's clock reads these seconds while a roofline is
active, so the time profile of a traced model is the same code as a measured one's, with
a simulated clock: what it gives is a ranking, NOT VERIFIED against the device.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from autotune.device import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY, DeviceSpec

__all__ = [
    "TRACED_ASSUMPTIONS",
    "Roofline",
    "as_the_cpu_runs",
    "is_traced",
    "simulated_now",
    "traced",
]

TRACED_ASSUMPTIONS = (
    "traced on fake tensors: a Hugging Face model's attention mask taken as nothing padded "
    "and its positions as one sequence per row, as in a plain sample batch",
)
"""What tracing takes for granted that a real step would read from the data."""


@contextlib.contextmanager
def traced() -> Iterator[FakeTensorMode]:
    """A fake-tensor mode: models built and samples made inside hold no memory, and
    every training step run inside is traced (see the module's documentation)."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode, _unpacked_positions(), _moves_in_place(), as_the_cpu_runs():
        yield mode


def is_traced(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor (a traced model's, or a traced sample's)."""
    return isinstance(tensor, FakeTensor)


@contextlib.contextmanager
def _moves_in_place() -> Iterator[None]:
    """``Module.to`` of a fake module: the module itself where nothing changes (as for a
    real one), else its tensors converted and replaced. torch swaps each tensor for its
    converted self, and a fake tensor, which its mode holds a weak reference to, cannot be
    swapped (peft moves its adapters so; FSDP2's timeline casts a copy to bf16)."""
    move = nn.Module.to

    def to(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = (*module.parameters(), *module.buffers())
        if memory_format is None and all(_as(t, device, dtype) for t in tensors):
            return module
        if memory_format is None and tensors and all(isinstance(t, FakeTensor) for t in tensors):
            return _converted(module, device, dtype)
        return move(module, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.to = move  # type: ignore[method-assign]


def _converted(
    module: nn.Module, device: torch.device | None, dtype: torch.dtype | None
) -> nn.Module:
    """``module`` with its fake tensors converted as ``Module.to`` converts them, each
    replaced rather than swapped (shared ones stay shared)."""
    done: dict[int, torch.Tensor] = {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            cast = (
                dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else None
            )
            new = t.detach().to(device=device or t.device, dtype=cast or t.dtype)
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            done[id(t)] = new
        return done[id(t)]

    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = convert(p)  # type: ignore[assignment]
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = convert(b)
    return module


def _as(t: torch.Tensor, device: torch.device | None, dtype: torch.dtype | None) -> bool:
    """Whether ``t`` is a fake tensor that ``Module.to(device, dtype)`` would leave as is
    (it casts floating-point tensors only)."""
    where = device is None or t.device == device
    kind = dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype
    return isinstance(t, FakeTensor) and where and kind


_UNREAD = (
    "find_packed_sequence_indices",  # position ids
    "_ignore_causal_mask_sdpa",  # padding masks, from here on
    "_ignore_bidirectional_mask_sdpa",
    "_can_skip_bidirectional_mask_xpu",
    "create_recurrent_attention_mask",
)
"""Hugging Face's mask helpers that read their first argument's values."""


@contextlib.contextmanager
def _unpacked_positions() -> Iterator[None]:
    """Hugging Face's mask helpers, given fake masks and positions, read real ones of the
    same shape: nothing padded, one sequence per row."""
    masks = None
    if "transformers" in sys.modules:  # a model of it may be built or run inside
        with contextlib.suppress(ImportError):  # older releases: no such helpers
            masks = importlib.import_module("transformers.masking_utils")
    found = {n: getattr(masks, n) for n in _UNREAD if hasattr(masks, n)}
    for name, helper in found.items():
        positions = name == "find_packed_sequence_indices"
        setattr(masks, name, _readable(helper, _positions if positions else _unpadded))
    try:
        yield
    finally:
        for name, helper in found.items():
            setattr(masks, name, helper)


def _readable(helper: Any, stand_in: Any) -> Any:
    """``helper`` given a real stand-in for a fake first argument, and run on it for
    real: its ops (a sum, a comparison) are counted as a real run's are, and it takes
    the path a real run on such data takes. The stand-in is made unseen (a real run has
    its mask already)."""

    @functools.wraps(helper)
    def readable(first: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(first, FakeTensor):
            return helper(first, *args, **kwargs)
        with _disable_current_modes():
            real = stand_in(first)
        with unset_fake_temporarily():
            return helper(real, *args, **kwargs)

    return readable


def _unpadded(mask: FakeTensor) -> torch.Tensor:
    """A padding mask with nothing padded."""
    return torch.ones(mask.shape, dtype=mask.dtype)


def _positions(position_ids: FakeTensor) -> torch.Tensor:
    """Positions of one sequence per row."""
    length = position_ids.shape[-1]
    return torch.arange(length, dtype=position_ids.dtype).expand(position_ids.shape)


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


_LOW = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class Roofline(TorchDispatchMode):
    """Simulated seconds of the ops run under it on ``spec``'s device."""

    _active: ClassVar[list[Roofline]] = []

    def __init__(self, spec: DeviceSpec) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.spec = spec
        self.seconds = 0.0
        self.flops = 0.0
        self.bytes = 0.0

    def __enter__(self) -> Roofline:
        Roofline._active.append(self)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        Roofline._active.remove(self)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        flops = float(count(*args, **kwargs, out_val=out)) if count is not None else 0.0
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        moved = 0.0
        if not func.is_view:
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            moved = float(sum(t.numel() * t.element_size() for t in (*inputs, *outputs)))
        rate = self.spec.flops[_precision(inputs)] * MATMUL_EFFICIENCY
        self.seconds += max(flops / rate, moved / (self.spec.bandwidth * MEMORY_EFFICIENCY))
        self.flops += flops
        self.bytes += moved
        return out


def simulated_now() -> float | None:
    """The innermost active roofline's seconds so far (``None``: none is active)."""
    return Roofline._active[-1].seconds if Roofline._active else None


def _precision(inputs: list[torch.Tensor]) -> str:
    """The precision whose peak an op runs at: its first low-precision float input's."""
    for t in inputs:
        if t.dtype in _LOW:
            return _LOW[t.dtype]
    return "fp32"
