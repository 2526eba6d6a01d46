"""autotune() end to end on CPU: real models, real budgets, and every bad input."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from torch import nn

import autotune
from autotune._format import GIB
from autotune.cli._figures import figures
from autotune.errors import BatchError, BudgetError, BudgetTooSmallError, ConfigError, LossError
from autotune.models import gpt_batch, tiny_gpt

MIB = 2**20


def tune(
    model: nn.Module, sample: object, budget_bytes: int, **kwargs: object
) -> autotune.TuneResult:
    kwargs.setdefault("n_trials", 30)
    return autotune.autotune(model, sample, budget_bytes / GIB, device="cpu", **kwargs)  # type: ignore[arg-type]


def floor_and_top(model: nn.Module, sample: object, global_batch: int) -> tuple[int, int]:
    """Measured peaks of the most frugal and the roomiest fp32 configs (a budget range that bites)."""
    from autotune.verify._verifier import Verifier

    names = autotune.find_blocks(model)
    low = autotune.TrainConfig(micro_batch_size=1, grad_accum_steps=global_batch, checkpoint=names)
    high = autotune.TrainConfig(micro_batch_size=global_batch)
    out = []
    for config in (low, high):
        verifier = Verifier(
            copy.deepcopy(model),
            sample,
            device=torch.device("cpu"),
            budget_bytes=2**40,
            loss_fn=None,
            steps=1,
        )
        measured, _ = verifier.trial(config)
        assert measured is not None
        out.append(measured.peak_bytes)
    return out[0], out[1]


@pytest.fixture(scope="module")
def gpt() -> nn.Module:
    return tiny_gpt(n_layer=3, n_embd=64, n_head=4, block_size=32, vocab_size=128)


@pytest.fixture(scope="module")
def gpt_result(gpt: nn.Module) -> tuple[autotune.TuneResult, int]:
    sample = gpt_batch(gpt.config, 4)
    low, high = floor_and_top(gpt, sample, 32)
    budget = low + (high - low) // 3
    return tune(gpt, sample, budget, global_batch_size=32, seed=0), budget


def test_result_fits_the_budget_and_keeps_the_global_batch(gpt_result) -> None:
    result, budget = gpt_result
    assert result.budget_bytes == budget
    assert result.measured.peak_bytes <= budget
    assert result.config.effective_batch_size == 32
    assert all(t.measured is None or t.measured.peak_bytes <= budget for t in result.trials)


def test_predicted_peak_is_within_three_percent(gpt_result) -> None:
    result, _ = gpt_result
    for trial in result.trials:
        if trial.measured is not None:
            err = (
                abs(trial.predicted.peak_bytes - trial.measured.peak_bytes)
                / trial.measured.peak_bytes
            )
            assert err <= 0.03, trial


def test_winner_is_the_fastest_verified_config(gpt_result) -> None:
    """Fastest measured, unless the fastest is as fast within the timing noise (then in
    ``tied``: the simplest won); a config within 1% of it with a smaller peak may win the
    tie. A fallback's peak alone is no speed."""
    result, _ = gpt_result
    passed = [t for t in result.trials if t.measured is not None and not t.peak_only]
    fastest = max(passed, key=lambda t: t.measured.samples_per_s)
    best = fastest.measured.samples_per_s
    if fastest.config != result.config and fastest.config in result.tied:
        return  # not known to be ahead of the winner, which is simpler
    tied = [t for t in passed if t.measured.samples_per_s >= 0.99 * best]
    assert result.measured.samples_per_s >= 0.99 * best
    assert result.measured.peak_bytes == min(t.measured.peak_bytes for t in tied)


def test_the_experts_recipe_is_verified_and_never_beats_the_winner(gpt_result) -> None:
    """The CPU expert's recipe (the faster precision, eager, the largest micro-batch that
    fits with no block or every block checkpointed) runs in the same run, timed the same
    way, and is not measured ahead of the winner beyond one timing's noise; where the
    configs run say it cannot win, it is not run and the note says why."""
    result, _ = gpt_result
    expert = result.expert
    if expert is None:
        assert re.search(r"left out, as it cannot win \(predicted at most [\d.]+ samples/s, "
                         r"[\d.]+ measured\)", result.expert_note)  # fmt: skip
        return
    assert expert.measured is not None
    assert expert in result.trials
    c = expert.config
    assert c.compile_level == "none" and not c.offload_activations and not c.offload_optimizer
    assert c.checkpoint in ((), result.model.blocks) and not c.selective_checkpoint
    ratio = result.measured.samples_per_s / expert.measured.samples_per_s
    assert ratio >= 1 - 2 * max(result.noise, 0.03)
    assert f"{ratio:.2f}x" in dict(figures(result))["expert's recipe"] or c == result.config


