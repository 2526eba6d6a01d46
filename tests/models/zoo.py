"""A zoo of real architectures built from tiny random configs, for the compatibility matrix.

Each :class:`Case` builds a model (random weights, no download), one sample batch of
:data:`BATCH` samples and the ``loss_fn`` autotune needs when the model computes no loss
itself (``None`` when Hugging Face's ``labels=`` gives ``output.loss``). The sizes are the
smallest that keep each architecture's structure (2-4 layers, width 32-64, vocabulary 100,
16 tokens, 32-pixel images) so that every case builds in well under a second on a CPU.

Dropout is left as each config has it: checkpointing must replay the same random numbers
(torch's checkpoint restores the RNG state), and the matrix checks that it does.

Importing this module imports transformers, timm, torchvision, diffusers and peft lazily,
inside the builders; torchvision (also imported by transformers' image utilities) needs
its ops declared first on a CPU build of torch: ``tests/torchvision_ops.py`` does that,
called by ``tests/conftest.py`` and by the ``benchmarks`` package.
"""

from __future__ import annotations

import importlib.util
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

BATCH = 4
"""Samples in every sample batch."""
SEQ = 16
"""Tokens per sample."""
VOCAB = 100
"""Vocabulary of every language model."""
IMAGE = 32
"""Side of every image, in pixels."""
CLASSES = 10
"""Classes of every classifier."""

LossFn = Callable[[Any, Any], torch.Tensor]
Built = tuple[nn.Module, Any, LossFn | None]


@dataclass(frozen=True)
class Case:
    """One architecture of the matrix.

    Attributes:
        name: Short unique id (the pytest parameter).
        family: What kind of model: ``causal-lm``, ``encoder``, ``seq2seq``, ``vision``,
            ``audio``, ``timm``, ``torchvision``, ``diffusers``, ``peft``.
        builder: Builds ``(model, batch, loss_fn)``; call :meth:`build`, which seeds it.
        block_pattern: A regular expression every block's qualified name must match.
        n_blocks: How many blocks ``find_blocks`` must return (``None``: at least 2).
        tuned: Also tuned end to end (a slow test): a few per family.
        note: What to know about the case when reading its result.
        selective: Whether its blocks can be checkpointed selectively; ``False``: an op
            changes a kept output in place, and autotune must refuse with a BlockError.
    """

    name: str
    family: str
    builder: Callable[[], Built]
    block_pattern: str
    n_blocks: int | None
    tuned: bool = False
    note: str = ""
    selective: bool = True

    @property
    def requires(self) -> tuple[str, ...]:
        """The packages the case builds with."""
        extra = {"timm": "timm", "torchvision": "torchvision", "diffusers": "diffusers"}
        if self.family == "peft":
            return ("transformers", "peft")
        return (extra.get(self.family, "transformers"),)

    def missing(self) -> list[str]:
        """The packages of :attr:`requires` that are not installed."""
        return [name for name in self.requires if importlib.util.find_spec(name) is None]

    def build(self) -> Built:
        """The model, batch and loss, the same on every call (seeded)."""
        seed_everything(0)
        return self.builder()

    def expected_blocks(self, model: nn.Module) -> tuple[str, ...]:
        """The outermost modules matching :attr:`block_pattern` (containers opened): the
        blocks to train with when ``find_blocks`` gets them wrong."""
        pattern = re.compile(self.block_pattern)
        names: list[str] = []
        for name, module in model.named_modules():
            inside = any(name.startswith(n + ".") for n in names)
            container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
            if pattern.fullmatch(name) and not inside and not container:
                names.append(name)
        return tuple(names)


def layers(*prefixes: str) -> str:
    """The pattern of numbered layers under any of ``prefixes``: ``model.layers.3``."""
    return "|".join(rf"{re.escape(p)}\.\d+" for p in prefixes)


