"""The GPU kit's one command, smoke-run on the CPU at tiny shapes (``KIT_SMOKE=1``).

A GPU is lent briefly and rarely: the command it runs first (``bash benchmarks/gpu_kit.sh
all``) must not spend its minutes on a script error. This runs the same script, the
same job definitions, the same expert's loop and the same table on the CPU: every job
tuned and run by the expert, nothing over its budget, one table at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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
    names = jobs.split()
    for step in ("preflight", *names, "traces", "traces-expandable", "slots"):
        assert f"== {step}: exit 0" in done.stderr, done.stderr[-3000:]
    # GPT-2 first, in a slot of its own; each job's rows in a file of its own.
    order = [line.split()[1] for line in done.stderr.splitlines() if line.endswith("s)")]
    assert order[:2] == ["preflight", "gpt2-124m"], order
    rows = [json.loads((tmp_path / f"jobs-{n}.json").read_text())["rows"] for n in names]
    report = {"rows": [r for job_rows in rows for r in job_rows]}
    assert [r["job"] for r in report["rows"]] == names
    for row in report["rows"]:
        assert "error" not in row and "cut" not in row and "phase" not in row, row
        assert row["over_budget"] == 0 and row["measured_peak"] <= row["budget_bytes"]
        assert row["expert"]["best"] is not None, row["expert"]
        assert row["tuned_over_expert"] > 0 and row["flops_per_token"] > 0
        assert row["tuned_compile_level"] in ("none", "blocks", "model")
        assert set(row["tuning_dynamo"]) == {"frames", "graphs", "graph_breaks"}
    # The dry run: GPT-2's work at the last GPU call's speeds fits its slot.
    assert "gpt2-124m" not in names or "gpt2-124m: " in done.stdout, done.stdout[-2000:]
    qlora = [r for r in report["rows"] if r["job"] == "qlora-7b"]
    assert all(r["expert"]["best"]["optimizer"] == "paged_adamw8bit" for r in qlora)
    # The tuned arm timed again by the expert's harness; the run's own expert beside it,
    # or why not (a busy machine can time its recipe as one that cannot win: left out).
    assert all(r["tuned_samples_per_s"] > 0 for r in report["rows"])
    assert all("run_expert" in r or r["run_expert_note"] for r in report["rows"])
    # The job's first step in a new process, from the saved YAML (no cache: none compiled).
    assert all(r["first_step_s"] > 0 and "first_step_error" not in r for r in report["rows"])
    calibration = json.loads((tmp_path / "calibration.json").read_text())
    assert {(p["variant"], p["micro_batch_size"]) for p in calibration["points"]} == {
        (v, b) for v in ("kept", "ckpt") for b in (2, 4)
    }
    table = done.stdout.splitlines()
    assert sum(line.startswith(("| gpt2", "| llama", "| qlora")) for line in table) == len(
        jobs.split()
    )


def test_the_preflight_refuses_a_machine_without_optuna_with_the_fix(tmp_path: Path) -> None:
    """The GPU machines lack optuna unless the shared set-up brought it: the preflight
    says so, with the line to fix it, before torch is even imported (its slot is 20 s)."""
    (tmp_path / "optuna.py").write_text("raise ModuleNotFoundError(\"No module named 'optuna'\")\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_preflight.py", "--device", "cpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.returncode == 1
    assert "optuna does not import" in done.stderr
    assert "begin the command with `source .gpu/setup.sh &&`" in done.stderr
    assert "refused" in done.stdout
    ready = subprocess.run(
        [sys.executable, "benchmarks/gpu_preflight.py", "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ready.returncode == 0 and "ready" in ready.stdout, ready.stderr


@pytest.mark.slow
def test_a_job_stopped_by_its_slot_keeps_what_finished(tmp_path: Path) -> None:
    """The kit stops a step with SIGINT at its slot's end: the job's row, written after
    each phase, keeps the phases that finished and says where it was cut."""
    out = tmp_path / "jobs.json"
    command = [sys.executable, "benchmarks/gpu_jobs.py", "--smoke", "--device", "cpu"]
    job = subprocess.Popen(
        [*command, "--only", "gpt2-124m", "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not (out.exists() and '"phase": "tuning"' in out.read_text()):
            assert job.poll() is None, job.communicate()[1][-2000:]
            time.sleep(0.2)
        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, err[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["cut"] == "tuning" and row["build_s"] > 0 and "tuned" not in row
    assert (
        "cut while tuning"
        in subprocess.run(
            [*command, "--table", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
        ).stdout
    )


def test_the_dry_run_fails_where_gpt2_s_work_would_outrun_its_slot(tmp_path: Path) -> None:
    """The smoke run's rows at the last GPU call's speeds: the work GPT-2 did there fits
    its slot; twenty verified configs more would not, and the check fails."""
    row = {"job": "gpt2-124m", "trials": [{}] * 4, "expert": {"runs": [{}] * 3}}
    row["first_step_s"] = 1.0

    def check(rows: list[dict[str, object]]) -> subprocess.CompletedProcess[str]:
        (tmp_path / "jobs.json").write_text(json.dumps({"rows": rows}))
        command = [
            sys.executable,
            "benchmarks/kit_slots.py",
            "--check",
            str(tmp_path / "jobs.json"),
        ]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)

    fits = check([row])  # the last H200 call's own counts, and a first step
    assert fits.returncode == 0 and "gpt2-124m: " in fits.stdout and "fits" in fits.stdout
    over = check([{**row, "trials": [{}] * 24}])
    assert over.returncode == 1 and over.stdout.rstrip().endswith("OVER")
