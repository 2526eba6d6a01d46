"""What compiling the blocks buys: each CPU case's forward+backward, eager against compiled.

For each case, precision and (``--micro-batches``) micro-batch size, two copies of the
model train side by side through autotune's runner: one eager, one with every block's
forward compiled (``autotune.train._compiled``, regional compilation, inductor's default
mode). Each arm runs with every block kept and with every block checkpointed over the
compiled forward. A row gives:

- ``time``: compiled / eager seconds of a forward+backward, the median of ``--rounds``
  passes timed round-robin with the eager pass (below 1.00 compile pays);
- ``peak``: compiled / eager bytes above the step's start of one forward+backward, each
  counted to the byte (the compiled one under ``CompiledBytesTracker``, its code compiled
  inside ``counted_allocations``);
- ``compile_s``: the first compiled pass's seconds beyond an eager pass (inductor's
  compilation, its caches cold or warm as found: ``--cold`` empties them first);
- ``loss``: the largest relative difference of the two arms' losses over three steps
  (``None`` where the model has dropout, whose random numbers compiled code draws
  otherwise).

    python benchmarks/compiled.py --out benchmarks/results/compiled-cpu.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see run.py

import argparse
import contextlib
import copy
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune
from autotune.measure._tracker import CompiledBytesTracker, LiveBytesTracker, state_tensors
from autotune.train._compiled import compile_blocks, counted_allocations, is_compiled
from benchmarks.cases import Case, cases_for
from benchmarks.run import _machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="only these case names")
    parser.add_argument("--precisions", nargs="*", default=["fp32", "bf16"])
    parser.add_argument("--micro-batches", nargs="*", type=int, default=[4, 16])
    parser.add_argument("--rounds", type=int, default=7, help="timed passes per arm")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--cold", action="store_true", help="empty inductor's caches first")
    parser.add_argument("--out", type=Path, default=Path("results-compiled.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows = []
    with torch._inductor.utils.fresh_cache() if args.cold else contextlib.nullcontext():
        for case in cases_for(torch.device("cpu")):
            if args.cases and case.name not in args.cases:
                continue
            for precision in args.precisions:
                for b in args.micro_batches:
                    for checkpointed in (False, True):
                        rows.append(run_row(case, precision, b, checkpointed, args.rounds))
                        print(_line(rows[-1]), file=sys.stderr, flush=True)
    report = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "machine": _machine(torch.device("cpu")),
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - started,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=1))
    print("\n".join(_line(r) for r in rows))
    print(f"wrote {args.out}")
    return 0


def run_row(case: Case, precision: str, b: int, checkpointed: bool, rounds: int) -> dict[str, Any]:
    """Eager against compiled blocks for one case, precision, micro-batch and mask."""
    model = case.build()
    blocks = autotune.find_blocks(model)
    config = autotune.TrainConfig(
        micro_batch_size=b, precision=precision, checkpoint=blocks if checkpointed else ()
    )
    chunk = case.sample(b)
    eager, compiled = copy.deepcopy(model), copy.deepcopy(model)
    compile_blocks(compiled, blocks)  # beneath the checkpoint wrappers prepare() adds

    def runner(work: torch.nn.Module) -> Any:
        torch.manual_seed(0)
        return autotune.prepare(work, config, lr=1e-4, device="cpu", loss_fn=case.loss_fn)

    with runner(eager) as plain, runner(compiled) as fast:
        first_eager = _timed(lambda: plain.forward_backward(chunk))
        with counted_allocations():  # inductor's code made here allocates where it counts
            first = _timed(lambda: fast.forward_backward(chunk))
        peaks = [_peak(r, chunk, cls) for r, cls in ((plain, LiveBytesTracker),
                                                      (fast, CompiledBytesTracker))]  # fmt: skip
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(rounds):
            for arm, r in enumerate((plain, fast)):
                times[arm].append(_timed(lambda r=r: r.forward_backward(chunk)))
        plain.zero_grad()
        fast.zero_grad()
        losses = [[float(r.step(chunk)) for _ in range(3)] for r in (plain, fast)]
    medians = [statistics.median(t) for t in times]
    # Dropout draws other random numbers in compiled code: no loss to compare then.
    dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    return {
        "case": case.name,
        "precision": precision,
        "micro_batch": b,
        "checkpointed": checkpointed,
        "eager_s": medians[0],
        "compiled_s": medians[1],
        "time": medians[1] / medians[0],
        "eager_peak": peaks[0],
        "compiled_peak": peaks[1],
        "peak": peaks[1] / peaks[0],
        "compile_s": first - first_eager,
        "losses": losses,
        "loss": None if dropout else max(abs(c - e) / abs(e) for e, c in zip(*losses, strict=True)),
    }


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _peak(runner: Any, chunk: Any, tracker_class: type[LiveBytesTracker]) -> int:
    """Bytes above the step's start at the peak of one forward+backward. A compiled
    model must run compiled under its tracker: an eager tracker would have dynamo skip
    the blocks' code, for good (until ``torch._dynamo.reset()``)."""
    tracker = tracker_class("cpu")
    tracker.track(state_tensors(runner.model, runner.optimizer))
    nodes: list[str] = []
    hooks = [
        m.register_forward_hook(lambda m, a, out: nodes.append(_node(out)))
        for m in runner.model.modules()
        if is_compiled(m)
    ]
    with tracker:
        start = tracker.live
        runner.forward_backward(chunk)
    for hook in hooks:
        hook.remove()
    runner.zero_grad()
    if set(nodes) - {"CompiledFunctionBackward"}:
        raise RuntimeError(f"the compiled blocks ran eagerly under the tracker: {nodes}")
    return tracker.peak - start


def _node(output: Any) -> str:
    """The autograd node that made a block's output (its first tensor)."""
    tensor = output[0] if isinstance(output, tuple) else output
    return type(tensor.grad_fn).__name__


def _line(r: dict[str, Any]) -> str:
    mask = "every block checkpointed" if r["checkpointed"] else "kept"
    return (
        f"{r['case']:15} {r['precision']} b{r['micro_batch']:<3} {mask:24} time "
        f"{r['time']:.2f}x  peak {r['peak']:.2f}x ({r['compiled_peak'] / 2**20:.1f} MiB)  "
        f"compile {r['compile_s']:.1f} s  loss rel diff "
        + ("- (dropout)" if r["loss"] is None else f"{r['loss']:.1e}")
    )


if __name__ == "__main__":
    sys.exit(main())
