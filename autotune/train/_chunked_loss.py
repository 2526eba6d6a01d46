"""The chunked loss (``TrainConfig.chunked_loss``): a causal language model's output layer and
cross-entropy taken a piece of the tokens at a time, each piece recomputed in backward, so
that a large vocabulary's logits are never whole.

A plain step holds the logits of every token of the micro-batch (and, through Hugging
Face's loss, an fp32 copy of them) from the output layer until the backward has passed
them: at 16 x 1024 tokens and 50,257 words, 3.3 GB in bf16 and 6.6 GB more in fp32. Here
the model's body runs as usual up to its last hidden states; then each of
:data:`CHUNKS` slices of the tokens goes through the output layer and the cross-entropy
under a checkpoint, which keeps only the slice's hidden states and its summed loss, and
makes the slice's logits again in backward. The loss is Hugging Face's ``ForCausalLMLoss``
(labels shifted by one, ``-100`` ignored, the mean over the tokens that count), computed
in fp32; the gradients are the plain loss's within rounding.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.errors import LossError
from autotune.train._loss import own_mean

__all__ = [
    "CHUNKS",
    "ChunkedLoss",
    "chunked_loss",
    "language_model",
    "taking_chunked_loss",
    "why_not_chunked",
]

CHUNKS = 8
"""Slices of the tokens: a slice's logits are an eighth of the whole."""
_IGNORE = -100
"""The label a token that does not count has (Hugging Face's, and torch's default)."""


def why_not_chunked(model: nn.Module, batch: Any, has_loss_fn: bool) -> str | None:
    """Why ``model`` on ``batch`` cannot take the chunked loss, or ``None`` where it can: a
    Hugging Face causal language model (or a peft model of one), its output layer a
    linear layer, given a dict batch with ``labels``, its loss its own (no ``loss_fn``)
    and its logits plain (no scaling or soft-capping, in its config or its text
    model's)."""
    if has_loss_fn:
        return "the loss is a loss_fn of your own"
    lm = language_model(model)
    if lm is None:
        return "the model is no Hugging Face causal language model with a linear output layer"
    if not isinstance(batch, dict) and not hasattr(batch, "keys"):
        return "the batch is no dict of the model's arguments"
    if "labels" not in batch:
        return "the batch has no labels"
    # A composite config (Gemma 3's) keeps the text model's settings in a sub-config.
    text = getattr(lm.config, "get_text_config", None)
    for config in (lm.config, text() if callable(text) else None):
        for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            if getattr(config, name, None) not in (None, 1, 1.0):
                return f"the model's logits are transformed ({name})"
    return None


def language_model(model: nn.Module) -> Any:
    """``model`` (a peft model's base model, its adapters in it) where it is a Hugging
    Face causal language model (not an encoder-decoder model, whose labels are aligned
    with its predictions and whose decoder reads inputs made from them) whose body is its
    ``base_model`` and whose output layer is linear; else ``None``."""
    transformers = sys.modules.get("transformers")  # not loaded: no Hugging Face model
    base = getattr(model, "get_base_model", None)  # a peft model's
    lm = base() if callable(base) else model
    if transformers is None or not isinstance(lm, transformers.PreTrainedModel):
        return None
    if own_mean(lm) != "next_tokens" or getattr(lm.config, "is_encoder_decoder", False):
        return None
    head = lm.get_output_embeddings()
    return lm if isinstance(head, nn.Linear) and lm.base_model is not lm else None


def chunked_loss(
    model: nn.Module, batch: Any, num_items: torch.Tensor | int | None = None
) -> torch.Tensor:
    """The causal language-model loss of ``model`` on ``batch`` (see the module), its
    logits made a slice of the tokens at a time. ``num_items``: what the summed loss is
    divided by in place of ``batch``'s counted tokens (Hugging Face's Trainer's
    ``num_items_in_batch``, the tokens of the whole accumulated step).

    Raises:
        LossError: the model cannot take it (:func:`why_not_chunked`).
    """
    why = why_not_chunked(model, batch, has_loss_fn=False)
    if why is not None:
        raise LossError(f"the chunked loss cannot be taken here: {why}; set chunked_loss: false.")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    lm = language_model(model)  # a Hugging Face causal language model (checked above)
    hidden = lm.base_model(**inputs)[0]
    head = lm.get_output_embeddings()
    labels = nn.functional.pad(batch["labels"], (0, 1), value=_IGNORE)[..., 1:]
    rows = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1).to(rows.device)
    size = -(-rows.shape[0] // CHUNKS)
    total = rows.new_zeros((), dtype=torch.float32)
    for start in range(0, rows.shape[0], size):
        piece = slice(start, start + size)
        total = total + checkpoint(
            _summed, rows[piece], head.weight, head.bias, targets[piece], use_reentrant=False
        )
    count = (targets != _IGNORE).sum().clamp(min=1) if num_items is None else num_items
    mean: torch.Tensor = total / count
    return mean


ChunkedLoss = Callable[[nn.Module, Any, Any], torch.Tensor]
"""A chunked loss, as :func:`chunked_loss` (or its graph compiled with the model's)."""


def taking_chunked_loss(
    model: nn.Module, forward: Callable[..., Any], loss: Callable[[], ChunkedLoss | None]
) -> Callable[..., Any]:
    """``model``'s ``forward`` returning, in an output without logits, the chunked loss
    ``loss()`` gives, where it gives one and the model trains on a dict of arguments with
    ``labels``, so that a loop that takes ``model(**batch).loss`` (Hugging Face's Trainer,
    one's own) trains with it; ``num_items_in_batch`` (the Trainer's count of the step's
    tokens) divides the summed loss. Any other call runs ``forward``."""
    outputs = importlib.import_module("transformers.modeling_outputs")

    def chunked_forward(*args: Any, **kwargs: Any) -> Any:
        taken = not args and "labels" in kwargs and model.training and torch.is_grad_enabled()
        chunked = loss() if taken else None
        if chunked is None:
            return forward(*args, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        return outputs.CausalLMOutputWithPast(loss=chunked(model, kwargs, num_items))

    return chunked_forward


def _summed(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """The summed cross-entropy of ``rows`` through the output layer, in fp32."""
    logits = nn.functional.linear(rows, weight, bias).float()
    return nn.functional.cross_entropy(logits, targets, ignore_index=_IGNORE, reduction="sum")
