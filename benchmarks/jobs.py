"""The GPU jobs people bring (issue 37), as memory-efficient training guides describe them.

1. ``llama-1b``: a full fine-tune of a ~1B LLaMA (width 2048, 20 layers, GQA 32/4), 1024
   tokens, global batch 16, at 24 GiB and at the card's own memory (for MFU).
2. ``qlora-7b``: QLoRA of a 7B Llama: the base quantized to 4-bit NF4 by bitsandbytes on
   the device, peft LoRA r=16 on the attention and MLP projections, 2048 tokens, global
   batch 16, bf16, ``paged_adamw8bit`` allowed, at 24 GiB.
3. ``gpt2-124m``: pre-training GPT-2 124M, 1024 tokens, global batch 32, at 16 and 24 GiB.

The large jobs run first (they have never run on a GPU), GPT-2 last.

Random weights, nothing downloaded. ``smoke=True`` gives the same jobs at tiny shapes and
MiB budgets, which the CPU runs in CI so that a lent GPU never spends minutes on a
script error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import autotune
from benchmarks.cases import GPT2_124M, LLAMA_1B, hf_gpt2, hf_llama, lm_batch

__all__ = ["Job", "jobs"]

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class Job:
    """One model to tune, how to feed it, and the budgets to tune it at."""

    name: str
    build: Callable[[torch.device], nn.Module]
    """Builds the model (seeded); the QLoRA base is built and quantized on the device."""
    sample: Callable[[int], dict[str, torch.Tensor]]
    """``sample(n)``: a batch of ``n`` sequences."""
    global_batch_size: int
    budgets: tuple[str, ...]
    """``"24GiB"``-style budgets, ``"card"`` (the device's own memory) or MiB ones."""
    shape: dict[str, int]
    """Layers, width and sequence length (the attention term of the FLOPs)."""
    space: autotune.SearchSpace = field(default_factory=autotune.SearchSpace)
    expert_optimizer: str = "adamw_fused"
    """What the expert's loop steps with (nanoGPT's and torchtitan's fused AdamW)."""
    expert_checkpointing: tuple[bool, ...] = (False, True)
    """Checkpointing every layer or none: the expert times both, keeps the faster."""
    notes: str = ""


def budget_bytes(budget: str, device: torch.device) -> int:
    """``"24GiB"`` / ``"512MiB"`` in bytes; ``"card"``: the device's memory (the CPU's
    stand-in for it in a smoke run: 1 GiB)."""
    if budget == "card":
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        return GIB
    for unit, size in (("GiB", GIB), ("MiB", MIB)):
        if budget.endswith(unit):
            return int(float(budget.removesuffix(unit)) * size)
    raise ValueError(f"budget {budget!r}: write 24GiB, 512MiB or card")


def _sample(vocab: int, seq: int) -> Callable[[int], dict[str, torch.Tensor]]:
    return functools.partial(lm_batch, vocab, seq)


def _on_the_host(build: Callable[[], nn.Module]) -> Callable[[torch.device], nn.Module]:
    """A job's builder of a model made on the host: the tuner copies it to the device."""
    return lambda device: build()


def _llama_config(shape: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**shape)


def _qlora(shape: dict[str, int], rank: int) -> Callable[[torch.device], nn.Module]:
    def build(device: torch.device) -> nn.Module:
        return qlora_llama(shape, device, rank=rank)

    return build


def qlora_llama(shape: dict[str, int], device: torch.device, *, rank: int = 16) -> nn.Module:
    """A QLoRA Llama as ``from_pretrained(quantization_config=BitsAndBytesConfig(
    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bf16))`` builds
    it: random bf16 weights made on ``device`` (13.5 GB for 7B, before any budget holds),
    each projection quantized there and its bf16 weight freed; then peft's
    ``prepare_model_for_kbit_training`` and LoRA on every projection of every layer."""
    import bitsandbytes as bnb
    import peft
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(_llama_config(shape))
    finally:
        torch.set_default_dtype(dtype)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if isinstance(linear, nn.Linear):
                    setattr(parent, name, _four_bit(bnb, linear, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model.is_loaded_in_4bit = True  # what from_pretrained marks; peft reads it
    model = peft.prepare_model_for_kbit_training(model)
    torch.manual_seed(0)
    lora = peft.LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, lora)


def _four_bit(bnb: Any, linear: nn.Linear, device: torch.device) -> nn.Module:
    """``linear`` as bitsandbytes' NF4 layer, its weight quantized on ``device``."""
    four = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=torch.bfloat16,
        quant_type="nf4",
        device="meta",
    )
    weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4")
    four.weight = weight.to(device)  # quantizes
    if linear.bias is not None:
        four.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return four


def _shape(llama: dict[str, int], seq: int) -> dict[str, int]:
    return {"layers": llama["num_hidden_layers"], "width": llama["hidden_size"], "seq": seq}


def jobs(*, smoke: bool = False) -> list[Job]:
    """The three jobs; ``smoke``: at tiny shapes and MiB budgets, for the CPU."""
    gpt2, llama = {**GPT2_124M, "vocab_size": 50257}, LLAMA_1B
    llama7 = {  # Llama 2 7B
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    }
    seq = {"gpt2": 1024, "llama": 1024, "qlora": 2048}
    budgets = {"gpt2": ("24GiB", "16GiB"), "llama": ("24GiB", "card"), "qlora": ("24GiB",)}
    if smoke:
        gpt2 = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64, "vocab_size": 512}
        small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                 "max_position_embeddings": 128}  # fmt: skip
        llama, llama7 = small, small
        seq = {"gpt2": 64, "llama": 64, "qlora": 64}
        budgets = {"gpt2": ("256MiB",), "llama": ("256MiB",), "qlora": ("256MiB",)}
    # The large jobs first, GPT-2 last: a kit stopped at its time limit has run them.
    return [
        Job(
            "llama-1b",
            _on_the_host(hf_llama(**llama)),
            _sample(llama["vocab_size"], seq["llama"]),
            16,
            budgets["llama"],
            _shape(llama, seq["llama"]),
            notes="full fine-tune of a ~1B LLaMA",
        ),
        Job(
            "qlora-7b",
            _qlora(llama7, 16 if not smoke else 4),
            _sample(llama7["vocab_size"], seq["qlora"]),
            16,
            budgets["qlora"],
            _shape(llama7, seq["qlora"]),
            space=autotune.SearchSpace(
                precisions=("bf16",), optimizers=("adamw", "paged_adamw8bit")
            ),
            expert_optimizer="paged_adamw8bit",
            expert_checkpointing=(True,),  # every QLoRA recipe checkpoints every layer
            notes="QLoRA: NF4 base (bitsandbytes), LoRA r=16 on every projection",
        ),
        Job(
            "gpt2-124m",
            _on_the_host(hf_gpt2(**gpt2)),
            _sample(gpt2["vocab_size"], seq["gpt2"]),
            32,
            budgets["gpt2"],
            {"layers": gpt2["n_layer"], "width": gpt2["n_embd"], "seq": seq["gpt2"]},
            notes="pre-training a small GPT",
        ),
    ]
