"""One rank of an FSDP2 run traced at any world size, in this process.

The per-rank plans of DDP and FSDP2 are predicted from one process's profile (the
cost model counts the shards, the gathered units and the gradient buckets). This traces
the thing itself: the model built on fake tensors (:func:`~autotune.measure._fake.traced`),
wrapped by :func:`autotune.prepare` with FSDP2's ``fully_shard`` exactly as a rank of
``world`` ranks wraps it, and stepped under the live-bytes tracker, in a process
group of torch's ``fake`` backend: this process is one rank of ``world``, and every
collective returns at once with its buffers allocated as a real one allocates them, but
nothing sent. The peak is the rank's live bytes, byte for byte those a real rank holds
(checked in the tests against real ranks on gloo), for 8 ranks or 1024. DDP is not
traced: its C++ reducer reads its gradient buckets' data.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from autotune.config import TrainConfig
from autotune.errors import DistributedError, ProfileError
from autotune.measure._fake import is_traced, traced
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import state_tensors
from autotune.train import LossFn, map_tensors, prepare, resize

__all__ = ["fake_ranks", "traced_rank_peak"]


@contextlib.contextmanager
def fake_ranks(world: int, rank: int = 0) -> Iterator[None]:
    """This process as rank ``rank`` of a process group of ``world`` ranks that
    communicates nothing (torch's ``fake`` backend), the default group while inside.

    Raises:
        DistributedError: a process group already exists here (this one cannot replace it).
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed: ranks cannot be traced.")
    if dist.is_initialized():
        raise DistributedError(
            "a process group is already initialised in this process: trace a rank in a "
            "process of its own (before init_process_group, or after destroy_process_group)."
        )
    # Registers the "fake" backend with torch.distributed (torch ships it for this use).
    importlib.import_module("torch.testing._internal.distributed.fake_pg")
    from torch.distributed import HashStore  # type: ignore[attr-defined]

    dist.init_process_group("fake", rank=rank, world_size=world, store=HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def traced_rank_peak(
    build: Callable[[], nn.Module],
    sample_batch: Any,
    config: TrainConfig,
    *,
    loss_fn: LossFn | None = None,
    rank: int = 0,
    steps: int = 2,
) -> int:
    """The live-bytes peak of rank ``rank`` training ``config`` (FSDP2 over
    ``config.world_size`` ranks) on its share of the global batch, traced.

    The first step makes the optimizer state, as in any run; the peak is the largest of
    the later ones (the steady state a rank holds).

    Args:
        build: A zero-argument callable that builds the model (called under tracing).
        sample_batch: A batch, or a zero-argument callable that makes one (called under
            tracing): the rank's local batch is ``config.effective_batch_size`` rows of it.
        config: An FSDP2 config (``parallel: fsdp``).
        loss_fn: ``loss_fn(output, batch) -> scalar`` (``None``: the model's own loss).
        rank: Which rank (the last one's shards may be shorter).
        steps: Steps run, the first not counted.

    Raises:
        ProfileError: a config that is not FSDP2's, or ``steps`` below 2.
        DistributedError: a process group already exists in this process.
    """
    if config.parallel != "fsdp" or steps < 2:
        raise ProfileError(
            "a traced rank needs an FSDP2 config (parallel: fsdp; DDP's reducer reads its "
            f"buckets' data, which a fake tensor has not) and 2 steps or more; got parallel "
            f"{config.parallel!r}, {steps} steps."
        )
    cpu = torch.device("cpu")
    with fake_ranks(config.world_size, rank), traced() as mode:
        model = build()
        made = sample_batch() if callable(sample_batch) else sample_batch
        faked = map_tensors(made, lambda t: t if is_traced(t) else mode.from_tensor(t))
        batch = resize(faked, config.effective_batch_size)
        runner = prepare(model, config, loss_fn=loss_fn, device=cpu)
        peak = 0
        for step in range(steps):
            with measure_peak(
                cpu,
                existing=state_tensors(runner.model, runner.optimizer),
                gathering=[runner.model],
            ) as reading:
                runner.step(batch)
            peak = max(peak, reading.peak_bytes) if step else 0
        runner.close()
        return peak
