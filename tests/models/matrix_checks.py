"""The checks of the compatibility matrix, shared by ``test_matrix.py`` and
``benchmarks/matrix.py``: each returns what went wrong instead of asserting, so that one
case reports every failing check at once and the benchmark can tabulate them.

For one case (:func:`run_case`):

* **blocks**: :func:`autotune.find_blocks` finds the layers the case expects (a pattern and
  a count), and they run in the forward in the order given (a checkpoint or offload plan
  follows that order).
* **training steps**: one micro-batch's forward and backward through
  :meth:`autotune.Runner.forward_backward`, from identical copies of the model and the same
  seed: every block checkpointed, every block offloaded, every block checkpointed
  selectively, against the plain step; bf16 with half the blocks checkpointed, and with half
  checkpointed selectively, against plain bf16. Gradients and losses must be equal bit
  for bit (the same kernels run on the same inputs: recomputing replays the forward,
  offloading copies tensors), and so must every buffer after the step (BatchNorm's running
  statistics must be updated once, not again by the recompute). One exception: selective
  checkpointing under bf16 autocast casts a weight at each use, where autocast's cache
  casts a weight shared by several blocks once (its gradients then meet in fp32, not bf16):
  equal to bf16's precision. A case whose blocks change a kept output in place must be
  refused with a BlockError instead.
* **estimate**: :func:`autotune.estimate` with half the blocks checkpointed predicts a
  positive number of bytes.

The cases marked ``tuned`` are also tuned end to end (:func:`tuned_end_to_end`): two in
the tests, every one by ``benchmarks/matrix.py --tuned``.
"""

from __future__ import annotations

import copy
import re
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from zoo import Case, LossFn, seed_everything

import autotune

BLOCKS = "blocks"
CHECKPOINT = "checkpoint"
OFFLOAD = "offload"
SELECTIVE = "selective"
BF16 = "bf16 checkpoint"
BUFFERS = "buffers"
ESTIMATE = "estimate"
CHECKS = (BLOCKS, CHECKPOINT, OFFLOAD, SELECTIVE, BF16, BUFFERS, ESTIMATE)
"""The checks, in the order a report lists them."""

MICRO = 4
"""The micro-batch: the whole sample batch of every case."""
_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    """What one case did: its blocks, its estimate and every problem found, by check."""

    case: Case
    found: tuple[str, ...] | None = None
    """What ``find_blocks`` returned (``None``: it raised)."""
    blocks: tuple[str, ...] = ()
    """The blocks the training steps used: the found ones if right, else the expected ones
    (so that a block-finding bug does not hide a checkpointing bug)."""
    peak: int | None = None
    seconds: float = 0.0
    problems: dict[str, list[str]] = field(default_factory=dict)

    def add(self, check: str, message: str) -> None:
        self.problems.setdefault(check, []).append(message)

    def ok(self, check: str) -> bool:
        return check not in self.problems

    def report(self) -> str:
        """Every problem, one line each, grouped by check."""
        lines = [f"{self.case.name}: blocks {self.found}"]
        for check in CHECKS:
            lines += [f"  [{check}] {m}" for m in self.problems.get(check, ())]
        return "\n".join(lines)


@dataclass
class Step:
    """The result of one forward+backward: loss, every gradient, every buffer after it."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Variant:
    """One training configuration of the matrix, compared against ``reference``."""

    label: str
    check: str
    reference: str | None
    config: Callable[[tuple[str, ...]], autotune.TrainConfig]
    tolerance: float = 0.0
    """Largest difference allowed, relative to the largest value of each tensor (0: equal
    bit for bit)."""


_BF16_EPS = 2.0**-7
"""bf16's precision: one unit in the last place of its 8-bit significand, relatively."""


