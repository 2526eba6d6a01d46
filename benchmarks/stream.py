"""A real job's stream through each path (issue 56): the tuned config trained on thousands
of padded rows of long-tailed lengths, as a user's trainer feeds them, against a plain
PyTorch loop trained without autotune on the same batches.

    python benchmarks/stream.py --out benchmarks/results/stream-cpu.json   # ~10 min, 2 cores

The job: a 2-layer Llama of 128 positions; 1,000 rows of log-normal lengths (median 40
tokens, clipped to 16..128, seeded), padded per batch to its longest row by a collator
that masks the pads' labels (-100), 16 rows a step, in order, so that an epoch ends on a
short batch of 8; an evaluation of 32 held-out rows every 50 steps. Tuned once on the
longest batch the stream can hold (16 rows of 128 tokens) at a budget where it needs
accumulation, fp32 and AdamW (the reference's math). Then each path trains 300 steps:
the runner (``prepare().step``), the runner with the model compiled whole (the compile
level forced on: the CPU's search leaves it off), ``apply()`` in a loop of one's own,
Hugging Face's ``Trainer`` with ``AutotuneCallback``, TRL's ``SFTTrainer`` with it (its
own collator; tuned on its own step, whose fused output layer holds workspaces of its
own, at a budget as far below that step's one-batch peak as the others'), and
Lightning's ``Autotune`` (which tunes itself, through ``training_step``). Per path: the peak of the whole run
under the CPU's live-bytes tracker against the budget and the prediction at the longest
length (for the trainers, which evaluate at their last step too, also without
evaluations); the graphs compiled and whether dynamo reached its recompile limit; samples/s
against the tuned config's at the same lengths (fixed batches padded to five quantiles
of the stream's widths, each step's seconds interpolated at its width; measured three
times after the path: the median, and the range the machine's noise spans); the
largest relative gap of the step losses (and evaluation losses) to the reference's.

Targets: every peak within the budget, graphs at most 2 (two kinds of shape: the first,
and every other), no recompile limit reached, samples/s at least 0.9x, losses within 1%
of the reference at every step.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see run.py

import argparse
import dataclasses
import itertools
import json
import logging
import math
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torchvision_ops import declare_torchvision_ops  # noqa: E402

import autotune  # noqa: E402
from autotune.errors import AutotuneWarning  # noqa: E402

declare_torchvision_ops()  # transformers' vision imports, on a torchvision without its ops
import transformers  # noqa: E402

CONTEXT, VOCAB, ROWS, GLOBAL, EVAL_EVERY, LR = 128, 256, 1000, 16, 50, 1e-3


def corpus(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of log-normal lengths (median 40, clipped to 16..CONTEXT)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(math.log(40) + 0.6 * torch.randn(n, generator=g))
    lengths = lengths.round().clamp(16, CONTEXT).long()
    return [{"input_ids": torch.randint(1, VOCAB, (int(n),), generator=g)} for n in lengths]


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rows padded to the longest (right), the pads masked and their labels -100."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
    )  # fmt: skip
    config.use_cache = False
    return transformers.LlamaForCausalLM(config)


def batches(data: list[dict[str, torch.Tensor]], steps: int) -> list[dict[str, torch.Tensor]]:
    """The stream: the rows in order, 16 a step, epoch after epoch (each epoch's last
    batch short)."""
    out: list[dict[str, torch.Tensor]] = []
    while len(out) < steps:
        out += [collate(data[i : i + GLOBAL]) for i in range(0, len(data), GLOBAL)]
    return out[:steps]


def counted(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


WARM = 5
"""Steps left out of the speed: the first ones warm the caches and thread pools."""


@dataclasses.dataclass
class Run:
    losses: list[float] = dataclasses.field(default_factory=list)
    evals: list[float] = dataclasses.field(default_factory=list)
    durations: list[float] = dataclasses.field(default_factory=list)
    """Each optimizer step's seconds, evaluation left out."""

    def speed(self, stream: list[Any]) -> float:
        """Samples a second over the steps after the first :data:`WARM`."""
        rows = sum(len(b["input_ids"]) for b in stream[WARM : len(self.durations)])
        return rows / sum(self.durations[WARM:])


