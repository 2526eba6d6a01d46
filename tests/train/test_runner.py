"""prepare() and the Runner (autotune.train): the Runner's training math, checkpointing."""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from tiny_gpt2 import causal_lm, padded_rows
from torch import nn

from autotune import TrainConfig, TuneResult, prepare
from autotune.errors import AutotuneWarning, BatchError, BlockError, ConfigError
from autotune.measure._tracker import LiveBytesTracker
from autotune.models import GPT, Block, gpt_batch, tiny_gpt
from autotune.result import Breakdown, Measurement, ModelInfo, TargetInfo
from autotune.train._checkpoint import apply_checkpointing, remove_checkpointing
from autotune.train._runner import Runner

Batch = tuple[torch.Tensor, torch.Tensor]


def batches(model: GPT, n: int, size: int = 8) -> list[Batch]:
    return [gpt_batch(model.config, size, seed=100 + i) for i in range(n)]


def train(
    model: nn.Module, config: TrainConfig, data: Sequence[Any], *, lr: float = 1e-2, seed: int = 0
) -> tuple[torch.Tensor, nn.Module, Runner]:
    """Train a deep copy of ``model`` from ``torch.manual_seed(seed)``; return losses, copy, runner."""
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    runner = prepare(model, config, lr=lr, device="cpu")
    losses = torch.stack([runner.step(batch) for batch in data])
    return losses, model, runner


def assert_same_weights(a: nn.Module, b: nn.Module, **tolerance: float) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        torch.testing.assert_close(
            sa[name], sb[name], msg=lambda m, n=name: f"{n}: {m}", **tolerance
        )


def weights_changed(before: nn.Module, after: nn.Module) -> bool:
    return any(
        not torch.equal(p, q) for p, q in zip(before.parameters(), after.parameters(), strict=True)
    )


# fp32 sums in another order differ in the last bits; SGD keeps them that small.
FP32 = {"rtol": 1e-5, "atol": 1e-6}


# --- the training math -----------------------------------------------------------------------


def test_step_matches_a_plain_pytorch_loop(tiny_gpt_model: GPT) -> None:
    data = batches(tiny_gpt_model, 3)
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2, optimizer="sgd")
    losses, model, _ = train(tiny_gpt_model, config, data)
    assert all(p.grad is None for p in model.parameters())  # freed after each step

    reference = copy.deepcopy(tiny_gpt_model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=1e-2, momentum=0.9)
    expected = []
    for batch in data:
        optimizer.zero_grad()
        loss = reference(*batch)
        loss.backward()
        optimizer.step()
        expected.append(loss.detach())
    torch.testing.assert_close(losses, torch.stack(expected), **FP32)
    assert_same_weights(model, reference, **FP32)


@pytest.mark.parametrize("optimizer", ["sgd", "adafactor"])
def test_accumulation_matches_one_big_micro_batch(tiny_gpt_model: GPT, optimizer: str) -> None:
    data = batches(tiny_gpt_model, 1) * 3  # one batch again: a fresh model's loss falls on it
    accum = TrainConfig(micro_batch_size=4, grad_accum_steps=2, optimizer=optimizer)
    whole = TrainConfig(micro_batch_size=8, grad_accum_steps=1, optimizer=optimizer)
    losses_a, model_a, _ = train(tiny_gpt_model, accum, data)
    losses_w, model_w, _ = train(tiny_gpt_model, whole, data)
    torch.testing.assert_close(losses_a, losses_w, **FP32)
    assert losses_a[-1] < losses_a[0]  # it trains
    assert weights_changed(tiny_gpt_model, model_a)
    # Adafactor divides by a root of tiny second moments, which magnifies rounding.
    tolerance = FP32 if optimizer == "sgd" else {"rtol": 1e-4, "atol": 1e-4}
    assert_same_weights(model_a, model_w, **tolerance)


