"""The memory half of a profile: which choices of a block it measured, and which it left out."""

from __future__ import annotations

import torch
from torch import nn

from autotune.config import Timeline
from autotune.cost._cost_model import SELECTIVE, CostModel
from autotune.cost._knobs import Knobs
from autotune.measure._memory_profile import memory_profile
from autotune.measure._profiler import Profiler

CPU = torch.device("cpu")


class SqueezeExcite(nn.Module):
    """timm's way: a convolution's output changed in place by ``ReLU(inplace=True)``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.conv(x))


def test_blocks_that_change_a_kept_output_leave_selective_checkpointing_out_with_a_note() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(SqueezeExcite(4), SqueezeExcite(4), nn.Flatten())
    sample = torch.randn(4, 4, 6, 6)
    profiler = Profiler(
        model, sample, ("0", "1"), device=CPU, loss_fn=lambda out, batch: out.square().mean()
    )
    profile, notes = memory_profile(
        profiler,
        (Timeline("fp32"), Timeline("bf16")),
        ("adamw",),
        device_name="cpu",
        context_bytes=0,
        selective=True,
    )
    assert not any(p.selective for p in profile.precisions.values())
    assert any(
        n.startswith("selective checkpointing: not searched, block '")
        and "cannot be checkpointed selectively" in n
        for n in notes
    ), notes
    # The other choices were measured: checkpointing the blocks still saves memory.
    cost = CostModel(profile)
    assert cost.peak_of(Knobs.given("fp32", "adamw", 8, 1, (1, 1))) < cost.peak_of(
        Knobs.given("fp32", "adamw", 8, 1, (0, 0))
    )
    assert not cost.can_select(Timeline("fp32"))
    assert SELECTIVE not in (cost.fitting_mask(Knobs.given("fp32", "adamw", 8, 1), 2**40) or ())


def test_a_model_that_takes_selective_checkpointing_measures_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2))
    )
    profiler = Profiler(
        model,
        torch.randn(4, 16),
        ("0", "1"),
        device=CPU,
        loss_fn=lambda out, batch: out.square().mean(),
    )
    profile, notes = memory_profile(
        profiler,
        (Timeline("fp32"),),
        ("adamw",),
        device_name="cpu",
        context_bytes=0,
        selective=True,
    )
    assert profile.precisions[Timeline("fp32")].selective and not notes
    assert all(len(ph.delta) == SELECTIVE + 1 for ph in profile.precisions[Timeline("fp32")].phases)
    off, _ = memory_profile(
        profiler, (Timeline("fp32"),), ("adamw",), device_name="cpu", context_bytes=0
    )
    assert not off.precisions[Timeline("fp32")].selective
    assert all(len(ph.delta) == 2 for ph in off.precisions[Timeline("fp32")].phases)
