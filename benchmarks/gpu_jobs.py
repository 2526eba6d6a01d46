"""The three GPU jobs (benchmarks/jobs.py) tuned, held to the budget, against the expert.

For each job and budget: the tuner runs (``autotune.autotune``, cold compiler on the
first job of the process) while NVML is sampled every millisecond; then its config is
timed again through autotune's runner, and the expert's compiled config
(benchmarks/expert.py) runs under the same budget, both by one harness
(benchmarks/harness.py: batch on the device, the same warm-up and syncs, no NVML thread). Recorded: both configs
and their measured throughput, MFU (benchmarks/mfu.py), every verified trial's peak and
step time predicted against measured, what the driver saw the tuning run hold against the
budget, and where the tuning seconds went; and the job's first training step in a new
process, from the saved YAML, with the tuner's compile cache beside it and (where the
config compiles) without it. The JSON is rewritten after every row, so a run stopped at
its time limit keeps what it measured; ``--table DIR`` prints the kit's one table from
what a run left there.

    python benchmarks/gpu_jobs.py --out jobs.json                         # on a GPU
    python benchmarks/gpu_jobs.py --smoke --device cpu --out /tmp/j.json  # CI's smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see run.py)

import argparse
import copy
import datetime
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune
from autotune.device import backend_for
from autotune.result import compile_cache_path
from benchmarks.expert import expert_config
from benchmarks.harness import time_runner
from benchmarks.jobs import Job, budget_bytes, jobs
from benchmarks.mfu import flops_per_token, mfu
from benchmarks.nvml_sampler import NvmlSampler

GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, MiB budgets (CPU)")
    parser.add_argument("--only", nargs="*", help="only these jobs, e.g. gpt2-124m qlora-7b")
    parser.add_argument("--budgets", nargs="*", help="only these budgets, e.g. 24GiB card")
    parser.add_argument("--out", type=Path, default=Path("jobs.json"))
    parser.add_argument("--table", type=Path, help="print the table of the results in DIR")
    parser.add_argument("--first-step", nargs=2, metavar=("JOB", "YAML"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--cold-first-step",
        action="store_true",
        help="also time the first step without the tuner's compile cache",
    )
    args = parser.parse_args(argv)
    if args.table is not None:
        print(table(args.table))
        return 0
    if args.first_step is not None:
        name, path = args.first_step
        job = next(j for j in jobs(smoke=args.smoke) if j.name == name)
        print("FIRST " + json.dumps(first_step(job, Path(path), torch.device(args.device))))
        return 0
    device = torch.device(args.device)
    index = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
    sampler = NvmlSampler(device, index=index)  # before CUDA starts here: the idle level
    idle = sampler.used() or 0
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "torch": str(torch.__version__),
        "device": _device_name(device),
        "driver": _driver(),
        "rows": [],
    }
    for job, budget in rows(jobs(smoke=args.smoke), args.only, args.budgets):
        row: dict[str, Any] = {"job": job.name, "budget": budget, "notes": job.notes}
        report["rows"].append(row)

        def save() -> None:
            args.out.write_text(json.dumps(report, indent=1, default=str))

        try:
            run_job(job, budget, device, sampler, idle, row, save, smoke=args.smoke,
                    cold_first_step=args.cold_first_step)  # fmt: skip
        except KeyboardInterrupt:  # the kit's slot ended: the row keeps what finished
            row["cut"] = row.get("phase", "build")
            save()
            print(json.dumps({"job": job.name, "cut": row["cut"]}), flush=True)
            return 0
        except Exception as exc:  # one job's failure is its row's, the next job still runs
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        row.pop("phase", None)
        save()
        print(json.dumps({k: v for k, v in row.items() if k != "trials"}), flush=True)
        gc.collect()
        backend_for(device).empty_cache()
    return 0


def rows(
    every: list[Job], only: list[str] | None, budgets: list[str] | None
) -> list[tuple[Job, str]]:
    """The (job, budget) rows to run, each job's first budget first (24 GiB for all
    three), so that a run stopped at its time limit has measured every job once."""
    picked = [j for j in every if not only or j.name in only]
    most = max((len(j.budgets) for j in picked), default=0)
    return [
        (j, j.budgets[i])
        for i in range(most)
        for j in picked
        if i < len(j.budgets) and (not budgets or j.budgets[i] in budgets)
    ]


def run_job(
    job: Job,
    budget: str,
    device: torch.device,
    sampler: NvmlSampler,
    idle: int,
    row: dict[str, Any],
    save: Callable[[], None],
    *,
    smoke: bool,
    cold_first_step: bool = False,
) -> None:
    """Tune ``job`` at ``budget`` into ``row``, then run the expert's config beside it.
    The phases run in the order their figures matter (the tuner's config and peaks, the
    tuned config timed again, the expert's, the first step in a new process); ``save``
    writes the row after each, so a job stopped at its slot keeps what finished
    (``row["phase"]``: the one running)."""
    started = time.perf_counter()
    row["phase"] = "build"
    try:
        model = job.build(device)
    except ImportError as exc:  # QLoRA without bitsandbytes: the other jobs still run
        row["error"] = f"cannot build the model: {exc}"
        return
    row["build_s"] = time.perf_counter() - started
    nbytes = budget_bytes(budget, device)
    row["budget_bytes"] = nbytes
    flops = flops_per_token(model, **job.shape)
    row["flops_per_token"] = flops
    name = row["device"] = _device_name(device)
    ops = backend_for(device)
    held = ops.foreign_bytes()  # the job's own model on the device (QLoRA's base)
    row["phase"] = "tuning"
    save()
    compiled = _dynamo_counts()
    with sampler:
        result = autotune.autotune(
            model,
            job.sample(min(job.global_batch_size, 8)),
            budget_gb=nbytes / GIB,
            global_batch_size=job.global_batch_size,
            device=device,
            space=job.space,
            seed=0,
        )
    if sampler.used() is not None:  # what the driver saw, less the job's model held before
        row["driver_tuning_bytes"] = sampler.peak - idle - held
    row.update(_tuned(result, flops, job.shape["seq"], name))
    row["tuning_dynamo"] = _dynamo_counts(since=compiled)
    row["tuning_alloc_retries"] = _alloc_retries(device)
    if result.expert is not None and result.expert.measured is not None:
        row["run_expert"] = result.expert.config.describe()  # the recipe inside the run
        row["run_expert_samples_per_s"] = result.expert.measured.samples_per_s
    row["run_expert_note"] = result.expert_note  # why not, or how it differs
    row["phase"] = "timing the tuned config"
    save()
    # The tuned config timed again as the expert is: same harness, batch on the device,
    # no NVML thread (sampled while tuning, never while timing).
    work = model if job.name.startswith("qlora") else copy.deepcopy(model)
    timing = time_runner(work, result, job.sample(job.global_batch_size), device)
    del work
    row["tuned_verified_samples_per_s"] = row["tuned_samples_per_s"]
    row["tuned_samples_per_s"] = timing.samples_per_s(job.global_batch_size)
    row["tuned_spread"] = timing.spread
    row["tuned_mfu"] = mfu(row["tuned_samples_per_s"], flops, job.shape["seq"], name)
    row["phase"] = "the expert's configs"
    save()
    compiled = _dynamo_counts()
    expert = expert_config(
        model,
        job.sample,
        job.global_batch_size,
        nbytes,
        device,
        optimizer=job.expert_optimizer,
        checkpointing=job.expert_checkpointing,
        backend="eager" if smoke else "inductor",
        in_place=job.name.startswith("qlora"),
    )
    row["expert"] = expert.as_dict()
    row["expert_dynamo"] = _dynamo_counts(since=compiled)
    row["expert_alloc_retries"] = _alloc_retries(device)
    best = expert.best
    row["expert_samples_per_s"] = best.samples_per_s if best else None
    row["expert_mfu"] = mfu(best.samples_per_s if best else None, flops, job.shape["seq"], name)
    if best and best.samples_per_s and row.get("tuned_samples_per_s"):
        row["tuned_over_expert"] = row["tuned_samples_per_s"] / best.samples_per_s
    row["phase"] = "the first step in a new process"
    save()
    row.update(first_steps(job, result, device, smoke=smoke, cold=cold_first_step))
    row["wall_s"] = time.perf_counter() - started


def _dynamo_counts(since: dict[str, int] | None = None) -> dict[str, int]:
    """Frames dynamo compiled (each a compile or a recompile), the graphs they made and
    the graph breaks so far in this process (dynamo's own counters), less those of
    ``since``; the kit logs each recompile's and break's reason too
    (``TORCH_LOGS=recompiles,graph_breaks``)."""
    from torch._dynamo.utils import counters

    now = {
        "frames": int(counters["frames"]["ok"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }
    return {k: v - (since or {}).get(k, 0) for k, v in now.items()}


def _alloc_retries(device: torch.device) -> int | None:
    """Times the caching allocator freed its cache and retried a request so far (each a
    synchronisation: a budget held too tightly shows here); ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


_FIRST_STEP_S = 120
"""The most a new process may take to build the job and take its first step."""


def first_steps(
    job: Job, result: autotune.TuneResult, device: torch.device, *, smoke: bool, cold: bool
) -> dict[str, Any]:
    """The tuned config's first training step in new processes, each with an inductor
    cache of its own (empty): with the tuner's compile cache beside the saved YAML, then
    (``cold``), where there is one, without it. Each entry: ``first_step_s``
    (``..._without_cache``), or the error that stopped it."""
    out: dict[str, Any] = {"compiles": result.compiles}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tuned.yaml"
        cache = compile_cache_path(result.save(path))
        kinds = ["first_step"] + (["first_step_without_cache"] if cold and cache.is_file() else [])
        for kind in kinds:
            if kind == "first_step_without_cache":
                cache.unlink()
            command = [sys.executable, __file__, "--first-step", job.name, str(path)]
            command += ["--device", str(device)] + (["--smoke"] if smoke else [])
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / kind)}
            try:
                done = subprocess.run(
                    command, capture_output=True, text=True, env=env, timeout=_FIRST_STEP_S
                )
            except subprocess.TimeoutExpired:
                out[f"{kind}_error"] = f"over {_FIRST_STEP_S} s"
                continue
            line = next((x for x in done.stdout.splitlines() if x.startswith("FIRST ")), None)
            if done.returncode or line is None:
                out[f"{kind}_error"] = done.stderr[-1000:]
                continue
            for key, value in json.loads(line[6:]).items():
                out[key.replace("first_step", kind, 1)] = value
    return out


