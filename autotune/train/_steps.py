"""The optimizer step's pieces shared by every loop: fp16's GradScaler, gradient
clipping, the refusal of a non-finite step (in the runner's loop and in a trainer's), and
the learning-rate scheduler's type."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from autotune.config import TrainConfig
from autotune.device import backend_for
from autotune.errors import NonFiniteError
from autotune.train._refusals import GRADIENTS, Refusals

__all__ = ["LoopRefusals", "Scheduler", "apply_step", "check_finite", "make_scaler"]


class Scheduler(Protocol):
    """A learning-rate scheduler (``torch.optim.lr_scheduler.LRScheduler`` is one)."""

    optimizer: torch.optim.Optimizer

    def step(self) -> None: ...


def apply_step(
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    max_grad_norm: float | None = None,
    refusals: Refusals | None = None,
) -> torch.Tensor:
    """Step ``optimizer`` (through ``scaler`` for fp16), gradients kept.

    Without a scaler, a step with non-finite gradients changes nothing (fp16's scaler
    skips such a step itself, and adapts its scale). Given ``refusals``, an optimizer with
    a fused kernel that reads a ``found_inf`` flag (fused AdamW, fused SGD) is handed one
    computed on the device, and skips the update there: the flag goes to ``refusals``,
    and the host never waits for it. Otherwise the flag is read at once (one sync) and
    non-finite gradients raise :class:`NonFiniteError` before anything changes.

    With ``max_grad_norm``, the gradients of the optimizer's parameters are first
    unscaled and clipped to that total 2-norm, as ``torch.nn.utils.clip_grad_norm_`` does.

    Returns:
        The total norm before clipping (an empty tensor without ``max_grad_norm``).
    """
    on_device = scaler is None and refusals is not None and _skips_on_device(optimizer)
    if scaler is None and not on_device:
        check_finite(optimizer)
    norm = torch.empty(0)
    if max_grad_norm is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if scaler is not None and _traced(optimizer):
        # GradScaler.step reads whether the unscaled gradients were finite; a traced step
        # has no values to read: the step a finite one takes, its ops all run.
        if max_grad_norm is None:
            scaler.unscale_(optimizer)
        optimizer.step()
        scaler.update()
    elif scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    elif on_device:
        assert refusals is not None
        found = _not_finite(optimizer)
        refusals.flag(found, GRADIENTS)
        _step_unless(optimizer, found)
    else:
        optimizer.step()
    return norm


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips its update on the device given a ``found_inf`` flag:
    one of torch's own built fused (not an optimizer of one's own that may claim the
    older contract of a ``grad_scaler`` argument), over plain gradients (not FSDP's
    shards, whose verdict the ranks must share)."""
    own = type(optimizer).__module__.startswith("torch.optim")
    fused = own and optimizer.defaults.get("fused") is True
    if not (fused and getattr(optimizer, "_step_supports_amp_scaling", False)):
        return False
    if _traced(optimizer):
        return False
    grads = (p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
    return not any(hasattr(g, "to_local") for g in grads)


def _not_finite(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """1.0 on the device where a gradient of ``optimizer``'s is NaN or inf, else 0.0: each
    gradient's largest magnitude (one multi-tensor kernel), summed, is finite or not."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return torch.zeros(())
    tops = torch._foreach_norm(grads, float("inf"))
    home = grads[0].device
    total = torch.stack([t.to(home, torch.float32) for t in tops]).sum()
    return (~torch.isfinite(total)).float()


def _step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()``, which its fused kernel skips where ``found_inf`` is nonzero."""
    _arm(optimizer, found_inf)
    try:
        optimizer.step()
    finally:
        _disarm(optimizer)


def _arm(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Hand ``optimizer``'s next step ``found_inf`` (the contract fp16's GradScaler steps
    a fused optimizer by: its kernel skips the update where the flag is nonzero)."""
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    optimizer.grad_scale = None  # type: ignore[attr-defined]


def _disarm(optimizer: torch.optim.Optimizer) -> None:
    """Take :func:`_arm`'s flag off ``optimizer``."""
    del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]


class LoopRefusals:
    """Non-finite steps refused in a trainer's loop (Hugging Face's ``Trainer``,
    Lightning), which steps the optimizer itself, as the runner refuses them.

    :meth:`before_step` runs between the backward and the trainer's ``optimizer.step()``.
    An optimizer whose fused kernel skips its update on a ``found_inf`` flag (torch's
    fused AdamW and SGD) is handed one computed on the device, with no read on the host,
    and :meth:`after_step` says a refused step once its flag has reached the host (on the
    CPU at once, on a GPU a step or two later). Any other optimizer's gradients are
    checked on the host before it steps (:func:`check_finite`: one read a step, as in
    the runner). fp16's GradScaler skips non-finite steps itself: not called there.

    Args:
        device: Where the model trains.
    """

    def __init__(self, device: torch.device) -> None:
        self.refusals = Refusals(backend_for(device))
        self._armed: torch.optim.Optimizer | None = None

    def before_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Arm ``optimizer``'s next step with the device's flag, or check its gradients
        on the host where its kernel cannot skip on one; whether it was armed.

        Raises:
            NonFiniteError: an unarmed optimizer's gradients are not finite (they are
                freed; it must not step).
        """
        self.disarm()
        if not _skips_on_device(optimizer):
            check_finite(optimizer)
            return False
        found = _not_finite(optimizer)
        self.refusals.flag(found, GRADIENTS)
        _arm(optimizer, found)
        self._armed = optimizer
        return True

    def after_step(self) -> None:
        """The step is taken: disarm the optimizer and read the flags that have arrived.

        Raises:
            NonFiniteError: a step was refused (this one on the CPU, an earlier one on a
                GPU); the weights kept their last finite values.
        """
        if self.disarm():
            self.refusals.end_step()

    def disarm(self) -> bool:
        """Take the flag off the optimizer armed last, if any (whether one was)."""
        optimizer, self._armed = self._armed, None
        if optimizer is None:
            return False
        _disarm(optimizer)
        return True


def _traced(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s gradients are fake tensors (a traced step's)."""
    return any(isinstance(p.grad, FakeTensor) for g in optimizer.param_groups for p in g["params"])


