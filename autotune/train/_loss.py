"""How a batch is fed to the model, and how the loss is found in its output.

The calling convention, used identically by tuning and by :func:`autotune.prepare`:

* a Tensor ``x``: ``model(x)``;
* a Mapping (dict, ``BatchEncoding``): ``model(**batch)``;
* a tuple/list: ``model(*batch)``; with a ``loss_fn``, the last element is taken to be the
  target the loss reads, so the model gets ``model(*batch[:-1])`` (the ``(x, y)`` idiom),
  except in a batch of per-sample lists (:class:`~autotune.train._batch_layout.SampleLists`:
  torchvision's detection ``(images, targets)``), whose records the model reads itself.

The loss: ``loss_fn(output, batch)`` when given; else a scalar output, ``output.loss``
(Hugging Face models given labels), or the first element of a tuple output.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from autotune._spelling import option
from autotune.errors import LossError
from autotune.train._batch_layout import SampleLists, layout_of

__all__ = [
    "LossFn",
    "call_model",
    "compute_loss",
    "counted_offset",
    "describe_call",
    "raised_in",
]

LossFn = Callable[[Any, Any], torch.Tensor]


def call_model(model: nn.Module, batch: Any, *, has_loss_fn: bool) -> Any:
    """Run ``model`` on ``batch`` by the calling convention above."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        target = has_loss_fn and len(batch) > 1 and not isinstance(layout_of(batch), SampleLists)
        return model(*(batch[:-1] if target else batch))
    return model(batch)


def compute_loss(output: Any, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The scalar loss of one forward pass, as a 0-dim tensor (a one-element loss is reshaped).

    Raises:
        LossError: no scalar loss can be derived; the message says what the output was.
    """
    if loss_fn is not None:
        loss = loss_fn(output, batch)
        if not _is_scalar(loss):
            raise LossError(
                f"{option('loss_fn')} returned {_describe(loss)}; it must return a scalar tensor "
                "(e.g. a mean over the batch)."
            )
        return _zero_dim(loss)
    if _is_scalar(output):
        return _zero_dim(output)
    attribute = getattr(output, "loss", None)
    if isinstance(attribute, torch.Tensor) and _is_scalar(attribute):
        return _zero_dim(attribute)
    if isinstance(output, (tuple, list)) and output and _is_scalar(output[0]):
        return _zero_dim(output[0])
    hint = ""
    if hasattr(output, "loss") and attribute is None:
        hint = " The output has a .loss of None: include labels in the batch (e.g. 'labels')."
    raise LossError(
        f"cannot derive a loss from the model's output, {_describe(output)}.{hint} "
        f"Pass {option('loss_fn=lambda output, batch: ...')} returning a scalar tensor."
    )


def counted_offset(model: nn.Module) -> int | None:
    """Where ``model``'s own loss is a mean over the label tokens that count (Hugging
    Face's language models and token classifiers, given a ``labels`` per token, -100 not
    counting): how many leading positions of each row's labels it never counts, 1 where
    it predicts each token from those before it (a causal language model shifts its
    labels), 0 where labels and predictions align (an encoder-decoder model, a masked
    language model, a token classifier), the rule Hugging Face's Trainer counts
    ``num_items_in_batch`` by. ``None``: another loss, a mean over samples."""
    transformers = sys.modules.get("transformers")  # not loaded: no Hugging Face model
    base = getattr(model, "get_base_model", None)  # a peft model's
    inner = base() if callable(base) else model
    if transformers is None or not isinstance(inner, transformers.PreTrainedModel):
        return None
    if getattr(inner.config, "is_encoder_decoder", False):
        return 0
    kind = getattr(inner, "loss_type", None) or ""
    name = type(inner).__name__
    if kind in _SHIFTED or name.endswith(("ForCausalLM", "LMHeadModel")):
        return 1
    if kind in _ALIGNED or name.endswith(_ALIGNED):
        return 0
    return None


_SHIFTED = ("ForCausalLM", "ForConditionalGeneration")
"""Hugging Face's loss types of a causal language model's loss (a decoder-only
``...ForConditionalGeneration`` is a vision-language model's, a causal one)."""
_ALIGNED = ("ForMaskedLM", "ForTokenClassification")


def raised_in(exc: BaseException, function: Callable[..., Any]) -> bool:
    """Whether ``exc`` was raised while ``function`` ran (it is in the traceback)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is function.__code__:
            return True
        tb = tb.tb_next
    return False


def describe_call(model: nn.Module, batch: Any, *, has_loss_fn: bool) -> str:
    """How :func:`call_model` calls ``model`` on ``batch``, in words, with what to pass."""
    name = f"{type(model).__name__}.forward"
    if isinstance(batch, Mapping):
        keys = ", ".join(f"{k}=" for k in batch)
        return (
            f"autotune called {name}({keys}) with the dict's items as keyword arguments; "
            "the sample batch's keys must be the names of forward's arguments"
        )
    if isinstance(batch, (tuple, list)):
        args = batch[:-1] if has_loss_fn and len(batch) > 1 else batch
        how = f"{name}({', '.join(_describe_short(a) for a in args)})"
        if has_loss_fn and len(batch) > 1:
            return (
                f"autotune called {how}: the {type(batch).__name__}'s items but the last "
                "(the target loss_fn reads), as positional arguments"
            )
        hint = ""
        if len(batch) > 1:
            hint = (
                f"; for an (inputs, target) batch pass "
                f"{option('loss_fn=lambda output, batch: ...')}, "
                "and the model gets every item but the last"
            )
        return (
            f"autotune called {how} with the {type(batch).__name__}'s items as positional "
            f"arguments{hint}"
        )
    return f"autotune called {name}({_describe_short(batch)})"


def _describe_short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}>"
    return f"<{type(value).__name__}>"


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def _zero_dim(loss: torch.Tensor) -> torch.Tensor:
    # A loss of shape (1,) would not add into the runner's 0-dim running total.
    return loss if loss.dim() == 0 else loss.reshape(())


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"an object of type {type(value).__name__}"
