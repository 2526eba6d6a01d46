"""``autotune tune`` under ``torchrun``: join the process group it describes, and leave it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["join_torchrun", "leave_group"]


def join_torchrun(device: str | None) -> tuple[bool, bool]:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1 in the environment):
    NCCL on CUDA, gloo on the CPU. (Whether this process is the first rank, whether it
    joined one here.)"""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True, False
    import torch
    import torch.distributed as dist

    joined = not dist.is_initialized()
    if joined:
        cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank() == 0, joined


@contextlib.contextmanager
def leave_group(joined: bool) -> Iterator[None]:
    """Leave the process group joined for the command when it ends (its threads would
    abort the process at exit otherwise)."""
    try:
        yield
    finally:
        if joined:
            import torch.distributed as dist

            with contextlib.suppress(RuntimeError):  # a rank that failed: nothing to wait for
                dist.barrier()  # every rank done with its collectives before the group goes
            dist.destroy_process_group()
