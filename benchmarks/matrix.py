"""The compatibility matrix outside pytest: every architecture of ``tests/models/zoo.py``
through the checks of ``tests/models/matrix_checks.py``, as a markdown table.

    python benchmarks/matrix.py                          # every case, ~1.5 min on 2 cores
    python benchmarks/matrix.py --cases t5 resnet bert   # only these
    python benchmarks/matrix.py --out /tmp/matrix.json   # also every problem, as JSON
    python benchmarks/matrix.py --tuned                  # tune the cases marked tuned, ~10 min

Per case: the blocks ``find_blocks`` returns (right: the layers the case expects, run in
that order), whether one micro-batch's gradients (and loss) with every block checkpointed,
every block offloaded, and bf16 with half the blocks checkpointed equal the plain run's bit
for bit, whether every buffer does too (BatchNorm's statistics), whether ``estimate`` runs,
and the seconds the case took. Each problem follows the table, grouped by check. The exit
status is 1 when any case has a problem. ``python -m pytest tests/models`` runs the same
checks, one test per case.
"""

from __future__ import annotations

import os

# As in run.py: spinning OpenMP threads make a shared 2-core machine's steps many times
# slower. It must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests"), str(_ROOT / "tests" / "models")]

from torchvision_ops import declare_torchvision_ops  # noqa: E402

declare_torchvision_ops()  # transformers imports torchvision: see tests/torchvision_ops.py
import torch  # noqa: E402
from matrix_checks import (  # noqa: E402
    BF16,
    BLOCKS,
    BUFFERS,
    CHECKPOINT,
    CHECKS,
    ESTIMATE,
    OFFLOAD,
    SELECTIVE,
    Outcome,
    run_case,
    tuned_end_to_end,
)
from zoo import CASES, Case  # noqa: E402

_COLUMNS = (
    (BLOCKS, "blocks ok"),
    (CHECKPOINT, "ckpt grads ok"),
    (OFFLOAD, "offload grads ok"),
    (SELECTIVE, "selective grads ok"),
    (BF16, "bf16 ckpt ok"),
    (BUFFERS, "buffers ok"),
    (ESTIMATE, "estimate ok"),
)


def table(outcomes: list[Outcome]) -> str:
    """One row per case: its blocks, a mark per check, its seconds."""
    head = ["case", "family", "#blocks", *(title for _, title in _COLUMNS), "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for o in outcomes:
        found = "error" if o.found is None else str(len(o.found))
        marks = ["yes" if o.ok(check) else "**NO**" for check, _ in _COLUMNS]
        cells = [o.case.name, o.case.family, found, *marks, f"{o.seconds:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def problems(outcomes: list[Outcome]) -> str:
    """Every problem, grouped by check, then by case."""
    lines = []
    for check in CHECKS:
        failing = [o for o in outcomes if not o.ok(check)]
        if failing:
            lines.append(f"\n### {check} ({len(failing)} cases)\n")
            lines += [f"- {o.case.name}: {m}" for o in failing for m in o.problems[check]]
    return "\n".join(lines)


def as_json(outcomes: list[Outcome], seconds: float) -> dict[str, object]:
    return {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "seconds": seconds,
        "cases": [
            {
                "case": o.case.name,
                "family": o.case.family,
                "found": o.found,
                "blocks": o.blocks,
                "estimate": o.peak,
                "seconds": o.seconds,
                "problems": o.problems,
            }
            for o in outcomes
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="only these case names")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny models)")
    parser.add_argument("--out", type=Path, help="write every outcome to this JSON file")
    parser.add_argument(
        "--tuned", action="store_true", help="tune the cases marked tuned end to end instead"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    unknown = set(args.cases or ()) - {c.name for c in CASES}
    if unknown:
        parser.error(f"no such cases: {', '.join(sorted(unknown))}")
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    try:  # the models' own notices (slow reference kernels, odd token ids) drown the table
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    if args.tuned:
        return tune_each([c for c in cases if c.tuned])
    started = time.perf_counter()
    outcomes = []
    for case in cases:
        if missing := case.missing():
            print(f"{case.name}: skipped, needs {', '.join(missing)}", file=sys.stderr)
            continue
        outcome = run_case(case)
        outcomes.append(outcome)
        status = "ok" if not outcome.problems else "FAILED: " + ", ".join(outcome.problems)
        print(f"{case.name}: {status} ({outcome.seconds:.1f} s)", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - started
    failed = sum(bool(o.problems) for o in outcomes)
    print(table(outcomes))
    print(problems(outcomes))
    print(f"\n{len(outcomes) - failed} of {len(outcomes)} cases pass; {seconds:.0f} s in all")
    if args.out:
        args.out.write_text(json.dumps(as_json(outcomes, seconds), indent=2))
    return 1 if failed else 0


def tune_each(cases: list[Case]) -> int:
    """Tune each case end to end (:func:`matrix_checks.tuned_end_to_end`), one line each."""
    failed = 0
    for case in cases:
        if missing := case.missing():
            print(f"{case.name}: skipped, needs {', '.join(missing)}", flush=True)
            continue
        started = time.perf_counter()
        found = tuned_end_to_end(case)
        failed += bool(found)
        status = "ok" if not found else "FAILED: " + "; ".join(found)
        print(f"{case.name}: {status} ({time.perf_counter() - started:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
