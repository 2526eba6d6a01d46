"""How a batch is fed to the model, and how the loss is found in its output.

The calling convention, used identically by tuning and by :func:`autotune.prepare`:

* a Tensor ``x``: ``model(x)``;
* a Mapping (dict, ``BatchEncoding``): ``model(**batch)``; with a ``loss_fn``, a key that is
  no argument of ``forward`` (a diffusion job's ``target``) goes to the ``loss_fn`` only
  (said once, in the ``autotune`` log);
* a tuple/list: ``model(*batch)``; with a ``loss_fn``, the last element is taken to be the
  target the loss reads, so the model gets ``model(*batch[:-1])`` (the ``(x, y)`` idiom),
  except in a batch of per-sample lists (:class:`~autotune.train._batch_layout.SampleLists`:
  torchvision's detection ``(images, targets)``), whose records the model reads itself.

The loss: ``loss_fn(output, batch)`` when given; else a scalar output, ``output.loss``
(Hugging Face models given labels), or the first element of a tuple output.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import torch
from torch import nn

from autotune._spelling import option
from autotune.errors import ConfigError, LossError
from autotune.train._batch_layout import SampleLists, layout_of

__all__ = [
    "LossFn",
    "LossMean",
    "call_model",
    "check_loss_mean",
    "compute_loss",
    "counted_offset",
    "describe_call",
    "own_mean",
    "raised_in",
]

log = logging.getLogger("autotune")

LossFn = Callable[[Any, Any], torch.Tensor]
LossMean = Literal["samples", "tokens", "next_tokens"]
"""What the loss is a mean over, and so what a micro-batch weighs in the accumulated step:

* ``"samples"``: the batch's samples (or what its layout weighs: a packed row's tokens);
* ``"tokens"``: the label tokens that count, ``labels`` not -100 (a dict batch's
  ``"labels"``, a tuple's last item: a label per token), as a masked language model's,
  a token classifier's or an encoder-decoder's loss is;
* ``"next_tokens"``: the same, less each row's first label, which a causal language
  model never predicts (it predicts each token from those before it).
"""
_OFFSETS: dict[str, int | None] = {"samples": None, "tokens": 0, "next_tokens": 1}


def call_model(model: nn.Module, batch: Any, *, has_loss_fn: bool) -> Any:
    """Run ``model`` on ``batch`` by the calling convention above."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        left = _left_out(type(model), tuple(batch)) if has_loss_fn else ()
        if left:
            return model(**{k: v for k, v in batch.items() if k not in left})
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        target = has_loss_fn and len(batch) > 1 and not isinstance(layout_of(batch), SampleLists)
        return model(*(batch[:-1] if target else batch))
    return model(batch)


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
@functools.cache
def _left_out(kind: type[nn.Module], keys: tuple[str, ...]) -> tuple[str, ...]:
    """The ``keys`` that are no arguments of ``kind.forward`` (none where it takes
    ``**kwargs``): a batch's targets, which only the ``loss_fn`` reads. Said once."""
    try:
        parameters = inspect.signature(kind.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: every key goes to forward
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return ()
    names = {p.name for p in parameters}
    left = tuple(k for k in keys if k not in names)
    if left:
        log.info(
            "autotune: the batch's %s %s no argument of %s.forward: the loss_fn reads %s, "
            "the model is not given %s",
            ", ".join(repr(k) for k in left),
            "is" if len(left) == 1 else "are",
            kind.__name__,
            "it" if len(left) == 1 else "them",
            "it" if len(left) == 1 else "them",
        )
    return left


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


def counted_offset(model: nn.Module, loss_mean: LossMean | None = None) -> int | None:
    """How many leading positions of each row's labels the loss never counts where it is
    a mean over the label tokens that count (1 for ``"next_tokens"``, 0 for
    ``"tokens"``), ``None`` where it is a mean over samples: as ``loss_mean`` says, else
    as ``model``'s own loss is (:func:`own_mean`).

    Raises:
        ConfigError: ``loss_mean`` is none of :data:`LossMean`'s.
    """
    check_loss_mean(loss_mean)
    mean = loss_mean or own_mean(model)
    return None if mean is None else _OFFSETS[mean]


def check_loss_mean(loss_mean: object) -> None:
    """Refuse a ``loss_mean`` that is none of :data:`LossMean`'s (``None``: the model's
    own loss's rule).

    Raises:
        ConfigError: it is none of them.
    """
    if loss_mean is not None and loss_mean not in _OFFSETS:
        said = ", ".join(repr(m) for m in get_args(LossMean))
        raise ConfigError(f"{option('loss_mean')}={loss_mean!r} is none of {said}.")


def own_mean(model: nn.Module) -> LossMean | None:
    """What ``model``'s own loss is a mean over, where it is a Hugging Face language model
    or token classifier given a ``labels`` per token (-100 not counting):
    ``"next_tokens"`` where it predicts each token from those before it (a causal
    language model shifts its labels), ``"tokens"`` where labels and predictions align
    (an encoder-decoder model, a masked language model, a token classifier), the rule
    Hugging Face's Trainer counts ``num_items_in_batch`` by; ``None`` for any other
    model (a peft model: its base model's)."""
    transformers = sys.modules.get("transformers")  # not loaded: no Hugging Face model
    base = getattr(model, "get_base_model", None)  # a peft model's
    inner = base() if callable(base) else model
    if transformers is None or not isinstance(inner, transformers.PreTrainedModel):
        return None
    if getattr(inner.config, "is_encoder_decoder", False):
        return "tokens"
    kind = getattr(inner, "loss_type", None) or ""
    name = type(inner).__name__
    if kind in _SHIFTED or name.endswith(("ForCausalLM", "LMHeadModel")):
        return "next_tokens"
    if kind in _ALIGNED or name.endswith(_ALIGNED):
        return "tokens"
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
        left = _left_out(type(model), tuple(batch)) if has_loss_fn else ()
        keys = ", ".join(f"{k}={_describe_short(v)}" for k, v in batch.items() if k not in left)
        also = ""
        if left:
            also = f" (the loss_fn alone reads {', '.join(repr(k) for k in left)})"
        elif not has_loss_fn:
            also = (
                "; a key that is no argument of forward (a target) goes to a loss_fn only: "
                f"pass {option('loss_fn=lambda output, batch: ...')} to read it there"
            )
        return f"autotune called {name}({keys}) with the dict's items as keyword arguments{also}"
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
