"""A small built-in GPT for the quickstart, the tests and the benchmarks (no downloads).

``GPT(config)(idx, targets)`` returns the mean cross-entropy loss, so a batch
``(idx, targets)`` trains with no ``loss_fn``; without targets it returns the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT", "GPTConfig", "example_batch", "gpt_batch", "tiny_gpt"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int = 512
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class SelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.dropout = c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.attn = SelfAttention(c)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """A GPT-2-style decoder: embeddings, ``blocks`` (the tuner's blocks), tied head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init)
        for name, param in self.named_parameters():  # GPT-2's: residual outputs by depth
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        """GPT-2's initialisation: a fresh model predicts near-uniformly (its loss starts
        near ``ln(vocab_size)``), as a fresh language model should."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_gpt(**overrides: Any) -> GPT:
    """A small GPT (about 1M parameters by default); keyword arguments override GPTConfig."""
    torch.manual_seed(0)
    return GPT(GPTConfig(**overrides))


def gpt_batch(
    config: GPTConfig, batch_size: int = 8, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``(idx, targets)`` batch of next-token prediction for ``config``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(config.vocab_size, (batch_size, config.block_size + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def example_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A sample batch for :func:`tiny_gpt` with default settings (the CLI's example)."""
    return gpt_batch(GPTConfig(), 8)