def test_fallbacks_are_verified_and_increasingly_frugal(gpt_result) -> None:
    result, _ = gpt_result
    peaks = [result.measured.peak_bytes]
    by_config = {t.config: t for t in result.trials}
    for fallback in result.fallbacks:
        assert fallback.effective_batch_size == result.config.effective_batch_size
        trial = by_config[fallback]
        assert trial.measured is not None
        peaks.append(trial.measured.peak_bytes)
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)


def test_breakdown_adds_up_to_the_predicted_peak(gpt_result, gpt) -> None:
    result, _ = gpt_result
    assert result.breakdown.total == result.predicted.peak_bytes
    n_params = sum(p.numel() for p in {id(p): p for p in gpt.parameters()}.values())
    assert result.breakdown.parameters == 4 * n_params
    assert result.breakdown.optimizer >= 8 * n_params  # AdamW: two fp32 states
    assert result.model.n_parameters == n_params
    assert result.model.blocks == ("blocks.0", "blocks.1", "blocks.2")


def test_saved_result_trains_with_prepare(gpt_result, gpt, tmp_path) -> None:
    result, _ = gpt_result
    loaded = autotune.load(result.save(tmp_path / "tuned.yaml"))
    assert loaded == result
    model = copy.deepcopy(gpt)
    runner = autotune.prepare(model, loaded, lr=1e-2)
    assert runner.config == result.config
    batch = gpt_batch(gpt.config, result.config.effective_batch_size, seed=1)
    losses = [runner.step(batch).item() for _ in range(5)]
    assert losses[-1] < losses[0]


def test_the_result_says_how_sure_it_is(gpt_result) -> None:
    from autotune.cli._commands import _describe

    result, _ = gpt_result
    assert 0.01 <= result.noise <= 0.15  # one timing's noise (4% at most here when idle)
    verified = {t.config for t in result.trials if t.measured is not None}
    assert set(result.tied) <= verified - {result.config}
    text = _describe(result)
    assert f"a timing is sure to about {100 * result.noise:.1f}% here" in text
    for config in result.tied:
        assert config.describe() in text.split("tied")[1]


def test_progress_is_shown_when_asked_and_silent_when_not(capsys) -> None:
    model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    sample = gpt_batch(model.config, 2)
    space = autotune.SearchSpace(micro_batch_sizes=[2, 4], precisions=["fp32"], checkpointing=False)
    tune(model, sample, GIB, global_batch_size=4, space=space, progress=True)
    shown = capsys.readouterr().err
    assert "profiling memory" in shown and "verifying micro_batch=" in shown
    tune(model, sample, GIB, global_batch_size=4, space=space)  # no terminal here: silent
    assert "verifying" not in capsys.readouterr().err


def test_max_tuning_s_verifies_one_winner_and_says_what_it_skipped(gpt, tmp_path) -> None:
    """Spent before the first candidate (profiling always runs): that candidate is
    verified, and every later run is skipped and named (the result and ``show``)."""
    sample = gpt_batch(gpt.config, 4)
    with pytest.raises(ConfigError, match="max_tuning_s must be a positive number"):
        tune(gpt, sample, GIB, max_tuning_s=0)
    result = tune(gpt, sample, GIB, global_batch_size=8, max_tuning_s=1e-3)
    assert result.measured is not None and result.measured.peak_bytes <= result.budget_bytes
    assert [t.config for t in result.trials] == [result.config]  # one run, the winner
    kinds = [s.split(" micro_batch=")[0] for s in result.skipped]
    # Each of the expert's ladders (none and every block checkpointed) at its top rung.
    assert kinds[0] == "candidates after the 1 run" and kinds[1] == "the expert's recipe"
    retimed = kinds.index("re-timing the contenders")
    assert set(kinds[1:retimed]) == {"the expert's recipe"}
    assert set(kinds[retimed + 1 : -1]) <= {"the fallback"}
    assert kinds[-1] == "sizing the evaluation batch"
    assert result.expert is None and "max_tuning_s" in result.expert_note
    assert result.config.eval_batch_size is None and not result.fallbacks
    assert autotune.load(result.save(tmp_path / "r.yaml")).skipped == result.skipped
    from autotune.cli._commands import _describe

    assert "skipped     for the time limit: candidates after the 1 run" in _describe(result)