def evaluated(model: nn.Module, held: dict[str, torch.Tensor], run: Run) -> None:
    was = model.training
    model.eval()
    with torch.no_grad():
        run.evals.append(float(model(**held).loss))
    model.train(was)


def reference(stream: list[Any], held: Any) -> Run:
    """The plain loop: one batch a step, the model's own loss, torch's AdamW."""
    model, run = llama(), Run()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step, batch in enumerate(stream, 1):
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(float(loss))
        run.durations.append(time.perf_counter() - start)
        if step % EVAL_EVERY == 0:
            evaluated(model, held, run)
    return run


def runner_path(result: Any, stream: list[Any], held: Any) -> tuple[Run, Any]:
    model, run = llama(), Run()
    runner = autotune.prepare(model, result, lr=LR)
    for step, batch in enumerate(stream, 1):
        start = time.perf_counter()
        run.losses.append(float(runner.step(batch)))
        run.durations.append(time.perf_counter() - start)
        if step % EVAL_EVERY == 0:
            evaluated(model, held, run)
    return run, runner


def apply_path(result: Any, stream: list[Any], held: Any) -> tuple[Run, Any]:
    model, run = llama(), Run()
    handle = autotune.apply(model, result, lr=LR)
    model.train()
    for step, batch in enumerate(stream, 1):
        start = time.perf_counter()
        total = 0.0
        for chunk, weight in handle.micro_batches(batch):
            with handle.autocast():
                loss = model(**chunk).loss * weight
            handle.backward(loss)
            total += float(loss)
        handle.optimizer_step()
        run.losses.append(total)
        run.durations.append(time.perf_counter() - start)
        if step % EVAL_EVERY == 0:
            evaluated(model, held, run)
    return run, handle


class _InOrder(transformers.Trainer):
    """The Trainer with the batches in order, as the reference takes them."""

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.data.SequentialSampler(self.train_dataset)


class _Losses(transformers.TrainerCallback):
    def __init__(self, run: Run) -> None:
        self.run = run
        self.start = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.run.durations.append(time.perf_counter() - self.start)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.run.losses.append(float(logs["loss"]))
        if logs and "eval_loss" in logs:
            self.run.evals.append(float(logs["eval_loss"]))


def trainer_arguments(
    result: Any, out: str, steps: int, held_rows: list[Any], evaluating: bool, **more: Any
) -> Any:
    """The exported arguments both trainers run with (``more``: a trainer's own)."""
    from autotune.integrations.transformers import training_arguments

    return training_arguments(
        result, out, learning_rate=LR, lr_scheduler_type="constant", max_steps=steps,
        max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no",
        disable_tqdm=True, eval_strategy="steps" if evaluating else "no",
        eval_steps=EVAL_EVERY, per_device_eval_batch_size=len(held_rows),
        dataloader_drop_last=False, **more,
    )  # fmt: skip


def trained(trainer: Any, model: nn.Module, tracked: bool) -> int | None:
    """Train; the peak under the tracker where ``tracked``."""
    if not tracked:
        trainer.train()
        return None
    with autotune.peak_memory(model) as reading:
        trainer.train()
    return reading.peak_bytes


def hf_path(
    result: Any,
    data: list[Any],
    held_rows: list[Any],
    steps: int,
    out: str,
    tracked: bool,
    evaluating: bool = True,
) -> tuple[Run, int | None]:
    from autotune.integrations.transformers import AutotuneCallback

    model, run = llama(), Run()
    args = trainer_arguments(result, out, steps, held_rows, evaluating)
    trainer = _InOrder(
        model=model, args=args, train_dataset=data, eval_dataset=held_rows,
        data_collator=collate, callbacks=[AutotuneCallback(result), _Losses(run)],
    )  # fmt: skip
    return run, trained(trainer, model, tracked)