def first_step(job: Job, path: Path, device: torch.device) -> dict[str, float]:
    """The job's first two training steps from the YAML at ``path`` in this (new)
    process: ``prepare()`` loads the compile cache beside it before anything compiles."""
    started = time.perf_counter()
    model = job.build(device)
    batch = job.sample(job.global_batch_size)
    on_device = {k: v.to(device) for k, v in batch.items()}
    ops = backend_for(device)
    with autotune.prepare(model, autotune.load(path), lr=1e-5, device=device) as runner:
        ready = time.perf_counter()
        runner.step(on_device)
        ops.synchronize()
        first = time.perf_counter()
        runner.step(on_device)
        ops.synchronize()
        second = time.perf_counter()
    return {
        "first_step_s": first - ready,
        "first_step_second_s": second - first,
        "first_step_build_s": ready - started,
    }


def _tuned(result: autotune.TuneResult, flops: float, seq: int, gpu: str) -> dict[str, Any]:
    """The tuned config, its figures, and every verified trial's errors."""
    trials = [
        {
            "config": t.config.describe(),
            "predicted_peak": t.predicted.peak_bytes,
            "measured_peak": t.measured.peak_bytes if t.measured else None,
            "predicted_step_s": t.predicted.step_s,
            "measured_step_s": t.measured.step_s if t.measured else None,
            "error": t.error,
        }
        for t in result.trials
    ]
    peak_errors = [
        abs(t["predicted_peak"] / t["measured_peak"] - 1) for t in trials if t["measured_peak"]
    ]
    step_errors = [
        abs(t["predicted_step_s"] / t["measured_step_s"] - 1)
        for t in trials
        if t["measured_step_s"]
    ]
    sps = result.measured.samples_per_s
    return {
        "tuned": result.config.describe(),
        "tuned_compile_level": result.config.compile_level,
        "tuned_samples_per_s": sps,
        "tuned_mfu": mfu(sps, flops, seq, gpu),
        "tuning_s": result.tuning_s,
        "spent": result.spent.__dict__,
        "predicted_peak": result.predicted.peak_bytes,
        "measured_peak": result.measured.peak_bytes,
        "peak_error_median": statistics.median(peak_errors) if peak_errors else None,
        "peak_error_max": max(peak_errors, default=None),
        "step_error_median": statistics.median(step_errors) if step_errors else None,
        "over_budget": sum(1 for t in trials if (t["measured_peak"] or 0) > result.budget_bytes),
        "trials": trials,
    }


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # no NVML (a CPU machine)
        return None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def table(where: Path) -> str:
    """The kit's table: every job row in ``where/jobs*.json``, with the CUDA tests' count
    and the calibration files found beside it."""
    lines = []
    tests = where / "cuda-tests.xml"
    if tests.exists():
        import xml.etree.ElementTree as ET

        suite = ET.parse(tests).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        lines.append(
            f"CUDA tests: {suite.get('tests')} run, {suite.get('failures')} failed, "
            f"{suite.get('errors')} errors, {suite.get('skipped')} skipped"
        )
    for name in ("calibration.json", "calibration-expandable.json"):
        if (where / name).exists():
            points = json.loads((where / name).read_text()).get("points", [])
            shares = [
                (p["reserved"] - p["allocated"]) / p["allocated"]
                for p in points
                if p.get("reserved") and p.get("allocated")
            ]
            lines.append(
                f"{name}: {len(points)} points, reserved over allocated "
                f"{_pct(min(shares, default=None))} to {_pct(max(shares, default=None))}"
            )
    for jobs_file in sorted(where.glob("jobs*.json")):  # the kit's all, then jobs-rest
        report = json.loads(jobs_file.read_text())
        lines.append(
            f"{report['device']}, driver {report.get('driver')}, torch {report['torch']}, "
            f"{report['date']}"
        )
        lines += _job_rows(report["rows"])
    return "\n".join(lines)


