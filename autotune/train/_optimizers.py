"""The optimizers autotune can build: by name, or from a factory of the user's.

The tuner never swaps the user's optimizer unless the search space is widened to other
names: optimizers change the training math, not only its speed and memory.

``adamw8bit`` is bitsandbytes' ``AdamW8bit`` (optional extra ``autotune[8bit]``): fused
CUDA kernels, a CPU backend, plain uint8 state tensors that the memory tracker counts
exactly, and no compilation on first use (torchao's ``AdamW8bit`` compiles its step with
``torch.compile``, about 20 s on first use, which tuning cannot afford).

A factory of the user's (``optimizer=`` of ``autotune()``, ``prepare()``, ``apply()``) is
known by its import path, ``module:qualified.name``, which configs and results record; the
factory itself is registered in this process when it is passed. A path read from a file
is never imported on its own: code runs only where the user passed it.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune._spelling import option
from autotune.config import BITSANDBYTES_OPTIMIZERS, OPTIMIZERS, is_factory
from autotune.errors import ConfigError

__all__ = [
    "DEFAULT_LR",
    "OptimizerFactory",
    "OptimizerSpec",
    "available",
    "build_optimizer",
    "factory_name",
    "fused_runs",
    "not_at_hand",
    "registered",
]

DEFAULT_LR = 3e-4
"""The learning rate of the named optimizers when none is given."""

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
"""Builds the user's optimizer from a list of the model's trainable parameters, or, where
its first parameter is named ``model`` (or annotated ``nn.Module``), from the model itself,
to make parameter groups. An optimizer class (``torch.optim.AdamW``) is a factory too."""

_FACTORIES: dict[str, OptimizerFactory] = {}


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one optimizer, and what its state costs."""

    build: Callable[[Iterable[torch.Tensor], float], torch.optim.Optimizer]
    state_bytes_per_param: float
    """Approximate state bytes per fp32 parameter, for messages; the profile measures it."""
    summary: str