def test_progress_by_default_where_a_person_watches_and_has_no_logging(monkeypatch) -> None:
    import logging

    from autotune.tuning import _progress

    assert _progress.shown(True) and not _progress.shown(False)
    logger = logging.getLogger("autotune")
    monkeypatch.setattr(logger, "propagate", False)  # as if no logging were set up anywhere
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(_progress, "watched", lambda: True)
    assert _progress.shown(None)
    monkeypatch.setattr(logger, "handlers", [logging.NullHandler()])  # the user's logging
    assert not _progress.shown(None)
    monkeypatch.setattr(_progress, "watched", lambda: False)  # a job's log file
    monkeypatch.setattr(logger, "handlers", [])
    assert not _progress.shown(None)


def snapshot(model: nn.Module) -> dict[str, object]:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
        },
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {
            n: (dict(m._forward_hooks), dict(m._forward_pre_hooks))
            for n, m in model.named_modules()
        },
        "forward": {n: m.__dict__.get("forward") for n, m in model.named_modules()},
        "device": {p.device for p in model.parameters()},
    }


def assert_same(before: dict[str, object], after: dict[str, object]) -> None:
    for key in ("requires_grad", "training", "hooks", "forward", "device"):
        assert before[key] == after[key], key
    for name, value in before["state"].items():  # type: ignore[union-attr]
        assert torch.equal(value, after["state"][name]), name  # type: ignore[index]
    for name, grad in before["grads"].items():  # type: ignore[union-attr]
        other = after["grads"][name]  # type: ignore[index]
        assert (grad is None and other is None) or torch.equal(grad, other), name


def user_model() -> nn.Module:
    model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    model.eval()
    model.wpe.weight.requires_grad_(False)
    model.blocks[0].register_forward_hook(lambda m, a, o: None)
    model(*gpt_batch(model.config, 2)).backward()  # leaves gradients behind
    return model


def test_model_is_left_exactly_as_it_was() -> None:
    model = user_model()
    before = snapshot(model)
    tune(model, gpt_batch(model.config, 4), 64 * MIB, global_batch_size=8)
    assert_same(before, snapshot(model))