def seed_everything(seed: int) -> None:
    """Seed torch, Python and NumPy: Wav2Vec2's SpecAugment masks draw from NumPy."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed)


# --- batches and losses -------------------------------------------------------------------


def _ids(vocab: int = VOCAB, length: int = SEQ, seed: int = 1) -> torch.Tensor:
    """Token ids of :data:`BATCH` samples, from 3 up (0-2: pad/bos/eos of most configs)."""
    return torch.randint(3, vocab, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def lm_batch(vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Causal or masked LM: the labels are the ids (the model shifts them if it must)."""
    ids = _ids(vocab)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def seq2seq_batch(vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Source ids and different target ids; the model makes decoder inputs from labels."""
    ids = _ids(vocab)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": _ids(vocab, 8, 2)}


def pixels(size: int = IMAGE, channels: int = 3) -> torch.Tensor:
    return torch.randn(BATCH, channels, size, size, generator=torch.Generator().manual_seed(3))


def classes() -> torch.Tensor:
    return torch.randint(CLASSES, (BATCH,), generator=torch.Generator().manual_seed(4))


def image_batch() -> dict[str, torch.Tensor]:
    """Hugging Face image classifiers: ``pixel_values`` and ``labels``."""
    return {"pixel_values": pixels(), "labels": classes()}


def image_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """timm and torchvision: ``(images, classes)``; the model gets the images only."""
    return pixels(), classes()


def cross_entropy(output: torch.Tensor, batch: Any) -> torch.Tensor:
    """Classification loss of a plain logits output against the batch's last element."""
    return nn.functional.cross_entropy(output, batch[-1])


def denoising_mse(output: Any, batch: Any) -> torch.Tensor:
    """A diffusion UNet's loss: the predicted noise against the target (the batch's last)."""
    return nn.functional.mse_loss(output.sample, batch[-1])


def _hf() -> Any:
    import transformers

    return transformers


# --- causal language models ---------------------------------------------------------------

_DECODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 64}  # fmt: skip
"""The shape most Llama-like configs share (head dim 8)."""


def _causal(config_name: str, model_name: str, **overrides: Any) -> Callable[[], Built]:
    def build() -> Built:
        t = _hf()
        config = getattr(t, config_name)(**{**_DECODER, **overrides})
        return getattr(t, model_name)(config), lm_batch(), None

    return build


def gpt2() -> Built:
    t = _hf()
    config = t.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64)
    return t.GPT2LMHeadModel(config), lm_batch(), None


def gpt_neo() -> Built:
    t = _hf()
    config = t.GPTNeoConfig(
        num_layers=2, hidden_size=32, num_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
        attention_types=[[["global", "local"], 1]], window_size=8,
    )  # fmt: skip
    return t.GPTNeoForCausalLM(config), lm_batch(), None


def gpt_j() -> Built:
    t = _hf()
    config = t.GPTJConfig(
        n_layer=2, n_embd=32, n_head=4, rotary_dim=4, vocab_size=VOCAB, n_positions=64
    )
    return t.GPTJForCausalLM(config), lm_batch(), None


def opt() -> Built:
    t = _hf()
    config = t.OPTConfig(
        num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4,
        word_embed_proj_dim=32, vocab_size=VOCAB, max_position_embeddings=64,
    )  # fmt: skip
    return t.OPTForCausalLM(config), lm_batch(), None


def bloom() -> Built:
    t = _hf()
    config = t.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=VOCAB)
    return t.BloomForCausalLM(config), lm_batch(), None


def gpt_neox() -> Built:
    t = _hf()
    config = t.GPTNeoXConfig(**_DECODER)
    return t.GPTNeoXForCausalLM(config), lm_batch(), None


def falcon() -> Built:
    t = _hf()
    config = t.FalconConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
        new_decoder_architecture=True, num_kv_heads=2,
    )  # fmt: skip
    return t.FalconForCausalLM(config), lm_batch(), None


def phi() -> Built:
    t = _hf()
    config = t.PhiConfig(**_DECODER)
    return t.PhiForCausalLM(config), lm_batch(), None