VARIANTS = (
    Variant("fp32", CHECKPOINT, None, lambda b: autotune.TrainConfig(micro_batch_size=MICRO)),
    Variant("fp32 checkpoint all", CHECKPOINT, "fp32",
            lambda b: autotune.TrainConfig(micro_batch_size=MICRO, checkpoint=b)),
    Variant("fp32 offload all", OFFLOAD, "fp32",
            lambda b: autotune.TrainConfig(micro_batch_size=MICRO, offload_activations=b)),
    Variant("fp32 selective all", SELECTIVE, "fp32",
            lambda b: autotune.TrainConfig(micro_batch_size=MICRO, selective_checkpoint=b)),
    Variant("bf16", BF16, None,
            lambda b: autotune.TrainConfig(micro_batch_size=MICRO, precision="bf16")),
    Variant("bf16 checkpoint half", BF16, "bf16",
            lambda b: autotune.TrainConfig(micro_batch_size=MICRO, precision="bf16",
                                           checkpoint=b[::2])),
    Variant("bf16 selective half", SELECTIVE, "bf16",
            lambda b: autotune.TrainConfig(micro_batch_size=MICRO, precision="bf16",
                                           selective_checkpoint=b[1::2]),
            tolerance=_BF16_EPS),
)  # fmt: skip
"""Plain runs first: each other variant is compared with its reference."""


def run_case(case: Case) -> Outcome:
    """Every check of ``case``; the model the case builds is left unchanged (checked)."""
    started = time.perf_counter()
    outcome = Outcome(case)
    model, batch, loss_fn = case.build()
    before = _state(model)
    outcome.found, outcome.blocks = check_blocks(model, batch, loss_fn, case, outcome)
    if outcome.blocks:
        check_steps(model, batch, loss_fn, outcome)
        check_estimate(model, batch, loss_fn, outcome)
    if not _same_tensors(before, _state(model)):
        outcome.add(ESTIMATE, "the case's model changed: estimate() must leave it as it was")
    outcome.seconds = time.perf_counter() - started
    return outcome


# --- blocks -------------------------------------------------------------------------------


def check_blocks(
    model: nn.Module, batch: Any, loss_fn: LossFn | None, case: Case, outcome: Outcome
) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """(found blocks or None, blocks to train with); problems go to ``outcome``."""
    try:
        found = autotune.find_blocks(model)
    except Exception as error:
        outcome.add(BLOCKS, f"find_blocks raised {_error(error)}")
        return None, case.expected_blocks(model)
    if not _expected(found, case, outcome):
        return found, case.expected_blocks(model)
    _in_forward_order(model, batch, loss_fn, found, outcome)
    return found, found


def _expected(found: tuple[str, ...], case: Case, outcome: Outcome) -> bool:
    """Whether ``found`` matches the case's pattern and count (else a problem)."""
    pattern = re.compile(case.block_pattern)
    stray = [name for name in found if not pattern.fullmatch(name)]
    if stray:
        outcome.add(BLOCKS, f"blocks outside {case.block_pattern!r}: {', '.join(stray)}")
    if case.n_blocks is not None and len(found) != case.n_blocks:
        outcome.add(BLOCKS, f"{len(found)} blocks, expected {case.n_blocks}: {', '.join(found)}")
        return False
    if case.n_blocks is None and len(found) < 2:
        outcome.add(BLOCKS, f"{len(found)} block(s), expected at least 2: {found}")
        return False
    return not stray


def _in_forward_order(
    model: nn.Module, batch: Any, loss_fn: LossFn | None, blocks: tuple[str, ...], outcome: Outcome
) -> None:
    """The blocks must all run, first calls in the order ``find_blocks`` gives them: the
    profiler's phases and the offloader's prefetch follow that order."""
    work = copy.deepcopy(model)
    calls: list[str] = []
    handles = [
        work.get_submodule(name).register_forward_pre_hook(
            lambda _m, _a, name=name: calls.append(name) if name not in calls else None
        )
        for name in blocks
    ]
    try:
        seed_everything(0)
        with torch.no_grad():
            autotune_call(work, batch, loss_fn)
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name in blocks if name not in calls]
    if missing:
        outcome.add(BLOCKS, f"blocks that never run in the forward: {', '.join(missing)}")
    elif calls != list(blocks):
        outcome.add(BLOCKS, f"blocks out of forward order; they run as {', '.join(calls)}")


