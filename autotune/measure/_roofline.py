"""Time on a device that is not here: each op's FLOPs and bytes against a datasheet.

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

from typing import Any, ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from autotune.device import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY, DeviceSpec

__all__ = ["Roofline", "simulated_now"]

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