def test_adamw_accumulation_matches_one_big_micro_batch(tiny_gpt_model: GPT) -> None:
    # AdamW's update g / sqrt(g^2) turns rounding in near-zero gradients into whole steps
    # of size lr, so compare the losses and weights after a single step at a small lr.
    data = batches(tiny_gpt_model, 1)
    accum = TrainConfig(micro_batch_size=2, grad_accum_steps=4, optimizer="adamw")
    whole = TrainConfig(micro_batch_size=8, grad_accum_steps=1, optimizer="adamw")
    losses_a, model_a, _ = train(tiny_gpt_model, accum, data, lr=1e-4)
    losses_w, model_w, _ = train(tiny_gpt_model, whole, data, lr=1e-4)
    torch.testing.assert_close(losses_a, losses_w, **FP32)
    assert_same_weights(model_a, model_w, rtol=0.0, atol=2.5e-4)  # at most ~one lr off
    assert weights_changed(tiny_gpt_model, model_a)


def test_ragged_batch_weights_micro_batches_by_size(tiny_gpt_model: GPT) -> None:
    data = [gpt_batch(tiny_gpt_model.config, 10, seed=7)]  # micro-batches of 4, 4 and 2
    ragged = TrainConfig(micro_batch_size=4, grad_accum_steps=2, optimizer="sgd")
    whole = TrainConfig(micro_batch_size=16, grad_accum_steps=1, optimizer="sgd")
    losses_r, model_r, _ = train(tiny_gpt_model, ragged, data)
    losses_w, model_w, _ = train(tiny_gpt_model, whole, data)
    torch.testing.assert_close(losses_r, losses_w, **FP32)
    assert_same_weights(model_r, model_w, **FP32)
    # The returned loss is the mean over the batch, as the model computes it in one pass.
    with torch.no_grad():
        expected = tiny_gpt_model(*data[0])
    torch.testing.assert_close(losses_r[0], expected, **FP32)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checkpointing_does_not_change_the_math(dropout: float) -> None:
    model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64, dropout=dropout)
    data = batches(model, 3)
    plain = TrainConfig(micro_batch_size=4, grad_accum_steps=2, optimizer="sgd")
    ckpt = plain.replace(checkpoint=("blocks.0", "blocks.1"))
    losses_p, model_p, _ = train(model, plain, data)
    losses_c, model_c, _ = train(model, ckpt, data)
    torch.testing.assert_close(losses_c, losses_p, rtol=0.0, atol=0.0)
    assert_same_weights(model_c, model_p, rtol=0.0, atol=0.0)
    assert all("forward" in model_c.blocks[i].__dict__ for i in (0, 1))  # really checkpointed
    if dropout:  # dropout is live: another seed gives other losses, so equality means something
        other, _, _ = train(model, plain, data, seed=1)
        assert not torch.allclose(other, losses_p)


def test_checkpointing_saves_activation_memory(tiny_gpt_model: GPT, tiny_gpt_batch: Batch) -> None:
    def live_after_forward(names: tuple[str, ...]) -> int:
        model = copy.deepcopy(tiny_gpt_model)
        apply_checkpointing(model, names)
        tracker = LiveBytesTracker()
        with tracker:
            loss = model(*tiny_gpt_batch)
            live = tracker.live  # what the graph keeps for backward
            loss.backward()
        return live

    assert live_after_forward(("blocks.0", "blocks.1")) < live_after_forward(("blocks.0",))
    assert live_after_forward(("blocks.0",)) < live_after_forward(())


