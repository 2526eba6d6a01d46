"""Lightning's ``Trainer`` with the ``Autotune`` callback, built and run for real."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from typing import Any

import pytest
import torch
from conftest import (
    MICRO,
    G,
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
from test_transformers import Rows, vocab_rows, wide_vocab_gpt2
from tiny_gpt2 import causal_lm, padded_rows
from torch.utils.data import DataLoader
from user_optimizers import sign_momentum

import autotune
from autotune import SearchSpace, TrainConfig, TuneResult
from autotune.errors import AutotuneWarning, ConfigError, NonFiniteError
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import state_tensors
from autotune.train._identity import fingerprint

pl = pytest.importorskip("lightning.pytorch")
from autotune.integrations.lightning import Autotune  # noqa: E402

STEPS = 3
LR = 0.05


class LitGPT(pl.LightningModule):
    def __init__(self, batch_size: int = 1, momentum: float = 0.9) -> None:
        super().__init__()
        self.model = gpt2()
        self.batch_size = batch_size
        self.momentum = momentum

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)  # silent while tuning, logged while training
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=self.momentum)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Rows(samples(STEPS * G, seed=1)), batch_size=self.batch_size)


class Watch(pl.Callback):
    """While training (after tuning): the peak under the budget guard, and each micro-batch."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.recorder = Recorder()
        self.stack = contextlib.ExitStack()
        self.reading: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.stack.callback(self.recorder.attach(pl_module.model).remove)
        self.grads_alive: list[bool] = []  # at each forward

        def before(module: Any, args: Any) -> None:
            self.grads_alive.append(any(p.grad is not None for p in module.parameters()))

        self.stack.callback(pl_module.model.register_forward_pre_hook(before).remove)
        existing = state_tensors(pl_module, *trainer.optimizers)
        peak = measure_peak(torch.device("cpu"), existing=existing, budget_bytes=self.budget)
        self.reading = self.stack.enter_context(peak)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.stack.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.stack.close()  # the guard's tracker off, for whatever runs next


