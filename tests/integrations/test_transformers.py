"""Hugging Face ``Trainer``, built and run for real with the tuned config."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from conftest import (
    MICRO,
    Recorder,
    as_tuned_on,
    fresh,
    gpt2,
    moved_apart,
    plain_step,
    runner_replay,
    samples,
)
from counted_ops import SYNCS, CountedOps
from tiny_gpt2 import causal_lm, padded_rows
from torch.utils.data import Dataset

import autotune
from autotune import TrainConfig, TuneResult
from autotune.errors import AutotuneWarning, ConfigError, NonFiniteError
from autotune.train._compiled import is_compiled

transformers = pytest.importorskip("transformers")
from autotune.integrations.transformers import (  # noqa: E402
    AutotuneCallback,
    training_arguments,
)

STEPS = 3
LR = 0.05


class Rows(Dataset):  # type: ignore[type-arg]
    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def trainer_for(model, result: TuneResult, tmp_path: Path, **overrides):
    args = training_arguments(
        result,
        str(tmp_path),
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_steps=STEPS,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        **overrides,
    )
    data = Rows(samples(STEPS * result.config.effective_batch_size, seed=1))
    return transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[AutotuneCallback(result)]
    )


def test_the_trainer_trains_as_tuned_within_the_budget(tuned: TuneResult, tmp_path) -> None:
    model = gpt2()
    start = fresh(model)  # before the recorder's hook, which a copy would share
    recorder = Recorder()
    recorder.attach(model)
    trainer = trainer_for(model, tuned, tmp_path)
    callback = next(
        c for c in trainer.callback_handler.callbacks if isinstance(c, AutotuneCallback)
    )

    # The public reading a user takes around their own Trainer: the budget's definition.
    with autotune.peak_memory(model) as reading:
        trainer.train()

    # (a) the measured peak: under the budget, and what was predicted
    assert reading.peak_bytes <= tuned.budget_bytes
    assert reading.peak_bytes == pytest.approx(tuned.predicted.peak_bytes, rel=0.03)
    # (c) the effective batch is exact: micro-batches of the tuned size, accumulated
    c = tuned.config
    assert [len(x["input_ids"]) for x in recorder.inputs] == [MICRO] * c.grad_accum_steps * STEPS
    assert trainer.state.global_step == STEPS
    # (b) the same math as autotune's Runner on the same batches (with the Trainer's
    # default clipping at norm 1), loss by loss and weight by weight
    replay, reference = runner_replay(start, tuned, recorder, lr=LR, max_grad_norm=1.0)
    assert torch.equal(torch.stack(recorder.losses), torch.stack(replay.losses))
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    # the mask was applied block by block while training, and taken off after
    assert callback.handle is None
    assert not any("forward" in vars(m) for m in model.modules())
    assert model.config.use_cache is trainer.args.use_cache  # as the Trainer set it


def test_the_trainer_trains_compiled_blocks_as_tuned(tuned: TuneResult, tmp_path) -> None:
    """A config that compiles the blocks: the Trainer's steps run them compiled (beneath
    the checkpoint of the first), with autotune's Runner's losses and weights on the same
    batches, and the model comes back uncompiled."""
    blocks = tuned.model.blocks
    config = tuned.config.replace(
        checkpoint=blocks[:1], selective_checkpoint=(), compile_blocks=blocks
    )
    result = dataclasses.replace(tuned, config=config)
    model = gpt2()
    start = fresh(model)
    recorder = Recorder()
    recorder.attach(model)
    compiled: list[bool] = []
    first = model.get_submodule(blocks[0])
    hook = first.register_forward_pre_hook(lambda m, a: compiled.append(is_compiled(m)))
    trainer_for(model, result, tmp_path).train()
    hook.remove()
    assert compiled and all(compiled)
    replay, reference = runner_replay(start, result, recorder, lr=LR, max_grad_norm=1.0)
    torch.testing.assert_close(torch.stack(recorder.losses), torch.stack(replay.losses))
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert not any(is_compiled(m) or "forward" in vars(m) for m in model.modules())


def test_training_arguments_are_real_and_use_transformers_5_names(tuned, tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation, no autotune warning
        args = training_arguments(tuned, str(tmp_path))
    c = tuned.config
    assert isinstance(args, transformers.TrainingArguments)
    assert args.per_device_train_batch_size == c.micro_batch_size
    assert args.gradient_accumulation_steps == c.grad_accum_steps
    assert args.optim == "sgd" and args.optim_args == "momentum=0.9"
    assert not args.gradient_checkpointing  # the callback checkpoints exactly the mask
    assert args.use_cpu


@pytest.mark.parametrize(
    ("optimizer", "optim"),
    [("adamw", "adamw_torch"), ("adamw_fused", "adamw_torch_fused"), ("sgd", "sgd"),
     ("adafactor", "adafactor"), ("adamw8bit", "adamw_bnb_8bit")],
)  # fmt: skip
def test_every_optimizer_has_its_hugging_face_name(tuned, tmp_path, optimizer, optim) -> None:
    result = dataclasses.replace(tuned, config=TrainConfig(micro_batch_size=2, optimizer=optimizer))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = training_arguments(result, str(tmp_path))
    assert args.optim == optim
    said = [str(w.message) for w in caught if issubclass(w.category, AutotuneWarning)]
    assert bool(said) == (optimizer == "adafactor"), said  # HF's Adafactor is not torch's
    if optimizer.startswith("adamw"):
        assert args.weight_decay == 0.01


def test_overrides_win_and_a_changed_tuned_setting_is_a_warning(tuned, tmp_path) -> None:
    with pytest.warns(AutotuneWarning, match="per_device_train_batch_size"):
        args = training_arguments(tuned, str(tmp_path), per_device_train_batch_size=1)
    assert args.per_device_train_batch_size == 1


def test_the_callback_warns_when_the_trainer_was_not_given_the_tuned_arguments(
    tuned, tmp_path
) -> None:
    model = gpt2()
    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=8, max_steps=1, use_cpu=True, report_to=[]
    )
    data = Rows(samples(8))
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[AutotuneCallback(tuned)]
    )
    with pytest.warns(AutotuneWarning, match=r"per_device_train_batch_size=8 \(tuned 4\)"):
        trainer.train()


def test_bad_results_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="takes the TuneResult"):
        training_arguments(TrainConfig(), str(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="takes the TuneResult"):
        AutotuneCallback({"config": {}})  # type: ignore[arg-type]


def test_a_non_finite_step_is_refused_and_the_weights_keep_their_values(
    tuned: TuneResult, tmp_path
) -> None:
    model = gpt2()
    trainer = trainer_for(model, tuned, tmp_path)
    poison, kept = [False], {}

    class Poison(transformers.TrainerCallback):  # from the second step on, NaN gradients
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            poison[0] = True
            kept.update({k: v.clone() for k, v in model.state_dict().items()})

    first = next(p for p in model.parameters() if p.requires_grad)
    first.register_hook(lambda g: g * float("nan") if poison[0] else g)
    trainer.add_callback(Poison())
    with pytest.raises(NonFiniteError, match="weights keep their last finite values"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in kept.items())
    assert all(p.grad is None for p in model.parameters())


def test_the_callback_adds_no_read_of_the_device_to_the_trainers_steps(
    tuned: TuneResult, tmp_path
) -> None:
    # Hugging Face's default AdamW kernel, fused: its steps are refused on the device.
    fused = dataclasses.replace(tuned, config=tuned.config.replace(optimizer="adamw_fused"))
    reads = {}
    for case, callbacks, nan_filter in [
        ("plain", [], False),
        ("tuned", [AutotuneCallback(fused)], False),
        ("filtered", [AutotuneCallback(fused)], True),  # the Trainer's default
    ]:
        args = training_arguments(
            fused, str(tmp_path), max_steps=STEPS, logging_steps=STEPS, report_to=[],
            save_strategy="no", disable_tqdm=True, logging_nan_inf_filter=nan_filter,
        )  # fmt: skip
        data = Rows(samples(STEPS * fused.config.effective_batch_size, seed=1))
        trainer = transformers.Trainer(
            model=gpt2(), args=args, train_dataset=data, callbacks=callbacks
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AutotuneWarning)  # the filter override's
            with CountedOps(SYNCS.__contains__) as syncs:
                trainer.train()
        reads[case] = syncs.count
    assert reads["tuned"] == reads["plain"]
    # The counter sees a read: the filter's, one per micro-batch.
    assert reads["filtered"] - reads["tuned"] >= STEPS * fused.config.grad_accum_steps


def test_a_step_learns_what_one_batch_of_its_rows_does_at_every_micro_batch(
    tuned: TuneResult, tmp_path
) -> None:
    """Padded rows of 3 to 32 label tokens: the Trainer divides each micro-batch's
    summed loss by the step's counted tokens (``num_items_in_batch``, which reaches the
    Llama's loss, the chunked loss too), so one SGD step at micro-batch 1, 2 and 8, and
    at 2 with the chunked loss, moves the weights as one plain PyTorch step of the 8 rows
    does."""
    model, batch = causal_lm("llama"), padded_rows()
    reference = plain_step(model, batch, lr=1.0)
    rows = Rows([{k: v[i] for k, v in batch.items()} for i in range(8)])
    for micro, chunked in ((1, False), (2, False), (8, False), (2, True)):
        work = fresh(model)
        result = as_tuned_on(tuned, work, micro, 8 // micro)
        result = dataclasses.replace(result, config=result.config.replace(chunked_loss=chunked))
        args = training_arguments(
            result, str(tmp_path), learning_rate=1.0, lr_scheduler_type="constant",
            max_steps=1, max_grad_norm=0.0, report_to=[], save_strategy="no",
            disable_tqdm=True,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=work, args=args, train_dataset=rows, callbacks=[AutotuneCallback(result)]
        )
        taken: list[bool] = []
        work.register_forward_hook(lambda m, a, out, seen=taken: seen.append(out.logits is None))
        trainer.train()
        assert taken == [chunked] * (8 // micro)  # the chunked loss never makes the logits
        assert moved_apart(work, reference, model) <= 1e-5, (micro, chunked)


def wide_vocab_gpt2() -> torch.nn.Module:
    """GPT-2 with a vocabulary wide for its size: an evaluation forward's logits (and its
    loss's copy of them) outgrow a training step at a small micro-batch."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=4096, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    model.accepts_loss_kwargs = False
    return model


