"""The held-out kinds of model, one each, at a size a 2-core CPU tunes in seconds: a
decoder LM, an encoder LM, a seq2seq model, a ViT, a CNN, a diffusion UNet, a mixture of
experts and LoRA adapters (issue 57's tuning-time target is over these).

Random weights from configs (nothing downloads); every case takes a global batch of 32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .cases import Case, cases_for, lm_batch

__all__ = ["kind_cases"]

_VOCAB, _SEQ = 2048, 128
_LLAMA = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": _VOCAB,
    "max_position_embeddings": 256,
}


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def seeded() -> nn.Module:
        torch.manual_seed(0)
        return build()

    return seeded


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    shape = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4}
    return BertForMaskedLM(
        BertConfig(**shape, num_attention_heads=4, vocab_size=_VOCAB, max_position_embeddings=256)
    )


def _masked_batch(n: int) -> dict[str, torch.Tensor]:
    """15% of the tokens masked, the others' labels -100."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, _VOCAB, (n, _SEQ), generator=g)
    chosen = torch.rand(n, _SEQ, generator=g) < 0.15
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return {"input_ids": ids.masked_fill(chosen, 4), "labels": labels}


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=_VOCAB, d_model=128, d_ff=512, d_kv=32, num_heads=4, num_layers=3,
            num_decoder_layers=3, decoder_start_token_id=0,
        )
    )  # fmt: skip


def _seq2seq_batch(n: int) -> dict[str, torch.Tensor]:
    """128 source tokens, 32 target tokens."""
    g = torch.Generator().manual_seed(0)
    source = torch.randint(3, _VOCAB, (n, _SEQ), generator=g)
    return {"input_ids": source, "labels": torch.randint(3, _VOCAB, (n, 32), generator=g)}


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    shape = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4}
    config = ViTConfig(**shape, num_attention_heads=4, image_size=64, patch_size=8, num_labels=10)
    return ViTForImageClassification(config)


def _vit_batch(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(n, 3, 64, 64, generator=g)
    return {"pixel_values": pixels, "labels": torch.randint(10, (n,), generator=g)}


def _unet() -> nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64),
        layers_per_block=1, cross_attention_dim=64, attention_head_dim=8, norm_num_groups=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )  # fmt: skip


def _latents(n: int) -> tuple[torch.Tensor, ...]:
    """Noisy latents, timesteps, text states, and the noise to predict (the loss's)."""
    g = torch.Generator().manual_seed(0)
    noisy = torch.randn(n, 4, 16, 16, generator=g)
    steps = torch.randint(0, 1000, (n,), generator=g)
    return noisy, steps, torch.randn(n, 16, 64, generator=g), torch.randn(n, 4, 16, 16, generator=g)


def _denoising_mse(output: Any, batch: Any) -> torch.Tensor:
    return nn.functional.mse_loss(output.sample, batch[-1])


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    shape = {**_LLAMA, "intermediate_size": 256}
    return MixtralForCausalLM(MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2))


def _lora_llama() -> nn.Module:
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(LlamaConfig(**_LLAMA))
    return peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))


def _lm(n: int) -> dict[str, torch.Tensor]:
    return lm_batch(_VOCAB, _SEQ, n)


def kind_cases() -> list[Case]:
    """One case per held-out kind (the decoder and the CNN: the CPU benchmark's own)."""
    cpu = {c.name: c for c in cases_for(torch.device("cpu"))}
    return [
        dataclasses.replace(cpu["hf-gpt2-small"], name="decoder-gpt2"),
        Case("encoder-bert", _seeded(_bert), _masked_batch, 32, extra={"seq": _SEQ}),
        Case("seq2seq-t5", _seeded(_t5), _seq2seq_batch, 32, extra={"source": _SEQ, "target": 32}),
        Case("vit", _seeded(_vit), _vit_batch, 32, extra={"image": 64, "patch": 8}),
        dataclasses.replace(cpu["resnet-small"], name="cnn-resnet"),
        Case("unet-diffusers", _seeded(_unet), _latents, 32, loss_fn=_denoising_mse),
        Case("moe-mixtral", _seeded(_mixtral), _lm, 32, extra={"experts": 4, "top": 2}),
        Case("lora-llama", _seeded(_lora_llama), _lm, 32, notes="LoRA r=8 on q, v"),
    ]
