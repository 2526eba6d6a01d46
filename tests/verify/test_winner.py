"""Choosing the winner among verified configurations."""

from __future__ import annotations

import dataclasses

import pytest

from autotune import Measurement, TrainConfig, TrialRecord, VerificationError
from autotune.cost._chooser import Candidate
from autotune.cost._cost_model import Prediction
from autotune.result import Breakdown
from autotune.verify._noise import BUSY, noise
from autotune.verify._winner import (
    choose_winner,
    fastest,
    known_ahead,
    retime_contenders,
    speeds,
    tied_with,
)


def sigma_of(records: list[TrialRecord]) -> float:
    """The noise of one timing that the records' timings say (a quiet machine's prior)."""
    return noise([speeds(r) for r in records if r.measured is not None])


def candidate(b: int, speed: float, peak: int) -> Candidate:
    config = TrainConfig(micro_batch_size=b)
    prediction = Measurement(peak, b / speed, speed)
    return Candidate(config, Prediction(prediction, Breakdown(0, 0, 0, 0, peak)))


def record(b: int, speed: float | None, peak: int = 100, error: str | None = None) -> TrialRecord:
    config = TrainConfig(micro_batch_size=b)
    predicted = Measurement(peak, b / 100.0, 100.0)
    measured = None if speed is None else Measurement(peak, b / speed, speed)
    return TrialRecord(config, predicted, measured, error)


def test_no_fit_is_an_error_that_lists_every_attempt() -> None:
    records = [record(8, None, error="out of memory"), record(4, None, error="over budget")]
    with pytest.raises(VerificationError, match="raise the budget") as info:
        fastest(records)
    assert info.value.attempts == (
        "micro_batch=8 accum=1 fp32 checkpoint=0 adamw: out of memory",
        "micro_batch=4 accum=1 fp32 checkpoint=0 adamw: over budget",
    )


def test_a_near_tie_goes_to_the_smaller_peak() -> None:
    fast = record(8, 100.0, peak=900)
    close = record(4, 99.5, peak=500)  # within 1%: the smaller peak is the safer pick
    slow = record(2, 90.0, peak=100)
    assert fastest([fast, close, slow]) is close
    assert fastest([record(8, 100.0, peak=900), slow]).config.micro_batch_size == 8


def test_the_frugal_sibling_of_a_rejected_candidate_is_verified() -> None:
    """A candidate like one that ran out of memory is that idea's next try, not a repeat;
    one like a candidate that fitted is skipped."""
    ran: list[int] = []

    def measure(config: TrainConfig, predicted: Measurement, beat: float = 0.0) -> TrialRecord:
        ran.append(config.micro_batch_size)
        if config.micro_batch_size > 24:  # the prediction was wrong: it does not fit
            return TrialRecord(config, predicted, None, "out of memory")
        return TrialRecord(config, predicted, predicted, None)

    candidates = [candidate(32, 300.0, 900), candidate(24, 290.0, 700),
                  candidate(20, 280.0, 600), candidate(8, 200.0, 300)]  # fmt: skip
    records = choose_winner(measure, candidates, top=2)
    assert ran == [32, 24, 8]  # 20 is too like 24, which fitted
    assert fastest(records).config.micro_batch_size == 24


def test_another_data_parallel_layout_is_another_idea() -> None:
    """DDP and FSDP2 (resharding or keeping units gathered) at the same micro-batch differ in
    memory and collectives: each is verified; a second DDP candidate like the first is not."""
    ran: list[tuple[str, bool, int]] = []

    def measure(config: TrainConfig, predicted: Measurement, beat: float = 0.0) -> TrialRecord:
        ran.append((config.parallel, bool(config.keep_gathered), config.micro_batch_size))
        return TrialRecord(config, predicted, predicted, None)

    def ranked(b: int, speed: float, **layout: object) -> Candidate:
        config = TrainConfig(micro_batch_size=b, world_size=2, **layout)  # type: ignore[arg-type]
        prediction = Measurement(100, b / speed, speed)
        return Candidate(config, Prediction(prediction, Breakdown(0, 0, 0, 0, 100)))

    candidates = [ranked(8, 300.0, parallel="ddp"), ranked(6, 290.0, parallel="ddp"),
                  ranked(8, 280.0, parallel="fsdp"),
                  ranked(8, 270.0, parallel="fsdp", keep_gathered=("h.0",))]  # fmt: skip
    choose_winner(measure, candidates, top=3)
    assert ran == [("ddp", False, 8), ("fsdp", False, 8), ("fsdp", True, 8)]


