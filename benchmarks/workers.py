"""Workers on one study: N real processes tune one model together on a fresh SQLite
database, run after run; each run must end with every worker done, one winner, and no
claim left in the storage (issue 38: 4 workers, 20 of 20 runs).

    python benchmarks/workers.py --workers 4 --runs 20 --out /tmp/workers.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see run.py)

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent


def work(storage: str, poll_s: float) -> None:
    """One worker: tune the tiny GPT in the shared study; print the winner as JSON."""
    import torch

    torch.set_num_threads(1)
    import autotune
    from autotune.jobs import _study_store as _studies
    from autotune.models import gpt_batch, tiny_gpt

    _studies.POLL_S = poll_s  # waiting workers read the storage this often
    model = tiny_gpt(n_layer=4, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    result = autotune.autotune(
        model,
        gpt_batch(model.config, 4),
        48 / 1024,
        device="cpu",
        global_batch_size=16,
        storage=storage,
        study_name="shared",
        n_trials=20,
        progress=False,
    )
    print(json.dumps({"winner": result.config.describe()}))


def one_run(workers: int, folder: Path, poll_s: float) -> dict[str, object]:
    """``workers`` processes on a fresh database; what they ended with."""
    storage = f"sqlite:///{folder / 'study.db'}"
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", storage, "--poll", str(poll_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for _ in range(workers)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    failed = [
        err.strip().splitlines()[-1:]
        for p, (_, err) in zip(procs, outs, strict=True)
        if p.returncode
    ]
    winners = sorted(
        {
            json.loads(out.strip().splitlines()[-1])["winner"]
            for p, (out, _) in zip(procs, outs, strict=True)
            if p.returncode == 0
        }
    )
    import optuna

    from autotune.jobs._claims import storage_of

    left = sorted(optuna.get_all_study_names(storage_of(storage)))
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "crashed": len(failed),
        "errors": failed,
        "winners": winners,
        "studies_left": left,
        "ok": not failed and len(winners) == 1 and left == ["shared"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("workers.json"))
    parser.add_argument(
        "--poll",
        type=float,
        default=0.02,
        help="seconds between a waiting worker's reads (the tuner's is 0.5; less is harsher)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        work(args.worker, args.poll)
        return
    runs = []
    for index in range(args.runs):
        with tempfile.TemporaryDirectory() as folder:
            runs.append(one_run(args.workers, Path(folder), args.poll))
        print(index, json.dumps(runs[-1]), flush=True)
    report = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores",
        "workers": args.workers,
        "poll_s": args.poll,
        "runs": runs,
        "ok_runs": sum(bool(r["ok"]) for r in runs),
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{report['ok_runs']} of {len(runs)} runs ended with one winner and no claim left")


if __name__ == "__main__":
    main()
