"""Phase-labelled memory timelines of one training step, and their fit in batch size.

A tracked step (two micro-batches and an optimizer step) is cut into phases by hooks:
the forward of each block, the stretch after it, the backward of each block (from the
moment the gradient of its output is ready), and so on. Each phase records the live
bytes it adds (``delta``) and its peak above its entry (``peak``). Measured at two
micro-batch sizes, with every block kept and with every block checkpointed, the phases
give a cost model that replays any checkpoint mask at any micro-batch size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autotune._profile_data import Line, Phase, PhaseKey
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import (
    Life,
    LiveBytesTracker,
    PhaseRecord,
    state_tensors,
    tracker_for,
)

__all__ = ["Lives", "fit_phases", "occurrences", "tracked_step"]


@dataclass
class Lives:
    """Where a tracked step's storages were made and freed, which blocks took each one as
    an argument, and which saved it for their backward (by :attr:`Life.born`)."""

    lives: list[Life] = field(default_factory=list)
    arguments: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    saved: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    """Which blocks' forwards saved it for backward themselves (not through a checkpoint,
    which saves what it needs its own way)."""
    returned: set[tuple[int, int]] = field(default_factory=set)
    """The storages the blocks returned (a block's output: the next one's argument, or,
    from the last, what the model's head reads)."""


@dataclass
class _Recorder:
    tracker: LiveBytesTracker
    model: nn.Module
    micro: int = 0
    in_backward: bool = False
    lives: Lives | None = None
    running: int | None = None
    """The block whose forward runs now."""
    parameters: list[nn.Parameter] = field(init=False)
    """The model's parameters, listed once: a mark reads their gradients (walking the
    modules at every mark cost a UNet's tracked step tens of milliseconds)."""

    def __post_init__(self) -> None:
        self.parameters = list(self.model.parameters())

    def takes(self, block: int, arguments: Any) -> None:
        """Note the storages ``block`` is called with (recording lives)."""
        if self.lives is not None:
            for where in self._births(arguments):
                self.lives.arguments.setdefault(where, set()).add(block)

    def gives(self, output: Any) -> None:
        """Note the storages a block returns (recording lives)."""
        if self.lives is not None:
            self.lives.returned.update(self._births(output))

    def _births(self, tree: Any) -> list[tuple[int, int]]:
        """Where the storages of the tensors in ``tree`` were made, those the tracker saw."""
        born = self.tracker.born
        if born is None:
            return []
        found = (
            born.get(id(t.untyped_storage()))
            for t in tree_flatten(tree)[0]
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta
        )
        return [where for where in found if where is not None]

    def save(self, t: torch.Tensor) -> torch.Tensor:
        """Autograd's pack hook while lives are recorded: an alias of ``t`` (the same
        storage, the same bytes), and the block whose forward saves it noted."""
        if self.lives is not None and self.running is not None:
            for where in self._births(t):
                self.lives.saved.setdefault(where, set()).add(self.running)
        return t.detach()

    def mark(self, label: str, block: int | None = None) -> None:
        grads = sum(
            p.grad.untyped_storage().nbytes() for p in self.parameters if p.grad is not None
        )
        self.tracker.phase(PhaseKey(self.micro, label, block), grads=grads)


@contextlib.contextmanager
def _block_hooks(rec: _Recorder, blocks: Sequence[nn.Module]) -> Iterator[None]:
    handles: list[Any] = []

    def pre(i: int) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not rec.in_backward:
                rec.mark("fwd", i)
                rec.takes(i, (args, kwargs))
                rec.running = i

        return hook

    def post(i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if rec.in_backward:
                return
            rec.running = None
            rec.gives(output)
            rec.mark("after", i)
            first = next(
                (
                    t
                    for t in tree_flatten(output)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ),
                None,
            )
            if first is not None:
                first.register_hook(lambda grad: rec.mark("bwd", i))

        return hook

    for i, module in enumerate(blocks):
        handles.append(module.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(module.register_forward_hook(post(i)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def tracked_step(
    runner: Any,
    chunk: Any,
    blocks: Sequence[nn.Module],
    cut: Callable[[], None] = lambda: None,
    lives: Lives | None = None,
) -> list[PhaseRecord]:
    """Run two micro-batches of ``chunk`` and an optimizer step under a tracker; ``cut``
    is called as each micro-batch and the optimizer step begins; ``lives``, where given,
    is filled with where each storage was made and freed, and the blocks' arguments.

    The runner must have taken one step already, so that optimizer state exists and the
    step is at steady state.

    Returns:
        The phase records; micro-batches are ``micro`` 1 and 2, the optimizer step 3.
    """
    tracker = tracker_for(runner.config.compile_level != "none", runner.device.type)
    rec = _Recorder(tracker, runner.model, lives=lives)
    existing = state_tensors(runner.model, runner.optimizer, runner.scaler)
    # Recording lives, autograd saves an alias of each tensor (the same storage, the same
    # bytes): the tensor an op returned is then dropped where Python lets go of it.
    aliased = (
        contextlib.nullcontext()
        if lives is None
        else torch.autograd.graph.saved_tensors_hooks(rec.save, _same)
    )
    with (
        _block_hooks(rec, blocks),
        measure_peak(runner.device, existing=existing, tracker=tracker),
        aliased,
    ):
        total = torch.zeros((), device=runner.device)  # the runner's running loss, as in a step
        rec.mark("start")
        if lives is not None:
            tracker.record_lives()
        for micro in (1, 2):
            rec.micro = micro
            cut()
            rec.mark("pre")
            loss = runner.forward_loss(chunk, 0.5)
            rec.mark("head_bwd")
            rec.in_backward = True
            runner.backward(loss)
            rec.in_backward = False
            total += loss.detach().float()
            del loss
            rec.mark("end")
        rec.micro = 3
        cut()
        rec.mark("opt")
        runner.optimizer_step()
        if lives is not None:
            lives.lives = tracker.lives()
    return tracker.phases


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def fit_phases(
    b1: int,
    runs1: Sequence[list[PhaseRecord]],
    b2: int,
    runs2: Sequence[list[PhaseRecord]],
    b3: int | None = None,
    runs3: Sequence[list[PhaseRecord]] = (),
) -> tuple[int, list[Phase]]:
    """Fit the phases of each variant's run at micro-batch sizes ``b1`` and ``b2``: each
    peak is the most of its local maxima's lines where the two runs have the same ones
    (see :func:`_peak_lines`); with runs at a third size ``b3`` too, the line of the
    peaks through the last two sizes is one more (see :attr:`Phase.bends`).

    Phases are matched by label and, for a label seen more than once (a weight-shared
    block called once per layer, ALBERT's), by its occurrence; the sequence is the kept
    run's at ``b1``. A phase missing from another run (data-dependent control flow) takes
    the kept run's values.

    Returns:
        The live bytes at step start, and the phases of micro-batches 1, 2 and the
        optimizer step, in order.
    """
    reference = runs1[0]
    base = reference[0].entry

    def table(records: list[PhaseRecord]) -> dict[tuple[PhaseKey, int], PhaseRecord]:
        return dict(zip(occurrences(records), records, strict=True))

    variants = range(len(runs1))
    tables = [[table(runs1[v]), table(runs2[v])] for v in variants]
    thirds = [table(runs) for runs in runs3]
    phases = []
    for r, key in zip(reference, occurrences(reference), strict=True):
        lines_delta, lines_peak, bends = [], [], []
        for v in variants:
            a = tables[v][0].get(key) or tables[0][0][key]
            b = tables[v][1].get(key) or tables[0][1].get(key) or a
            lines_delta.append(Line.through(b1, a.exit - a.entry, b2, b.exit - b.entry))
            peak, more = _peak_lines(b1, a, b2, b)
            lines_peak.append(peak)
            if b3 is not None and thirds:
                c = thirds[v].get(key) or thirds[0].get(key) or b
                more = (*more, Line.through(b2, b.peak - b.entry, b3, c.peak - c.entry))
            bends.append(more)
        # Only a block's own forward and backward are its; what happens between blocks
        # (e.g. autocast dropping cached weight casts when the forward ends) depends on
        # every block's choice, and the cost model interpolates it.
        block = r.key.block if r.key.label in ("fwd", "bwd") else None
        kept = tuple(bends) if any(bends) else ()
        phases.append(Phase(r.key, block, tuple(lines_delta), tuple(lines_peak), r.grads, kept))
    return base, phases


def _peak_lines(b1: int, a: PhaseRecord, b2: int, b: PhaseRecord) -> tuple[Line, tuple[Line, ...]]:
    """A phase's peak above its entry against the micro-batch size, from its records
    ``a`` at ``b1`` and ``b`` at ``b2``: a line, and more lines it is the most of.

    Each local maximum of the live bytes is linear in the batch size; the peak is the
    most of them, which bends where a steeper one takes over (an op whose bytes grow
    faster than the one that peaks at the profiled sizes). Where the two records have as
    many local maxima (the same ops), the peak is their upper envelope from micro-batch 1
    up: the line that peaks at ``b2``, and those that take over elsewhere. Otherwise the
    line through the two peaks.
    """
    chord = Line.through(b1, a.peak - a.entry, b2, b.peak - b.entry)
    if not a.tops or len(a.tops) != len(b.tops):
        return chord, ()
    tops = [
        Line.through(b1, x - a.entry, b2, y - b.entry) for x, y in zip(a.tops, b.tops, strict=True)
    ]
    hull = _upper_envelope([*tops, Line(0.0, 0.0)], lowest=1.0)
    at_b2 = max(hull, key=lambda line: (line(b2), line.slope))
    return at_b2, tuple(line for line in hull if line is not at_b2)


def _upper_envelope(lines: Sequence[Line], lowest: float) -> list[Line]:
    """The lines that are the most of ``lines`` somewhere from ``lowest`` up, by slope."""
    best: dict[float, Line] = {}
    for line in lines:  # of equal slopes, the highest
        if line.slope not in best or line.const > best[line.slope].const:
            best[line.slope] = line
    hull: list[Line] = []
    for line in sorted(best.values(), key=lambda line: line.slope):
        # The last line is never the most where the new one overtakes the one before it
        # no later than it overtakes the one before.
        while len(hull) >= 2 and _crossing(hull[-2], line) <= _crossing(hull[-2], hull[-1]):
            hull.pop()
        hull.append(line)
    while len(hull) >= 2 and _crossing(hull[0], hull[1]) <= lowest:
        hull.pop(0)  # the most only below ``lowest``
    return hull


def _crossing(low: Line, high: Line) -> float:
    """Where ``high`` (the steeper line) overtakes ``low``."""
    return (low.const - high.const) / (high.slope - low.slope)


def occurrences(records: Sequence[PhaseRecord]) -> list[tuple[PhaseKey, int]]:
    """Each record's key and how many records before it had the same key (a phase's
    name, the same in every run of the step)."""
    seen: dict[PhaseKey, int] = {}
    out = []
    for r in records:
        out.append((r.key, seen.get(r.key, 0)))
        seen[r.key] = out[-1][1] + 1
    return out