def fits(config: TrainConfig, predicted: Measurement) -> TrialRecord:
    """Every config fits and runs at its predicted speed."""
    return TrialRecord(config, predicted, predicted, None)


def test_candidates_that_cannot_beat_the_measured_best_are_not_verified() -> None:
    ran: list[int] = []

    def measure(config: TrainConfig, predicted: Measurement, beat: float = 0.0) -> TrialRecord:
        ran.append(config.micro_batch_size)
        return fits(config, predicted)

    # Speeds as predicted (calibration 1.0): 70 * 1.15 < 100 cannot win, 90 * 1.15 can.
    candidates = [candidate(64, 100.0, 900), candidate(8, 95.0, 300),
                  candidate(2, 90.0, 100), candidate(1, 70.0, 50)]  # fmt: skip
    choose_winner(measure, candidates, top=5)
    assert ran == [64, 8, 2]
    # With one calibration point nothing is skipped yet.
    ran.clear()
    choose_winner(measure, [candidate(64, 100.0, 900), candidate(2, 50.0, 100)], top=5)
    assert ran == [64, 2]
    # On a busy machine the predictions are looser: 70 * 1.5 may still beat 100.
    ran.clear()
    choose_winner(measure, candidates, top=5, slack=BUSY.slack)
    assert ran == [64, 8, 2, 1]


class Clockwork:
    """Re-timings in a fixed order (seconds per step), as a verifier would measure them."""

    def __init__(self, seconds: dict[int, list[float]]) -> None:
        self.seconds = seconds
        self.asked: list[int] = []

    def retime(self, config: TrainConfig) -> float:
        self.asked.append(config.micro_batch_size)
        return self.seconds[config.micro_batch_size].pop(0)


def test_settle_races_only_the_contenders_whose_order_is_not_known() -> None:
    # micro-batch b runs b samples per step: speeds b / seconds.
    records = [record(8, 100.0), record(4, 94.0), record(2, 90.0), record(1, 80.0)]
    # 2 and 1 are over 7% behind after one timing each: known at the 3% assumed noise.
    # Round 1: 8 -> 100/s again, 4 -> 92/s: a lead of 7.3% over two rounds, more than
    # 1.645 standard errors of the noise (the two rounds' ratios pooled with the 3%
    # assumed: 2.5%), so 4 stops racing after one round.
    clock = Clockwork({8: [0.080], 4: [4 / 92]})
    settled = retime_contenders(clock, records)  # type: ignore[arg-type]
    assert clock.asked == [8, 4]
    timings = {r.config.micro_batch_size: r.timings for r in settled}
    assert timings == {8: (0.08, 0.08), 4: (4 / 94, 4 / 92), 2: (), 1: ()}
    speeds = {r.config.micro_batch_size: r.measured.samples_per_s for r in settled if r.measured}
    assert speeds[4] == pytest.approx(4 / ((4 / 94 + 4 / 92) / 2))  # its 2 timings' median
    assert fastest(settled).config.micro_batch_size == 8


def test_two_rounds_that_agree_do_not_pass_for_a_quiet_machine() -> None:
    """A 3.6% lead in two rounds whose ratios agree: the assumed 3% still weighs as two
    rounds, so the lead is not yet known and the race goes on."""
    records = [record(8, 100.0), record(4, 97.0)]
    clock = Clockwork({8: [0.080, 0.080], 4: [4 / 96, 4 / 96]})
    retime_contenders(clock, records)  # type: ignore[arg-type]
    assert clock.asked == [8, 4, 8, 4]


