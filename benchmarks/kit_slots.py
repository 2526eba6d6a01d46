"""The GPU kit's time: each step's slot in the one call, and whether its work fits.

A GPU is lent for 15 minutes, one command of at most 10; the kit's ``all`` gets 9 of
them (540 s), in steps run one after another, each stopped at its slot. The order is
what a call must bring back first: the preflight, GPT-2 124M (the job measured before, in
a slot of its own), the allocator traces, then the 1B full fine-tune and the QLoRA 7B.

The dry run: the kit's CPU smoke run counts each job's work (models built, verified
configs, the expert's configs, first steps in a new process); at the speeds the last GPU
call measured (:data:`LAST_GPU`, GPT-2 124M on one H200) GPT-2's work must fit its
slot, or the check fails before a GPU spends its minutes on a job it cannot finish. The
larger jobs were never measured on a GPU: their work at GPT-2's speeds is shown (a
floor: they are slower), and a job whose slot ends keeps its row as far as it got (the
tuner's config and peaks first, then its timing, the expert's, the first step).

    python benchmarks/kit_slots.py gpt2-124m          # one step's slot, in seconds
    python benchmarks/kit_slots.py --check jobs*.json  # the smoke run's jobs against theirs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

CALL_S = 540
"""The kit's ``all``: 9 of a lent GPU's 15 minutes (the machine's start and the copies
back take the rest)."""

SLOTS: dict[str, int] = {
    "preflight": 20,
    "gpt2-124m": 290,
    "traces": 25,
    "traces-expandable": 25,
    "llama-1b": 120,
    "qlora-7b": 60,
}
"""Each step of ``all``, in the order it runs, and its most seconds. GPT-2's is its work
at the last call's speeds with room for the noise in it: the dry run's 233-241 s, or
273 s with the last call's own counts (4 configs verified, 3 of the expert's), plus a
first step. The 1B gets about what its tuning needs at GPT-2's speeds (the tuner's
figures come first in its row), the 7B what is left."""

LAST_GPU = Path(__file__).parent / "results" / "cuda-h200-jobs.json"
"""The last GPU call's jobs (NVIDIA H200, torch 2.11.0+cu130, 2026-11-26): its GPT-2 124M
row at 24 GiB gives the speeds; a later call's rows saved in its place give theirs."""


def unit_seconds(report: Path = LAST_GPU) -> dict[str, float]:
    """Seconds of each unit of a job's work in the GPT-2 row of ``report``: building the
    model, the tuner's profile, one verified config, and one of the expert's configs
    (compiled whole from cold, timed: the row's wall less the build and the tuning,
    over the expert's configs and the tuned config timed again)."""
    rows = json.loads(report.read_text())["rows"]
    row = next(r for r in rows if r["job"] == "gpt2-124m" and "error" not in r)
    after = row["wall_s"] - row["build_s"] - row["tuning_s"]
    return {
        "build_s": row["build_s"],
        "profile_s": row["spent"]["profile_s"],
        "verify_s": row["spent"]["verification_s"] / len(row["trials"]),
        "expert_s": after / (len(row["expert"]["runs"]) + 1),
    }


def predicted_s(row: dict[str, Any], unit: dict[str, float]) -> float:
    """Seconds a smoke run's job row would take at the speeds ``unit`` (see
    :func:`unit_seconds`): its model built, profiled, its verified configs, its expert's
    configs and the tuned one timed again, and each first step in a new process (a build
    and one config timed)."""
    trials = len(row.get("trials", ()))
    expert = len(row.get("expert", {}).get("runs", ())) + 1  # and the tuned config, again
    first = sum(k in row for k in ("first_step_s", "first_step_without_cache_s"))
    return (
        unit["build_s"] * (1 + first)
        + unit["profile_s"]
        + unit["verify_s"] * trials
        + unit["expert_s"] * (expert + first)
    )


MEASURED = ("gpt2-124m",)
"""The jobs :data:`LAST_GPU` measured: the check holds them to their slots."""


def check(rows: list[dict[str, Any]]) -> list[str]:
    """A line per job row: its predicted seconds against its slot, ``OVER`` where a
    measured job would outrun it (an unmeasured one: the floor, and what it keeps)."""
    out, unit = [], unit_seconds()
    for row in rows:
        slot, need = SLOTS[row["job"]], predicted_s(row, unit)
        line = f"{row['job']}: {need:.0f} s of work at the last GPU's speeds, slot {slot} s"
        if row["job"] not in MEASURED:
            out.append(f"{line}: never measured on a GPU (a floor); its row keeps what ends")
        else:
            out.append(f"{line}: {'fits' if need <= slot else 'OVER'}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", nargs="?", help="print this step's slot in seconds")
    parser.add_argument("--check", nargs="*", type=Path, help="job files of a smoke run")
    args = parser.parse_args(argv)
    if args.step is not None:
        print(SLOTS[args.step])
        return 0
    rows = [r for f in args.check or () for r in json.loads(f.read_text())["rows"]]
    lines = [f"the kit's all: {sum(SLOTS.values())} s of slots in a call of {CALL_S} s"]
    lines += check(rows)
    print("\n".join(lines))
    over = sum(SLOTS.values()) > CALL_S or any(line.endswith("OVER") for line in lines)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