def sft_trainer(model: nn.Module, args: Any, data: list[Any], held_rows: list[Any]) -> Any:
    """TRL's ``SFTTrainer`` on the rows already tokenized, in order, padded by its own
    collator (labels -100 at the pads); it computes the loss through its own fused output
    layer (``fused_lm_head``), patched into ``model``."""
    import datasets
    import tokenizers
    import trl

    class InOrder(trl.SFTTrainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    words = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="t0", eos_token="t1"
    )
    rows = {"input_ids": [r["input_ids"].tolist() for r in data]}
    held = {"input_ids": [r["input_ids"].tolist() for r in held_rows]}
    return InOrder(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict(rows),
        eval_dataset=datasets.Dataset.from_dict(held), processing_class=tokenizer,
    )  # fmt: skip


def trl_tuned(longest: Any, shortfall: float, data: list[Any], held_rows: list[Any]) -> Any:
    """The config tuned for TRL's step, as its users tune (the trainer's own batch, with
    ``fused_lm_head``: TRL's output layer holds workspaces of its own), on the longest
    batch, at a budget as far below its one-batch peak as the other paths'."""
    import trl

    model = llama()
    sft_trainer(model, trl.SFTConfig(tempfile.mkdtemp(), use_cpu=True), data, held_rows)
    sample = {**longest, "fused_lm_head": True}
    plain = autotune.TrainConfig(micro_batch_size=GLOBAL, optimizer="adamw")
    peak, _ = autotune.estimate(model, sample, plain, device="cpu")
    space = autotune.SearchSpace(precisions=("fp32",), optimizers=("adamw",))
    budget_gb = (peak - shortfall) / 2**30
    return autotune.autotune(
        model, sample, budget_gb, global_batch_size=GLOBAL, device="cpu", space=space
    )


def trl_path(
    result: Any,
    data: list[Any],
    held_rows: list[Any],
    steps: int,
    out: str,
    tracked: bool,
    evaluating: bool = True,
) -> tuple[Run, int | None]:
    """``SFTTrainer`` with ``AutotuneCallback`` and the exported ``SFTConfig``."""
    import trl

    from autotune.integrations.transformers import AutotuneCallback

    model, run = llama(), Run()
    args = trainer_arguments(
        result, out, steps, held_rows, evaluating, args_class=trl.SFTConfig,
        max_length=CONTEXT, packing=False,
    )  # fmt: skip
    trainer = sft_trainer(model, args, data, held_rows)
    trainer.add_callback(AutotuneCallback(result))
    trainer.add_callback(_Losses(run))
    return run, trained(trainer, model, tracked)


TRAINERS = {"hf": hf_path, "trl": trl_path}
"""The paths through a Hugging Face trainer, by name."""


def lightning_path(
    given: Any, budget_gb: float, data: list[Any], held: Any, steps: int, longest: Any = None
) -> tuple[Run, Any, int | None]:
    """Tuned by the callback (``given`` None), or trained with ``given`` under the
    tracker: the run, the result, the peak where tracked."""
    import lightning.pytorch as pl

    from autotune.integrations.lightning import Autotune

    run = Run()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.batch_size = llama(), 1
            self.micro: list[tuple[float, int]] = []
            self.start: float | None = None

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if self.start is None:
                self.start = time.perf_counter()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.micro.append((float(loss), counted(batch)))
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.trainer.fit_loop.epoch_loop._accumulated_batches_reached() or (
                self.trainer.fit_loop.epoch_loop._num_ready_batches_reached()
            ):
                assert self.start is not None
                run.durations.append(time.perf_counter() - self.start)
                self.start = None
                tokens = sum(n for _, n in self.micro)
                run.losses.append(sum(loss * n for loss, n in self.micro) / tokens)
                self.micro = []
                if len(run.losses) % EVAL_EVERY == 0:
                    evaluated(self.model, held, run)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size, collate_fn=collate)

    space = autotune.SearchSpace(precisions=("fp32",))
    callback = (
        Autotune(budget_gb, GLOBAL, space=space, sample_batch=longest)
        if given is None
        else Autotune.from_result(given)
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, callbacks=[callback], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = Module()
    if given is None:
        trainer.fit(module)
        return run, callback.result, None
    with autotune.peak_memory(module) as reading:
        trainer.fit(module)
    return run, callback.result, reading.peak_bytes


def gap(run: Run, ref: Run) -> tuple[float, float]:
    """The largest relative gaps of the step and evaluation losses to the reference's."""
    steps = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))
    evals = max(
        (abs(a - b) / abs(b) for a, b in zip(run.evals, ref.evals, strict=False)), default=0
    )
    return steps, evals