def check_finite(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a step whose gradients are not finite, before anything changes.

    Raises:
        NonFiniteError: a gradient of ``optimizer``'s parameters is NaN or inf; the
            gradients are freed, the weights keep their last finite values.
    """
    if not _finite(optimizer):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(
            "this step's gradients are not finite (NaN or inf), so it was not applied: the "
            "weights keep their last finite values. Check this batch's loss and inputs, or "
            "lower the learning rate; catch autotune.NonFiniteError to skip the batch."
        )


def _finite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient of ``optimizer``'s parameters is finite (one sync).

    FSDP's gradients are shards: a NaN may sit in one rank's shard only, and a rank alone
    must not refuse a step the others take. Their verdicts are combined (one all-reduce of
    a flag), so that every rank refuses the step or none does.
    """
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    sharded = any(hasattr(g, "to_local") for g in grads)
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    flags = [torch.isfinite(g).all() for g in local if g.numel()]
    home = local[0].device if local else torch.device("cpu")
    finite = (
        torch.stack([f.to(home) for f in flags]).all()
        if flags
        else torch.ones((), dtype=torch.bool, device=home)
    )
    if sharded and dist.is_available() and dist.is_initialized():
        # NCCL reduces CUDA tensors only; host shards (CPUOffloadPolicy) send their flag up.
        nccl = "nccl" in str(dist.get_backend())
        where = torch.device("cuda", torch.cuda.current_device()) if nccl else home
        verdict = finite.to(where, torch.int32)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
        finite = verdict
    if isinstance(finite, FakeTensor):  # a traced step (no data): its ops ran, none to read
        return True
    return bool(finite)


def make_scaler(
    config: TrainConfig, device: torch.device, previous: torch.amp.GradScaler | None = None
) -> torch.amp.GradScaler | None:
    """fp16's loss scaler (``None`` otherwise), carrying ``previous``'s scale and counters.

    Its scale lives where the optimizer steps. An offloaded optimizer unscales host
    gradients; a scale left on the GPU would reach the host by a non-blocking copy that
    torch does not wait for. On the host, scaling the loss copies it up (from pageable
    memory, so the copy has read it before it returns) and unscaling needs no copy.
    """
    if config.precision != "fp16":
        return None
    home = torch.device("cpu") if config.offload_optimizer else device
    scaler = torch.amp.GradScaler(home.type)
    if previous is not None:
        scaler.load_state_dict(previous.state_dict())
    scaler.scale(torch.ones((), device=home))  # the scale is made on ``home`` now
    return scaler