def deepseek_v3() -> Built:
    """Multi-head latent attention, a dense first layer then routed experts."""
    t = _hf()
    config = t.DeepseekV3Config(
        **{**_DECODER, "num_hidden_layers": 3}, num_key_value_heads=4, moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    return t.DeepseekV3ForCausalLM(config), lm_batch(), None


def mamba() -> Built:
    t = _hf()
    config = t.MambaConfig(
        num_hidden_layers=2, hidden_size=32, state_size=8, vocab_size=VOCAB, use_mambapy=False
    )
    return t.MambaForCausalLM(config), lm_batch(), None


def mamba2() -> Built:
    t = _hf()
    config = t.Mamba2Config(
        num_hidden_layers=2, hidden_size=32, state_size=8, num_heads=8, head_dim=8, n_groups=1,
        expand=2, vocab_size=VOCAB, chunk_size=8,
    )  # fmt: skip
    return t.Mamba2ForCausalLM(config), lm_batch(), None


def jamba() -> Built:
    """Hybrid: Mamba layers, one attention layer, experts every other layer."""
    t = _hf()
    config = t.JambaConfig(
        **{**_DECODER, "num_hidden_layers": 4}, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=4, attn_layer_offset=2, mamba_d_state=8, mamba_dt_rank=8,
        use_mamba_kernels=False,
    )  # fmt: skip
    return t.JambaForCausalLM(config), lm_batch(), None


def zamba2() -> Built:
    """Hybrid: Mamba2 layers and a shared attention block reused between them."""
    t = _hf()
    config = t.Zamba2Config(
        hidden_size=32, num_hidden_layers=4, vocab_size=VOCAB, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=64, mamba_d_state=8, mamba_headdim=8,
        n_mamba_heads=8, mamba_ngroups=1, chunk_size=8, use_mamba_kernels=False,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_mem_blocks=1,
        adapter_rank=4, max_position_embeddings=64,
    )  # fmt: skip
    return t.Zamba2ForCausalLM(config), lm_batch(), None


def rwkv() -> Built:
    t = _hf()
    config = t.RwkvConfig(
        num_hidden_layers=2, hidden_size=32, attention_hidden_size=32, intermediate_size=64,
        vocab_size=VOCAB, context_length=64,
    )  # fmt: skip
    return t.RwkvForCausalLM(config), lm_batch(), None


def lora_llama() -> Built:
    """LoRA adapters on a Llama: only the adapters train, the base weights are frozen."""
    import peft

    t = _hf()
    base = t.LlamaForCausalLM(t.LlamaConfig(**_DECODER, num_key_value_heads=2))
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(base, lora), lm_batch(), None


# --- encoders -----------------------------------------------------------------------------

_ENCODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 64}  # fmt: skip


def _masked(config_name: str, model_name: str, **overrides: Any) -> Callable[[], Built]:
    def build() -> Built:
        t = _hf()
        config = getattr(t, config_name)(**{**_ENCODER, **overrides})
        return getattr(t, model_name)(config), lm_batch(), None

    return build


def distilbert() -> Built:
    t = _hf()
    config = t.DistilBertConfig(
        n_layers=2, dim=32, n_heads=4, hidden_dim=64, vocab_size=VOCAB, max_position_embeddings=64
    )
    return t.DistilBertForMaskedLM(config), lm_batch(), None


# --- encoder-decoders ---------------------------------------------------------------------

_T5 = {"num_layers": 2, "num_decoder_layers": 2, "d_model": 32, "d_ff": 64, "num_heads": 4,
       "d_kv": 8, "vocab_size": VOCAB, "decoder_start_token_id": 0, "pad_token_id": 0}  # fmt: skip
_BART = {"encoder_layers": 2, "decoder_layers": 2, "d_model": 32, "encoder_ffn_dim": 64,
         "decoder_ffn_dim": 64, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
         "vocab_size": VOCAB, "max_position_embeddings": 64, "pad_token_id": 1,
         "decoder_start_token_id": 2}  # fmt: skip


def _seq2seq(config_name: str, model_name: str, shape: dict[str, Any]) -> Callable[[], Built]:
    def build() -> Built:
        t = _hf()
        config = getattr(t, config_name)(**shape)
        return getattr(t, model_name)(config), seq2seq_batch(), None

    return build


def switch_transformers() -> Built:
    t = _hf()
    config = t.SwitchTransformersConfig(
        **_T5, num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
    )  # fmt: skip
    return t.SwitchTransformersForConditionalGeneration(config), seq2seq_batch(), None


def bert2bert() -> Built:
    """``EncoderDecoderModel``: a BERT encoder and a BERT decoder with cross-attention."""
    t = _hf()
    encoder = t.BertConfig(**_ENCODER)
    decoder = t.BertConfig(**_ENCODER, is_decoder=True, add_cross_attention=True)
    config = t.EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    return t.EncoderDecoderModel(config=config), seq2seq_batch(), None