def test_model_is_left_as_it_was_when_tuning_fails_or_is_interrupted() -> None:
    model = user_model()
    before = snapshot(model)
    sample = gpt_batch(model.config, 4)
    with pytest.raises(LossError):
        tune(model, sample[0], 64 * MIB)  # logits only: no loss
    assert_same(before, snapshot(model))
    calls = 0

    def interrupting_loss(output: torch.Tensor, batch: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return output.float().mean()

    with pytest.raises(KeyboardInterrupt):
        tune(model, sample, 64 * MIB, loss_fn=interrupting_loss)
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("budget", [0, -1.0, math.nan, math.inf, "24", True])
def test_bad_budget(budget: object) -> None:
    model = tiny_gpt(n_layer=1, n_embd=16, n_head=2, block_size=8, vocab_size=32)
    with pytest.raises(BudgetError, match="budget_gb must be a"):
        autotune.autotune(model, gpt_batch(model.config, 2), budget, device="cpu")  # type: ignore[arg-type]


def test_budget_below_the_minimum_says_the_minimum_and_what_lowers_it() -> None:
    model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    with pytest.raises(BudgetTooSmallError) as info:
        tune(model, gpt_batch(model.config, 4), 100_000, global_batch_size=8)
    message = str(info.value)
    assert "below the minimum this model needs" in message
    assert "optimizer state" in message and "adafactor" in message
    assert info.value.minimum_bytes > info.value.budget_bytes
    # The minimum it names is real: a budget just above it tunes.
    result = tune(
        model, gpt_batch(model.config, 4), int(info.value.minimum_bytes * 1.05), global_batch_size=8
    )
    assert result.measured.peak_bytes <= int(info.value.minimum_bytes * 1.05)


@pytest.mark.parametrize(
    ("sample", "error", "words"),
    [
        ({1, 2}, BatchError, "set"),
        (
            (torch.zeros(4, 8, dtype=torch.long), torch.zeros(3, 8, dtype=torch.long)),
            BatchError,
            "4 rows",
        ),
        ({"a": 1}, BatchError, "no tensor"),
    ],
)
def test_bad_sample_batch(sample: object, error: type, words: str) -> None:
    model = tiny_gpt(n_layer=1, n_embd=16, n_head=2, block_size=8, vocab_size=32)
    with pytest.raises(error, match=words):
        autotune.autotune(model, sample, 1.0, device="cpu")


@pytest.mark.parametrize("global_batch", [0, -4, 2.5, True])
def test_bad_global_batch(global_batch: object) -> None:
    model = tiny_gpt(n_layer=1, n_embd=16, n_head=2, block_size=8, vocab_size=32)
    with pytest.raises(ConfigError, match="global_batch_size must be a positive integer"):
        autotune.autotune(
            model, gpt_batch(model.config, 2), 1.0, device="cpu", global_batch_size=global_batch
        )  # type: ignore[arg-type]


def test_a_sample_batch_the_model_rejects_says_how_it_was_called() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))  # (x, y) and no loss_fn
    with pytest.raises(BatchError, match="forward failed on the sample batch") as info:
        autotune.autotune(model, batch, 1.0, device="cpu")
    message = str(info.value)
    assert "Sequential.forward(<tensor (1, 8) float32>, <tensor (1,) int64>)" in message
    assert "pass loss_fn=" in message and "Sequential.forward() takes 2" in message
    assert isinstance(info.value.__cause__, TypeError)  # the model's own error, kept


def test_a_dict_batch_with_the_wrong_keys_names_them() -> None:
    model = tiny_gpt(n_layer=1, n_embd=16, n_head=2, block_size=8, vocab_size=32)
    x, y = gpt_batch(model.config, 4)
    called = r"GPT.forward\(input_ids=<tensor \(1, 8\) int64>, labels=<tensor \(1, 8\) int64>\)"
    with pytest.raises(BatchError, match=called + " with the dict.*goes to a loss_fn only"):
        autotune.autotune(model, {"input_ids": x, "labels": y}, 1.0, device="cpu")