def vocab_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(4096, (n, 32), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


def test_evaluation_stays_in_the_budget_where_the_default_batch_goes_over(tmp_path) -> None:
    model = wide_vocab_gpt2()
    sample = {k: torch.stack([r[k] for r in vocab_rows(2, 0)]) for k in ("input_ids", "labels")}
    plain, _ = autotune.estimate(model, sample, TrainConfig(micro_batch_size=2), device="cpu")
    # One training config, none checkpointed: the plain loss goes over, the chunked loss
    # fits. The evaluation batch is sized beside it with the logits the Trainer's own
    # evaluation makes (the chunked loss trains only).
    space = autotune.SearchSpace(
        precisions=("fp32",), micro_batch_sizes=(2,), checkpointing=False,
        selective_checkpointing=False, chunked_loss=True,
    )  # fmt: skip
    result = autotune.autotune(
        model, sample, 0.95 * plain / 2**30, global_batch_size=2, space=space, device="cpu"
    )
    assert result.config.chunked_loss
    tuned = result.config.eval_batch_size
    assert tuned is not None and 2 <= tuned < 8  # HF's default of 8 does not fit here

    def evaluating(result: TuneResult, **overrides: object) -> int:
        """The peak of two training steps, each followed by an evaluation."""
        net = wide_vocab_gpt2()
        args = training_arguments(
            result, str(tmp_path), max_steps=2, eval_strategy="steps", eval_steps=1,
            report_to=[], save_strategy="no", disable_tqdm=True, **overrides,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=net,
            args=args,
            train_dataset=Rows(vocab_rows(4, 1)),
            eval_dataset=Rows(vocab_rows(16, 2)),
            callbacks=[AutotuneCallback(result)],
        )
        with autotune.peak_memory(net) as reading:
            trainer.train()
        assert len([e for e in trainer.state.log_history if "eval_loss" in e]) == 2
        return reading.peak_bytes

    assert evaluating(result) <= result.budget_bytes  # at the tuned evaluation batch
    # What the Trainer evaluated with before (its default 8), with the same training config:
    before = dataclasses.replace(result, config=result.config.replace(eval_batch_size=None))
    assert evaluating(before) > result.budget_bytes
    # Asked for more than fits, the callback lowers it (and says so).
    with pytest.warns(AutotuneWarning, match=f"evaluating with {tuned}, the largest"):
        assert evaluating(result, per_device_eval_batch_size=8) <= result.budget_bytes


def test_the_trainer_trains_the_model_compiled_whole_as_tuned(tuned: TuneResult, tmp_path) -> None:
    """A config that compiles the model whole (its loss inside, the first block
    checkpointed inside the graph): the Trainer's steps run it compiled, with autotune's
    Runner's losses and weights on the same batches, and the model comes back eager."""
    config = tuned.config.replace(
        checkpoint=tuned.model.blocks[:1], selective_checkpoint=(), compile_model=True
    )
    result = dataclasses.replace(tuned, config=config)
    model = gpt2()
    start = fresh(model)
    recorder = Recorder()
    recorder.attach(model)
    compiled: list[bool] = []
    hook = model.register_forward_pre_hook(
        lambda m, a: compiled.append(type(vars(m).get("forward")).__name__ != "method")
    )
    trainer_for(model, result, tmp_path).train()
    hook.remove()
    assert compiled and all(compiled)  # the forward the Trainer called: compiled
    # The same math as the Runner's eager step (its compiled one is tested in tests/train:
    # the recorder's hook inside its graph would be compiled again at every call).
    eager = dataclasses.replace(result, config=config.replace(compile_model=False))
    replay, reference = runner_replay(start, eager, recorder, lr=LR, max_grad_norm=1.0)
    torch.testing.assert_close(torch.stack(recorder.losses), torch.stack(replay.losses))
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert not any("forward" in vars(m) for m in model.modules())
