"""The job's first step with and without the tuner's compile cache (issue 57).

Tunes the test suite's pointwise-chain model (``tests/pointwise_chain.py``: two blocks that
compiling speeds up several times on any CPU, so that the winner compiles) with compiled
blocks searched (fp32, one thread) in a process of its own, then runs the tuned config's
first training step in fresh processes, each with an empty inductor cache: three with
the compile cache beside the YAML, three without it, in turn.

    python benchmarks/compile_cache.py --out benchmarks/results/compile-cache-cpu.json  # ~3 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]

FIRST_STEP = """
import json, sys, time
t0 = time.perf_counter()
import torch
from torch._dynamo.utils import counters
import autotune
from pointwise_chain import chained, loss
torch.set_num_threads(1)
runner = autotune.prepare(chained(), autotune.load(sys.argv[1]), loss_fn=loss)
batch = torch.randn(16, 16, 32)
started = time.perf_counter()
runner.step(batch)
first = time.perf_counter() - started
started = time.perf_counter()
runner.step(batch)
second = time.perf_counter() - started
print("ROW " + json.dumps({
    "first_step_s": first, "second_step_s": second, "process_s": time.perf_counter() - t0,
    "fxgraph_hits": counters["inductor"]["fxgraph_cache_hit"],
    "fxgraph_misses": counters["inductor"]["fxgraph_cache_miss"],
}))
"""


def _run(code: list[str], path: Path, cache_dir: Path) -> str:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "PYTHONPATH": os.pathsep.join([str(_ROOT / "tests"), *sys.path]),
    }
    done = subprocess.run(
        [sys.executable, *code, str(path)], capture_output=True, text=True, env=env
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path = work / "tuned.yaml"
        tuned = _run([str(_ROOT / "tests" / "pointwise_chain.py")], path, work / "tuner")
        config = next(x for x in tuned.splitlines() if x.startswith("TUNED "))[6:]
        cache = path.with_suffix(".compile-cache")
        size = cache.stat().st_size
        rows: dict[str, list[dict[str, Any]]] = {"with_cache": [], "without_cache": []}
        for i in range(args.repeats):  # in turn, so that a slow spell hits both alike
            for name in rows:
                if name == "without_cache":
                    cache.rename(work / "kept")
                try:
                    out = _run(["-c", FIRST_STEP], path, work / f"job-{name}-{i}")
                finally:
                    if name == "without_cache":
                        (work / "kept").rename(cache)
                row = json.loads(next(x for x in out.splitlines() if x.startswith("ROW "))[4:])
                rows[name].append(row)
                print(f"{name:14} first step {row['first_step_s']:6.2f} s  {row}", flush=True)
    summary = {
        name: {
            "first_step_s_median": statistics.median(r["first_step_s"] for r in runs),
            "first_step_s_range": [
                min(r["first_step_s"] for r in runs),
                max(r["first_step_s"] for r in runs),
            ],
        }
        for name, runs in rows.items()
    }
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "config": config,
        "cache_bytes": size,
        "summary": summary,
        "rows": rows,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
