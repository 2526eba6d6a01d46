"""Data-parallel training on real processes (gloo on CPU): every rank's peak as predicted
from one process's profile and, for FSDP2, as traced on fake tensors in one process (byte
for byte), and the same losses as one process over the same global batch."""

from __future__ import annotations

import pytest
from ranks import run
from sweeps import sweep

CASES = [
    {
        "model": "mlp",
        "parallel": "fsdp",
        "micro": 64,
        "accum": 1,
        "checkpoint": ["1.1"],
        "keep": ["1.2"],
    },
    {"model": "mlp-frozen", "parallel": "fsdp", "micro": 16, "accum": 2},
    {"model": "mlp", "parallel": "fsdp", "micro": 16, "accum": 1, "offload": True},
    {"model": "gpt", "parallel": "ddp", "micro": 4, "accum": 2, "selective": ["blocks.0"]},
    # Padded rows of very different lengths, a token mean: the ranks weigh their tokens
    # against every rank's (not each its own mean), as one process over the global batch.
    {"model": "gpt-padded", "parallel": "ddp", "micro": 2, "accum": 2, "loss_mean": "tokens"},
    {
        "model": "gpt",
        "parallel": "fsdp",
        "micro": 4,
        "accum": 2,
        "precision": "bf16",
        "checkpoint": ["blocks.0"],
        "selective": ["blocks.1"],
    },
]
"""One case of each kind (FSDP2 with blocks checkpointed and kept gathered, a frozen
part, the optimizer offloaded, DDP with selective checkpointing, a token mean over padded
rows, bf16 with every block choice); ``benchmarks/parallel.py`` predicts more configs and
shapes at 1, 2 and 4 ranks."""


@pytest.mark.parametrize("world", sweep([2, 4], [2]))
def test_every_rank_within_3_percent_and_same_losses_as_one_process(world: int) -> None:
    # At 4 ranks FSDP2's cases (its shards change with the world size; DDP's ranks hold
    # the whole model at any size, checked at 2).
    cases = CASES if world == 2 else [CASES[0], CASES[-1]]
    results = run(world, {"cases": cases, "trace": True})
    traced = []  # (traced, its least measured step), of the first and the last rank
    for i, spec in enumerate(cases):
        for rank, rows in enumerate(results):
            r = rows[i]
            low, high = min(r["measured"]), max(r["measured"])
            if spec["parallel"] == "fsdp" and rank in (0, world - 1):
                traced.append((r["traced"], low))
            assert abs(r["predicted"] - low) <= 0.03 * low, (spec, rank, r["predicted"], low)
            # On gloo a reduce-scatter's buffer is sometimes freed late by gloo's own thread
            # (run to run; at most a unit's whole gradient, the MLP block's 132 KB: 10% of
            # its 1.3 MB a rank at 4 ranks): over the prediction by at most that.
            assert high <= r["predicted"] * 1.10, (spec, rank, r["predicted"], high)
            tol = 2e-2 if spec.get("precision") == "bf16" else 1e-5
            assert r["losses"] == pytest.approx(r["reference"], rel=tol), (spec, rank)
        # Ranks agree: same losses, same prediction.
        assert len({tuple(rows[i]["losses"]) for rows in results}) == 1
        assert len({rows[i]["predicted"] for rows in results}) == 1
    # The rank traced alone on a fake process group of `world` ranks (fake tensors,
    # nothing sent) holds what it held for real, byte for byte (the last rank's shards
    # are shorter: its own figure), unless gloo freed a buffer late in both measured steps.
    assert all(t <= low <= t + 132 * 1024 for t, low in traced), traced
    assert sum(t == low for t, low in traced) >= 0.8 * len(traced), traced


def test_fsdp2_prediction_peak_memory_and_an_independent_count_agree() -> None:
    """Read from before the first step, when FSDP2 has not yet made the storage it
    gathers parameters into: ``peak_memory`` follows it as it is made and freed by
    resizing (it once counted it whole for good: 20% over), and agrees with a count
    that shares nothing with autotune's tracker."""
    spec = {"model": "gpt", "parallel": "fsdp", "micro": 4, "accum": 2, "checkpoint": ["blocks.0"]}
    for rank, r in enumerate(run(2, {"readings": spec})):
        # The count also holds the three batches, made before the block.
        counted = r["count"] - r["batches"]
        assert abs(r["peak_memory"] - counted) <= 1e-3 * counted, (rank, r)
        assert abs(r["predicted"] - counted) <= 0.03 * counted, (rank, r)


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_a_nan_in_one_rank_s_gradients_is_refused_by_every_rank(parallel: str) -> None:
    # Under FSDP the NaN sits in one rank's shard only: that rank alone must not refuse
    # the step (the others would step, and the next collective would hang).
    results = run(2, {"nonfinite": {"parallel": parallel}})
    for rank, r in enumerate(results):
        assert r == {"raised": True, "unchanged": True, "next_step_trained": True}, (rank, r)
