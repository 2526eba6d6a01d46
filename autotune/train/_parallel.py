"""Data parallelism as a config says: DDP, or FSDP2's ``fully_shard`` with each block a unit.

The process group is the user's (``torchrun`` and ``init_process_group``); this module only
checks it matches the config. Under FSDP2 every block is a unit, resharded after forward
unless the config keeps it gathered, and the root holds the parameters outside the blocks.
bf16 is FSDP's ``MixedPrecisionPolicy`` (bf16 parameters, fp32 gradient reduction) under
bf16 autocast, and an offloaded optimizer is FSDP's ``CPUOffloadPolicy``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from autotune._blocks import find_blocks
from autotune.config import TrainConfig
from autotune.errors import AutotuneError, DistributedError

__all__ = [
    "Parallel",
    "agree_max",
    "broadcast",
    "check_group",
    "collective",
    "following_gathered",
    "gathered_tensors",
    "group_size",
    "rank",
    "rank_zero",
]


def group_size() -> int:
    """Ranks in the default process group; 1 when none is initialised."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default process group; 0 when none is initialised."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def agree_max(values: Sequence[float], device: torch.device) -> list[float]:
    """The largest of each value over the ranks (the values themselves without a group),
    so that every rank decides alike.

    Raises:
        DistributedError: another rank failed or stopped answering.
    """
    if group_size() == 1:
        return list(values)
    import torch.distributed as dist

    home = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(list(values), dtype=torch.float64, device=home)
    with collective("agreeing on a measurement"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.cpu()]


def broadcast(obj: Any, src: int = 0) -> Any:
    """``obj`` as rank ``src`` has it, on every rank (itself without a group).

    Raises:
        DistributedError: another rank failed or stopped answering.
    """
    if group_size() == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    with collective("receiving rank 0's results"):
        dist.broadcast_object_list(box, src=src)
    return box[0]


T = TypeVar("T")


def rank_zero(fn: Callable[[], T]) -> T:
    """``fn()`` run on rank 0 and its result sent to every rank (just ``fn()`` alone); an
    :class:`AutotuneError` it raises is raised on every rank."""
    if group_size() == 1:
        return fn()
    outcome: tuple[T | None, AutotuneError | None] = (None, None)
    if rank() == 0:
        try:
            outcome = (fn(), None)
        except AutotuneError as exc:  # every rank raises what rank 0 found
            outcome = (None, exc)
    value, error = broadcast(outcome)
    if error is not None:
        raise error
    return value  # type: ignore[no-any-return]


@contextlib.contextmanager
def collective(doing: str) -> Iterator[None]:
    """Turn a collective's failure (a rank that died, a broken connection, a timeout) into
    a :class:`DistributedError` that says so, instead of torch's deep stack."""
    try:
        yield
    except (DistributedError, torch.OutOfMemoryError):
        raise
    except RuntimeError as exc:  # DistBackendError, gloo's and NCCL's errors
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise DistributedError(
            f"rank {rank()} of {group_size()}: {doing} failed, so another rank has stopped, "
            f"crashed or cannot be reached ({first}). Check the other ranks' logs."
        ) from None