def test_settle_calls_a_tie_when_the_lead_stays_within_the_noise() -> None:
    """Two configs 1% apart: after a round the lead (0.1%) is under half what the last
    round could call (1.645 * 2.5% * sqrt(2/3) = 3.3%), so the race ends there, a tie;
    3% apart in both timings, it goes on to the last round."""
    records = [record(8, 100.0), record(4, 99.0)]
    clock = Clockwork({8: [0.081, 0.079], 4: [0.0402, 0.0406]})
    settled = retime_contenders(clock, records)  # type: ignore[arg-type]
    assert clock.asked == [8, 4]
    assert all(len(r.timings) == 2 for r in settled)
    sigma = sigma_of(settled)
    a, b = sorted(settled, key=lambda r: -r.measured.samples_per_s)  # type: ignore[union-attr]
    assert not known_ahead(a, b, sigma)
    records = [record(8, 100.0), record(4, 97.0)]
    clock = Clockwork({8: [0.081, 0.079], 4: [4 / 96, 4 / 96]})
    retime_contenders(clock, records)  # type: ignore[arg-type]
    assert clock.asked == [8, 4, 8, 4]


def timed(config: TrainConfig, speed: float, peak: int, spread: tuple[float, ...] = ()):
    """A record measured at ``speed``; ``spread``: its timings, as multiples of its step."""
    step = config.global_batch_size / speed
    m = Measurement(peak, step, speed)
    return TrialRecord(config, m, m, None, tuple(step * f for f in spread))


def test_a_lead_counts_once_it_exceeds_the_noise_of_the_timings_behind_it() -> None:
    plain = TrainConfig(micro_batch_size=8)
    fast = timed(plain, 100.0, 1, (0.98, 1.0, 1.02))  # 2% noise, 3 timings
    # Timed alone: its own spread (2%, two degrees of freedom) pooled with the 3% assumed.
    assert sigma_of([fast]) == pytest.approx((0.02**2 * 2 + 0.03**2 * 2) ** 0.5 / 2, rel=0.01)
    sigma = 0.02
    # Round by round, 1.645 standard errors of the mean of 3 differences at 2%: 2.7%.
    assert known_ahead(fast, timed(plain, 97.0, 1, (1,) * 3), sigma)
    assert not known_ahead(fast, timed(plain, 97.5, 1, (1,) * 3), sigma)
    # Timed once each, the same gap is well within the noise.
    assert not known_ahead(timed(plain, 100.0, 1), timed(plain, 97.0, 1), sigma)


def test_a_slow_spell_that_hits_a_round_alike_is_not_noise() -> None:
    """Both configs 10% slower in the same round: their ratio held, so the lead is known."""
    a = timed(TrainConfig(micro_batch_size=8), 100.0, 1, (1.0, 1.1, 1.0))
    b = timed(TrainConfig(micro_batch_size=4), 96.0, 1, (1.0, 1.1, 1.0))
    # The ratio never moved: two degrees of freedom of no noise, pooled with the 3% assumed.
    assert sigma_of([a, b]) == pytest.approx(0.03 / 2**0.5)
    assert known_ahead(a, b, sigma_of([a, b]))


def test_within_the_timing_noise_the_simpler_config_wins() -> None:
    checkpointed = TrainConfig(micro_batch_size=8, grad_accum_steps=4, checkpoint=("a", "b"))
    selective = TrainConfig(micro_batch_size=8, grad_accum_steps=4, selective_checkpoint=("a",))
    plain = TrainConfig(micro_batch_size=8, grad_accum_steps=4)
    fewer_steps = TrainConfig(micro_batch_size=16, grad_accum_steps=2, checkpoint=("a", "b"))
    # Timings that scatter 2% either way, in opposite rounds: 2.8% noise per timing (2.9%
    # pooled with the 3% assumed), and leads up to 3.9% over three rounds are ties.
    up, down = (0.98, 1.0, 1.02), (1.02, 1.0, 0.98)
    fast = timed(checkpointed, 100.0, 500, up)
    simple = timed(plain, 98.5, 900, down)
    assert sigma_of([fast, simple]) == pytest.approx(0.0292, rel=0.01)
    assert fastest([fast, simple]) is simple  # fewer wrapped blocks, larger peak
    assert fastest([fast, timed(selective, 98.5, 900, down)]).config is selective
    assert fastest([fast, timed(fewer_steps, 98.5, 900, down)]).config is fewer_steps
    # Outside the noise the faster one wins.
    assert fastest([fast, timed(plain, 95.0, 900, down)]) is fast
    # Timed once each, nothing is known of the noise: 3% is assumed, a 1.5% lead is a tie.
    assert fastest([timed(checkpointed, 100.0, 500), timed(plain, 98.5, 900)]).config is plain
    # However noisy the re-timings, the noise assumed is at most 4%.
    wild = (0.5, 1.0, 1.5)
    assert sigma_of([timed(plain, 1.0, 1, wild), timed(plain, 1.0, 1, up)]) == 0.04