def _job_rows(rows: list[dict[str, Any]]) -> list[str]:
    head = (
        "| job | budget | tuned | samples/s | expert | samples/s | tuned/expert | MFU tuned "
        "| MFU expert | peak err med/max | step err med | driver seen tuning | tuning s "
        "| first step s, cache / none |"
    )
    out = [head, "|" + "---|" * 14]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['job']} | {r['budget']} | {r['error'][:80]} |" + " |" * 11)
            continue
        if "tuned" not in r:  # cut before the tuner finished
            out.append(f"| {r['job']} | {r['budget']} | cut while {r.get('cut')} |" + " |" * 11)
            continue
        first = f"{_num(r.get('first_step_s'))} / {_num(r.get('first_step_without_cache_s'))}"
        seen = r.get("driver_tuning_bytes")
        seen_s = "-" if seen is None else f"{seen / GIB:.2f} / {r['budget_bytes'] / GIB:.2f} GiB"
        expert = r["expert"]["config"] if "expert" in r else f"cut while {r.get('cut')}"
        out.append(
            f"| {r['job']} | {r['budget']} | {r['tuned']} | {_num(r['tuned_samples_per_s'])} "
            f"| {expert} | {_num(r.get('expert_samples_per_s'))} "
            f"| {_num(r.get('tuned_over_expert'), '.2f')} | {_pct(r.get('tuned_mfu'))} "
            f"| {_pct(r.get('expert_mfu'))} "
            f"| {_pct(r['peak_error_median'])} / {_pct(r['peak_error_max'])} "
            f"| {_pct(r['step_error_median'])} | {seen_s} | {_num(r['tuning_s'], '.0f')} "
            f"| {first} |"
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
