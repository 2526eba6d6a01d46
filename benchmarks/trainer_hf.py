"""Inside Hugging Face ``Trainer``: autotune against ``auto_find_batch_size``.

* **autotune**: ``autotune.autotune`` on the model (the optimizer fixed to AdamW, which the
  ``Trainer`` steps on the device: no optimizer offload), then a ``Trainer`` with
  ``training_arguments(result, ...)`` and ``AutotuneCallback(result)``.
* **auto_find_batch_size**: ``per_device_train_batch_size=G``, fp32, ``adamw_torch``, under
  the CPU budget guard for two optimizer steps: the ``Trainer`` retries through accelerate's
  ``find_executable_batch_size`` (0.9x per OOM; the guard's error reads as torch's). The
  user then keeps the global batch exact: the largest divisor of ``G`` not above the batch
  found, the rest as ``gradient_accumulation_steps``.

Each timed run trains a fresh model for ``WARMUP + TIMED`` optimizer steps, unguarded.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

from transformers import Trainer, TrainerCallback, TrainingArguments

import autotune
from autotune import TuneResult
from autotune.integrations.transformers import AutotuneCallback, training_arguments

from .budgets import Budget
from .cases import Case
from .trainer_lightning import Baseline
from .trainer_parts import TIMED, WARMUP, Clock, Guard, Rows

__all__ = ["autotune_arm", "finder_arm", "timed_autotune", "timed_baseline"]

_COMMON: dict[str, Any] = {
    "learning_rate": 1e-6,
    "use_cpu": True,
    "report_to": [],
    "save_strategy": "no",
    "logging_strategy": "no",
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
}


class _Ticks(TrainerCallback):
    def __init__(self) -> None:
        self.clock = Clock()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock.tick()


class _Armed(TrainerCallback):
    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.guard.arm()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.guard.disarm()


def autotune_arm(case: Case, data: Any, budget: Budget) -> TuneResult:
    """Tune the model for the ``Trainer``: AdamW on the device."""
    space = autotune.SearchSpace(optimizers=("adamw",), offload_optimizer=False)
    return autotune.autotune(
        case.build(),
        case.sample(min(case.global_batch_size or 8, 8)),
        budget.gib,
        global_batch_size=case.global_batch_size,
        device="cpu",
        space=space,
        seed=0,
    )


def finder_arm(case: Case, data: Any, budget: Budget) -> Baseline:
    """Run ``auto_find_batch_size`` from the global batch under the budget guard."""
    g = case.global_batch_size or 32
    model = case.build()
    guard = Guard(budget.budget_bytes)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            per_device_train_batch_size=g,
            auto_find_batch_size=True,
            max_steps=2,
            optim="adamw_torch",
            **_COMMON,
        )
        trainer = Trainer(model, args, train_dataset=Rows(data), callbacks=[_Armed(guard)])
        started = time.perf_counter()
        guard.start(model)
        try:
            trainer.train()
        finally:
            guard.stop()
        seconds = time.perf_counter() - started
    return Baseline(trainer._train_batch_size, g, seconds)


def timed_autotune(case: Case, data: Any, result: TuneResult) -> float:
    """Samples/s of a ``Trainer`` run as tuned."""
    ticks = _Ticks()
    with tempfile.TemporaryDirectory() as out:
        args = training_arguments(result, out, max_steps=WARMUP + TIMED, **_COMMON)
        callbacks = [AutotuneCallback(result), ticks]
        Trainer(case.build(), args, train_dataset=Rows(data), callbacks=callbacks).train()
    return ticks.clock.samples_per_s(result.config.effective_batch_size)


def timed_baseline(case: Case, data: Any, baseline: Baseline) -> float:
    """Samples/s of an fp32 ``Trainer`` run at the batch found, the global batch kept."""
    ticks = _Ticks()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            per_device_train_batch_size=baseline.batch_size,
            gradient_accumulation_steps=baseline.accumulate,
            max_steps=WARMUP + TIMED,
            optim="adamw_torch",
            **_COMMON,
        )
        Trainer(case.build(), args, train_dataset=Rows(data), callbacks=[ticks]).train()
    return ticks.clock.samples_per_s(baseline.batch_size * baseline.accumulate)