def _adamw(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


def _adamw_fused(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    # What nanoGPT, torchtitan and Hugging Face's optim="adamw_torch_fused" build: one
    # kernel updates every parameter, where the foreach AdamW makes temporary copies of
    # the states for each of its passes.
    return torch.optim.AdamW(params, lr=lr, fused=True)


def fused_runs(device: torch.device) -> bool:
    """Whether torch has the fused AdamW kernel for ``device`` (CUDA, and the CPU since
    torch 2.4): AdamW refuses ``fused=True`` on a device without it."""
    try:
        probe = torch.zeros(1, device=device, requires_grad=True)
        torch.optim.AdamW([probe], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


def _sgd(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _adafactor(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(params, lr=lr)


def _adamw8bit(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    # AdamW's defaults (betas, eps, weight decay 0.01), states quantised blockwise to 8 bits.
    optimizer: torch.optim.Optimizer = _bitsandbytes().optim.AdamW8bit(params, lr=lr)
    return optimizer


def _paged_adamw8bit(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    # What Hugging Face's optim="paged_adamw_8bit" builds: AdamW8bit whose states of
    # parameters of 1e5 elements or more live in CUDA unified memory (paged to the host
    # when the device is full). Off CUDA, its unpaged twin: the same state and math.
    return _paged(params, lr, "PagedAdamW8bit", "AdamW8bit")


def _paged_adamw(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    # Hugging Face's optim="paged_adamw_32bit": fp32 states, paged as above.
    return _paged(params, lr, "PagedAdamW32bit", "AdamW32bit")


def _paged(
    params: Iterable[torch.Tensor], lr: float, paged: str, unpaged: str
) -> torch.optim.Optimizer:
    params = list(params)
    # bitsandbytes pages through CUDA unified memory only (elsewhere it warns and runs
    # unpaged): build the unpaged twin where the parameters are not on CUDA.
    cuda = any(p.device.type == "cuda" for p in params)
    build = getattr(_bitsandbytes().optim, paged if cuda else unpaged)
    optimizer: torch.optim.Optimizer = build(params, lr=lr)
    return optimizer


def _bitsandbytes() -> Any:
    """Import bitsandbytes, or say how to install it."""
    # Its CPU backend logs a warning at import about optional 4-bit kernels we never use.
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError(
            "optimizers adamw8bit, paged_adamw8bit and paged_adamw need bitsandbytes: "
            "pip install 'autotune[8bit]' "
            "(or pip install bitsandbytes)."
        ) from None
    finally:
        log.setLevel(level)
    return bitsandbytes


def available(name: str) -> bool:
    """Whether optimizer ``name`` can be built here (its optional library is installed,
    or its factory was passed in this process)."""
    if is_factory(name):
        return registered(name)
    if name not in BITSANDBYTES_OPTIMIZERS:
        return name in _SPECS
    try:
        _bitsandbytes()
    except ConfigError:
        return False
    return True


_SPECS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(_adamw, 8.0, "AdamW, two fp32 states per parameter"),
    "adamw_fused": OptimizerSpec(
        _adamw_fused, 8.0, "AdamW as one fused kernel (torch), two fp32 states per parameter"
    ),
    "sgd": OptimizerSpec(_sgd, 4.0, "SGD with momentum 0.9, one fp32 state per parameter"),
    "adafactor": OptimizerSpec(_adafactor, 0.5, "Adafactor, factored second moments"),
    "adamw8bit": OptimizerSpec(
        _adamw8bit, 2.0, "AdamW with 8-bit blockwise-quantised states (bitsandbytes)"
    ),
    "paged_adamw8bit": OptimizerSpec(
        _paged_adamw8bit, 2.0, "adamw8bit with its states paged in CUDA unified memory"
    ),
    "paged_adamw": OptimizerSpec(
        _paged_adamw, 8.0, "AdamW (bitsandbytes, fp32 states) paged in CUDA unified memory"
    ),
}


def build_optimizer(
    name: str,
    params: Sequence[torch.Tensor],
    lr: float | None,
    *,
    model: nn.Module | None = None,
    standing_for: Sequence[torch.Tensor] | None = None,
) -> torch.optim.Optimizer:
    """Build the optimizer called ``name`` over ``params``.

    Args:
        name: One of :data:`~autotune.config.OPTIMIZERS`, or a registered factory's path.
        params: What the optimizer updates: the model's trainable parameters, or host
            master weights standing for them (``standing_for``, in the same order).
        lr: The named optimizers' learning rate (``None``: :data:`DEFAULT_LR`); a factory
            sets its own.
        model: The model, for a factory that builds parameter groups from it.
        standing_for: The trainable parameters ``params`` stand for; default ``params``.

    Raises:
        ConfigError: the name is unknown, the factory is not registered here, or what it
            built is not an optimizer over the trainable parameters.
    """
    if is_factory(name):
        return _from_factory(name, params, model, standing_for)
    spec = _SPECS.get(name)
    if spec is None:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}.")
    return spec.build(params, DEFAULT_LR if lr is None else lr)


def factory_name(factory: OptimizerFactory | str) -> str:
    """Register the user's optimizer factory (or its import path, imported now) in this
    process; returns its name, the import path ``module:qualified.name``.

    Raises:
        ConfigError: not callable, nameless, or its path cannot be imported.
    """
    if isinstance(factory, str):
        if factory in _FACTORIES:  # passed in this process already
            return factory
        if not is_factory(factory):
            raise ConfigError(
                f"optimizer {factory[:60]!r} is not an import path of a factory; write it as "
                "module:function (e.g. mytraining.optim:make_optimizer), or pass the "
                "function itself."
            )
        _FACTORIES[factory] = _imported(factory)
        return factory
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None)
    if not callable(factory) or not module or not qualname:
        raise ConfigError(
            f"optimizer= takes a function (or class) that builds a torch.optim.Optimizer, got "
            f"{type(factory).__name__}; wrap it in a def with a name, which the config records."
        )
    name = f"{module}:{qualname}"
    _FACTORIES[name] = factory
    return name


def not_at_hand(name: str) -> ConfigError:
    """The error of a config tuned with a factory not passed in this process."""
    return ConfigError(
        f"this config was tuned with your optimizer factory {name}; pass it: "
        f"{option('optimizer=<that function> (or its import path as a string)')}."
    )


def registered(name: str) -> bool:
    """Whether the factory ``name`` was passed in this process (it can be built)."""
    return name in _FACTORIES


def _imported(path: str) -> OptimizerFactory:
    module, _, attr = path.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in attr.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"optimizer {path} cannot be imported here ({e}); make its module importable "
            "(on PYTHONPATH) or pass the factory itself."
        ) from None
    if not callable(found):
        raise ConfigError(f"optimizer {path} is a {type(found).__name__}, not a factory.")
    factory: OptimizerFactory = found
    return factory


def _from_factory(
    name: str,
    params: Sequence[torch.Tensor],
    model: nn.Module | None,
    standing_for: Sequence[torch.Tensor] | None,
) -> torch.optim.Optimizer:
    factory = _FACTORIES.get(name)
    if factory is None:
        raise not_at_hand(name)
    gets_model = _takes_model(factory)
    if gets_model and model is None:
        raise ConfigError(f"optimizer factory {name} takes the model; none was given to build it.")
    try:
        optimizer = factory(model if gets_model else list(params))
    except Exception as e:  # the user's code: say whose
        raise ConfigError(f"optimizer factory {name} failed: {type(e).__name__}: {e}") from e
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer factory {name} returned a {type(optimizer).__name__}; it must return a "
            "torch.optim.Optimizer."
        )
    if gets_model and standing_for is not None:
        _check_covers(name, optimizer, standing_for)
        _moved_to(name, optimizer, standing_for, params)
    else:
        _check_covers(name, optimizer, params)
    return optimizer


def _takes_model(factory: OptimizerFactory) -> bool:
    """Whether the factory's first parameter is the model (named ``model`` or annotated
    ``nn.Module``) rather than the list of parameters."""
    try:
        first = next(iter(inspect.signature(factory).parameters.values()), None)
    except (TypeError, ValueError):
        return False
    if first is None:
        return False
    note = first.annotation
    if isinstance(note, str):
        return first.name == "model" or note.rsplit(".", 1)[-1] == "Module"
    return first.name == "model" or (isinstance(note, type) and issubclass(note, nn.Module))


def _check_covers(
    name: str, optimizer: torch.optim.Optimizer, trainable: Sequence[torch.Tensor]
) -> None:
    """Every trainable parameter in the optimizer (else it would never learn, and the
    memory measured would not be a real run's)."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = sum(id(p) not in held for p in trainable)
    if missing:
        raise ConfigError(
            f"the optimizer factory {name} left {missing} of the model's {len(trainable)} "
            "trainable parameters out of its optimizer; give it every parameter that "
            "requires grad (freeze the others with requires_grad_(False))."
        )


def _moved_to(
    name: str,
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor],
) -> None:
    """An optimizer built over the model's parameters made to update host ``masters``
    instead (an offloaded optimizer whose factory takes the model): possible while it has
    no state yet, as torch's optimizers make theirs at the first step."""
    if optimizer.state:
        raise ConfigError(
            f"the optimizer of factory {name} makes its state as it is built, on the "
            "device: it cannot be offloaded to the host. Leave offload_optimizer off "
            f"({option('SearchSpace(offload_optimizer=False)')})."
        )
    master_of = {id(p): m for p, m in zip(params, masters, strict=True)}
    for group in optimizer.param_groups:
        group["params"] = [master_of.get(id(p), p) for p in group["params"]]
