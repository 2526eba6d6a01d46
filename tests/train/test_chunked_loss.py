"""The chunked loss (``chunked_loss``): a causal language model's output layer and
cross-entropy a slice of the tokens at a time. The loss and the gradients are the plain
loss's; the logits are never whole, so a 32k vocabulary holds far less; the runner
trains with it, ``estimate()`` predicts its peak, and a model it does not fit is refused
in words."""

from __future__ import annotations

import copy

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


@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2"])
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
        torch.testing.assert_close(b.grad, a.grad)
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
    chunked, error = verifier.run(config)
    plain, _ = verifier.run(config.replace(chunked_loss=False))
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
        autotune.apply(copy.deepcopy(llama()), config, device="cpu").undo()


def test_an_encoder_decoder_model_is_not_offered_it() -> None:
    """BART's labels align with its predictions and its decoder reads inputs made from
    them: the causal chunked loss would shift them and lose ``final_logits_bias``."""
    from autotune.train import why_not_chunked

    config = transformers.BartConfig(
        encoder_layers=1, decoder_layers=1, d_model=16, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=64,
    )  # fmt: skip
    bart = transformers.BartForConditionalGeneration(config)
    ids = torch.randint(4, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    assert "no Hugging Face causal language model" in str(
        why_not_chunked(bart, {"input_ids": ids, "labels": ids}, has_loss_fn=False)
    )


def test_at_a_binding_budget_it_plans_a_micro_batch_the_plain_loss_cannot_fit() -> None:
    """Profiled as a timeline of its own beside the plain one, the chunked loss is the
    only way to micro-batch 8 under a budget between their peaks there."""
    from autotune.cost import Chooser, CostModel
    from autotune.measure import Profiler, memory_profile

    profiler = Profiler(llama(), batch(8), (), device=torch.device("cpu"), loss_fn=None)
    profile, notes = memory_profile(
        profiler, ("fp32", "fp32+chunked"), ("adamw",), device_name="cpu", context_bytes=0
    )
    assert not notes
    cost = CostModel(profile)
    plain, chunked = (
        cost.memory(TrainConfig(micro_batch_size=8, chunked_loss=c))[0] for c in (False, True)
    )
    chooser = Chooser(
        cost=cost, sizes=(1, 2, 4, 8), precisions=("fp32", "fp32+chunked"),
        optimizers=("adamw",), global_batch_size=8, limit=(plain + chunked) // 2,
    )  # fmt: skip
    assert chooser.config("fp32", "adamw", 8) is None
    config = chooser.config("fp32+chunked", "adamw", 8)
    assert config is not None and config.chunked_loss and config.micro_batch_size == 8
