"""Model FLOPs utilisation: the model's FLOPs per second over the card's dense bf16 peak.

The FLOPs are the model's, not the hardware's (recomputation by checkpointing is not
counted, as in PaLM's definition): counted from the model's matrix products, each
``in x out`` weight costing 2 FLOPs a token forward, 2 backward for its input's gradient
and 2 more for its own gradient where it is trained (a frozen QLoRA base: 4, LoRA and a
full fine-tune: 6), plus attention's ``12 * layers * width * tokens`` per token (QK^T and
AV, forward and backward). The peak is the datasheet's dense bf16 rate from autotune's
device table.
"""

from __future__ import annotations

from torch import nn

from autotune.device import DEVICES

__all__ = ["flops_per_token", "mfu", "peak_flops", "table_name"]

_NAMES = (("H200", "H200-141GB"), ("H100 PCIe", "H100-PCIe-80GB"), ("H100", "H100-80GB"),
          ("A100-SXM4-40GB", "A100-40GB"), ("A100", "A100-80GB"), ("L40S", "L40S-48GB"),
          ("A10", "A10-24GB"), ("L4", "L4-24GB"), ("4090", "RTX4090-24GB"),
          ("3090", "RTX3090-24GB"))  # fmt: skip


def table_name(gpu: str) -> str | None:
    """The device table's entry for a GPU as torch names it (``NVIDIA H200``), or ``None``."""
    for part, name in _NAMES:
        if part in gpu:
            return name
    return None


def peak_flops(gpu: str) -> float | None:
    """The GPU's dense bf16 peak FLOP/s from the table (``None``: not in it, or a CPU)."""
    name = table_name(gpu)
    return DEVICES[name].flops["bf16"] if name else None


def flops_per_token(model: nn.Module, *, layers: int, width: int, seq: int) -> float:
    """Training FLOPs per token of ``model`` (see the module's docstring)."""
    total = 0.0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or not isinstance(weight, nn.Parameter):
            continue
        n = _matmul_params(module)
        if n:
            total += (6.0 if weight.requires_grad else 4.0) * n
    return total + 12.0 * layers * width * seq


def _matmul_params(module: nn.Module) -> int:
    """Weights of one matrix product (a linear layer, GPT-2's Conv1D, a 4-bit layer whose
    packed weight's size is not its shape's), 0 for anything else."""
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return int(module.in_features) * int(module.out_features)
    if type(module).__name__ == "Conv1D":  # transformers' GPT-2 projection: (in, out)
        return int(module.weight.numel())
    return 0


def mfu(samples_per_s: float | None, flops_token: float, seq: int, gpu: str) -> float | None:
    """The share of the card's dense bf16 peak that ``samples_per_s`` reaches."""
    peak = peak_flops(gpu)
    if samples_per_s is None or peak is None:
        return None
    return samples_per_s * seq * flops_token / peak