# --- precision -------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_close_to_fp32(tiny_gpt_model: GPT, precision: str) -> None:
    data = batches(tiny_gpt_model, 2)
    fp32 = TrainConfig(micro_batch_size=4, grad_accum_steps=2, optimizer="sgd")
    losses_32, _, runner_32 = train(tiny_gpt_model, fp32, data)
    losses, model, runner = train(tiny_gpt_model, fp32.replace(precision=precision), data)
    assert runner_32.scaler is None
    assert (runner.scaler is not None) == (precision == "fp16")
    assert isinstance(runner.scaler, torch.amp.GradScaler) or precision == "bf16"
    assert losses.dtype == torch.float32 and torch.isfinite(losses).all()
    torch.testing.assert_close(losses, losses_32, rtol=2e-2, atol=0.0)
    assert weights_changed(tiny_gpt_model, model)  # the optimizer step was not skipped
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast, not .half()
    # The forward really runs in reduced precision.
    with runner.autocast():
        assert (
            model.head(torch.randn(2, 32)).dtype
            == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        )


def test_fp16_scaler_scales_the_backward(tiny_gpt_model: GPT, tiny_gpt_batch: Batch) -> None:
    model = copy.deepcopy(tiny_gpt_model)
    runner = prepare(model, TrainConfig(micro_batch_size=8, precision="fp16"), device="cpu")
    assert runner.scaler is not None
    loss = runner.forward_loss(tiny_gpt_batch)
    runner.backward(loss)
    scaled = model.ln_f.bias.grad.clone()

    reference = copy.deepcopy(tiny_gpt_model)
    with runner.autocast():
        reference(*tiny_gpt_batch).backward()
    scale = runner.scaler.get_scale()
    assert scale > 1
    # Equal up to fp16 rounding, which the unscaled reference suffers more of.
    torch.testing.assert_close(scaled / scale, reference.ln_f.bias.grad, rtol=2e-2, atol=1e-4)
    assert scaled.abs().max() > 100 * reference.ln_f.bias.grad.abs().max()


# --- prepare() -------------------------------------------------------------------------------


def tune_result(config: TrainConfig, device: str = "cpu") -> TuneResult:
    m = Measurement(peak_bytes=1000, step_s=0.1, samples_per_s=80.0)
    return TuneResult(
        config=config,
        predicted=m,
        measured=m,
        budget_bytes=2000,
        target=TargetInfo(
            device=device, name="test", total_bytes=1 << 30, torch_version=torch.__version__
        ),
        model=ModelInfo(
            class_name="GPT", fingerprint="0", n_parameters=1, blocks=("blocks.0", "blocks.1")
        ),
        breakdown=Breakdown(parameters=1, gradients=1, optimizer=1, activations=1, other=1),
    )


def test_prepare_accepts_a_tune_result(tiny_gpt_model: GPT, tiny_gpt_batch: Batch) -> None:
    config = TrainConfig(
        micro_batch_size=4, grad_accum_steps=2, checkpoint=("blocks.1",), optimizer="sgd"
    )
    # tuned for another device and model: prepare() says so, and still trains as tuned
    with pytest.warns(AutotuneWarning, match="may not fit here"):
        runner = prepare(tiny_gpt_model, tune_result(config), lr=0.5)
    assert runner.config == config
    assert runner.device == torch.device("cpu")
    assert isinstance(runner.optimizer, torch.optim.SGD)
    assert runner.optimizer.param_groups[0]["lr"] == 0.5
    assert (
        "forward" in tiny_gpt_model.blocks[1].__dict__
        and "forward" not in tiny_gpt_model.blocks[0].__dict__
    )
    assert torch.isfinite(runner.step(tiny_gpt_batch))


@pytest.mark.parametrize("bad", [{"micro_batch_size": 4}, "tuned.yaml", None])
def test_prepare_rejects_other_config_types(tiny_gpt_model: GPT, bad: Any) -> None:
    with pytest.raises(ConfigError, match="TrainConfig or a TuneResult"):
        prepare(tiny_gpt_model, bad)