class Parallel:
    """A model wrapped for data parallelism: ``module`` is what a step calls.

    Args:
        model: The model, on ``device``, its blocks already checkpointed as configured.
        config: The configuration (``parallel`` and ``world_size``).
        units: The blocks, FSDP's units; default: :func:`~autotune._blocks.find_blocks`.
        device: Where the model trains.

    Raises:
        DistributedError: no process group, or one of another size than the config's.
    """

    def __init__(
        self, model: nn.Module, config: TrainConfig, units: Sequence[str], device: torch.device
    ) -> None:
        self.kind = config.parallel
        self.module: nn.Module = model
        self.device = device
        self._ddp: Any = None
        if self.kind == "none":
            return
        check_group(config)
        self.units = tuple(units) or find_blocks(model)
        if self.kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [device.index] if device.type == "cuda" else None
            self._ddp = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
            self.module = self._ddp
        else:
            _fully_shard(model, config, self.units, device)

    @property
    def keeps_gradients(self) -> bool:
        """Whether gradients are zeroed in place rather than freed: DDP's, once it has
        built its buckets again in its second step (before, the views would keep the old
        buckets alive beside the new ones)."""
        return self._ddp is not None and bool(getattr(self._ddp, "_has_rebuilt_buckets", True))

    def last_micro_batch(self, last: bool) -> None:
        """DDP reduces gradients in the step's last backward only, once its buckets are
        built for good: before, every backward reduces, so that the gradients become views
        of the buckets at once instead of being made beside them (same sum)."""
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = last or not self.keeps_gradients

    def mean_over_ranks(self, count: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of this rank's ``count`` (a 0-dim tensor): what a rank
        divides its summed loss by, where the loss is a mean over what every rank counts,
        so that the mean of the ranks' gradients (DDP's, FSDP2's) is the whole step's.
        Reduced on the device without a read on the host."""
        import torch.distributed as dist

        total = count.to(self.device, torch.float32, non_blocking=True)
        dist.all_reduce(total)
        return total / dist.get_world_size()

    def reset(self) -> None:
        """After an error in the middle of a step (an out-of-memory error before a
        fallback), put FSDP2's per-step state back, as its ``reset_iter_state`` asks."""
        reset = getattr(self.module, "reset_iter_state", None) if self.kind == "fsdp" else None
        if reset is not None:
            reset()

    def switch(self, config: TrainConfig) -> None:
        """Take a fallback's FSDP resharding choice (the wrapping itself cannot change).

        Raises:
            DistributedError: the fallback changes the data parallelism or world size.
        """
        if config.parallel != self.kind:
            raise DistributedError(
                f"cannot switch from parallel {self.kind} to {config.parallel} mid-training."
            )
        if self.kind == "fsdp":
            model = self.module
            for name in self.units:
                unit: Any = model.get_submodule(name)
                unit.set_reshard_after_forward(name not in config.keep_gathered)


def check_group(config: TrainConfig) -> None:
    """Raise :class:`DistributedError` unless the process group is the config's."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedError(
            f"this config trains with {config.parallel} over {config.world_size} ranks but no "
            "process group is initialised; launch with torchrun and call "
            "torch.distributed.init_process_group() first."
        )
    if dist.get_world_size() != config.world_size:
        raise DistributedError(
            f"this config was tuned for {config.world_size} ranks but the process group has "
            f"{dist.get_world_size()}; tune again at this world size or launch "
            f"{config.world_size} processes."
        )


def _fully_shard(
    model: nn.Module, config: TrainConfig, units: Sequence[str], device: torch.device
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    with unset_fake_temporarily():  # the mesh is bookkeeping: real even in a traced run
        mesh = init_device_mesh(device.type, (config.world_size,))
    mp = MixedPrecisionPolicy()
    if config.precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    policy = offload if config.offload_optimizer else OffloadPolicy()
    for name in units:
        fully_shard(
            model.get_submodule(name),
            mesh=mesh,
            reshard_after_forward=name not in config.keep_gathered,
            mp_policy=mp,
            offload_policy=policy,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    if device.type == "cpu":  # gloo
        for name in (*units, ""):
            model.get_submodule(name).set_custom_reduce_scatter(InPlaceReduceScatter())  # type: ignore[operator]


class InPlaceReduceScatter:
    """FSDP2's reduce-scatter on the CPU: the input all-reduced in place, this rank's
    shard copied out (what FSDP2 calls through ``set_custom_reduce_scatter``).

    gloo's own reduce-scatter into a tensor is that all-reduce run on a copy of the whole
    input, which its thread makes and frees: freed late where the rank's compute keeps
    that thread waiting, it is memory at any moment of the step after, there one step
    and not the next. In place, the step holds what it holds on NCCL. The same sum; the
    input, FSDP2's own buffer, is not read again.
    """

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A buffer of the collective, as FSDP2's default allocates it."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        import torch.distributed as dist

        dist.all_reduce(input_tensor, op=op, group=group)
        n = output_tensor.numel()
        start = dist.get_rank(group) * n
        output_tensor.copy_(input_tensor.view(-1)[start : start + n].view_as(output_tensor))


def gathered_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors FSDP2 gathers parameters into, whose storage it frees and allocates
    again by resizing (outside any op a dispatch mode sees); empty for other models, and
    for units that have not run forward yet (FSDP2 makes them in a unit's first one)."""
    out: list[torch.Tensor] = []
    for module in model.modules():
        out.extend(_unit_gathered(module))
    return out


@contextlib.contextmanager
def following_gathered(
    models: Iterable[nn.Module], watch: Callable[[list[torch.Tensor]], None]
) -> Iterator[None]:
    """Hand ``watch`` the tensors FSDP2 gathers the ``models``' parameters into: those
    that exist now, and each unit's from its first forward on (FSDP2 makes them in the
    unit's pre-forward hook, which runs before the one added here), so that a reading
    that starts before the first step follows them too."""
    handles = []
    for model in models:
        watch(gathered_tensors(model))
        for module in model.modules():
            if _param_group(module) is not None:
                hook = module.register_forward_pre_hook(lambda m, _: watch(_unit_gathered(m)))
                handles.append(hook)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _param_group(module: nn.Module) -> Any:
    """FSDP2's parameter group of a unit (``None`` for other modules)."""
    state = getattr(module, "_get_fsdp_state", None)
    return getattr(state(), "_fsdp_param_group", None) if state else None


def _unit_gathered(module: nn.Module) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for param in getattr(_param_group(module), "fsdp_params", ()):
        out.extend(getattr(param, "all_gather_outputs", ()))
        out.extend(getattr(param, "_unsharded_inner_tensors", ()))
    return out
