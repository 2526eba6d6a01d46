"""A Hugging Face model's own gradient checkpointing, off while autotune's mask applies.

``gradient_checkpointing_enable()`` (which peft's ``prepare_model_for_kbit_training``
calls by default, so every QLoRA model has it on) sets ``gradient_checkpointing`` on each
layer (on the decoder stack before transformers 4.48): every layer then recomputes its
activations whatever the config's mask says, so kept blocks would not be kept and
checkpointed ones would recompute twice over. The tuned mask is what must run.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["disable_hf_checkpointing"]


def disable_hf_checkpointing(model: nn.Module) -> Callable[[], None]:
    """Turn off ``gradient_checkpointing`` on every module of ``model`` that has it on.

    Returns:
        A function that turns it back on where it was on.
    """
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", None) is True]
    for m in flagged:
        m.__dict__["gradient_checkpointing"] = False  # a plain attribute, as HF sets it

    def undo() -> None:
        for m in flagged:
            m.__dict__["gradient_checkpointing"] = True

    return undo