def test_the_result_lists_who_is_tied_with_the_winner_and_how_noisy_timings_were() -> None:
    from autotune.verify._winner import tied_with

    checkpointed = TrainConfig(micro_batch_size=8, grad_accum_steps=4, checkpoint=("a", "b"))
    plain = TrainConfig(micro_batch_size=8, grad_accum_steps=4)
    slow = TrainConfig(micro_batch_size=2, grad_accum_steps=16)
    up, down = (0.98, 1.0, 1.02), (1.02, 1.0, 0.98)
    records = [
        timed(checkpointed, 100.0, 500, up),
        timed(plain, 98.5, 900, down),
        timed(slow, 60.0, 100, (1.0, 1.0, 1.0)),
    ]
    chosen = fastest(records)
    assert chosen.config == plain  # the simpler of the tie
    tied, sigma = tied_with(chosen, records)
    assert tied == [checkpointed]  # the fastest measured is listed; the slow one is not
    assert sigma == pytest.approx(sigma_of(records))
    # A lead that is known: nothing tied.
    known = [timed(plain, 100.0, 1, (1,) * 3), timed(slow, 60.0, 1, (1,) * 3)]
    assert tied_with(fastest(known), known)[0] == []


def test_on_a_busy_machine_every_close_contender_races_a_round_more() -> None:
    """Timed once each while other work ran, 8 leads 2 by 15% and 1 by 30%. On a quiet
    machine that 15% is known at once; on a busy one it races paired rounds, in which 2
    turns out as fast: after two, its lead is under half what the third could call, so
    the race ends a round early, a tie, listed, and the simpler (no accumulation) wins."""
    from autotune.verify._noise import BUSY
    from autotune.verify._winner import tied_with

    records = [record(8, 100.0), record(2, 87.0), record(1, 77.0)]
    assert retime_contenders(Clockwork({}), records) == records  # quiet: nothing raced
    clock = Clockwork({8: [0.080, 0.081, 0.080], 2: [2 / 99.0, 2 / 101.0, 2 / 100.0]})
    settled = retime_contenders(clock, records, BUSY)  # type: ignore[arg-type]
    assert clock.asked == [8, 2] * 2  # 1 is 30% behind: known even here
    chosen = fastest(settled, BUSY)
    tied, sigma = tied_with(chosen, settled, BUSY)
    assert len(tied) == 1 and sigma > 0.04  # the noise measured, not capped at 4%
    assert {chosen.config.micro_batch_size, tied[0].micro_batch_size} == {8, 2}


def test_a_lead_within_the_run_to_run_drift_is_a_tie_won_by_the_simpler_config() -> None:
    """Rounds that agree to the last digit make a 2% lead certain within one run, but a
    speed moves by about 3% from run to run on a quiet machine (10% on a busy one): the
    next run could order them the other way, so it is a tie, given to the simpler."""
    steady = (1.0, 1.0, 1.0)
    mixed = TrainConfig(micro_batch_size=8, precision="bf16")
    accumulating = TrainConfig(micro_batch_size=4, grad_accum_steps=2)
    fp32 = TrainConfig(micro_batch_size=8)
    assert fastest([timed(mixed, 102.0, 1, steady), timed(fp32, 100.0, 9, steady)]).config is fp32
    # fp32 before mixed precision, then the least accumulation.
    ordered = [timed(mixed, 102.0, 1, steady), timed(accumulating, 100.0, 9, steady)]
    assert fastest(ordered).config is accumulating
    beyond = [timed(mixed, 105.0, 1, steady), timed(fp32, 100.0, 9, steady)]
    assert fastest(beyond).config is mixed
    assert fastest(beyond, BUSY).config is fp32
    tied, _ = tied_with(beyond[1], beyond, BUSY)
    assert tied == [mixed]