def whisper() -> Built:
    """Log-mel features in (length twice ``max_source_positions``), tokens out."""
    t = _hf()
    config = t.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=32,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=32,
        pad_token_id=1, bos_token_id=2, eos_token_id=2, decoder_start_token_id=2,
        suppress_tokens=[], begin_suppress_tokens=[],
    )  # fmt: skip
    features = torch.randn(BATCH, 16, 32, generator=torch.Generator().manual_seed(5))
    return (
        t.WhisperForConditionalGeneration(config),
        {
            "input_features": features,
            "labels": _ids(VOCAB, 8, 2),
        },
        None,
    )


# --- vision -------------------------------------------------------------------------------

_VIT = {"image_size": IMAGE, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64, "num_labels": CLASSES}  # fmt: skip


def _image(config_name: str, model_name: str, **shape: Any) -> Callable[[], Built]:
    def build() -> Built:
        t = _hf()
        config = getattr(t, config_name)(num_labels=CLASSES, **shape)
        return getattr(t, model_name)(config), image_batch(), None

    return build


def segformer() -> Built:
    """Semantic segmentation: a label per pixel."""
    t = _hf()
    config = t.SegformerConfig(
        num_encoder_blocks=2, depths=[2, 2], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        decoder_hidden_size=32, num_labels=CLASSES,
    )  # fmt: skip
    labels = torch.randint(
        CLASSES, (BATCH, IMAGE, IMAGE), generator=torch.Generator().manual_seed(6)
    )
    return t.SegformerForSemanticSegmentation(config), {"pixel_values": pixels(),
                                                        "labels": labels}, None  # fmt: skip


def clip() -> Built:
    """Image and text towers, the contrastive loss of ``return_loss=True``."""
    t = _hf()
    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 64}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": IMAGE, "patch_size": 8}  # fmt: skip
    config = t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    ids = _ids()
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels(),
             "return_loss": True}  # fmt: skip
    return t.CLIPModel(config), batch, None


# --- audio --------------------------------------------------------------------------------


def wav2vec2() -> Built:
    """CTC on raw audio: a CNN feature extractor (not a block) then transformer layers."""
    t = _hf()
    config = t.Wav2Vec2Config(
        vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, pad_token_id=0,
        mask_time_length=2,
    )  # fmt: skip
    audio = torch.randn(BATCH, 800, generator=torch.Generator().manual_seed(7))
    labels = torch.randint(1, 20, (BATCH, 8), generator=torch.Generator().manual_seed(8))
    return t.Wav2Vec2ForCTC(config), {"input_values": audio, "labels": labels}, None


# --- timm, torchvision, diffusers ---------------------------------------------------------


def _timm(name: str, **kwargs: Any) -> Callable[[], Built]:
    def build() -> Built:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)
        return model, image_pair(), cross_entropy

    return build


def torchvision_resnet18() -> Built:
    import torchvision

    return torchvision.models.resnet18(num_classes=CLASSES), image_pair(), cross_entropy


def unet() -> Built:
    """A text-conditioned diffusion UNet: down, mid and up blocks, skip connections."""
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64),
        layers_per_block=1, cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )  # fmt: skip
    g = torch.Generator().manual_seed(9)
    noisy = torch.randn(BATCH, 4, 16, 16, generator=g)
    steps = torch.randint(0, 1000, (BATCH,), generator=g)
    text = torch.randn(BATCH, 8, 32, generator=g)
    noise = torch.randn(BATCH, 4, 16, 16, generator=g)
    return model, (noisy, steps, text, noise), denoising_mse


# --- the zoo ------------------------------------------------------------------------------

_H = layers("transformer.h")
_M = layers("model.layers")
_T5_BLOCKS = layers("encoder.block", "decoder.block")
_BART_BLOCKS = layers("model.encoder.layers", "model.decoder.layers")
_VIT_SHAPE = {k: v for k, v in _VIT.items() if k != "num_labels"}


def _llama_like(config: str, model: str, **overrides: Any) -> Callable[[], Built]:
    return _causal(config, model, num_key_value_heads=2, **overrides)


