"""Peak prediction on real architectures (Hugging Face models built from tiny configs).

For each model a memory profile is taken at micro-batch sizes 2 and 4, then configs at
other sizes, with accumulation, autocast and mixed checkpoint masks are predicted and
run for real. Target: within 3% (on CPU the tracker is exact, so misses are model bugs).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
import torch
from sweeps import sweep
from torch import nn

from autotune import TrainConfig, find_blocks
from autotune._profile_data import Profile, profile_from_json, profile_to_json
from autotune.config import Timeline
from autotune.cost._cost_model import CostModel
from autotune.measure._memory_profile import memory_profile
from autotune.measure._profiler import Profiler
from autotune.verify._verifier import Verifier

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")


def lm_batch(vocab: int, n: int = 4, length: int = 16) -> dict[str, torch.Tensor]:
    ids = torch.randint(vocab, (n, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def gpt2() -> tuple[nn.Module, object]:
    c = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=96, n_positions=32)
    return transformers.GPT2LMHeadModel(c), lm_batch(96)


def llama() -> tuple[nn.Module, object]:
    c = transformers.LlamaConfig(
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(c), lm_batch(96)


def bert() -> tuple[nn.Module, object]:
    c = transformers.BertConfig(
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        vocab_size=96,
        max_position_embeddings=32,
    )
    batch = lm_batch(96)
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    return transformers.BertForMaskedLM(c), batch


def t5() -> tuple[nn.Module, object]:
    c = transformers.T5Config(
        num_layers=2,
        num_decoder_layers=2,
        d_model=32,
        d_ff=64,
        num_heads=2,
        d_kv=16,
        vocab_size=96,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(c), lm_batch(96)


MODELS: dict[str, Callable[[], tuple[nn.Module, object]]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "t5": t5,
}


def profile(model: nn.Module, sample: object, blocks: tuple[str, ...]) -> Profile:
    profiler = Profiler(model, sample, blocks, device=CPU, loss_fn=None)
    profile, _ = memory_profile(
        profiler,
        (Timeline("fp32"), Timeline("bf16")),
        ("adamw",),
        device_name="cpu",
        context_bytes=0,
    )
    return profile


def measured_peak(model: nn.Module, sample: object, config: TrainConfig) -> int:
    """The peak of one verified step of ``config`` on a copy of ``model``."""
    verifier = Verifier(
        copy.deepcopy(model), sample, device=CPU, budget_bytes=2**40, loss_fn=None, steps=1
    )
    measured, error = verifier.trial(config)
    assert error is None and measured is not None, error
    return measured.peak_bytes


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", sweep(list(MODELS), ["llama", "t5"]))  # decoder, enc-dec
def test_peak_prediction_on_real_models(name: str) -> None:
    torch.manual_seed(0)
    model, sample = MODELS[name]()
    blocks = find_blocks(model)
    cost = CostModel(profile(copy.deepcopy(model), sample, blocks))
    half = blocks[::2]
    configs = [
        TrainConfig(micro_batch_size=1, grad_accum_steps=4),
        TrainConfig(micro_batch_size=8, checkpoint=blocks),
        TrainConfig(micro_batch_size=6, grad_accum_steps=2, checkpoint=half),
        TrainConfig(micro_batch_size=3, grad_accum_steps=3, precision="bf16", checkpoint=half),
    ]
    for config in configs:
        predicted, parts = cost.memory(config)
        measured = measured_peak(model, sample, config)
        err = abs(predicted - measured) / measured
        assert err <= 0.03, (name, config.describe(), predicted, measured)
        assert min(dataclasses.astuple(parts)) >= 0  # nothing holds negative bytes


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_checkpointed_layer_holding_what_python_drops_is_predicted_exactly() -> None:
    """LoRA on a Qwen2, its base frozen: a kept layer saves neither the embedding output
    nor the rotary tables, which Python drops as the decoder returns; a checkpointed one
    holds them until its backward. A mask of both kinds is predicted to the byte (issue
    47: it missed by 0.8% either way when the free was interpolated between the runs)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    c = transformers.Qwen2Config(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=32,
    )
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model, sample = peft.get_peft_model(transformers.Qwen2ForCausalLM(c), lora), lm_batch(96)
    blocks = find_blocks(model)
    measured_profile = profile(copy.deepcopy(model), sample, blocks)
    assert measured_profile.precisions[Timeline("fp32")].crossings  # what moves, kept with a study:
    assert profile_from_json(profile_to_json(measured_profile)) == measured_profile
    cost = CostModel(measured_profile)
    for config in (
        TrainConfig(micro_batch_size=4, checkpoint=blocks[:2], eval_batch_size=8),
        TrainConfig(micro_batch_size=3, grad_accum_steps=2, checkpoint=blocks[1:3]),
    ):
        predicted, _ = cost.memory(config)
        measured = measured_peak(model, sample, config)
        assert predicted == measured, (config.describe(), predicted, measured)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_checkpointed_encoder_decoder_trains_like_the_original() -> None:
    """T5's decoder layers pass a key/value cache; checkpointing must not replay it."""
    import autotune

    torch.manual_seed(0)
    model, batch = t5()
    blocks = find_blocks(model)
    assert blocks[-1].startswith("decoder.")
    results = []
    for mask in ((), blocks):
        torch.manual_seed(1)  # T5 has dropout: checkpointing must replay the same masks
        runner = autotune.prepare(
            copy.deepcopy(model),
            TrainConfig(micro_batch_size=2, grad_accum_steps=2, checkpoint=mask),
            lr=1e-3,
        )
        losses = [runner.step(batch).item() for _ in range(3)]
        results.append((losses, [p.detach().clone() for p in runner.model.parameters()]))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