def fixed_speed(result: Any, stream: list[Any], path: str) -> float:
    """The tuned config's samples/s at the stream's lengths, from fixed batches: the
    seconds of a step of 16 rows padded to each quantile of the stream's widths (through
    the runner, one runner for all, as the job meets them), interpolated at every step's
    width, each step's rows counted (the model of ``path``: TRL's with its fused output
    layer; Lightning's blocks named inside its module)."""
    widths = [b["input_ids"].shape[1] for b in stream[WARM:]]
    at = sorted({int(statistics.quantiles(widths, n=4, method="inclusive")[i]) for i in range(3)})
    at = sorted({min(widths), *at, max(widths)})
    config, model = result.config, llama()
    if path == "lightning":
        blocks = tuple(b.removeprefix("model.") for b in config.checkpoint)
        config = config.replace(checkpoint=blocks)
    extra: dict[str, Any] = {}
    if path == "trl":
        import trl

        rows_given = corpus(4, seed=9)
        sft_trainer(model, trl.SFTConfig(tempfile.mkdtemp(), use_cpu=True), rows_given, rows_given)
        extra["fused_lm_head"] = True
    runner = autotune.prepare(model, config, lr=LR)
    seconds = []
    for width in at:
        rows = corpus(GLOBAL, seed=7)
        batch = collate([{"input_ids": r["input_ids"][:width]} for r in rows])
        batch = {k: nn.functional.pad(v, (0, width - v.shape[1])) for k, v in batch.items()}
        batch.update(extra)
        for _ in range(2):
            runner.step(batch)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            runner.step(batch)
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
    runner.close()
    total = sum(
        len(b["input_ids"]) / GLOBAL * _interpolated(at, seconds, b["input_ids"].shape[1])
        for b in stream[WARM:]
    )
    return sum(len(b["input_ids"]) for b in stream[WARM:]) / total