def test_prepare_puts_the_model_in_train_mode_on_the_device(
    tiny_gpt_model: GPT, tiny_gpt_batch: Batch
) -> None:
    model = tiny_gpt_model.eval()
    model(*tiny_gpt_batch).backward()  # stale gradients from before prepare()
    apply_checkpointing(model, ["blocks.0"])  # a previous prepare() of another config
    runner = prepare(model, TrainConfig(checkpoint=("blocks.1",)), device="cpu")
    assert runner.model is model
    assert all(m.training for m in model.modules())
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert "forward" not in model.blocks[0].__dict__  # the old config's checkpointing is gone
    assert "forward" in model.blocks[1].__dict__
    assert runner.device == torch.device("cpu")


def test_prepare_needs_trainable_parameters(tiny_gpt_model: GPT) -> None:
    tiny_gpt_model.requires_grad_(False)
    with pytest.raises(ConfigError, match="no parameters that require grad"):
        prepare(tiny_gpt_model, TrainConfig(), device="cpu")
    with pytest.raises(ConfigError):
        prepare(nn.ReLU(), TrainConfig(), device="cpu")


def test_frozen_parameters_stay_frozen(tiny_gpt_model: GPT, tiny_gpt_batch: Batch) -> None:
    tiny_gpt_model.wpe.requires_grad_(False)
    frozen = tiny_gpt_model.wpe.weight.detach().clone()
    runner = prepare(tiny_gpt_model, TrainConfig(micro_batch_size=8), lr=1e-2, device="cpu")
    runner.step(tiny_gpt_batch)
    assert torch.equal(tiny_gpt_model.wpe.weight, frozen)
    assert all(
        p is not tiny_gpt_model.wpe.weight
        for g in runner.optimizer.param_groups
        for p in g["params"]
    )


# --- apply_checkpointing / remove_checkpointing ---------------------------------------------------


def test_remove_checkpointing_restores_the_class_forward(tiny_gpt_model: GPT) -> None:
    block = tiny_gpt_model.blocks[0]
    apply_checkpointing(tiny_gpt_model, ["blocks.0"])
    assert "forward" in block.__dict__
    remove_checkpointing(tiny_gpt_model)
    assert "forward" not in block.__dict__
    assert block.forward.__func__ is Block.forward  # type: ignore[attr-defined]
    assert vars(block).keys() == vars(copy.deepcopy(tiny_gpt_model.blocks[1])).keys()


def test_remove_checkpointing_keeps_a_user_set_forward(tiny_gpt_model: GPT) -> None:
    block = tiny_gpt_model.blocks[0]
    calls: list[int] = []

    def user_forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return Block.forward(block, x)

    block.forward = user_forward  # type: ignore[method-assign]
    apply_checkpointing(tiny_gpt_model, ["blocks.0"])
    assert block.forward is not user_forward
    tiny_gpt_model(torch.zeros(2, 4, dtype=torch.long))
    assert calls == [1]  # the checkpointed forward wraps the user's
    remove_checkpointing(tiny_gpt_model)
    assert block.forward is user_forward


def test_checkpointing_is_idempotent(tiny_gpt_model: GPT, tiny_gpt_batch: Batch) -> None:
    apply_checkpointing(tiny_gpt_model, ["blocks.0"])
    wrapped = tiny_gpt_model.blocks[0].forward
    apply_checkpointing(tiny_gpt_model, ["blocks.0", "blocks.0"])
    assert tiny_gpt_model.blocks[0].forward is wrapped  # not wrapped twice
    remove_checkpointing(tiny_gpt_model)
    remove_checkpointing(tiny_gpt_model)
    assert all("forward" not in m.__dict__ for m in tiny_gpt_model.modules())
    assert torch.isfinite(tiny_gpt_model(*tiny_gpt_batch))


def test_checkpointed_model_gives_the_same_output_without_grad(
    tiny_gpt_model: GPT, tiny_gpt_batch: Batch
) -> None:
    expected = tiny_gpt_model(tiny_gpt_batch[0])
    apply_checkpointing(tiny_gpt_model, ["blocks.0", "blocks.1"])
    with torch.no_grad():
        torch.testing.assert_close(tiny_gpt_model(tiny_gpt_batch[0]), expected, rtol=0, atol=0)
    torch.testing.assert_close(tiny_gpt_model(tiny_gpt_batch[0]), expected, rtol=0, atol=0)