def test_a_dict_batchs_target_goes_to_the_loss_fn_only() -> None:
    """A diffusion job's batch carries its target (the noise) beside the model's
    arguments: the model is not given it, the loss_fn reads it; tuned and trained."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
        pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    batch = {
        "hidden_states": torch.randn(4, 4, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(4, 4, 16, generator=g),
        "pooled_projections": torch.randn(4, 8, generator=g),
        "timestep": torch.randint(0, 1000, (4,), generator=g),
        "target": torch.randn(4, 4, 8, 8, generator=g),
    }

    def mse(output, batch):  # type: ignore[no-untyped-def]
        return nn.functional.mse_loss(output.sample, batch["target"])

    space = autotune.SearchSpace(precisions=("fp32",), micro_batch_sizes=(2,))
    result = autotune.autotune(
        model, batch, 1.0, global_batch_size=4, device="cpu", loss_fn=mse, space=space,
        n_trials=4,
    )  # fmt: skip
    with autotune.prepare(model, result, loss_fn=mse, lr=1e-3) as runner:
        losses = [runner.step(batch).item() for _ in range(3)]
    assert losses[-1] < losses[0]


def test_a_seq2seq_wrappers_source_and_target_advice_works_as_written() -> None:
    """``(src, tgt)`` with a loss_fn: the last item is the target, so the model gets
    ``src`` alone; the message says so, and the batch it advises trains."""

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 16)
            self.core = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
            self.head = nn.Linear(16, 16)

        def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            return self.head(self.core(self.embed(src), self.embed(tgt)))

    def loss_fn(output, batch):  # type: ignore[no-untyped-def]
        return nn.functional.cross_entropy(output.flatten(0, 1), batch[-1].flatten())

    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(16, (4, 6), generator=g), torch.randint(16, (4, 7), generator=g)
    with pytest.raises(BatchError, match=r"model\(\*batch\[:-1\]\): the last item is the"):
        autotune.autotune(Seq2Seq(), (src, tgt), 1.0, device="cpu", loss_fn=loss_fn)
    # The advice: the decoder's inputs beside the source, the target last.
    batch = (src, tgt[:, :-1], tgt[:, 1:])
    space = autotune.SearchSpace(precisions=("fp32",), micro_batch_sizes=(2,))
    result = autotune.autotune(
        Seq2Seq(), batch, 1.0, device="cpu", loss_fn=loss_fn, space=space, n_trials=4
    )
    with autotune.prepare(Seq2Seq(), result, loss_fn=loss_fn, lr=1e-3) as runner:
        assert torch.isfinite(runner.step(batch))


def test_a_failing_loss_fn_is_a_loss_error() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def loss_fn(output, batch):  # type: ignore[no-untyped-def]
        return nn.functional.cross_entropy(output, batch)  # batch, not batch[1]

    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    with pytest.raises(LossError, match=r"loss_fn\(output, batch\) failed on the sample"):
        autotune.autotune(model, batch, 1.0, device="cpu", loss_fn=loss_fn)


def test_no_loss_derivable_says_to_pass_loss_fn() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(LossError, match="loss_fn=lambda output, batch"):
        autotune.autotune(model, torch.randn(4, 8), 1.0, device="cpu")


def test_narrowed_space_is_respected() -> None:
    model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    space = autotune.SearchSpace(precisions=("fp32",), checkpointing=False)
    result = tune(model, gpt_batch(model.config, 4), 256 * MIB, global_batch_size=16, space=space)
    assert result.config.precision == "fp32" and result.config.checkpoint == ()
    assert all(t.config.precision == "fp32" and not t.config.checkpoint for t in result.trials)


def test_cnn_with_tuple_batch_and_loss_fn() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 16 * 16, 10),
    )
    sample = (torch.randn(4, 3, 16, 16), torch.randint(10, (4,)))
    result = tune(
        model,
        sample,
        64 * MIB,
        global_batch_size=16,
        loss_fn=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
    )
    assert result.measured.peak_bytes <= 64 * MIB
    assert result.model.blocks == ("0", "2", "4", "7")  # a mixed Sequential: its layers


def batchnorm_net() -> nn.Module:
    """BatchNorm over a 1x1 map (a ResNet's last stage on small images): one sample per
    channel cannot train, so micro-batch 1 fails with the model's own ValueError."""
    torch.manual_seed(0)
    stage = [nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)) for _ in range(2)]
    return nn.Sequential(
        nn.Conv2d(3, 8, 4, stride=4), *stage, nn.AdaptiveAvgPool2d(1), nn.BatchNorm2d(8),
        nn.Flatten(), nn.Linear(8, 10),
    )  # fmt: skip


@pytest.mark.parametrize("sizes", [None, (2, 4, 8)])
def test_a_size_the_model_cannot_train_on_is_a_finding_not_the_end(sizes) -> None:
    model = batchnorm_net()
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    sample = (torch.randn(4, 3, 4, 4), torch.randint(10, (4,)))
    space = autotune.SearchSpace(micro_batch_sizes=sizes)
    result = tune(
        model,
        sample,
        64 * MIB,
        global_batch_size=8,
        space=space,
        loss_fn=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
    )
    assert result.config.micro_batch_size > 1
    assert all(t.config.micro_batch_size > 1 for t in result.trials)
    if sizes is not None:  # a size outside the space is never run: the copy is the model's
        assert 1 not in seen


def test_a_model_on_the_meta_device_is_refused_with_advice_that_works() -> None:
    def build() -> nn.Module:
        return tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)

    with torch.device("meta"):
        meta = build()
    sample = gpt_batch(build().config, 2)
    words = r"meta device \(wte.weight has a shape and no values\).*autotune.plan_ahead\(build"
    with pytest.raises(autotune.ProfileError, match=words):
        autotune.autotune(meta, sample, 1.0, device="cpu")
    with pytest.raises(autotune.ProfileError, match=words):
        autotune.estimate(meta, sample, device="cpu")
    planned = autotune.plan_ahead(build, sample, 1.0)  # the advice, as written
    assert planned.unverified and planned.config.micro_batch_size >= 1
