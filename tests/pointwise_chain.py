"""A model whose blocks compiling speeds up by far more than any CPU's noise: a helper
module, not a test module, so that a new process builds the same graphs the tuner did
(pytest rewrites a test module's code). And the block the compiled-block tests share
(:class:`Block`), one class whose code inductor compiles once for all of them."""

from __future__ import annotations

import sys

import torch
from torch import nn

import autotune


class Block(nn.Module):
    """Norm, expand, a pointwise chain inductor fuses, project, residual."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(self.norm(x))) * 2
        return x + self.down(h).tanh()


class Chain(nn.Module):
    """A norm and a chain of pointwise ops: a kernel each in eager code, one fused kernel
    compiled, so that compiling wins by far more than the noise on any CPU."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        for _ in range(12):
            h = torch.tanh(h) * 1.5 + h.sigmoid()
        return x + h


def chained() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Chain(), Chain(), nn.Linear(32, 1))


def loss(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def tune_and_save(path: str) -> autotune.TuneResult:
    """Tune :func:`chained` with compiled blocks searched, on one thread, and save it at
    ``path`` (with its compile cache beside it): what a user's tuning process does."""
    torch.set_num_threads(1)
    result = autotune.autotune(
        chained(), torch.randn(16, 16, 32), budget_gb=0.0015, loss_fn=loss, device="cpu",
        global_batch_size=16, space=autotune.SearchSpace(precisions=("fp32",), compile_blocks=True),
    )  # fmt: skip
    result.save(path)
    return result


if __name__ == "__main__":  # python pointwise_chain.py PATH: tune and save, in a process of its own
    print("TUNED", tune_and_save(sys.argv[1]).config.describe())