def test_the_plainest_candidate_is_verified_where_it_could_still_win() -> None:
    """Past the top few, the fastest predicted fp32 config with nothing wrapped runs too:
    a config with more parts then wins only by more than the noise, run after run."""
    ran: list[str] = []

    def measure(config: TrainConfig, predicted: Measurement, beat: float = 0.0) -> TrialRecord:
        ran.append(config.describe().split(" adamw")[0])
        return fits(config, predicted)

    def ranked(speed: float, **knobs: object) -> Candidate:
        config = TrainConfig(**knobs)  # type: ignore[arg-type]
        prediction = Measurement(100, config.micro_batch_size / speed, speed)
        return Candidate(config, Prediction(prediction, Breakdown(0, 0, 0, 0, 100)))

    mixed = [ranked(100.0, micro_batch_size=16, precision="bf16"),
             ranked(98.0, micro_batch_size=64, precision="bf16", checkpoint=("a",))]  # fmt: skip
    plain = ranked(92.0, micro_batch_size=16, grad_accum_steps=4)
    choose_winner(measure, [*mixed, plain], top=2)
    assert ran[-1] == "micro_batch=16 accum=4 fp32 checkpoint=0"
    # Where the measured speeds say it cannot win (70 * 1.15 < 100), it is not run.
    ran.clear()
    choose_winner(measure, [*mixed, ranked(70.0, micro_batch_size=16, grad_accum_steps=4)], top=2)
    assert len(ran) == 2


def test_the_experts_recipe_is_found_as_an_expert_finds_it() -> None:
    """From the largest micro-batch predicted to fit down: one that runs out of memory is
    followed by the next size, until one runs; a mask none of whose sizes runs leaves the
    recipe to the other; none at all says why."""
    from autotune.cost import ExpertRecipe
    from autotune.verify._verification import baseline_record, verify_baseline

    ran: list[int] = []
    beaten: list[float] = []

    def measure(config: TrainConfig, predicted: Measurement, beat: float = 0.0) -> TrialRecord:
        ran.append(config.micro_batch_size)
        beaten.append(beat)
        if config.micro_batch_size > 4:
            return TrialRecord(config, predicted, None, error="out of memory")
        return TrialRecord(config, predicted, Measurement(100, 0.1, 10.0 * config.micro_batch_size))

    ladder = tuple(candidate(b, 10.0, 100) for b in (16, 8, 4, 2))
    recipe = ExpertRecipe((ladder,))
    records, _ = verify_baseline(measure, recipe, [], slack=0.15)
    assert ran == [16, 8, 4]  # 2 is not run: 4 ran
    expert = baseline_record(records, recipe)
    assert expert is not None and expert.config.micro_batch_size == 4
    # Tried already (among the tuner's candidates): not run again.
    ran.clear()
    assert verify_baseline(measure, recipe, records, slack=0.15) == ([], "") and ran == []
    failing = ExpertRecipe((ladder[:2],))
    assert baseline_record(verify_baseline(measure, failing, [], slack=0.15)[0], failing) is None
    # Raced against the fastest config measured before it, as a candidate is: a recipe
    # far behind the tuner's winner stops early instead of taking its whole timing.
    ran.clear()
    beaten.clear()
    winner = TrialRecord(TrainConfig(micro_batch_size=32), Measurement(100, 0.2, 160.0),
                         Measurement(100, 0.1, 320.0))  # fmt: skip
    again = ExpertRecipe((ladder[2:],))
    verify_baseline(measure, again, [winner], slack=0.15)
    assert ran == [4] and beaten == [320.0]
    # Where two configs run say the time model is at most 2x optimistic, a recipe
    # predicted at 10 samples/s (at most 2 * 10 * 1.15 = 23) cannot beat 320: not run.
    ran.clear()
    second = dataclasses.replace(winner, config=TrainConfig(micro_batch_size=2))
    _, note = verify_baseline(measure, again, [winner, second], slack=0.15)
    assert ran == []
    assert note.endswith("left out, as it cannot win (predicted at most 23.0 samples/s, 320.0 measured)")  # fmt: skip
    # A fallback's peak alone, on a rung of the recipe, is not the expert's timing.
    fallback = dataclasses.replace(records[-1], measured=Measurement(100, 0.0, 0.0), peak_only=True)
    assert baseline_record([fallback], recipe) is None
