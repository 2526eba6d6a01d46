"""The live-bytes tracker: exact live tensor-storage bytes, phase by phase, and a budget guard.

:class:`LiveBytesTracker` is a ``TorchDispatchMode`` that sees every storage an op
allocates and is told (by a weak-reference finalizer) when it is freed. Storages that
existed before the measured region (parameters, buffers, gradients, optimizer state) are
registered with :meth:`LiveBytesTracker.track`. Host memory that offload keeps on purpose
is left out where it is not the device's memory (see :mod:`autotune.device._backend`); on the
CPU it is the same memory, so it counts and offload saves nothing.

On CPU nothing runs out of memory at a budget, so the tracker doubles as a **budget
guard**: it raises ``torch.OutOfMemoryError`` the moment live bytes pass the budget. Every
OOM path of autotune is tested on CPU with it.

Under :class:`LiveBytesTracker` code compiled by ``torch.compile`` runs eagerly, op by op:
dynamo steps aside for a dispatch mode, and then skips that code for the rest of the
process (until ``torch._dynamo.reset()``), so autotune's copies run eagerly anyway (see
:func:`autotune.train._compiled.decompile`). Under :class:`CompiledBytesTracker` it runs
as compiled, and its buffers count: the tracker routes them through the dispatcher while
it is active (:func:`autotune.train._compiled.counted_allocations`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from autotune._profile_data import PhaseKey
from autotune.device import backend_for, in_host_memory, is_host_storage
from autotune.train import copying_buffers, counted_allocations, quantization_state

__all__ = [
    "CompiledBytesTracker",
    "Life",
    "LiveBytesTracker",
    "PhaseRecord",
    "state_tensors",
    "tracker_for",
]


@dataclass
class PhaseRecord:
    """Live bytes around one labelled stretch of a step (see :meth:`LiveBytesTracker.phase`)."""

    key: PhaseKey
    entry: int
    peak: int
    exit: int = 0
    grads: int = 0
    """Gradient bytes alive when the phase began."""
    peak_at: int = 0
    """When (the tracker's count of changes) the peak was first reached."""
    tops: list[int] = field(default_factory=list)
    """The live bytes at each local maximum within the phase, in order (each where the
    bytes fall after rising, and the exit where they were rising): the peak is the most
    of them, and each is linear in the batch size where the phase's ops are the same."""


@dataclass(frozen=True)
class Life:
    """A storage an op made while lives were recorded (:meth:`LiveBytesTracker.record_lives`)."""

    born: tuple[int, int]
    """The index of the phase it was made in, and how many storages that phase made before."""
    nbytes: int
    end: int | None
    """The index of the phase it was freed in (``None``: alive when recording stopped)."""
    early: bool
    """Whether it was freed before that phase's peak."""
    dropped: int | None = None
    """The index of the phase in which the tensor the op returned was dropped (``None``:
    not while recording): where Python let go of it, where autograd saves an alias of it
    (see :func:`~autotune.measure._timeline.tracked_step`)."""


class LiveBytesTracker(TorchDispatchMode):
    """Counts live storage bytes on one device type; optionally enforces a budget.

    Args:
        device_type: Only storages on this device type are counted (``"cpu"``, ``"cuda"``).
        budget_bytes: If given, raise ``torch.OutOfMemoryError`` when live bytes exceed it.
    """

    def __init__(self, device_type: str = "cpu", *, budget_bytes: int | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type
        self.budget_bytes = budget_bytes
        self.counts_host = backend_for(torch.device(device_type)).host_is_device
        """Whether offload's host memory is this device's (the CPU): then it counts."""
        self.live = 0
        self.peak = 0
        self.phases: list[PhaseRecord] = []
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes, while the storage lives
        self._watched: dict[int, torch.UntypedStorage] = {}  # id(storage) -> storage
        self._clock = 0  # changes of the live bytes so far
        self._rising = False  # the last change of the live bytes was a rise
        self.born: dict[int, tuple[int, int]] | None = None
        """id(storage) -> :attr:`Life.born` of each storage alive, while lives are recorded."""
        self._freed: list[tuple[tuple[int, int], int, int, int]] = []
        self._made = 0  # storages the current phase has made
        self._dropped: dict[tuple[int, int], int] = {}  # Life.born -> Life.dropped

    supports_higher_order_operators = True
    """Higher-order operators (compiled code's ``run_and_save_rng_state``, which a block
    checkpointed inside a compiled graph runs) come through :meth:`__torch_dispatch__`
    whole: their outputs count, like any op's."""

    runs_compiled: ClassVar[bool] = False
    """Whether code compiled by ``torch.compile`` runs under this tracker as compiled
    (``False``: dynamo steps aside and it runs as eager ops, each one counted)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """``torch``'s switch for :attr:`runs_compiled`: the compilation itself unseen."""
        return cls.runs_compiled

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of tensors that already exist (model and optimizer state)."""
        for t in tensors:
            self._add(_storage(t), _device_type(t), check_budget=False)

    def watch(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors whose storage is freed and allocated again by resizing it outside
        any op (FSDP2's gathered parameters): their size is read again at every op. A
        storage counted already (made by an op) is read again from now on."""
        for t in tensors:
            storage = _storage(t)
            self._add(storage, _device_type(t), check_budget=False)
            if id(storage) in self._sizes and id(storage) not in self._watched:
                self._watched[id(storage)] = storage
                self._resized(storage, check_budget=False)

    def record_lives(self) -> None:
        """From now on, note when each storage an op makes is made and freed (:meth:`lives`)."""
        self.born = {}

    def lives(self) -> list[Life]:
        """Each storage made by an op since :meth:`record_lives`: where it was made and
        freed, by phase."""
        drop = self._dropped.get
        out = [
            Life(born, n, end, clock < self.phases[end].peak_at, drop(born))
            for born, n, end, clock in self._freed
        ]
        births = list((self.born or {}).items())  # a finalizer may drop one meanwhile
        alive = ((born, self._sizes[key]) for key, born in births if key in self._sizes)
        return out + [Life(born, n, None, False, drop(born)) for born, n in alive]

    def phase(self, key: PhaseKey, *, grads: int = 0) -> None:
        """Close the current phase and open one labelled ``key`` at the current live bytes."""
        self.close()
        self.phases.append(PhaseRecord(key, self.live, self.live, grads=grads, peak_at=self._clock))
        self._made = 0

    def close(self) -> None:
        """Close the last phase (call once the measured region is over)."""
        if self.phases:
            self.phases[-1].exit = self.live
            self._fall()  # where the bytes were rising, the exit is a top

    def _fall(self) -> None:
        """The live bytes are about to fall, or the phase to end: a top where they rose."""
        if self._rising and self.phases:
            self.phases[-1].tops.append(self.live)
        self._rising = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for storage in self._watched.values():  # resized since the last op?
            self._resized(storage, check_budget=False)
        out = func(*args, **(kwargs or {}))
        for storage in self._watched.values():
            self._resized(storage, check_budget=True)
        if in_host_memory() and not self.counts_host:
            return out
        inputs = {
            id(s): s for t in _op_tensors((args, kwargs)) if _has_storage(t) for s in (_storage(t),)
        }
        schema = getattr(func, "_schema", None)
        if schema is None or schema.is_mutable:
            # An out= or resize_ op may resize a counted storage in place: count the change.
            for storage in inputs.values():
                self._resized(storage, check_budget=True)
        widened = _FLOAT_STATISTICS.get(func, ()) if _mixed(args) else ()
        for i, t in enumerate(_op_tensors(out)):
            # An output sharing an input's storage is a view or an in-place result: no new bytes.
            if _has_storage(t):
                storage = _storage(t)
                if id(storage) not in inputs:
                    wide = i in widened and isinstance(t, FakeTensor) and t.element_size() < 4
                    nbytes = t.numel() * 4 if wide else None
                    new = id(storage) not in self._sizes
                    self._add(storage, _device_type(t), check_budget=True, nbytes=nbytes)
                    if (
                        new
                        and self.born is not None
                        and id(storage) in self._sizes
                        and not copying_buffers()  # a checkpoint's copy: not the block's
                    ):
                        self._note_birth(storage, t)
        return out

    def _note_birth(self, storage: torch.UntypedStorage, t: torch.Tensor) -> None:
        """Note where ``storage`` (``t``'s, which an op returned) is made, and watch ``t``."""
        assert self.born is not None
        born = self.born[id(storage)] = (len(self.phases) - 1, self._made)
        self._made += 1
        weakref.finalize(t, self._drop, born)

    def _drop(self, born: tuple[int, int]) -> None:
        self._dropped[born] = len(self.phases) - 1

    def _resized(self, storage: torch.UntypedStorage, *, check_budget: bool) -> None:
        key = id(storage)
        if key in self._sizes and storage.nbytes() != self._sizes[key]:
            delta = storage.nbytes() - self._sizes[key]
            self._sizes[key] = storage.nbytes()
            self._grow(delta, check_budget=check_budget)

    def _add(
        self,
        storage: torch.UntypedStorage,
        device_type: str,
        *,
        check_budget: bool,
        nbytes: int | None = None,
    ) -> None:
        """Count ``storage``, of a tensor on ``device_type`` (a fake tensor's storage is
        on ``meta``; the tensor says which device it stands for), as ``nbytes`` where
        given (a fake statistic the real kernel keeps wider)."""
        key = id(storage)
        if (
            key in self._sizes
            or device_type != self.device_type
            or (is_host_storage(storage) and not self.counts_host)
        ):
            return
        nbytes = storage.nbytes() if nbytes is None else nbytes
        self._sizes[key] = nbytes
        weakref.finalize(storage, self._free, key)
        self._grow(nbytes, check_budget=check_budget)

    def _grow(self, nbytes: int, *, check_budget: bool) -> None:
        if nbytes < 0:
            self._fall()
        elif nbytes > 0:
            self._rising = True
        self.live += nbytes
        self._clock += 1
        if self.live > self.peak:
            self.peak = self.live
        if self.phases and self.live > self.phases[-1].peak:
            self.phases[-1].peak = self.live
            self.phases[-1].peak_at = self._clock
        if check_budget and self.budget_bytes is not None and self.live > self.budget_bytes:
            # Worded like torch's own (and its CPU allocator's), so that tools which
            # recognise OOMs by message (accelerate, Lightning, Hugging Face) react as to
            # a real one.
            allocator = (
                " DefaultCPUAllocator: can't allocate memory:" if self.device_type == "cpu" else ""
            )
            raise torch.OutOfMemoryError(
                f"{self.device_type.upper()} out of memory.{allocator} autotune budget guard: "
                f"{self.live} live bytes on {self.device_type} "
                f"exceed the budget of {self.budget_bytes} bytes"
            )

    def _free(self, key: int) -> None:
        nbytes = self._sizes.pop(key, 0)
        if nbytes:
            self._fall()
        self.live -= nbytes
        self._clock += 1
        if self.born is not None and key in self.born:
            self._freed.append((self.born.pop(key), nbytes, len(self.phases) - 1, self._clock))


class CompiledBytesTracker(LiveBytesTracker):
    """A :class:`LiveBytesTracker` under which compiled code runs as compiled: what it
    measures is what compiled code holds, its buffers allocated through the dispatcher
    while the tracker is active (:func:`~autotune.train.counted_allocations`), by
    inductor's fast path again after."""

    runs_compiled = True

    def __enter__(self) -> CompiledBytesTracker:
        self._counted = counted_allocations()
        self._counted.__enter__()
        try:
            super().__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            self._counted.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            self._counted.__exit__(None, None, None)


def tracker_for(
    compiled: bool, device_type: str, *, budget_bytes: int | None = None
) -> LiveBytesTracker:
    """The tracker of a run whose blocks are ``compiled`` (or not): a compiled block run
    under the plain tracker would run eagerly, and never compiled again in the process."""
    kind = CompiledBytesTracker if compiled else LiveBytesTracker
    return kind(device_type, budget_bytes=budget_bytes)


_aten = torch.ops.aten
_FLOAT_STATISTICS = {
    _aten.native_layer_norm.default: (1, 2),
    _aten.native_batch_norm.default: (1, 2),
    _aten._native_batch_norm_legit.default: (1, 2),
    _aten._native_batch_norm_legit.no_stats: (1, 2),
    _aten.native_group_norm.default: (1, 2),
}
"""Ops whose saved statistics (mean, inverse deviation: outputs 1 and 2) the CPU kernels
keep in float32 for a bf16 or fp16 input with float32 parameters (autocast's normalisation
layers), where the fake kernels give them the input's dtype: a traced step counts them at
4 bytes an element, as a real one holds them."""


def _op_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of an op's arguments or outputs (tuples, lists and dicts of them), in
    ``tree_flatten``'s order: the tracker's per-op walk, four times faster than the general
    pytree one (which dominated a tracked step's own cost)."""
    found: list[torch.Tensor] = []
    stack = [tree]  # no closure calling itself: a reference cycle per op would keep the
    while stack:  # garbage collector running, and finalizers firing mid-iteration
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return found


def _mixed(args: Any) -> bool:
    """Whether an op's arguments hold a float32 tensor (its weight, its statistics)."""
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args)


def _has_storage(t: torch.Tensor) -> bool:
    # Sparse, nested and other wrapper-subclass tensors have no plain storage; they are not
    # counted. A DTensor (FSDP2's shards) counts its local tensor, fake or not. A Parameter
    # subclass that is no wrapper (bitsandbytes' Params4bit and Int8Params) has a plain
    # storage.
    if type(t) is torch.Tensor:  # nearly every op's tensors: the short way
        return t.layout == torch.strided and not t.is_meta
    t = _local(t)
    if isinstance(t, FakeTensor):  # traced without memory: its storage's bytes count
        return t.layout == torch.strided
    plain = type(t) is torch.Tensor or (
        isinstance(t, torch.nn.Parameter) and not is_traceable_wrapper_subclass(t)
    )
    return plain and t.layout == torch.strided and not t.is_meta


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s bytes on this process: a DTensor's local shard."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _device_type(t: torch.Tensor) -> str:
    """The device type of the memory ``t`` holds (a fake tensor's: the one it stands for)."""
    return _local(t).device.type


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    if type(t) is torch.Tensor:
        return t.untyped_storage()
    return _local(t).untyped_storage()


def state_tensors(*objects: Any) -> list[torch.Tensor]:
    """The tensors held by modules, optimizers and GradScalers: the persistent state of a step."""
    out: list[torch.Tensor] = []
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                out.append(p)
                if p.grad is not None:
                    out.append(p.grad)
            out.extend(obj.buffers())
            out.extend(quantization_state(obj))  # a quantized weight's absmax, code, scales
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.amp.GradScaler):
            # Its state_dict() holds Python numbers (.item()), not the tensors it keeps.
            flat = tree_flatten(vars(obj))[0]
            out.extend(v for v in flat if isinstance(v, torch.Tensor))
        elif obj is not None and hasattr(obj, "state_dict"):
            flat = tree_flatten(obj.state_dict())[0]
            out.extend(v for v in flat if isinstance(v, torch.Tensor))
    return [_local(t) for t in out if _has_storage(t)]
