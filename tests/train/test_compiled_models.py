"""A model the user compiled with ``torch.compile`` is measured as its eager self, with a
warning that says so, and stays compiled: autotune's copies run eagerly, so that dynamo
never meets its code under the live-bytes tracker (which would make it skip that code
for the rest of the process, the user's compiled model included)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotune
from autotune import AutotuneWarning, TrainConfig
from autotune.train._identity import fingerprint


class Block(nn.Module):
    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), Block(), nn.Linear(24, 1))


def loss(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def ran_compiled(run: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``run``'s last op came out of compiled code."""
    return type(run(x).grad_fn).__name__ == "CompiledFunctionBackward"


def test_a_compiled_model_is_estimated_as_its_eager_self_and_stays_compiled() -> None:
    eager = model()
    x = torch.randn(4, 8, 24)
    config = TrainConfig(micro_batch_size=4, checkpoint=("1",))
    expected, _ = autotune.estimate(eager, x, config, device="cpu", loss_fn=loss)
    compiled = torch.compile(eager)
    assert ran_compiled(compiled, x)  # compiled here, before autotune sees it
    assert autotune.find_blocks(compiled) == ("0", "1", "2")  # the eager module's names
    assert fingerprint(compiled) == fingerprint(eager)
    with pytest.warns(AutotuneWarning, match="without compilation"):
        peak, _ = autotune.estimate(compiled, x, config, device="cpu", loss_fn=loss)
    assert peak == expected
    assert ran_compiled(compiled, x)  # dynamo still runs the user's compiled code


def test_compiled_blocks_of_the_users_are_measured_eagerly_and_stay_compiled() -> None:
    """A model whose blocks the user compiled one by one (regional compilation, each
    ``torch.compile(block)`` in its place): the same blocks, the same peak as eager."""
    eager = model()
    x = torch.randn(4, 8, 24)
    config = TrainConfig(micro_batch_size=4, checkpoint=("0", "2"))
    expected, _ = autotune.estimate(eager, x, config, device="cpu", loss_fn=loss)
    regional = model()
    for i in range(3):
        regional[i] = torch.compile(regional[i])
    assert ran_compiled(regional[0], x)
    assert autotune.find_blocks(regional) == ("0", "1", "2")
    with pytest.warns(AutotuneWarning, match=r"3 of its modules \(0, ...\)"):
        peak, _ = autotune.estimate(regional, x, config, device="cpu", loss_fn=loss)
    assert peak == expected
    assert ran_compiled(regional[0], x)
