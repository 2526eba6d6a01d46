"""The attention implementation as a knob: the same math, measured like any other knob,
set by ``prepare()`` and put back; a clear error for a model without the choice."""

from __future__ import annotations

import copy

import pytest
import torch

import autotune
from autotune import ConfigError, SearchSpace, TrainConfig
from autotune.models import gpt_batch, tiny_gpt
from autotune.train._applied import Applied
from autotune.train._attention import attention_of, set_attention

transformers = pytest.importorskip("transformers")


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def batch(n: int = 8, length: int = 48) -> dict[str, torch.Tensor]:
    ids = torch.randint(96, (n, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def test_eager_and_sdpa_train_with_the_same_losses_and_are_put_back() -> None:
    model = llama()
    losses = {}
    for name in ("eager", "sdpa"):
        work = copy.deepcopy(model)
        config = TrainConfig(micro_batch_size=4, grad_accum_steps=2, attention=name)
        with autotune.prepare(work, config, device="cpu", lr=1e-3) as runner:
            assert attention_of(work) == name
            losses[name] = torch.stack([runner.step(batch()) for _ in range(3)])
            runner.undo()
        assert attention_of(work) == "sdpa"  # as it was
    torch.testing.assert_close(losses["eager"], losses["sdpa"], rtol=1e-5, atol=1e-6)


def test_each_implementation_is_tuned_and_the_fastest_verified_wins() -> None:
    model = llama()
    sample = batch()
    space = SearchSpace(
        precisions=("fp32",), selective_checkpointing=False, attention=("eager", "sdpa")
    )
    result = autotune.autotune(model, sample, 0.05, global_batch_size=8, space=space,
                               device="cpu")  # fmt: skip
    assert attention_of(model) == "sdpa"  # the user's model is left as it was
    tried = {t.config.attention for t in result.trials if t.measured is not None}
    assert tried == {"eager", "sdpa"}
    best = max((t for t in result.trials if t.measured), key=lambda t: t.measured.samples_per_s)
    assert result.config.attention in tried
    assert result.measured.samples_per_s >= 0.97 * best.measured.samples_per_s
    assert all(f.attention == result.config.attention for f in result.fallbacks)
    assert "attention=" in result.config.describe()
    runner = autotune.prepare(model, result, device="cpu")
    assert attention_of(model) == result.config.attention
    runner.step(sample)
    runner.undo()
    assert attention_of(model) == "sdpa"


def test_a_model_without_the_choice_is_a_clear_error() -> None:
    gpt = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    with pytest.raises(ConfigError, match="no attention implementation to choose"):
        set_attention(gpt, "eager")
    with pytest.raises(ConfigError, match="no attention implementation to choose"):
        autotune.autotune(gpt, gpt_batch(gpt.config, 4), 0.01, device="cpu",
                          space=SearchSpace(attention=("sdpa",)))  # fmt: skip
    with pytest.raises(ConfigError, match="attention must be one of"):
        TrainConfig(attention="fast")
    with pytest.raises(ConfigError, match=r"SearchSpace\.attention must be"):
        SearchSpace(attention=())
    with pytest.raises(ConfigError, match="not available here"):
        set_attention(llama(), "flash_attention_3")
    model = llama()
    fallback = TrainConfig(micro_batch_size=2, attention="flash_attention_3")
    with pytest.raises(ConfigError, match="not available here"):  # at once, not mid-run
        Applied(model, TrainConfig(), lr=1e-3, device=torch.device("cpu"), fallbacks=[fallback])
    with pytest.raises(ConfigError, match="not supported with storage"):
        autotune.autotune(model, batch(), 0.05, device="cpu", storage="x.db",
                          space=SearchSpace(attention=("eager", "sdpa")))  # fmt: skip
    assert attention_of(model) == "sdpa"
