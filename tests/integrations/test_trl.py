"""TRL's ``SFTTrainer`` with a peft LoRA adapter, trained as tuned: the sample batch is the
trainer's own (packing makes rows of ``max_length`` from the dataset's sequences), the
``SFTConfig`` is built from the exported arguments, and the losses are autotune's runner's
on the same packed batches."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from conftest import Recorder

import autotune
from autotune import SearchSpace, TrainConfig

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from autotune.integrations.transformers import (  # noqa: E402
    AutotuneCallback,
    sample_batch,
    training_arguments,
)

G, MICRO, STEPS, LR = 8, 2, 3, 0.01
SFT: dict[str, Any] = {
    "packing": True,
    "packing_strategy": "wrapped",  # rows of max_length, sequences cut where a row ends
    "max_length": 32,
    "learning_rate": LR,
    "lr_scheduler_type": "constant",
    "max_steps": STEPS,
    "logging_steps": 1,
    "report_to": [],
    "save_strategy": "no",
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
}


def tokenizer() -> Any:
    """A word-level tokenizer built here (nothing downloaded): token ``t{i}`` is id ``i``."""
    import tokenizers

    vocab = {f"t{i}": i for i in range(128)}
    model = tokenizers.models.WordLevel(vocab, unk_token="t0")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(model), pad_token="t0", eos_token="t1"
    )


def lora_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, eos_token_id=1,
        pad_token_id=0,
    )  # fmt: skip
    base = transformers.LlamaForCausalLM(config)
    base.accepts_loss_kwargs = False  # per-sample means, as the runner weights micro-batches
    lora = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with warnings.catch_warnings():  # peft calls transformers' deprecated names
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(base, lora)


def sequences() -> Any:
    """Token sequences of 8 to 40 tokens, already tokenized (TRL packs them)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 40, (60,), generator=g)
    rows = [torch.randint(2, 128, (int(n),), generator=g).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": rows})


def sft_trainer(model: torch.nn.Module, args: Any, *callbacks: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TRL on the tokenizer's new EOS
        return trl.SFTTrainer(
            model=model,
            args=args,
            train_dataset=sequences(),
            processing_class=tokenizer(),
            callbacks=list(callbacks),
        )


def test_sft_trainer_with_lora_trains_as_tuned(tmp_path) -> None:
    model = lora_llama()
    # The sample is the trainer's own batch (packing decides its shape), through the fused
    # LM head the SFTTrainer puts on the model for its loss: what its step runs.
    probe = trl.SFTConfig(str(tmp_path), per_device_train_batch_size=G, use_cpu=True, **SFT)
    sample = sample_batch(sft_trainer(model, probe))
    assert sample["fused_lm_head"] is True and sample["input_ids"].shape == (G, 32)
    blocks = autotune.find_blocks(model)
    kept, _ = autotune.estimate(model, sample, TrainConfig(micro_batch_size=MICRO), device="cpu")
    ckpt, _ = autotune.estimate(
        model, sample, TrainConfig(micro_batch_size=MICRO, checkpoint=blocks), device="cpu"
    )
    budget = kept - 0.3 * (kept - ckpt)  # some blocks must be checkpointed
    space = SearchSpace(precisions=("fp32",), micro_batch_sizes=(MICRO,))
    result = autotune.autotune(
        model, sample, budget / 2**30, global_batch_size=G, space=space, device="cpu"
    )
    assert result.config.checkpoint and result.config.grad_accum_steps == G // MICRO

    start = copy.deepcopy(model)
    recorder = Recorder()
    recorder.attach(model)
    args = training_arguments(result, str(tmp_path), args_class=trl.SFTConfig, **SFT)
    assert isinstance(args, trl.SFTConfig) and args.per_device_train_batch_size == MICRO
    trainer = sft_trainer(model, args, AutotuneCallback(result))
    with autotune.peak_memory(model) as reading:
        trainer.train()

    assert reading.peak_bytes <= result.budget_bytes
    assert [len(x["input_ids"]) for x in recorder.inputs] == [MICRO] * (G // MICRO) * STEPS
    # autotune's runner on the same batches, through the same fused head (a copy's own
    # forward would reach the trained model through TRL's patch).
    replay = Recorder()
    replay.attach(start)
    with autotune.prepare(start, result.config, lr=LR) as runner:
        for batch in recorder.steps(result.config.grad_accum_steps):
            runner.step({**batch, "fused_lm_head": True}, max_grad_norm=1.0)
    torch.testing.assert_close(torch.stack(recorder.losses), torch.stack(replay.losses))
    for a, b in zip(model.parameters(), start.parameters(), strict=True):
        torch.testing.assert_close(a, b)
