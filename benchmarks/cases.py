"""The benchmark cases: a model, a sample batch, a global batch and how to pick budgets.

CPU cases are small enough to tune, sweep and baseline in minutes on a 2-core machine;
their budgets are derived from a probe of the model (see :mod:`benchmarks.budgets`), not
hard-coded, so that they force the same trade-offs on any CPU. CUDA cases are the sizes
the design is about (GPT-2 124M, a ~1B LLaMA) at fixed budgets of 16 and 24 GiB.
Nothing is downloaded: every model is built from a config with random weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import autotune
from autotune.models import GPTConfig, gpt_batch, tiny_gpt
from autotune.train._loss import LossFn

__all__ = ["GPT2_124M", "LLAMA_1B", "Case", "cases_for", "hf_gpt2", "hf_llama", "lm_batch"]


@dataclass(frozen=True)
class Case:
    """One model to benchmark and how to feed it."""

    name: str
    """Short identifier, used in the table and the JSON."""
    build: Callable[[], nn.Module]
    """Builds the model (seeded: the same weights every time)."""
    sample: Callable[[int], Any]
    """``sample(n)``: a batch of ``n`` samples."""
    global_batch_size: int | None
    """Samples per optimizer step, kept exact with accumulation (``None``: not fixed)."""
    loss_fn: LossFn | None = None
    """Passed to the tuner, the grid and the baseline alike."""
    space: autotune.SearchSpace | None = None
    """The tuner's search space (default ``SearchSpace()``)."""
    budgets_gib: tuple[float, ...] = ()
    """Fixed budgets; empty: derived from a probe of the model on the device."""
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    """Shape facts recorded in the JSON (layers, width, sequence length)."""

    def compiling(self, compiled: bool | None) -> Case:
        """This case with compiled blocks searched or not (``None``: the space's default)."""
        if compiled is None:
            return self
        space = dataclasses.replace(self.space or autotune.SearchSpace(), compile_blocks=compiled)
        return dataclasses.replace(self, space=space)


# --- models -----------------------------------------------------------------------------


class ResBlock(nn.Module):
    """A ResNet basic block at constant width: conv-bn-relu-conv-bn plus the input."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(x + y)


class SmallResNet(nn.Module):
    """A small residual CNN for 32x32 images: stem, ``blocks`` (the tuner's), linear head."""

    def __init__(self, channels: int = 32, n_blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.blocks = nn.Sequential(*(ResBlock(channels) for _ in range(n_blocks)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features: torch.Tensor = self.blocks(self.stem(x)).mean(dim=(2, 3))
        logits: torch.Tensor = self.head(features)
        return logits


def _image_batch(n: int, size: int = 32, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(classes, (n,), generator=g)


def _classification_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output, batch[-1])


def lm_batch(vocab: int, seq: int, n: int) -> dict[str, torch.Tensor]:
    """A Hugging Face causal-LM batch: the model shifts ``labels`` itself."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (n, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def hf_gpt2(**shape: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(**shape))

    return build


def hf_llama(**shape: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**shape))

    return build


def _small_resnet() -> nn.Module:
    torch.manual_seed(0)
    return SmallResNet()


# --- cases ------------------------------------------------------------------------------


def _cpu_cases() -> list[Case]:
    gpt = GPTConfig()  # tiny_gpt's defaults: 4 layers, width 128, 64 tokens, vocab 512
    gpt2 = {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 128, "vocab_size": 2048}
    llama = {
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 2048,
        "max_position_embeddings": 256,
    }
    return [
        Case(
            "tiny_gpt",
            tiny_gpt,
            lambda n: gpt_batch(gpt, n),
            32,
            extra={"layers": gpt.n_layer, "width": gpt.n_embd, "seq": gpt.block_size},
        ),
        Case(
            "hf-gpt2-small",
            hf_gpt2(**gpt2),
            lambda n: lm_batch(2048, 128, n),
            32,
            extra={**gpt2, "seq": 128},
        ),
        Case(
            "hf-llama-small",
            hf_llama(**llama),
            lambda n: lm_batch(2048, 128, n),
            32,
            extra={**llama, "seq": 128},
        ),
        Case(
            "resnet-small",
            _small_resnet,
            _image_batch,
            32,
            loss_fn=_classification_loss,
            notes="residual CNN, 32x32 images, BatchNorm, loss_fn given",
            extra={"channels": 32, "blocks": 4, "image": 32},
        ),
    ]


GPT2_124M = {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024}
"""GPT-2 small (its vocabulary, 50257, is transformers' default)."""
LLAMA_1B = {  # TinyLlama's width at 20 layers: ~1.0B parameters
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 20,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
"""The ~1B LLaMA of the GPU cases and jobs."""


def _cuda_cases() -> list[Case]:
    gpt2, llama = GPT2_124M, LLAMA_1B
    return [
        Case(
            "gpt2-124m",
            hf_gpt2(**gpt2),
            lambda n: lm_batch(50257, 1024, n),
            32,
            budgets_gib=(24.0, 16.0),
            extra={**gpt2, "seq": 1024},
        ),
        Case(
            "llama-1b",
            hf_llama(**llama),
            lambda n: lm_batch(32000, 1024, n),
            16,
            # fp32 AdamW state alone (16 bytes per parameter) is ~16 GB: at 16 GiB only a
            # lighter optimizer can fit, so the tuner may swap it; the baseline keeps AdamW.
            space=autotune.SearchSpace(optimizers=("adamw", "adafactor")),
            budgets_gib=(24.0, 16.0),
            notes="adafactor allowed as an opt-in swap; the baseline keeps adamw",
            extra={**llama, "seq": 1024},
        ),
    ]


def cases_for(device: torch.device) -> list[Case]:
    """The cases for ``device``: CUDA cases on a GPU, CPU cases otherwise."""
    return _cuda_cases() if device.type == "cuda" else _cpu_cases()
