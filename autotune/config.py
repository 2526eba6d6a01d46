"""``TrainConfig``: one training configuration, every knob autotune searches.

The names of the precisions and optimizers live here, at the bottom of the package, so
that every layer can validate a knob without importing the code that implements it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from autotune.errors import ConfigError

__all__ = [
    "ATTENTION",
    "BITSANDBYTES_OPTIMIZERS",
    "COMPILE_LEVELS",
    "FUSED_OPTIMIZERS",
    "MAX_BATCH",
    "OPTIMIZERS",
    "PAGED_OPTIMIZERS",
    "PARALLEL",
    "PRECISIONS",
    "Timeline",
    "TrainConfig",
    "check_optimizer",
    "is_factory",
]

MAX_BATCH = 2**31 - 1
"""The largest micro-batch size or accumulation count a config may hold."""
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""Training precisions: fp32, bf16 autocast, fp16 autocast with a GradScaler."""
OPTIMIZERS: tuple[str, ...] = (
    "adamw",
    "adamw_fused",
    "sgd",
    "adafactor",
    "adamw8bit",
    "paged_adamw8bit",
    "paged_adamw",
)
"""Optimizer names; :mod:`autotune.train._optimizers` builds them."""
BITSANDBYTES_OPTIMIZERS: tuple[str, ...] = ("adamw8bit", "paged_adamw8bit", "paged_adamw")
"""The optimizers bitsandbytes builds (no data parallelism)."""
PAGED_OPTIMIZERS: dict[str, str] = {"paged_adamw8bit": "adamw8bit", "paged_adamw": "adamw"}
"""Paged optimizers (their large states in CUDA unified memory), each with its unpaged
twin of the same state size: off CUDA, bitsandbytes runs them unpaged."""
FUSED_OPTIMIZERS: dict[str, str] = {"adamw": "adamw_fused"}
"""Optimizers with a fused twin (one kernel for the whole step: the same math, no
temporary copies of the states, faster): where the device has the fused kernel, the
tuner searches the twin in their place."""
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_<][\w.<>]*")
"""An optimizer factory's import path, ``module:qualified.name``."""


def is_factory(optimizer: str) -> bool:
    """Whether ``optimizer`` names a factory of the user's by its import path
    (``module:name``) rather than one of :data:`OPTIMIZERS`."""
    return isinstance(optimizer, str) and _FACTORY.fullmatch(optimizer) is not None


def check_optimizer(optimizer: object, where: str) -> None:
    """Raise ConfigError unless ``optimizer`` is a name of :data:`OPTIMIZERS` or a
    factory's import path."""
    if optimizer in OPTIMIZERS or (isinstance(optimizer, str) and is_factory(optimizer)):
        return
    got = str(optimizer)[:60]
    raise ConfigError(
        f"{where} must be one of {', '.join(OPTIMIZERS)}, or the import path of a factory "
        f"of your own (module:function), got {got!r}."
    )


