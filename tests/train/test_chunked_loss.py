"""The chunked loss (``chunked_loss``): a causal language model's output layer and
cross-entropy a slice of the tokens at a time. The loss and the gradients are the plain
loss's; the logits are never whole, so a 32k vocabulary holds far less; the runner
trains with it, ``estimate()`` predicts its peak, and a model it does not fit is refused
in words."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import autotune
from autotune import TrainConfig
from autotune.measure._tracker import LiveBytesTracker, state_tensors
from autotune.verify._verifier import Verifier

transformers = pytest.importorskip("transformers")
VOCAB, SEQ = 32_000, 64


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def batch(n: int = 4) -> dict[str, torch.Tensor]:
    ids = torch.randint(VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt the loss leaves out
    return {"input_ids": ids, "labels": labels}


def lora_llama() -> nn.Module:
    """The Llama with peft's LoRA adapters on its attention: the adapters train."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(llama(), lora)


@pytest.mark.parametrize("build", [llama, gpt2, lora_llama], ids=["llama", "gpt2", "lora"])
def test_the_loss_and_gradients_are_the_plain_ones_and_the_logits_never_whole(build) -> None:
    plain, chunked = build(), build()
    held = []
    for model, loss_of in ((plain, lambda m: m(**batch()).loss), (chunked, autotune.chunked_loss)):
        tracker = LiveBytesTracker("cpu")
        tracker.track(state_tensors(model))
        with tracker:
            start = tracker.live
            loss = loss_of(model) if model is plain else loss_of(model, batch())
            loss.backward()
        held.append(tracker.peak - start)
        model.loss_value = loss.detach()
    torch.testing.assert_close(chunked.loss_value, plain.loss_value)
    for a, b in zip(plain.parameters(), chunked.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None) == (not a.requires_grad)
        if a.requires_grad:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6)
    logits = 4 * 4 * SEQ * VOCAB  # one fp32 copy of the whole logits
    assert held[0] > 2 * logits and held[1] < held[0] - logits


def test_the_runner_trains_with_it_and_its_peak_is_predicted() -> None:
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2, chunked_loss=True)
    sample = batch(8)
    predicted = autotune.estimate(llama(), sample, config, device="cpu").peak_bytes
    verifier = Verifier(
        llama(), sample, device=torch.device("cpu"), budget_bytes=2**32, loss_fn=None,
        blocks=autotune.find_blocks(llama()),
    )  # fmt: skip
    chunked, error = verifier.trial(config)
    plain, _ = verifier.trial(config.replace(chunked_loss=False))
    assert error is None and chunked is not None and plain is not None
    assert chunked.peak_bytes == predicted
    assert chunked.peak_bytes < 0.8 * plain.peak_bytes
    with autotune.prepare(llama(), config, lr=1e-3, device="cpu") as runner:
        losses = [runner.step(sample).item() for _ in range(3)]
    assert losses[-1] < losses[0]


def test_a_model_it_does_not_fit_is_refused_in_words() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    config = TrainConfig(micro_batch_size=2, chunked_loss=True)
    runner = autotune.prepare(model, config, loss_fn=None, device="cpu")
    with runner, pytest.raises(autotune.LossError, match="no Hugging Face causal language model"):
        runner.step(torch.randn(2, 8))
    with pytest.warns(autotune.AutotuneWarning, match=r"autotune\.chunked_loss\(model, batch\)"):
        autotune.apply(copy.deepcopy(model), config, device="cpu").undo()


def test_a_loop_that_takes_the_models_own_loss_takes_it_chunked() -> None:
    """``apply()``: while it trains, ``model(**batch)`` given labels returns the chunked
    loss (no logits), as the Trainer and a loop of one's own take it; undone after."""
    model, plain = llama(), llama()
    config = TrainConfig(micro_batch_size=4, chunked_loss=True)
    handle = autotune.apply(model, config, device="cpu")
    out = model(**batch())
    assert out.logits is None
    torch.testing.assert_close(out.loss, plain(**batch()).loss)
    with torch.no_grad():  # evaluation: the whole logits, as the model makes them
        assert model(**batch()).logits is not None
    handle.undo()
    assert "forward" not in vars(model) and model(**batch()).logits is not None


def bart() -> nn.Module:
    config = transformers.BartConfig(
        encoder_layers=1, decoder_layers=1, d_model=16, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=64,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


def t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def gemma2() -> nn.Module:
    """Gemma 2: its logits soft-capped (``final_logit_softcapping`` 30)."""
    config = transformers.Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    return transformers.Gemma2ForCausalLM(config)


def gemma3() -> nn.Module:
    """Gemma 3's composite model, its text model's logits soft-capped in its sub-config."""
    text = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        final_logit_softcapping=30.0,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=16, patch_size=4,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=16
    )
    return transformers.Gemma3ForConditionalGeneration(config)


@pytest.mark.parametrize(
    ("build", "why"),
    [
        (bart, "no Hugging Face causal language model"),
        (t5, "no Hugging Face causal language model"),
        (gemma2, r"logits are transformed \(final_logit_softcapping\)"),
        (gemma3, r"logits are transformed \(final_logit_softcapping\)"),
    ],
    ids=["bart", "t5", "gemma2", "gemma3"],
)
def test_a_model_whose_loss_it_is_not_is_not_offered_it(build, why: str) -> None:
    """An encoder-decoder model's labels align with its predictions and its decoder
    reads inputs made from them (the causal chunked loss would shift them, and lose
    BART's ``final_logits_bias``); soft-capped logits are no plain linear layer's."""
    from autotune.train import why_not_chunked

    ids = torch.randint(4, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    found = why_not_chunked(build(), {"input_ids": ids, "labels": ids}, has_loss_fn=False)
    assert found is not None and re.search(why, found), found