def _interpolated(xs: list[int], ys: list[float], x: int) -> float:
    """``ys`` at ``x``, linearly between the nearest of ``xs`` (sorted)."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    for (x0, y0), (x1, y1) in itertools.pairwise(zip(xs, ys, strict=True)):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--paths",
        nargs="*",
        default=["runner", "compiled", "apply", "hf", "trl", "lightning"],
    )
    parser.add_argument(
        "--lightning-sample",
        choices=["longest", "scanned"],
        default="longest",
        help="Lightning's sample: the longest batch given, or the widest it scans",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.simplefilter("ignore")
    data, held_rows = corpus(ROWS, seed=0), corpus(32, seed=1)
    held = collate(held_rows)
    stream = batches(data, args.steps)
    widths = [b["input_ids"].shape[1] for b in stream]
    mean_width = round(statistics.mean(widths))
    longest = collate(corpus(GLOBAL, seed=2))
    longest = {
        k: nn.functional.pad(v, (0, CONTEXT - v.shape[1]), value=-100 if k == "labels" else 0)
        for k, v in longest.items()
    }
    plain = autotune.TrainConfig(micro_batch_size=GLOBAL, optimizer="adamw")
    peak, _ = autotune.estimate(llama(), longest, plain, device="cpu")
    budget_gb = 0.6 * peak / 2**30  # binds: the whole batch at once does not fit
    space = autotune.SearchSpace(precisions=("fp32",), optimizers=("adamw",))
    started = time.perf_counter()
    result = autotune.autotune(
        llama(), longest, budget_gb, global_batch_size=GLOBAL, device="cpu", space=space
    )
    tuning_s = time.perf_counter() - started
    print(
        f"tuned in {tuning_s:.0f} s: {result.config.describe()}, predicted peak "
        f"{result.predicted.peak_bytes / 2**20:.2f} MiB at {CONTEXT} tokens, budget {budget_gb * 2**30 / 2**20:.2f} MiB"
    )
    shortfall = peak - budget_gb * 2**30
    trl_result = trl_tuned(longest, shortfall, data, held_rows) if "trl" in args.paths else None
    ref = reference(stream, held)
    rows: dict[str, Any] = {}
    tracked_steps = stream[:60]
    for path in args.paths:
        graphs = counters["stats"]["unique_graphs"]
        training_peak = None  # the training steps' peak, where evaluations are in the peak
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AutotuneWarning)
            tuned = result
            if path == "trl":
                tuned = trl_result
            if path == "compiled":
                config = result.config.replace(compile_model=True)
                tuned = dataclasses.replace(result, config=config, fallbacks=())
            if path in ("runner", "compiled"):
                run, handle = runner_path(tuned, stream, held)
            elif path == "apply":
                run, handle = apply_path(tuned, stream, held)
            elif path in TRAINERS:
                out = tempfile.mkdtemp(prefix=f"stream-{path}-")
                run, _ = TRAINERS[path](tuned, data, held_rows, args.steps, out, False)
            else:
                sample = longest if args.lightning_sample == "longest" else None
                run, tuned, _ = lightning_path(None, budget_gb, data, held, args.steps, sample)
        said = [str(w.message) for w in caught if issubclass(w.category, AutotuneWarning)]
        compiled = counters["stats"]["unique_graphs"] - graphs
        # The peak, under the tracker: the stream's first 60 steps again.
        if path in ("runner", "compiled", "apply"):
            handle.close() if hasattr(handle, "close") else handle.undo()
            rerun = runner_path if path != "apply" else apply_path
            with autotune.peak_memory() as reading:
                _, again = rerun(tuned, tracked_steps, held)
            peak = reading.peak_bytes
            again.close() if hasattr(again, "close") else again.undo()
        elif path in TRAINERS:
            trainer_path = TRAINERS[path]
            out = tempfile.mkdtemp(prefix=f"stream-{path}-")
            _, peak = trainer_path(tuned, data, held_rows, len(tracked_steps), out, True)
            # The training steps alone (the Trainer evaluates at its last step too).
            _, training_peak = trainer_path(
                tuned, data, held_rows, len(tracked_steps), out, True, evaluating=False
            )
        else:
            _, _, peak = lightning_path(tuned, budget_gb, data, held, len(tracked_steps))
        steps_gap, evals_gap = gap(run, ref)
        # The tuned config at the stream's lengths, three times: the machine's spread.
        speed = run.speed(stream)
        fixed = sorted(fixed_speed(tuned, stream, path) for _ in range(3))
        rows[path] = {
            "config": tuned.config.describe(),
            "peak_mib": None if peak is None else peak / 2**20,
            "training_peak_mib": None if training_peak is None else training_peak / 2**20,
            "budget_mib": tuned.budget_bytes / 2**20,
            "predicted_mib": tuned.predicted.peak_bytes / 2**20,
            "graphs_compiled": compiled,
            "recompile_limit_said": any("recompile limit" in s for s in said),
            "samples_per_s": speed,
            "fixed_samples_per_s": fixed,
            "speed_ratio": speed / fixed[1],
            "speed_ratio_range": [speed / fixed[2], speed / fixed[0]],
            "loss_gap": steps_gap,
            "eval_gap": evals_gap,
            "steps": len(run.losses),
            "evaluations": len(run.evals),
        }
        print(path, json.dumps(rows[path]), flush=True)
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "tuning_s": tuning_s,
        "tuned": result.config.describe(),
        "mean_width": mean_width,
        "widths": len(set(widths)),
        "reference_samples_per_s": ref.speed(stream),
        "paths": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