ATTENTION: tuple[str, ...] = (
    "eager",
    "sdpa",
    "flash_attention_2",
    "flash_attention_3",
    "flex_attention",
)
"""Attention implementations a Hugging Face model may run (its ``attn_implementation``)."""
PARALLEL: tuple[str, ...] = ("none", "ddp", "fsdp")
"""Data parallelism over ``world_size`` ranks: none, DDP (replicated), FSDP2 (sharded)."""
_BLOCK_CHOICES = ("checkpoint", "selective_checkpoint", "offload_activations")
"""The fields that name blocks, each block in one at most (unnamed: kept)."""
COMPILE_LEVELS: tuple[str, ...] = ("none", "blocks", "model")
"""What runs through ``torch.compile``: nothing, each block (``compile_blocks``), or the
whole model with its loss (``compile_model``)."""
_SUFFIXES = {"none": "", "blocks": "+compiled", "model": "+model"}
"""The suffix of each compile level in a timeline's saved name (see :class:`Timeline`)."""
_CHUNKED = "+chunked"
"""The suffix of a chunked loss in a timeline's saved name."""


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Which of a profile's memory timelines a config trains on: its precision, what
    runs compiled, and whether its loss is chunked. Each is a timeline of its own; a
    compiled timeline keeps or checkpoints its blocks whole, never selectively or
    offloaded.

    Saved (in profiles, and as a study's sampled value) by its name, ``str(timeline)``:
    the precision, ``+compiled`` where the blocks run compiled, ``+model`` where the model
    and its loss do, ``+chunked`` where the loss is chunked (``bf16+compiled+chunked``).
    """

    precision: str
    level: str = "none"
    """What runs compiled, one of :data:`COMPILE_LEVELS`."""
    chunked: bool = False

    def __str__(self) -> str:
        return self.precision + _SUFFIXES[self.level] + (_CHUNKED if self.chunked else "")

    @staticmethod
    def named(name: str) -> Timeline:
        """The timeline saved as ``name`` (the inverse of ``str``)."""
        plain = name.removesuffix(_CHUNKED)
        level = next((lv for lv, s in _SUFFIXES.items() if s and plain.endswith(s)), "none")
        return Timeline(plain.removesuffix(_SUFFIXES[level]), level, plain != name)

    @property
    def compiled(self) -> bool:
        """Whether anything runs compiled (the blocks or the whole model)."""
        return self.level != "none"

    @property
    def eager(self) -> Timeline:
        """This timeline's precision and loss, nothing compiled."""
        return dataclasses.replace(self, level="none")

    @property
    def unchunked(self) -> Timeline:
        """This timeline with the plain loss (its twin, for a chunked one)."""
        return dataclasses.replace(self, chunked=False)

    def knobs(self, blocks: tuple[str, ...]) -> dict[str, Any]:
        """The :class:`TrainConfig` knobs of this timeline over a model's ``blocks``: its
        precision, every block compiled or the model compiled, and the loss chunked."""
        return {
            "precision": self.precision,
            "compile_blocks": blocks if self.level == "blocks" else (),
            "compile_model": self.level == "model",
            "chunked_loss": self.chunked,
        }


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training configuration: every knob autotune searches, each with a safe default."""

    micro_batch_size: int = 1
    """Samples per forward/backward pass."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated before each optimizer step."""
    precision: str = "fp32"
    """``fp32``; ``bf16`` (autocast); or ``fp16`` (autocast with a GradScaler)."""
    checkpoint: tuple[str, ...] = ()
    """Blocks (qualified module names) whose activations are recomputed in backward."""
    selective_checkpoint: tuple[str, ...] = ()
    """Blocks checkpointed selectively: the outputs of their expensive ops (matrix
    products, convolutions, attention) are kept, the cheap ops (norms, activations,
    dropout, casts) recomputed in backward. Memory between keeping a block and
    checkpointing it, less recomputation than checkpointing it."""
    offload_activations: tuple[str, ...] = ()
    """Blocks whose saved activations go to pinned host memory."""
    optimizer: str = "adamw"
    """Optimizer name, one of :data:`OPTIMIZERS`, or the import path (``module:name``)
    of the factory of your own it was tuned with (see ``autotune(optimizer=...)``)."""
    offload_optimizer: bool = False
    """Keep optimizer states and run the step on the host (with FSDP: its
    ``CPUOffloadPolicy``, the sharded parameters and gradients on the host too)."""
    parallel: str = "none"
    """Data parallelism, one of :data:`PARALLEL`: ``ddp`` replicates the model on every
    rank, ``fsdp`` shards parameters, gradients and optimizer state with FSDP2's
    ``fully_shard`` (each block a unit; bf16 as its ``MixedPrecisionPolicy``)."""
    world_size: int = 1
    """Ranks training together; the global batch is ``effective_batch_size * world_size``."""
    keep_gathered: tuple[str, ...] = ()
    """FSDP units (blocks) not resharded after forward (``reshard_after_forward=False``):
    their parameters stay gathered until their backward, one all-gather fewer."""
    attention: str | None = None
    """The attention implementation of a model that has one (a Hugging Face model's
    ``attn_implementation``, one of :data:`ATTENTION`); ``None``: the model's own."""
    compile_blocks: tuple[str, ...] = ()
    """Blocks whose forward runs through ``torch.compile`` (regional compilation: one
    graph shared by identical blocks), beneath their checkpoint wrapper where they are
    checkpointed. A compiled block is kept or checkpointed whole, never selectively or
    offloaded."""
    compile_model: bool = False
    """The whole model's forward and its loss through ``torch.compile`` as one graph (the
    loss fused with the output layer), shapes static at ``micro_batch_size``, the
    checkpointed blocks recomputed inside the graph. Not with ``compile_blocks``, nor with
    blocks checkpointed selectively or offloaded."""
    chunked_loss: bool = False
    """A causal language model's output layer and cross-entropy taken an eighth of the
    tokens at a time, each piece recomputed in backward: a large vocabulary's logits are
    never whole (Hugging Face causal language models whose loss is their own)."""
    eval_batch_size: int | None = dataclasses.field(default=None, compare=False)
    """Samples per evaluation forward (no gradients) that fit the budget beside this
    config's training state, measured after a training step; ``None``: not measured. Not
    a knob of training: configs that differ only here are equal."""

    @property
    def compile_level(self) -> str:
        """What runs compiled, one of :data:`COMPILE_LEVELS`."""
        if self.compile_model:
            return "model"
        return "blocks" if self.compile_blocks else "none"

    @property
    def timeline(self) -> Timeline:
        """The profile's timeline this config trains on."""
        return Timeline(self.precision, self.compile_level, self.chunked_loss)

    def __post_init__(self) -> None:
        names = ("micro_batch_size", "grad_accum_steps")
        for name in names if self.eval_batch_size is None else (*names, "eval_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH:
                shown = value if type(value) is not int else f"{value:.3g}"
                raise ConfigError(
                    f"{name} must be an integer from 1 to {MAX_BATCH}, got {str(shown)[:40]}."
                )
        if self.precision not in PRECISIONS:
            got = str(self.precision)[:40]
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {got!r}.")
        check_optimizer(self.optimizer, "optimizer")
        for name in _BLOCK_CHOICES:
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ConfigError(
                    f"{name} must be a list of block names, got {type(value).__name__}."
                )
            object.__setattr__(self, name, tuple(value))
        value = self.compile_blocks
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            raise ConfigError(
                f"compile_blocks must be a list of block names, got {type(value).__name__}."
            )
        object.__setattr__(self, "compile_blocks", tuple(value))
        both = set(value) & set(self.selective_checkpoint + self.offload_activations)
        if both:
            raise ConfigError(
                f"blocks {sorted(both)} are compiled and checkpointed selectively or "
                "offloaded; a compiled block is kept or checkpointed whole."
            )
        self._check_compile_model()
        if not isinstance(self.chunked_loss, bool):
            raise ConfigError(f"chunked_loss must be true or false, got {self.chunked_loss!r:.40}.")
        for i, first in enumerate(_BLOCK_CHOICES):
            for second in _BLOCK_CHOICES[i + 1 :]:
                both = set(getattr(self, first)) & set(getattr(self, second))
                if both:
                    raise ConfigError(
                        f"blocks {sorted(both)} are in both {first} and {second}; a block is "
                        "kept, checkpointed, checkpointed selectively or offloaded, one of these."
                    )
        if self.attention is not None and self.attention not in ATTENTION:
            got = str(self.attention)[:40]
            raise ConfigError(f"attention must be one of {', '.join(ATTENTION)}, got {got!r}.")
        if not isinstance(self.offload_optimizer, bool):
            raise ConfigError(
                f"offload_optimizer must be true or false, got {self.offload_optimizer!r}."
            )
        self._check_parallel()

    def _check_compile_model(self) -> None:
        if not isinstance(self.compile_model, bool):
            raise ConfigError(
                f"compile_model must be true or false, got {self.compile_model!r:.40}."
            )
        if not self.compile_model:
            return
        if self.compile_blocks:
            raise ConfigError(
                "compile_model compiles the whole model, its blocks included; leave "
                "compile_blocks empty."
            )
        wrapped = self.selective_checkpoint or self.offload_activations
        if wrapped:
            raise ConfigError(
                "with compile_model the blocks are kept or checkpointed whole: move the "
                "blocks of selective_checkpoint and offload_activations to checkpoint."
            )

    def _check_parallel(self) -> None:
        if self.parallel not in PARALLEL:
            got = str(self.parallel)[:40]
            raise ConfigError(f"parallel must be one of {', '.join(PARALLEL)}, got {got!r}.")
        n = self.world_size
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 65536:
            raise ConfigError(f"world_size must be an integer from 1 to 65536, got {n!r}.")
        if self.parallel == "none" and n != 1:
            raise ConfigError(
                f"world_size is {n} but parallel is none; set parallel to ddp or fsdp."
            )
        value = self.keep_gathered
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"keep_gathered must be a list of block names, got {value!r:.40}.")
        object.__setattr__(self, "keep_gathered", tuple(value))
        if value and self.parallel != "fsdp":
            raise ConfigError("keep_gathered names FSDP units; it needs parallel: fsdp.")
        if self.parallel == "none":
            return
        unsupported = [
            (self.offload_activations, "activation offload"),
            (self.optimizer in BITSANDBYTES_OPTIMIZERS, f"the {self.optimizer} optimizer"),
            (self.precision == "fp16" and self.parallel == "fsdp", "fp16 (use bf16)"),
            (self.offload_optimizer and self.parallel == "ddp", "optimizer offload"),
            (self.compile_blocks, "compile_blocks"),
            (self.compile_model, "compile_model"),
        ]
        for flag, what in unsupported:
            if flag:
                raise ConfigError(f"{what} is not supported with parallel: {self.parallel}.")

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.effective_batch_size * self.world_size

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step: ``micro_batch_size * grad_accum_steps``."""
        return self.micro_batch_size * self.grad_accum_steps

    def can_switch_to(self, other: TrainConfig) -> bool:
        """Whether training can go on with ``other`` mid-run (a fallback): the same
        optimizer (its state is kept) and the same data parallelism over as many ranks."""
        return (self.optimizer, self.parallel, self.world_size) == (
            other.optimizer,
            other.parallel,
            other.world_size,
        )

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some knobs changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def digest(self) -> str:
        """A short hash of every knob: a result's file records its config's, so that a
        config edited by hand is not shown with figures measured for another."""
        fields = dataclasses.asdict(self)
        del fields["eval_batch_size"]  # not a knob of training: the figures hold without it
        knobs = json.dumps(fields, sort_keys=True, default=list)
        return hashlib.sha256(knobs.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """A one-line human summary of the knobs."""
        parts = [
            f"micro_batch={self.micro_batch_size}",
            f"accum={self.grad_accum_steps}",
            self.precision,
            f"checkpoint={len(self.checkpoint)}",
            self.optimizer,
        ]
        if self.selective_checkpoint:
            parts.insert(4, f"selective={len(self.selective_checkpoint)}")
        if self.offload_activations:
            parts.append(f"offload_act={len(self.offload_activations)}")
        if self.offload_optimizer:
            parts.append("offload_opt")
        if self.parallel != "none":
            parts.append(f"{self.parallel}x{self.world_size}")
        if self.keep_gathered:
            parts.append(f"keep_gathered={len(self.keep_gathered)}")
        if self.attention:
            parts.append(f"attention={self.attention}")
        if self.compile_blocks:
            parts.append(f"compiled={len(self.compile_blocks)}")
        if self.compile_model:
            parts.append("compiled=model")
        if self.chunked_loss:
            parts.append("chunked_loss")
        if self.eval_batch_size is not None:
            parts.append(f"eval_batch={self.eval_batch_size}")
        return " ".join(parts)