CASES: list[Case] = [
    # causal language models
    Case("gpt2", "causal-lm", gpt2, _H, 2, tuned=True),
    Case("gpt-neo", "causal-lm", gpt_neo, _H, 2),
    Case("gpt-j", "causal-lm", gpt_j, _H, 2),
    Case("opt", "causal-lm", opt, layers("model.decoder.layers"), 2),
    Case("bloom", "causal-lm", bloom, _H, 2),
    Case("llama", "causal-lm", _llama_like("LlamaConfig", "LlamaForCausalLM"), _M, 2, tuned=True),
    Case("mistral", "causal-lm", _llama_like("MistralConfig", "MistralForCausalLM", sliding_window=8), _M, 2),
    Case("mixtral", "causal-lm", _llama_like("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2), _M, 2),
    Case("qwen2", "causal-lm", _llama_like("Qwen2Config", "Qwen2ForCausalLM"), _M, 2),
    Case("qwen2-moe", "causal-lm", _llama_like("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32), _M, 2),
    Case("qwen3", "causal-lm", _llama_like("Qwen3Config", "Qwen3ForCausalLM", head_dim=8), _M, 2),
    Case("gemma", "causal-lm", _llama_like("GemmaConfig", "GemmaForCausalLM", head_dim=8), _M, 2),
    Case("gemma2", "causal-lm", _llama_like("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=8), _M, 2),
    Case("phi", "causal-lm", phi, _M, 2),
    Case("phi3", "causal-lm", _llama_like("Phi3Config", "Phi3ForCausalLM", pad_token_id=0), _M, 2),
    Case("falcon", "causal-lm", falcon, _H, 2),
    Case("stablelm", "causal-lm", _llama_like("StableLmConfig", "StableLmForCausalLM"), _M, 2),
    Case("gpt-neox", "causal-lm", gpt_neox, layers("gpt_neox.layers"), 2),
    Case("deepseek-v3", "causal-lm", deepseek_v3, _M, 3),
    Case("mamba", "causal-lm", mamba, layers("backbone.layers"), 2),
    Case("mamba2", "causal-lm", mamba2, layers("backbone.layers"), 2),
    Case("rwkv", "causal-lm", rwkv, layers("rwkv.blocks"), 2),
    Case("jamba", "causal-lm", jamba, _M, 4, note="two layer classes: Mamba and attention"),
    Case("zamba2", "causal-lm", zamba2, _M, 4, note="hybrid layers share one attention block's weights"),
    # encoders
    Case("bert", "encoder", _masked("BertConfig", "BertForMaskedLM"), layers("bert.encoder.layer"), 2, tuned=True),
    Case("roberta", "encoder", _masked("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1), layers("roberta.encoder.layer"), 2),
    Case("distilbert", "encoder", distilbert, layers("distilbert.transformer.layer"), 2),
    Case("albert", "encoder", _masked("AlbertConfig", "AlbertForMaskedLM", embedding_size=16),
         r"albert\.encoder\.albert_layer_groups\.0(\.albert_layers\.0)?", 1, tuned=True,
         note="one layer group, weight-shared, runs at every depth: a single block"),
    Case("electra", "encoder", _masked("ElectraConfig", "ElectraForMaskedLM", embedding_size=16), layers("electra.encoder.layer"), 2),
    Case("deberta-v2", "encoder", _masked("DebertaV2Config", "DebertaV2ForMaskedLM"), layers("deberta.encoder.layer"), 2),
    Case("xlm-roberta", "encoder", _masked("XLMRobertaConfig", "XLMRobertaForMaskedLM", pad_token_id=1), layers("roberta.encoder.layer"), 2),
    Case("mpnet", "encoder", _masked("MPNetConfig", "MPNetForMaskedLM", pad_token_id=1), layers("mpnet.encoder.layer"), 2),
    # encoder-decoders
    Case("t5", "seq2seq", _seq2seq("T5Config", "T5ForConditionalGeneration", _T5), _T5_BLOCKS, 4, tuned=True),
    Case("mt5", "seq2seq", _seq2seq("MT5Config", "MT5ForConditionalGeneration", _T5), _T5_BLOCKS, 4),
    Case("umt5", "seq2seq", _seq2seq("UMT5Config", "UMT5ForConditionalGeneration", _T5), _T5_BLOCKS, 4),
    Case("switch-transformers", "seq2seq", switch_transformers, _T5_BLOCKS, 4),
    Case("bart", "seq2seq", _seq2seq("BartConfig", "BartForConditionalGeneration", _BART), _BART_BLOCKS, 4),
    Case("mbart", "seq2seq", _seq2seq("MBartConfig", "MBartForConditionalGeneration", _BART), _BART_BLOCKS, 4),
    Case("pegasus", "seq2seq", _seq2seq("PegasusConfig", "PegasusForConditionalGeneration", _BART), _BART_BLOCKS, 4),
    Case("marian", "seq2seq", _seq2seq("MarianConfig", "MarianMTModel", _BART), _BART_BLOCKS, 4),
    Case("bert2bert", "seq2seq", bert2bert, layers("encoder.encoder.layer", "decoder.bert.encoder.layer"), 4, tuned=True),
    Case("whisper", "audio", whisper, _BART_BLOCKS, 4, tuned=True),
    # vision
    Case("vit", "vision", _image("ViTConfig", "ViTForImageClassification", **_VIT_SHAPE), layers("vit.layers"), 2, tuned=True),
    Case("deit", "vision", _image("DeiTConfig", "DeiTForImageClassification", **_VIT_SHAPE), layers("deit.layers"), 2),
    Case("swin", "vision", _image("SwinConfig", "SwinForImageClassification", image_size=IMAGE, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4),
         layers("swin.encoder.layers.0.blocks", "swin.encoder.layers.1.blocks"), 4),
    Case("convnext", "vision", _image("ConvNextConfig", "ConvNextForImageClassification", num_stages=2, hidden_sizes=[16, 32], depths=[2, 2]),
         layers("convnext.encoder.stages.0.layers", "convnext.encoder.stages.1.layers"), 4),
    Case("resnet", "vision", _image("ResNetConfig", "ResNetForImageClassification", embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2], layer_type="basic"),
         layers("resnet.encoder.stages.0.layers", "resnet.encoder.stages.1.layers"), 4, tuned=True, note="BatchNorm"),
    Case("regnet", "vision", _image("RegNetConfig", "RegNetForImageClassification", embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2], groups_width=8),
         layers("regnet.encoder.stages.0.layers", "regnet.encoder.stages.1.layers"), 4, note="BatchNorm"),
    Case("mobilenet-v2", "vision", _image("MobileNetV2Config", "MobileNetV2ForImageClassification", image_size=IMAGE, depth_multiplier=0.25),
         layers("mobilenet_v2.layer"), 16, note="BatchNorm"),
    Case("efficientnet", "vision", _image("EfficientNetConfig", "EfficientNetForImageClassification", image_size=IMAGE, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320),
         layers("efficientnet.encoder.blocks"), 7, note="BatchNorm"),
    Case("segformer", "vision", segformer, layers("segformer.stages.0.blocks", "segformer.stages.1.blocks"), 4, note="BatchNorm in the decode head"),
    Case("clip", "vision", clip, layers("text_model.encoder.layers", "vision_model.encoder.layers"), 4),
    # audio
    Case("wav2vec2", "audio", wav2vec2, layers("wav2vec2.encoder.layers"), 2, note="SpecAugment masks from NumPy's RNG; layerdrop"),
    # timm, torchvision, diffusers, peft
    Case("timm-resnet18", "timm", _timm("resnet18"), layers(*(f"layer{i}" for i in range(1, 5))), 8,
         note="BatchNorm; not tuned: its peak is AdamW's step (11M parameters), which no checkpoint lowers"),
    Case("timm-vit-tiny", "timm", _timm("vit_tiny_patch16_224", img_size=IMAGE, patch_size=8, depth=4), layers("blocks"), 4, tuned=True),
    Case("timm-convnext-atto", "timm", _timm("convnext_atto"), layers(*(f"stages.{i}.blocks" for i in range(4))), 12),
    Case("timm-efficientnet-b0", "timm", _timm("efficientnet_b0"), layers(*(f"blocks.{i}" for i in range(7))), 16, note="BatchNorm; squeeze-excite's ReLU(inplace=True) after a convolution", selective=False),
    Case("timm-mobilenetv3", "timm", _timm("mobilenetv3_small_100"), layers(*(f"blocks.{i}" for i in range(6))), 12, note="BatchNorm; squeeze-excite's ReLU(inplace=True) after a convolution", selective=False),
    Case("torchvision-resnet18", "torchvision", torchvision_resnet18, layers(*(f"layer{i}" for i in range(1, 5))), 8, note="BatchNorm"),
    Case("unet2d-condition", "diffusers", unet, r"(down_blocks|up_blocks)\.\d+(\..+)?|mid_block(\..+)?", None,
         note="no single stack: the down, mid and up blocks or layers inside them, in forward order"),
    Case("lora-llama", "peft", lora_llama, layers("base_model.model.model.layers"), 2, note="only the adapters train"),
]  # fmt: skip
"""Every case, by family."""

BY_NAME: dict[str, Case] = {case.name: case for case in CASES}