@pytest.mark.parametrize("names", [["blocks.7"], ["blocks.0", "nope"], ["blocks.0.ln1.weight"]])
def test_unknown_block_is_a_block_error(tiny_gpt_model: GPT, names: list[str]) -> None:
    bad = names[-1]
    with pytest.raises(BlockError, match=bad.replace(".", r"\.")):
        apply_checkpointing(tiny_gpt_model, names)
    # Nothing was wrapped: the model is as it was before the failed call.
    assert all("forward" not in m.__dict__ for m in tiny_gpt_model.modules())
    with pytest.raises(BlockError):
        prepare(tiny_gpt_model, TrainConfig(checkpoint=tuple(names)), device="cpu")


def test_checkpointed_model_deep_copies_independently(tiny_gpt_model: GPT) -> None:
    apply_checkpointing(tiny_gpt_model, ["blocks.0"])
    clone = copy.deepcopy(tiny_gpt_model)
    wrapped = clone.blocks[0].forward
    assert isinstance(wrapped, functools.partial)
    name, block, forward, _ = wrapped.args
    assert name == "blocks.0" and block is clone.blocks[0]  # the copy runs its own block
    assert forward.__self__ is clone.blocks[0]
    remove_checkpointing(clone)
    assert "forward" not in clone.blocks[0].__dict__
    assert "forward" in tiny_gpt_model.blocks[0].__dict__


# --- Hugging Face ------------------------------------------------------------------------------