def trainer_with(*callbacks: pl.Callback, steps: int = STEPS) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_autotune_tunes_at_fit_start_and_trains_as_tuned(tuned: TuneResult) -> None:
    module = LitGPT()
    start = fresh(module.model)
    space = SearchSpace(precisions=("fp32",), micro_batch_sizes=(MICRO,))
    callback = Autotune(tuned.budget_bytes / 2**30, global_batch_size=G, space=space, n_trials=20)
    watch = Watch(tuned.budget_bytes)
    trainer = trainer_with(callback, watch)
    trainer.fit(module)

    result = callback.result
    assert result is not None and result.config.optimizer == "sgd"  # the module's optimizer
    c = result.config
    assert c.checkpoint and set(c.checkpoint) <= set(result.model.blocks)  # mask applied below
    # applied: the batch-size attribute, accumulation, precision
    assert module.batch_size == c.micro_batch_size == MICRO
    assert trainer.accumulate_grad_batches == c.grad_accum_steps == G // MICRO
    assert trainer.precision == "32-true"
    # (a) the peak while training: under the budget, and what was predicted
    assert watch.reading.peak_bytes <= result.budget_bytes
    assert watch.reading.peak_bytes == pytest.approx(result.predicted.peak_bytes, rel=0.03)
    # (c) the effective batch is exact
    recorder = watch.recorder
    assert [len(x["input_ids"]) for x in recorder.inputs] == [MICRO] * (G // MICRO) * STEPS
    assert trainer.global_step == STEPS
    # the last step's gradients are gone before a step's first forward (Lightning would
    # free them only after it, holding them with its activations)
    assert watch.grads_alive == [i % (G // MICRO) != 0 for i in range(STEPS * G // MICRO)]
    # (b) the same math as autotune's Runner on the same batches (of the inner model, whose
    # blocks are named without the module's "model." prefix)
    inner = c.replace(checkpoint=tuple(n.removeprefix("model.") for n in c.checkpoint))
    replay, reference = runner_replay(
        start, dataclasses.replace(result, config=inner), recorder, lr=LR
    )
    assert torch.equal(torch.stack(recorder.losses), torch.stack(replay.losses))
    for a, b in zip(module.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    # the blocks are unwrapped when fit ends, and nothing of the tuning is left behind
    assert not any("forward" in vars(m) for m in module.modules())
    assert callback.handle is None


class LitAdamW(LitGPT):
    """The module most Lightning code has: a plain AdamW from configure_optimizers."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def test_a_modules_plain_adamw_trains_fused_as_tuned(tuned: TuneResult) -> None:
    module = LitAdamW()
    # A result tuned with another optimizer is refused, with advice that runs as written.
    with pytest.raises(ConfigError, match="let the callback tune the module") as refused:
        trainer_with(Autotune.from_result(tuned)).fit(module)
    advice = re.search(r"Autotune\(budget_gb=[^)]*\)", str(refused.value))
    assert advice is not None
    callback = eval(advice.group(0), {"Autotune": Autotune})  # the callback's defaults
    watch = Watch(tuned.budget_bytes)
    trainer = trainer_with(callback, watch)
    trainer.fit(module)
    result = callback.result
    assert result is not None and result.config.optimizer == "adamw_fused"
    optimizer = trainer.optimizers[0]  # the module's own, stepping with the tuned kernel
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    assert all(g["fused"] and g["lr"] == 1e-4 for g in optimizer.param_groups)
    assert trainer.global_step == STEPS
    assert watch.reading.peak_bytes <= result.budget_bytes
    assert watch.reading.peak_bytes == pytest.approx(result.predicted.peak_bytes, rel=0.03)


class LitSign(LitGPT):
    """A module whose optimizer autotune has never heard of."""

    def configure_optimizers(self) -> Any:
        optimizer = sign_momentum([p for p in self.parameters() if p.requires_grad])
        return {
            "optimizer": optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1),
        }


def test_an_unknown_optimizer_is_tuned_as_configure_optimizers_builds_it(tuned) -> None:
    module = LitSign()
    space = SearchSpace(precisions=("fp32",), micro_batch_sizes=(MICRO,))
    callback = Autotune(tuned.budget_bytes / 2**30, global_batch_size=G, space=space, n_trials=20)
    watch = Watch(tuned.budget_bytes)
    trainer_with(callback, watch).fit(module)
    result = callback.result
    assert result is not None
    assert result.config.optimizer == f"{__name__}:LitSign.configure_optimizers"
    # Its one momentum per parameter measured (SGD's, by chance the same size), not
    # assumed to be AdamW's two.
    params = sum(p.numel() * 4 for p in module.parameters())
    assert result.breakdown.optimizer == params
    assert watch.reading.peak_bytes <= result.budget_bytes
    assert watch.reading.peak_bytes == pytest.approx(result.predicted.peak_bytes, rel=0.03)


class LitWide(pl.LightningModule):
    """A wide-vocabulary GPT-2 validated every step, its validation batch an attribute."""

    def __init__(self, eval_batch_size: int = 8) -> None:
        super().__init__()
        self.model = wide_vocab_gpt2()
        self.batch_size = 1
        self.eval_batch_size = eval_batch_size
        self.validated: list[int] = []  # each validation batch's size

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.model(**batch)
        self.validated.append(len(batch["input_ids"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Rows(vocab_rows(4, 1)), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Rows(vocab_rows(16, 2)), batch_size=self.eval_batch_size)


def test_validation_runs_at_the_tuned_batch_within_the_budget() -> None:
    module = LitWide()
    sample = {k: torch.stack([r[k] for r in vocab_rows(2, 0)]) for k in ("input_ids", "labels")}
    floor, _ = autotune.estimate(
        module.model, sample, TrainConfig(micro_batch_size=2, optimizer="sgd")
    )
    budget = 1.1 * floor  # fits training at 2, not a validation batch of 8 beside it
    space = SearchSpace(precisions=("fp32",), micro_batch_sizes=(2,))

    def fit(**named: str) -> tuple[Autotune, Watch]:
        callback = Autotune(budget / 2**30, global_batch_size=2, space=space, **named)
        watch = Watch(int(budget))
        trainer = trainer_with(callback, watch)
        trainer.val_check_interval = 1
        trainer.fit(module)
        return callback, watch

    callback, watch = fit(eval_batch_arg_name="eval_batch_size")
    tuned = callback.result.config.eval_batch_size
    assert module.eval_batch_size == tuned < 8
    assert max(module.validated) == tuned and len(module.validated) > 16 // tuned  # each step
    assert watch.reading.peak_bytes <= callback.result.budget_bytes
    # The module's own validation batch of 8 goes over the budget (the guard raises), and
    # without eval_batch_arg_name the callback says so first.
    module.eval_batch_size = 8
    with (
        warnings.catch_warnings(record=True) as seen,
        pytest.raises(torch.OutOfMemoryError, match="budget guard"),
    ):
        warnings.simplefilter("always")  # Lightning's own deprecations recorded, not raised
        fit()
    said = [str(w.message) for w in seen if issubclass(w.category, AutotuneWarning)]
    assert any(f"the largest that does is {tuned}" in m for m in said)


class LitManual(LitGPT):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = self.model(**batch).loss
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss


def test_manual_optimization_is_refused_and_the_advice_trains(tuned: TuneResult) -> None:
    module = LitManual()
    with pytest.raises(ConfigError, match=r"autotune\.autotune\(\) and train with autotune\.apply"):
        trainer_with(Autotune(tuned.budget_bytes / 2**30, global_batch_size=G)).fit(module)
    # The advice as written: ``tuned`` is autotune.autotune() on this architecture; the
    # module's model trains with apply()'s handle, under the budget.
    loader = DataLoader(Rows(samples(STEPS * G, seed=1)), batch_size=G)
    with (
        autotune.apply(module.model, tuned, lr=LR, device="cpu") as handle,
        autotune.peak_memory(handle) as reading,
    ):
        for batch in loader:
            for chunk, weight in handle.micro_batches(batch):
                handle.backward(handle.model(**chunk).loss * weight)
            handle.optimizer_step()
    assert 0 < reading.peak_bytes <= tuned.budget_bytes


def test_a_train_loader_other_than_one_dataloader_is_refused_and_the_advice_trains(
    tuned: TuneResult,
) -> None:
    module = LitGPT(batch_size=MICRO)
    rows = DataLoader(Rows(samples(4 * MICRO)), batch_size=MICRO)
    module.train_dataloader = lambda: {"a": rows, "b": rows}  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match=r"got dict\. Tune with autotune\.autotune"):
        trainer_with(Autotune(tuned.budget_bytes / 2**30, global_batch_size=G)).fit(module)
    # The advice as written: ``tuned`` is autotune.autotune() on this architecture; the
    # module's model trains as tuned through prepare(), on one of its loaders' batches.
    with (
        autotune.prepare(module.model, tuned, lr=LR, device="cpu") as runner,
        autotune.peak_memory(runner) as reading,
    ):
        for batch in DataLoader(Rows(samples(STEPS * G, seed=1)), batch_size=G):
            runner.step(batch)
    assert 0 < reading.peak_bytes <= tuned.budget_bytes


def test_a_module_without_the_batch_size_attribute_is_refused() -> None:
    module = LitGPT()
    del module.batch_size
    module.train_dataloader = lambda: DataLoader(Rows(samples(8)), batch_size=2)  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match=r"'batch_size'.*or pass batch_arg_name="):
        trainer_with(Autotune(1.0)).fit(module)
    module.rows = 2  # the advice: the loader's batch size an attribute the callback is told of
    module.train_dataloader = lambda: DataLoader(Rows(samples(8)), batch_size=module.rows)  # type: ignore[method-assign]
    Autotune(1.0, batch_arg_name="rows").setup(trainer_with(), module, "fit")


class LitRows(pl.LightningModule):
    """A causal language model trained on given rows, in order, with SGD."""

    def __init__(self, model: torch.nn.Module, rows: Rows) -> None:
        super().__init__()
        self.model, self.rows, self.batch_size = model, rows, 1

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.rows, batch_size=self.batch_size)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_step_learns_what_one_batch_of_its_rows_does_at_every_micro_batch(
    tuned: TuneResult, kind: str
) -> None:
    """Padded rows of 3 to 32 label tokens: each micro-batch weighs its share of the
    step's counted tokens, where Lightning would weigh each the same, so that one SGD
    step at micro-batch 1, 2 and 8 moves the weights as one plain PyTorch step of the 8
    rows does; the same with a last window cut short by the epoch's end."""
    model, batch = causal_lm(kind), padded_rows()
    reference = plain_step(model, batch, lr=1.0)
    rows = Rows([{k: v[i] for k, v in batch.items()} for i in range(8)])
    for micro, accum in ((1, 8), (2, 4), (8, 1), (2, 6)):  # the last: 4 batches, not 6
        module = LitRows(fresh(model), rows)
        result = as_tuned_on(tuned, module, micro, accum, prefix="model.")
        trainer = trainer_with(Autotune.from_result(result), steps=1)
        trainer.fit(module)
        assert trainer.global_step == 1
        assert moved_apart(module.model, reference, model) <= 1e-5, (micro, accum)


def on_module(tuned: TuneResult, module: pl.LightningModule) -> TuneResult:
    """``tuned`` as tuned on ``module`` (its blocks sit under the module's ``model.``),
    without fallbacks."""
    c, info = tuned.config, tuned.model
    return dataclasses.replace(
        tuned,
        config=c.replace(checkpoint=tuple(f"model.{b}" for b in c.checkpoint)),
        model=dataclasses.replace(
            info, fingerprint=fingerprint(module), blocks=tuple(f"model.{b}" for b in info.blocks)
        ),
        fallbacks=(),
    )


def test_the_callback_adds_no_read_of_the_device_to_the_trainers_steps(tuned) -> None:
    # The module's AdamW steps fused, as tuned: its steps are refused on the device.
    fused = on_module(tuned, LitAdamW())
    fused = dataclasses.replace(fused, config=fused.config.replace(optimizer="adamw_fused"))
    reads = []
    for callbacks in ([], [Autotune.from_result(fused)]):
        module = LitAdamW(batch_size=MICRO)
        if not callbacks:  # the plain loop with the same kernel, trained without a cache
            module.configure_optimizers = lambda m=module: torch.optim.AdamW(  # type: ignore[method-assign]
                m.parameters(), lr=1e-4, fused=True
            )
            # (Without a cache or an attention mask, Hugging Face reads the positions on
            # the host to find packed rows: the read is the cache's absence's, not ours.)
            module.model.config.use_cache = False
        trainer = trainer_with(*callbacks)
        trainer.accumulate_grad_batches = fused.config.grad_accum_steps
        with CountedOps(SYNCS.__contains__) as syncs:
            trainer.fit(module)
        assert trainer.global_step == STEPS
        reads.append(syncs.count)
    assert reads[1] == reads[0]


def test_a_non_finite_step_is_refused_and_the_weights_keep_their_values(
    tuned: TuneResult,
) -> None:
    module = LitGPT(batch_size=MICRO)
    poison, kept = [False], {}

    class Poison(pl.Callback):  # from the second step on, NaN gradients
        def on_train_batch_end(self, trainer, pl_module, *args):  # type: ignore[no-untyped-def]
            if trainer.global_step == 1 and not poison[0]:
                poison[0] = True
                kept.update({k: v.clone() for k, v in module.state_dict().items()})

    first = next(p for p in module.parameters() if p.requires_grad)
    first.register_hook(lambda g: g * float("nan") if poison[0] else g)
    result = on_module(tuned, module)
    trainer = trainer_with(Autotune.from_result(result), Poison())
    with pytest.raises(NonFiniteError, match="weights keep their last finite values"):
        trainer.fit(module)
    assert trainer.global_step == 1
    assert all(torch.equal(module.state_dict()[k], v) for k, v in kept.items())
