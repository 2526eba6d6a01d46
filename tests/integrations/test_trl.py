"""TRL's ``SFTTrainer`` with a peft LoRA adapter, trained as tuned: the sample batch is the
trainer's own (packing makes rows of ``max_length`` from the dataset's sequences), the
``SFTConfig`` is built from the exported arguments, and the losses are autotune's runner's
on the same packed batches."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Recorder
from sweeps import sweep

import autotune
from autotune import SearchSpace, TrainConfig
from autotune.measure._memory_profile import working_copy

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


def lora_llama(quantized_in: Path | None = None) -> torch.nn.Module:
    """A tiny Llama with LoRA on its attention; ``quantized_in``: its base saved there and
    loaded 4-bit (NF4, bitsandbytes' CPU backend), prepared for k-bit training: QLoRA."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, eos_token_id=1,
        pad_token_id=0,
    )  # fmt: skip
    base = transformers.LlamaForCausalLM(config)
    with warnings.catch_warnings():  # peft calls transformers' deprecated names
        warnings.simplefilter("ignore", FutureWarning)
        if quantized_in is not None:
            base.save_pretrained(quantized_in)
            four_bit = transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
            )
            base = transformers.LlamaForCausalLM.from_pretrained(
                quantized_in, quantization_config=four_bit, device_map="cpu"
            )
            base = peft.prepare_model_for_kbit_training(base)
        base.accepts_loss_kwargs = False  # per-sample means, as the runner weighs micro-batches
        lora = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        torch.manual_seed(0)
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


@pytest.mark.parametrize("quantized", sweep([False, True], [False]), ids=["lora", "qlora"])
def test_sft_trainer_with_lora_trains_as_tuned(tmp_path, quantized: bool) -> None:
    if quantized:
        pytest.importorskip("bitsandbytes")
    model = lora_llama(tmp_path / "base" if quantized else None)
    # The sample is the trainer's own batch (packing decides its shape), through the fused
    # LM head the SFTTrainer puts on the model for its loss: what its step runs.
    probe = trl.SFTConfig(str(tmp_path), per_device_train_batch_size=G, use_cpu=True, **SFT)
    sample = sample_batch(sft_trainer(model, probe))
    assert sample["fused_lm_head"] is True and sample["input_ids"].shape == (G, 32)
    blocks = autotune.find_blocks(model)
    precision = "bf16" if quantized else "fp32"
    at = TrainConfig(micro_batch_size=MICRO, precision=precision)
    kept, _ = autotune.estimate(model, sample, at, device="cpu")
    ckpt, _ = autotune.estimate(model, sample, at.replace(checkpoint=blocks), device="cpu")
    budget = kept - 0.3 * (kept - ckpt)  # some blocks must be checkpointed
    # A 4-bit base computes in bf16 (its compute dtype): so does the step around it.
    space = SearchSpace(precisions=("bf16" if quantized else "fp32",), micro_batch_sizes=(MICRO,))
    result = autotune.autotune(
        model, sample, budget / 2**30, global_batch_size=G, space=space, device="cpu"
    )
    assert result.config.checkpoint and result.config.grad_accum_steps == G // MICRO

    start = working_copy(model, torch.device("cpu"))  # a 4-bit base's quantization state too
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