def autotune_call(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> Any:
    """Call ``model`` on ``batch`` the way autotune does (see ``autotune.train._loss``)."""
    from autotune.train._loss import call_model

    return call_model(model, batch, has_loss_fn=loss_fn is not None)


# --- training steps -----------------------------------------------------------------------


def check_steps(model: nn.Module, batch: Any, loss_fn: LossFn | None, outcome: Outcome) -> None:
    """Every :data:`VARIANTS` run from its own copy, each compared with its reference."""
    copies = [copy.deepcopy(model) for _ in VARIANTS]  # all before any run
    steps: dict[str, Step] = {}
    refuse = not outcome.case.selective
    for variant, work in zip(VARIANTS, copies, strict=True):
        config = variant.config(outcome.blocks)
        try:
            steps[variant.label] = train_step(work, batch, loss_fn, config)
        except autotune.BlockError as error:
            if not (refuse and config.selective_checkpoint and _REFUSED in str(error)):
                outcome.add(variant.check, f"{variant.label}: {_error(error)}")
            continue
        except Exception as error:
            outcome.add(variant.check, f"{variant.label}: {_error(error)}")
            continue
        if refuse and config.selective_checkpoint:
            outcome.add(variant.check, f"{variant.label}: ran; a refusal was expected")
        reference = steps.get(variant.reference or "")
        if reference is not None:
            _compare(variant, reference, steps[variant.label], outcome)


_REFUSED = "cannot be checkpointed selectively"
"""What the BlockError of a block that changes a kept output in place says."""


def train_step(
    model: nn.Module, batch: Any, loss_fn: LossFn | None, config: autotune.TrainConfig
) -> Step:
    """One micro-batch's forward and backward as the runner trains it, seeded."""
    seed_everything(0)
    runner = autotune.prepare(model, config, lr=1e-3, loss_fn=loss_fn, device="cpu")
    try:
        loss = runner.forward_backward(batch)
        grads = {
            name: None if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters()
        }
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    finally:
        runner.close()
    return Step(loss, grads, buffers)


def _compare(variant: Variant, reference: Step, step: Step, outcome: Outcome) -> None:
    label = f"{variant.label} vs {variant.reference}"
    tol = variant.tolerance
    if list(_differences({"loss": reference.loss}, {"loss": step.loss}, tol)):
        outcome.add(
            variant.check, f"{label}: loss {step.loss.item()!r} != {reference.loss.item()!r}"
        )
    differ = list(_differences(reference.grads, step.grads, tol))
    if differ:
        outcome.add(
            variant.check, f"{label}: {_summary(differ, len(reference.grads), 'gradients')}"
        )
    differ = list(_differences(reference.buffers, step.buffers, tol))
    if differ:
        outcome.add(BUFFERS, f"{label}: {_summary(differ, len(reference.buffers), 'buffers')}")


Difference = tuple[str, float, float]
"""(name, largest absolute difference, largest absolute reference value); inf: missing."""


def _differences(
    reference: dict[str, torch.Tensor | None],
    other: dict[str, torch.Tensor | None],
    tolerance: float = 0.0,
) -> Iterator[Difference]:
    """The tensors that differ by more than ``tolerance`` of their largest value."""
    for name in reference.keys() | other.keys():
        a, b = reference.get(name), other.get(name)
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape != b.shape:
            yield name, float("inf"), float("inf")
        elif not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            largest = a.double().abs().max().item()
            if diff > tolerance * largest:
                yield name, diff, largest


def _summary(differ: list[Difference], total: int, what: str) -> str:
    """How many differ, by kind (the name's last part: ``weight``, ``running_mean``), with
    the worst of each kind: its absolute difference and the largest reference value."""
    kinds: dict[str, list[Difference]] = {}
    for d in sorted(differ, key=lambda d: -d[1]):
        kinds.setdefault(d[0].rsplit(".", 1)[-1], []).append(d)
    parts = [
        f"{kind} x{len(ds)} (worst {ds[0][0]} |diff| {ds[0][1]:.3g}, max |ref| {ds[0][2]:.3g})"
        for kind, ds in kinds.items()
    ]
    return f"{len(differ)} of {total} {what} differ: {'; '.join(parts)}"


# --- estimate -----------------------------------------------------------------------------


def check_estimate(model: nn.Module, batch: Any, loss_fn: LossFn | None, outcome: Outcome) -> None:
    """``estimate`` with every other block checkpointed: a positive int."""
    blocks = outcome.blocks
    config = autotune.TrainConfig(micro_batch_size=MICRO, checkpoint=blocks[::2])
    try:
        peak, _ = autotune.estimate(
            model, batch, config, loss_fn=loss_fn, device="cpu", blocks=blocks
        )
    except Exception as error:
        outcome.add(ESTIMATE, _error(error))
        return
    if not isinstance(peak, int) or peak <= 0:
        outcome.add(ESTIMATE, f"estimate returned {peak!r}, not a positive int")
    else:
        outcome.peak = peak


# --- helpers ------------------------------------------------------------------------------


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _short(path: str) -> str:
    """A source file as a package path: ``torch/utils/checkpoint.py``."""
    return path.split("site-packages/")[-1].removeprefix(str(_ROOT) + "/")


def _error(error: BaseException) -> str:
    """The error's type and first line, and where in the library or model it was raised."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    frames = traceback.extract_tb(error.__traceback__)
    where = next((f"{_short(f.filename)}:{f.lineno}" for f in reversed(frames)), "?")
    return f"{type(error).__name__}: {first} (at {where})"


def tuned_end_to_end(case: Case) -> list[str]:
    """Tune ``case`` at a budget halfway between the peaks with no block and with every
    block checkpointed (micro-batch 4, accumulation 2: gradients live beside the second
    micro-batch's activations, as in every accumulating config the search weighs); what
    went wrong: the winner over the budget, its peak not as predicted (3%), the user's
    model changed, no expert's recipe beside it and no reason said."""
    import autotune

    model, batch, loss_fn = case.build()
    blocks = autotune.find_blocks(model)
    common: dict[str, Any] = {"loss_fn": loss_fn, "device": "cpu"}
    plain = autotune.TrainConfig(micro_batch_size=MICRO, grad_accum_steps=2)
    kept, _ = autotune.estimate(model, batch, plain, **common)
    ckpt, _ = autotune.estimate(model, batch, plain.replace(checkpoint=blocks), **common)
    if ckpt >= kept:
        return [f"every block checkpointed is not predicted smaller ({ckpt} >= {kept})"]
    before = _state(model)
    result = autotune.autotune(
        model,
        batch,
        (kept + ckpt) / 2 / 2**30,
        global_batch_size=8,
        space=autotune.SearchSpace(micro_batch_sizes=(2, 4, 8)),
        n_trials=20,
        **common,
    )
    measured, predicted = result.measured.peak_bytes, result.predicted.peak_bytes
    problems = []
    if measured > result.budget_bytes:
        problems.append(f"{result.config.describe()} measured {measured} over the budget")
    if abs(measured - predicted) > 0.03 * measured:
        problems.append(f"measured {measured}, predicted {predicted}: over 3% apart")
    if not _same_tensors(before, _state(model)):
        problems.append("the user's model changed")
    if result.expert is None and not result.expert_note:
        problems.append("no expert's recipe, and no word of why")
    return problems


def measured_peak(model: nn.Module, batch: Any, config: Any, loss_fn: LossFn | None) -> int:
    """The peak of one verified step of ``config`` on a copy of ``model`` (the CPU's
    tracker: exact)."""
    from autotune.verify._verifier import Verifier

    verifier = Verifier(
        copy.deepcopy(model), batch, device=torch.device("cpu"), budget_bytes=2**40,
        loss_fn=loss_fn, steps=1,
    )  # fmt: skip
    reading, error = verifier.trial(config)
    assert error is None and reading is not None, error
    return reading.peak_bytes
