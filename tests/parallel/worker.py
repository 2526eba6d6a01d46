"""One rank of a data-parallel test: ``python worker.py JOB`` under the environment that
``ranks.start`` sets. Prints ``RESULT <json>``.

For each case of the job: the per-rank peak that :func:`autotune.estimate` predicts from
a single-process profile, the peak the rank measures training the config as prepared
(with the budget-guard tracker, as verification measures it), its losses, and the losses
of one process training the same global batches without data parallelism.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import autotune
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import state_tensors
from autotune.models import gpt_batch, tiny_gpt


def mlp() -> nn.Module:
    torch.manual_seed(0)
    blocks = nn.Sequential(
        *(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4))
    )
    return nn.Sequential(nn.Linear(32, 64), blocks, nn.Linear(64, 10))


def mlp_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


def model_and_data(name: str, n: int) -> tuple[nn.Module, Any, Any]:
    """The model, its loss (None: its own) and ``n`` samples."""
    if name.startswith("mlp"):
        g = torch.Generator().manual_seed(1)
        model = mlp()
        if name == "mlp-frozen":  # frozen parameters: no gradients, no optimizer state
            model[0].requires_grad_(False)
            model[1][0].requires_grad_(False)
        data = (torch.randn(n, 32, generator=g), torch.randint(10, (n,), generator=g))
        return model, mlp_loss, data
    layers = 6 if name == "gpt6" else 3
    model = tiny_gpt(n_layer=layers, n_embd=64, n_head=2, block_size=32, vocab_size=128)
    x, y = gpt_batch(model.config, n, seed=1)
    if name == "gpt-padded":  # rows of 2 to 32 tokens, long-tailed: the pads' labels -100
        g = torch.Generator().manual_seed(2)
        lengths = torch.exp(2.5 + 0.8 * torch.randn(n, generator=g)).long().clamp(2, 32)
        y = y.masked_fill(torch.arange(32) >= lengths[:, None], -100)
    return model, None, (x, y)


def rows(batch: Any, start: int, stop: int) -> Any:
    return tuple(t[start:stop] for t in batch)


def config_of(spec: dict[str, Any], world: int) -> autotune.TrainConfig:
    return autotune.TrainConfig(
        micro_batch_size=spec["micro"],
        grad_accum_steps=spec["accum"],
        precision=spec.get("precision", "fp32"),
        checkpoint=tuple(spec.get("checkpoint", ())),
        selective_checkpoint=tuple(spec.get("selective", ())),
        parallel=spec["parallel"],
        world_size=world,
        keep_gathered=tuple(spec.get("keep", ())),
        offload_optimizer=spec.get("offload", False),
    )


def traced_peak(spec: dict[str, Any], rank: int, world: int) -> int:
    """Rank ``rank``'s peak of ``spec`` over ``world`` ranks, traced in this process
    (fake tensors, a fake process group): what :func:`case` measures on a real rank."""
    from autotune.measure import traced_rank_peak

    local = spec["micro"] * spec["accum"]
    loss_fn = model_and_data(spec["model"], 1)[1]
    return traced_rank_peak(
        lambda: model_and_data(spec["model"], 1)[0],
        lambda: model_and_data(spec["model"], local)[2],
        config_of(spec, world),
        loss_fn=loss_fn,
        rank=rank,
    )


def case(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    local = spec["micro"] * spec["accum"]
    config = config_of(spec, world)
    model, loss_fn, data = model_and_data(spec["model"], local * world * 3)
    predicted, _ = autotune.estimate(model, rows(data, 0, 4), config, device="cpu", loss_fn=loss_fn)
    reference = copy.deepcopy(model)
    mean = spec.get("loss_mean")  # "tokens": each rank's micro-batches weigh their tokens
    runner = autotune.prepare(model, config, lr=1e-3, loss_fn=loss_fn, device="cpu", loss_mean=mean)
    losses, peaks = [], []
    for step in range(3):
        mine = rows(data, (step * world + rank) * local, (step * world + rank + 1) * local)
        with measure_peak(
            torch.device("cpu"),
            existing=state_tensors(runner.model, runner.optimizer),
            gathering=[runner.model],
        ) as reading:
            loss = runner.step(mine)
        if step:  # the first step makes the optimizer state, as in one process
            peaks.append(reading.peak_bytes)
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    single = config.replace(
        parallel="none",
        world_size=1,
        keep_gathered=(),
        grad_accum_steps=config.grad_accum_steps * world,
    )
    ref = autotune.prepare(
        reference, single, lr=1e-3, loss_fn=loss_fn, device="cpu", loss_mean=mean
    )
    expected = [
        float(ref.step(rows(data, step * world * local, (step + 1) * world * local)))
        for step in range(3)
    ]
    return {"predicted": predicted, "measured": peaks, "losses": losses, "reference": expected}


def readings(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Three readings of the same three steps of ``spec`` on this rank, the first step
    included: the peak predicted from one process, ``autotune.peak_memory`` around the
    runner, and an independent count of every storage any op receives or returns."""
    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/
    from storage_count import StorageCount

    local = spec["micro"] * spec["accum"]
    config = config_of(spec, world)
    model, loss_fn, data = model_and_data(spec["model"], local * world * 3)
    predicted, _ = autotune.estimate(model, rows(data, 0, 4), config, device="cpu", loss_fn=loss_fn)
    runner = autotune.prepare(model, config, lr=1e-3, loss_fn=loss_fn, device="cpu")
    mine = [
        tuple(
            t.clone()
            for t in rows(data, (s * world + rank) * local, (s * world + rank + 1) * local)
        )
        for s in range(3)
    ]
    held = [t for batch in mine for t in batch]
    alive = [*state_tensors(runner.model, runner.optimizer), *held]
    with StorageCount(alive) as count, autotune.peak_memory(runner) as reading:
        for batch in mine:
            runner.step(batch)
    return {
        "predicted": predicted,
        "peak_memory": reading.peak_bytes,
        "count": count.peak,
        "batches": sum(t.nbytes for t in held),
    }