def test_hugging_face_gpt2_with_dict_batch_and_checkpointing() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(64, (4, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    plain = TrainConfig(micro_batch_size=2, grad_accum_steps=2)
    losses_p, model_p, _ = train(model, plain, [batch] * 4, lr=1e-3)
    losses_c, model_c, _ = train(
        model, plain.replace(checkpoint=("transformer.h.0",)), [batch] * 4, lr=1e-3
    )
    assert (losses_p[1:] < losses_p[:-1]).all(), losses_p
    torch.testing.assert_close(losses_c, losses_p, rtol=0.0, atol=0.0)
    assert_same_weights(model_c, model_p, rtol=0.0, atol=0.0)
    assert "forward" in model_c.transformer.h[0].__dict__


# --- releasing what a runner holds -----------------------------------------------------


def test_close_releases_the_offloaded_optimizer_and_unwraps_the_blocks() -> None:
    import gc
    import weakref

    from autotune.errors import ConfigError
    from autotune.models import gpt_batch, tiny_gpt

    model = tiny_gpt()
    forwards = {name: m.forward for name, m in model.named_modules()}
    config = TrainConfig(
        micro_batch_size=2, grad_accum_steps=2, checkpoint=("blocks.0",), offload_optimizer=True
    )
    runner = prepare(model, config, device="cpu")
    runner.step(gpt_batch(model.config, 4))
    assert runner.host is not None
    host = weakref.ref(runner.host)
    assert any(p._post_accumulate_grad_hooks for p in model.parameters())
    with runner:
        pass  # the context manager closes
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert all(m.forward == forwards[name] for name, m in model.named_modules())
    with pytest.raises(ConfigError, match="closed"):
        runner.step(gpt_batch(model.config, 4))
    runner.close()  # twice is harmless
    del runner
    gc.collect()
    assert host() is None  # its pinned master weights and host state are gone


def next_token_mean(output: Any, batch: Any) -> torch.Tensor:
    """A ``loss_fn`` of one's own: a causal LM's mean over its counted next tokens."""
    logits, labels = output.logits[:, :-1], batch[-1][:, 1:]
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


@pytest.mark.parametrize("path", ["runner", "apply", "chunked", "loss_fn", "packed"])
def test_accumulation_weighs_label_tokens_as_one_batch_does(path: str) -> None:
    """A causal LM's loss is a mean over its counted label tokens: micro-batches weigh
    theirs, so that one SGD step at micro-batch 1, 2 and 8 moves the weights as one plain
    PyTorch step of the 8 rows (1e-5 relative), through the runner, ``apply()`` in a loop
    of one's own, the chunked loss, a ``loss_fn`` of one's own said to be a mean over next
    tokens (``loss_mean``), and the 8 sequences packed in one row."""
    model, batch = causal_lm(), padded_rows()
    loss_fn = None
    if path == "loss_fn":
        batch = (batch["input_ids"], batch["labels"])
        loss_fn = next_token_mean
    if path == "packed":  # the 8 sequences' tokens in one row, each its positions from 0
        keep = batch["attention_mask"].bool()
        positions = torch.arange(32).expand(8, 32)
        # Each sequence's first label is -100, as Hugging Face's DataCollatorWithFlattening
        # makes it: no token is predicted from the sequence before.
        labels = batch["labels"].clone()
        labels[:, 0] = -100
        batch = {
            "input_ids": batch["input_ids"][keep][None],
            "position_ids": positions[keep][None],
            "labels": labels[keep][None],
        }
    reference = copy.deepcopy(model)
    plain = loss_fn(reference(batch[0]), batch) if loss_fn else reference(**batch).loss
    plain.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= p.grad
    reference.requires_grad_(False)
    model.requires_grad_(False)
    moved = torch.cat(
        [(a - b).flatten() for a, b in zip(reference.parameters(), model.parameters(), strict=True)]
    )
    for micro in (1, 2, 8):
        config = TrainConfig(
            micro_batch_size=micro, grad_accum_steps=8 // micro, optimizer="sgd",
            chunked_loss=path == "chunked",
        )  # fmt: skip
        work = copy.deepcopy(model).requires_grad_(True)
        if path == "apply":
            import autotune

            with autotune.apply(work, config, lr=1.0, device="cpu") as handle:
                optimizer = torch.optim.SGD(work.parameters(), lr=1.0)
                for chunk, weight in handle.micro_batches(batch):
                    (work(**chunk).loss * weight).backward()
                optimizer.step()
        else:
            mean = "next_tokens" if path == "loss_fn" else None
            runner = prepare(work, config, lr=1.0, device="cpu", loss_fn=loss_fn, loss_mean=mean)
            runner.step(batch)
        # SGD's momentum does nothing on a first step: the update is the gradient.
        work.requires_grad_(False)
        error = torch.cat(
            [
                (a - b).flatten()
                for a, b in zip(work.parameters(), reference.parameters(), strict=True)
            ]
        )
        assert error.norm() <= 1e-5 * moved.norm(), (
            path,
            micro,
            float(error.norm() / moved.norm()),
        )


def test_a_token_mean_said_of_a_batch_without_token_labels_is_refused_with_advice() -> None:
    model = nn.Linear(4, 2)
    batch = (torch.randn(8, 4), torch.randn(8, 2))
    mse = lambda out, b: nn.functional.mse_loss(out, b[-1])  # noqa: E731
    config = TrainConfig(micro_batch_size=2, grad_accum_steps=4, optimizer="sgd")
    with pytest.raises(ConfigError, match="loss_mean='words' is none of 'samples', 'tokens'"):
        prepare(model, config, loss_fn=mse, loss_mean="words")  # type: ignore[arg-type]
    runner = prepare(model, config, loss_fn=mse, loss_mean="tokens", device="cpu")
    with pytest.raises(BatchError, match="pass loss_mean='samples'"):
        runner.step(batch)
    runner.close()
    # The advice, as written: micro-batches weigh their samples.
    prepare(model, config, loss_fn=mse, loss_mean="samples", device="cpu").step(batch)
