"""The cost model against real measurements on CPU, where the tracker is exact.

The profile is measured at micro-batch sizes 2 and 4, kept and fully checkpointed; the
model must then predict other sizes, accumulation and mixed checkpoint masks.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from autotune._profile_data import TimeCurve
from autotune.config import Timeline, TrainConfig
from autotune.cost._cost_model import CHECKPOINT, KEEP, SELECTIVE, CostModel
from autotune.cost._cost_model import min_cost_cover as _min_cost_cover
from autotune.cost._knobs import Knobs
from autotune.verify._verifier import Verifier

CPU = torch.device("cpu")


def measured_peak(model: torch.nn.Module, sample: object, config: TrainConfig) -> int:
    verifier = Verifier(
        copy.deepcopy(model), sample, device=CPU, budget_bytes=2**40, loss_fn=None, steps=1
    )
    measured, error = verifier.trial(config)
    assert error is None
    assert measured is not None
    return measured.peak_bytes


def assert_close_bytes(predicted: int, measured: int, rel: float = 0.01) -> None:
    assert abs(predicted - measured) <= rel * measured, (predicted, measured)


@pytest.mark.parametrize(
    ("b", "accum", "precision", "mask", "optimizer", "selective"),
    [
        (1, 1, "fp32", (), "adamw", ()),
        (8, 1, "fp32", (), "adamw", ()),
        (16, 1, "fp32", ("blocks.0", "blocks.2"), "adamw", ()),
        (6, 3, "fp32", ("blocks.1",), "adamw", ()),
        (12, 2, "bf16", ("blocks.0", "blocks.1", "blocks.2"), "adamw", ()),
        (8, 4, "bf16", (), "sgd", ()),
        (3, 1, "fp32", ("blocks.0", "blocks.1", "blocks.2"), "sgd", ()),
        # autocast caches weight casts until the forward ends; a mixed mask must not
        # leak them once per accumulated micro-batch
        (1, 16, "bf16", ("blocks.1",), "adamw", ()),
        # selectively checkpointed blocks, alone and beside kept and checkpointed ones
        (8, 1, "fp32", (), "adamw", ("blocks.0", "blocks.1", "blocks.2")),
        (16, 2, "fp32", ("blocks.0",), "adamw", ("blocks.2",)),
        (12, 1, "bf16", (), "adamw", ("blocks.1",)),
        (5, 3, "bf16", ("blocks.2",), "sgd", ("blocks.0", "blocks.1")),
        (1, 8, "bf16", (), "adamw", ("blocks.0", "blocks.1", "blocks.2")),
    ],
)
def test_predicted_peak_matches_measured(
    gpt_profile, gpt3_model, gpt3_sample, b, accum, precision, mask, optimizer, selective
):
    config = TrainConfig(
        micro_batch_size=b,
        grad_accum_steps=accum,
        precision=precision,
        checkpoint=mask,
        selective_checkpoint=selective,
        optimizer=optimizer,
    )
    predicted, parts = CostModel(gpt_profile).memory(config)
    measured = measured_peak(gpt3_model, gpt3_sample, config)
    assert_close_bytes(predicted, measured)
    if selective and b >= 2:  # the new choice is replayed exactly, to the byte, from the
        # profiled sizes (2 and 4) up; below them a line through 2 and 4 may miss a little
        assert predicted == measured
    assert min(dataclasses.astuple(parts)) >= 0  # nothing holds negative bytes
    assert parts.parameters == gpt_profile.param_bytes
    assert parts.optimizer == gpt_profile.optimizers[optimizer].state_bytes


def test_checkpointing_lowers_the_predicted_peak(gpt_profile):
    cost = CostModel(gpt_profile)
    none = cost.peak_of(Knobs.given("fp32", "adamw", 16, 1, (False,) * 3))
    some = cost.peak_of(Knobs.given("fp32", "adamw", 16, 1, (True, False, False)))
    full = cost.peak_of(Knobs.given("fp32", "adamw", 16, 1, (True,) * 3))
    assert none > some > full
    # Keeping the matrix products' outputs costs memory that full checkpointing saves.
    selective = cost.peak_of(Knobs.given("fp32", "adamw", 16, 1, (SELECTIVE,) * 3))
    assert none > selective > full


def test_plan_finds_the_cheapest_fitting_mask(gpt_profile):
    cost = CostModel(gpt_profile)
    none = cost.peak_of(Knobs.given("fp32", "adamw", 16, 1, (False,) * 3))
    full = cost.peak_of(Knobs.given("fp32", "adamw", 16, 1, (True,) * 3))
    assert cost.fitting_mask(Knobs.given("fp32", "adamw", 16, 1), none) == (False,) * 3
    assert cost.fitting_mask(Knobs.given("fp32", "adamw", 16, 1), full - 1) is None
    limit = (none + full) // 2
    mask = cost.fitting_mask(Knobs.given("fp32", "adamw", 16, 1), limit)
    assert mask is not None
    assert cost.peak_of(Knobs.given("fp32", "adamw", 16, 1, mask)) <= limit
    # Identical blocks: no fitting mask checkpoints fewer blocks.
    fewer = [m for m in _all_masks(3) if sum(m) < sum(mask)]
    assert all(cost.peak_of(Knobs.given("fp32", "adamw", 16, 1, m)) > limit for m in fewer)


def _all_masks(n: int) -> list[tuple[bool, ...]]:
    return [tuple(bool(i >> k & 1) for k in range(n)) for i in range(2**n)]


def test_min_cost_cover_is_exact_on_heterogeneous_items():
    savings = [5.0, 4.0, 3.0, 7.0, 1.0]
    costs = [4.0, 1.0, 1.5, 6.0, 0.2]
    for need in (1.0, 4.5, 8.0, 12.0, 19.0):
        mask = _min_cost_cover(savings, costs, need)
        assert mask is not None
        assert sum(s for s, m in zip(savings, mask, strict=True) if m) >= need
        best = min(
            sum(c for c, m in zip(costs, ms, strict=True) if m)
            for ms in _all_masks(5)
            if sum(s for s, m in zip(savings, ms, strict=True) if m) >= need
        )
        assert sum(c for c, m in zip(costs, mask, strict=True) if m) == pytest.approx(best)
    assert _min_cost_cover(savings, costs, 100.0) is None


def test_time_curve_interpolates_and_extrapolates():
    curve = TimeCurve((1, 4, 16), (1.0, 2.0, 6.0), (2, 8), (0.3, 0.5))
    assert curve.fwd_bwd(4) == 2.0
    assert curve.fwd_bwd(10) == pytest.approx(4.0)
    assert curve.fwd_bwd(32) == pytest.approx(12.0)  # per-sample cost of the largest size
    assert curve.recompute(2) == pytest.approx(0.3 * curve.fwd_bwd(2))
    assert curve.recompute(32) == pytest.approx(0.5 * curve.fwd_bwd(32))
    assert 0.3 * curve.fwd_bwd(4) < curve.recompute(4) < 0.5 * curve.fwd_bwd(4)


def test_profile_survives_json(gpt_profile) -> None:
    from autotune._profile_data import profile_from_json, profile_to_json

    timed = dataclasses.replace(
        gpt_profile,
        precisions={
            p: dataclasses.replace(pp, time=TimeCurve((1, 4), (0.1, 0.3), (2,), (0.3,)))
            for p, pp in gpt_profile.precisions.items()
        },
    )
    again = profile_from_json(profile_to_json(timed))
    assert again == timed
    config = TrainConfig(micro_batch_size=5, grad_accum_steps=3, checkpoint=("blocks.1",))
    assert CostModel(again).predict(config) == CostModel(timed).predict(config)


def test_plan_with_selective_checkpointing_is_the_brute_force_optimum(gpt_profile) -> None:
    """With a fourth choice per block the knapsack still finds the fastest fitting mask."""
    import itertools

    curve = TimeCurve((1, 4, 16), (0.01, 0.03, 0.1), (4, 16), (0.3, 0.35), (0.12, 0.2))
    timed = dataclasses.replace(
        gpt_profile,
        precisions={
            p: dataclasses.replace(pp, time=curve) for p, pp in gpt_profile.precisions.items()
        },
        block_weights=(0.5, 0.3, 0.2),  # unequal blocks: "the first k" is not the answer
    )
    cost = CostModel(timed)
    knobs = Knobs(timeline=Timeline("fp32"), optimizer="adamw", micro_batch=16, accum=1)
    none = cost.peak_of(knobs.masked((KEEP,) * 3))
    full = cost.peak_of(knobs.masked((CHECKPOINT,) * 3))
    every = [knobs.masked(m) for m in itertools.product((KEEP, CHECKPOINT, SELECTIVE), repeat=3)]
    chose_selective = False
    for limit in [full + (none - full) * k // 12 for k in range(1, 12)]:
        mask = cost.fitting_mask(knobs, limit)
        assert mask is not None
        planned = knobs.masked(mask)
        assert cost.peak_of(planned) <= limit
        best = min(cost.step_s_of(k) for k in every if cost.peak_of(k) <= limit)
        assert cost.step_s_of(planned) == pytest.approx(best)
        chose_selective |= SELECTIVE in mask
        without = cost.fitting_mask(knobs, limit, selective=False)
        assert without is not None and SELECTIVE not in without
        assert cost.step_s_of(planned) <= cost.step_s_of(knobs.masked(without))
    assert chose_selective  # at some budget the cheaper recomputation pays


def test_knobs_are_what_the_cost_model_reads_of_a_config(gpt_profile) -> None:
    """A config's knobs predict what the config does, and name its blocks back; the
    knobs given one by one predict the same."""
    config = TrainConfig(
        micro_batch_size=6,
        grad_accum_steps=3,
        precision="bf16",
        checkpoint=("blocks.0",),
        selective_checkpoint=("blocks.2",),
        optimizer="sgd",
    )
    cost = CostModel(gpt_profile)
    knobs = cost.knobs(config)
    mask = (CHECKPOINT, KEEP, SELECTIVE)
    bf16 = Timeline("bf16")
    assert knobs == Knobs(timeline=bf16, optimizer="sgd", micro_batch=6, accum=3, mask=mask)
    assert knobs.config(gpt_profile.blocks) == config
    assert Knobs.given("bf16", "sgd", 6, 3, mask) == knobs
    assert cost.peak_of(knobs) == cost.memory(config)[0] == cost.peaks_of(knobs)[0]
    assert (
        cost.fitting_mask(knobs, 2**40)
        == cost.fitting_mask(Knobs.given("bf16", "sgd", 6, 3), 2**40)
        == (KEEP,) * 3
    )
