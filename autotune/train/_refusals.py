"""``Refusals``: the steps refused for non-finite values, learnt without stopping the device.

A step whose gradients (or, with fp16, whose loss) are not finite is refused: the weights
keep their last finite values. Deciding that on the host would read a flag off the device
every step, and the host could never run ahead of the device (on a GPU, it waits for the
step's last kernel before it may queue the next step's first). So the decision is the
device's: a flag computed there skips the update inside the optimizer's own kernel (the
fused optimizers read it as ``found_inf``, as fp16's GradScaler hands it to them), and a
copy of the flag travels to host memory behind the step. The host reads it once it has
arrived, never waiting for it: on the CPU at once, on a GPU a step or two later; a flag two
steps old is waited for, so that a refusal is never said later than that.
:meth:`Refusals.check` with ``wait=True`` (the runner's ``check_steps()``) waits for all.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from autotune.device import Backend, host_memory, mark_host
from autotune.errors import NonFiniteError

__all__ = ["GRADIENTS", "LOSS", "Refusals"]

GRADIENTS = "its gradients are not finite (NaN or inf)"
"""Why a step was refused: a gradient of the optimizer's parameters is not finite."""
LOSS = "its loss is not finite, so fp16's GradScaler skipped the update"
"""Why a step was refused: its loss is not finite (fp16)."""
_LAG = 2
"""Steps after which a flag not yet arrived is waited for."""


@dataclass
class _Flag:
    step: int
    why: str
    host: torch.Tensor
    """The flag in host memory (pinned on a GPU), nonzero where the step was refused."""
    arrived: Any
    """The device's event after the copy (``None``: copied already)."""

    def ready(self, wait: bool) -> bool:
        if self.arrived is None:
            return True
        if wait:
            self.arrived.synchronize()
            return True
        return bool(self.arrived.query())

    def refused(self) -> bool:
        # Host memory read by Python: no op on the device, nothing to wait for.
        return bool(self.host.tolist())


class Refusals:
    """The flags of the steps taken, read on the host as they arrive.

    Args:
        backend: The device's backend (its streams carry the copies, where it has them).
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.steps = 0
        """Optimizer steps ended so far."""
        self._current: list[tuple[torch.Tensor, str]] = []
        self._pending: list[_Flag] = []

    def flag(self, refused: torch.Tensor, why: str) -> None:
        """Add a flag of the step being taken: nonzero where it is refused for ``why``.
        A traced step's flag (a fake tensor: no values) is left out."""
        if not isinstance(refused, FakeTensor):
            self._current.append((refused, why))

    def end_step(self) -> None:
        """The step's flags are queued: send them to the host, and say what has arrived.

        Raises:
            NonFiniteError: a step (this one on the CPU, an earlier one on a GPU) was
                refused; the steps after it were applied.
        """
        step = self.steps = self.steps + 1
        for flag, why in self._current:
            self._pending.append(self._sent(step, flag, why))
        self._current = []
        self.check()

    def check(self, *, wait: bool = False) -> None:
        """Read the flags that have arrived (``wait``: every flag, waiting for the device).

        Raises:
            NonFiniteError: the first refused step among them.
        """
        refused = [f for f in self._arrived(wait) if f.refused()]
        if refused:
            raise _error(refused[0], self.steps)

    def drop(self) -> None:
        """Forget the flags of the step being taken: it raised before it ended."""
        self._current = []

    def _arrived(self, wait: bool) -> Iterator[_Flag]:
        """The pending flags that have arrived (or are old enough to wait for), removed."""
        waiting = []
        for f in self._pending:
            if f.ready(wait or self.steps - f.step >= _LAG):
                yield f
            else:
                waiting.append(f)
        self._pending = waiting

    def _sent(self, step: int, flag: torch.Tensor, why: str) -> _Flag:
        """``flag`` copied to host memory behind the step's work, with its arrival."""
        streams = self.backend.streams
        with host_memory():
            host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=self.backend.pins)
        mark_host((host,))
        host.copy_(flag, non_blocking=streams)
        arrived = self.backend.current_stream().record_event() if streams else None
        return _Flag(step, why, host, arrived)


def _error(flag: _Flag, steps: int) -> NonFiniteError:
    since = steps - flag.step
    after = (
        ""
        if since == 0
        else f" The {since} step{'s' if since > 1 else ''} after it "
        f"{'were' if since > 1 else 'was'} applied (this error is said once the device's "
        "verdict has reached the host, without waiting for it)."
    )
    return NonFiniteError(
        f"step {flag.step} was not applied: {flag.why}, so the weights keep their last "
        f"finite values.{after} Check that batch's loss and inputs, or lower the learning "
        "rate; catch autotune.NonFiniteError to go on with the next batch."
    )