def tune(job: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """``autotune.autotune`` on every rank, then a step of the result as prepared."""
    if rank == job.get("die_rank"):  # killed for real in the middle of verification
        from autotune.verify import _verifier

        def die(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        _verifier.Verifier.trial = die  # type: ignore[method-assign]
    if rank == job.get("busy_rank"):  # as if other work shared this rank's cores alone
        from autotune.verify import _verification

        _verification.busy = lambda others: True  # type: ignore[assignment]
    deepened = []
    if job.get("shallow"):  # as if the whole model did not fit the device: copies of 3 and 4
        from autotune.measure import _depth
        from autotune.tuning import _profiling

        _depth._WHOLE_SHARE = 0.0
        deepen = _profiling.deepen
        _profiling.deepen = lambda *a: deepened.append(1) or deepen(*a)  # type: ignore[assignment]
    model, loss_fn, data = model_and_data(job["model"], 8)
    result = autotune.autotune(
        model,
        data,
        job["budget_gb"],
        loss_fn=loss_fn,
        global_batch_size=job["global_batch"],
        device="cpu",
        # What the ranks check is their agreement and per-rank peaks, not the precisions:
        # fp32 alone (bf16 under FSDP2 is tests/parallel/test_per_rank.py's).
        space=autotune.SearchSpace(precisions=("fp32",), selective_checkpointing=False),
    )
    runner = autotune.prepare(model, result, loss_fn=loss_fn, device="cpu")
    local = result.config.effective_batch_size
    loss = runner.step(rows(data, 0, local) if local <= 8 else data)
    return {"result": result.to_dict(), "loss": float(loss), "deepened": bool(deepened)}


def fallback(rank: int, world: int) -> dict[str, Any]:
    """A step that runs out of memory (the budget guard) falls back on every rank."""
    from autotune.result import Measurement, ModelInfo, TargetInfo, TuneResult

    blocks = ("blocks.0", "blocks.1", "blocks.2")
    fast = autotune.TrainConfig(micro_batch_size=8, parallel="fsdp", world_size=world)
    frugal = fast.replace(micro_batch_size=2, grad_accum_steps=4, checkpoint=blocks)
    model, _, data = model_and_data("gpt", 8 * world)
    sample = rows(data, 0, 4)
    peaks = [autotune.estimate(model, sample, c, device="cpu")[0] for c in (fast, frugal)]
    budget = (peaks[0] + peaks[1]) // 2
    m = Measurement(peaks[0], 1.0, 1.0)
    result = TuneResult(
        config=fast,
        predicted=m,
        measured=m,
        budget_bytes=budget,
        target=TargetInfo("cpu", "CPU", 2**34, torch.__version__),
        model=ModelInfo(type(model).__qualname__, "", 0, blocks),
        breakdown=autotune.estimate(model, sample, fast, device="cpu")[1],
        fallbacks=(frugal,),
    )
    reference = copy.deepcopy(model)
    mine = rows(data, rank * 8, rank * 8 + 8)
    runner = autotune.prepare(model, result, lr=1e-3, device="cpu")
    runner.step(mine)  # optimizer state made outside the guard, as verification does
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with measure_peak(
            torch.device("cpu"),
            existing=state_tensors(runner.model, runner.optimizer),
            gathering=[runner.model],
            budget_bytes=budget,
        ):
            loss = runner.step(mine)
    with measure_peak(
        torch.device("cpu"),
        existing=state_tensors(runner.model, runner.optimizer),
        gathering=[runner.model],
        budget_bytes=budget,
    ) as after:
        runner.step(mine)  # the fallback from now on, within the budget
    ref = autotune.prepare(reference, frugal, lr=1e-3, device="cpu")
    ref.step(mine)
    expected = ref.step(mine)
    return {
        "config": runner.config.describe(),
        "warned": [str(w.message) for w in caught],
        "peak_after": after.peak_bytes,
        "budget": budget,
        "loss": float(loss),
        "expected": float(expected),
    }


def nonfinite(job: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """A NaN on one rank only: in its batch (DDP's all-reduce spreads it), or in its
    gradient shard (FSDP: no collective does). Every rank refuses the step, or none."""
    config = autotune.TrainConfig(micro_batch_size=4, parallel=job["parallel"], world_size=world)
    model, loss_fn, data = model_and_data("mlp", 4 * world)
    mine = rows(data, rank * 4, rank * 4 + 4)
    handle = autotune.apply(model, config, lr=1e-3, device="cpu")
    params = [p for p in handle.model.parameters() if p.requires_grad]
    last = rank == world - 1

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def backward(batch: Any) -> None:
        for chunk, weight in handle.micro_batches(batch):
            with handle.autocast():
                out = handle.parallel.module(chunk[0])  # DDP's wrapper under DDP
                handle.backward(loss_fn(out, chunk) * weight)

    backward(mine)
    handle.optimizer_step()  # a finite step first: the optimizer state exists
    before = [local(p).detach().clone() for p in params]
    if job["parallel"] == "ddp":
        x = mine[0].clone()
        x[0, 0] = float("nan") if last else x[0, 0]
        backward((x, mine[1]))
    else:
        backward(mine)
        if last:
            local(params[0].grad).view(-1)[0] = float("nan")
    raised = False
    try:
        handle.optimizer_step()
    except autotune.NonFiniteError:
        raised = True
    unchanged = all(torch.equal(local(p).detach(), b) for p, b in zip(params, before, strict=True))
    backward(mine)
    handle.optimizer_step()  # the next batch trains on every rank
    moved = not all(torch.equal(local(p).detach(), b) for p, b in zip(params, before, strict=True))
    handle.undo()
    return {"raised": raised, "unchanged": unchanged, "next_step_trained": moved}


def main() -> None:
    job = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if "cases" in job:
            out: Any = [case(spec, rank, world) for spec in job["cases"]]
        elif "readings" in job:
            out = readings(job["readings"], rank, world)
        elif job.get("fallback"):
            out = fallback(rank, world)
        elif "nonfinite" in job:
            out = nonfinite(job["nonfinite"], rank, world)
        else:
            out = tune(job, rank, world)
        dist.barrier()  # every rank done with its collectives before the group goes
    finally:
        dist.destroy_process_group()
    if job.get("trace") and rank in (0, world - 1):  # the first and the last (short) shards
        for spec, row in zip(job["cases"], out, strict=True):
            # this rank again, traced alone on a fake process group of `world` ranks
            row["traced"] = traced_peak(spec, rank, world) if spec["parallel"] == "fsdp" else None
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
