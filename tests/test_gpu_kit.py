"""The GPU kit's one command, smoke-run on the CPU at tiny shapes (``KIT_SMOKE=1``).

A GPU is lent briefly and rarely: the command it runs first (``bash benchmarks/gpu_kit.sh
all``) must not spend its minutes on a script error. This runs the same script, the
same job definitions, the same expert's loop and the same table on the CPU: every job
tuned and run by the expert, nothing over its budget, one table at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sweeps import sweep

ROOT = Path(__file__).resolve().parent.parent


JOBS = ["llama-1b", "qlora-7b", "gpt2-124m"]


@pytest.mark.slow
@pytest.mark.parametrize("jobs", sweep(["gpt2-124m", " ".join(JOBS)], ["gpt2-124m"]))
def test_the_kit_runs_every_step_and_prints_one_table(tmp_path: Path, jobs: str) -> None:
    """CI runs every step with one job (GPT-2's, the one each GPU call runs first); ``-m
    sweep`` runs the three, as a GPU call does: run it before one."""
    env = {**os.environ, "KIT_SMOKE": "1", "OUT": str(tmp_path), "KIT_SMOKE_JOBS": jobs}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # this python
    done = subprocess.run(
        ["bash", "benchmarks/gpu_kit.sh", "all"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for step in ("tests", "calibrate", "jobs"):
        assert f"== {step}: exit 0" in done.stderr, done.stderr[-3000:]
    report = json.loads((tmp_path / "jobs.json").read_text())
    assert [r["job"] for r in report["rows"]] == [j for j in JOBS if j in jobs.split()]
    for row in report["rows"]:
        assert "error" not in row, row["error"]
        assert row["over_budget"] == 0 and row["measured_peak"] <= row["budget_bytes"]
        assert row["expert"]["best"] is not None, row["expert"]
        assert row["tuned_over_expert"] > 0 and row["flops_per_token"] > 0
    qlora = [r for r in report["rows"] if r["job"] == "qlora-7b"]
    assert all(r["expert"]["best"]["optimizer"] == "paged_adamw8bit" for r in qlora)
    # The tuned arm timed again by the expert's harness; the run's own expert beside it.
    assert all(r["tuned_samples_per_s"] > 0 and "run_expert" in r for r in report["rows"])
    # The job's first step in a new process, from the saved YAML (no cache: none compiled).
    assert all(r["first_step_s"] > 0 and "first_step_error" not in r for r in report["rows"])
    calibration = json.loads((tmp_path / "calibration.json").read_text())
    assert {p["variant"] for p in calibration["points"]} == {"kept", "ckpt"}
    table = done.stdout.splitlines()
    assert sum(line.startswith(("| gpt2", "| llama", "| qlora")) for line in table) == len(
        jobs.split()
    )
