"""One tuned result that the real trainers train with: a small Hugging Face GPT-2 on CPU.

The budget lies a fifth of the way from the peak with no block checkpointed to the peak
with all, at the only micro-batch size allowed, so the tuner must choose a partial
checkpoint mask: the knob the trainers' own settings cannot express.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from tiny_gpt2 import MICRO, SEQ, VOCAB, gpt2
from torch import nn

import autotune
from autotune import SearchSpace, TrainConfig, TuneResult
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import state_tensors

G = 8  # the global batch


def samples(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def stack(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


@pytest.fixture(scope="session")
def tuned() -> TuneResult:
    model, sample = gpt2(), stack(samples(G))
    blocks = autotune.find_blocks(model)
    kept = autotune.estimate(model, sample, TrainConfig(micro_batch_size=MICRO, optimizer="sgd"))
    ckpt = autotune.estimate(
        model, sample, TrainConfig(micro_batch_size=MICRO, optimizer="sgd", checkpoint=blocks)
    )
    budget = (kept[0] - 0.2 * (kept[0] - ckpt[0])) / 2**30
    space = SearchSpace(precisions=("fp32",), optimizers=("sgd",), micro_batch_sizes=(MICRO,))
    result = autotune.autotune(
        model, sample, budget, global_batch_size=G, device="cpu", space=space, n_trials=20
    )
    assert 0 < len(result.config.checkpoint) < len(blocks), result.config  # a partial mask
    return result


@dataclass
class Recorder:
    """The micro-batches a trainer feeds the model, and the loss of each."""

    inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)

    def attach(self, model: nn.Module) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if module.training and torch.is_grad_enabled():
                self.inputs.append({k: kwargs[k].detach().clone() for k in ("input_ids", "labels")})
                self.losses.append(output.loss.detach().clone())

        return model.register_forward_hook(hook, with_kwargs=True)

    def steps(self, accum: int) -> list[dict[str, torch.Tensor]]:
        """The batches of each optimizer step, the micro-batches joined in order."""
        chunks = [self.inputs[i : i + accum] for i in range(0, len(self.inputs), accum)]
        return [{k: torch.cat([c[k] for c in chunk]) for k in chunk[0]} for chunk in chunks]


def runner_replay(
    model: nn.Module, result: TuneResult, recorder: Recorder, *, lr: float, **step: Any
) -> tuple[Recorder, nn.Module]:
    """What autotune's Runner does on the trainer's batches: its losses and its model."""
    replay = Recorder()
    handle = replay.attach(model)
    runner = autotune.prepare(model, result.config, lr=lr)
    for batch in recorder.steps(result.config.grad_accum_steps):
        runner.step(batch, **step)
    handle.remove()
    runner.close()
    return replay, model


@pytest.fixture
def peak_of() -> Iterator[Any]:
    """``with peak_of(model, budget) as reading``: live bytes under the CPU budget guard."""

    def measure(model: nn.Module, budget: int) -> Any:
        return measure_peak(torch.device("cpu"), existing=state_tensors(model), budget_bytes=budget)

    yield measure


def fresh(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def as_tuned_on(
    tuned: TuneResult, model: nn.Module, micro: int, accum: int, prefix: str = ""
) -> TuneResult:
    """``tuned``'s result as if tuned on ``model`` at ``micro`` x ``accum`` with SGD, no
    block checkpointed and no fallback: for the tests of what a step learns, which is
    the same at every setting (its blocks are found under ``prefix``)."""
    from autotune.train._identity import fingerprint

    blocks = autotune.find_blocks(getattr(model, prefix.rstrip("."), model) if prefix else model)
    config = TrainConfig(micro_batch_size=micro, grad_accum_steps=accum, optimizer="sgd")
    return dataclasses.replace(
        tuned,
        config=config,
        model=dataclasses.replace(
            tuned.model, fingerprint=fingerprint(model), blocks=tuple(prefix + b for b in blocks)
        ),
        fallbacks=(),
        by_length=(),
    )


def plain_step(model: nn.Module, batch: dict[str, torch.Tensor], lr: float) -> nn.Module:
    """``model`` after one plain PyTorch SGD step of ``batch`` with its own loss."""
    model = copy.deepcopy(model)
    model(**batch).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return model


def moved_apart(a: nn.Module, b: nn.Module, start: nn.Module) -> float:
    """How far ``a``'s weights are from ``b``'s, relative to how far ``b`` moved from
    ``start``'s."""
    with torch.no_grad():
        gap = torch.cat(
            [(x - y).flatten() for x, y in zip(a.parameters(), b.parameters(), strict=True)]
        )
        moved = torch.cat(
            [(x - y).flatten() for x, y in zip(b.parameters(), start.parameters(), strict=True)]
        )
        return float(gap.norm() / moved.norm())
