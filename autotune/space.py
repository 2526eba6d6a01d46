"""``SearchSpace``: which knobs the tuner may turn."""

from __future__ import annotations

from dataclasses import dataclass

from autotune._spelling import option
from autotune.config import ATTENTION, PRECISIONS, check_optimizer
from autotune.errors import ConfigError

__all__ = ["SearchSpace"]


@dataclass(frozen=True)
class SearchSpace:
    """Narrows or widens the knobs ``autotune()`` searches.

    The default never changes the training math beyond precision: the optimizer stays
    ``adamw`` (the user's) unless ``optimizers`` names others; where the device has
    torch's fused AdamW kernel, ``adamw`` is searched as ``adamw_fused`` (the same math in
    one kernel). Offload and checkpointing do not change the math (same losses and
    weights), so they are searched by default.
    """

    def compiles(self, device_type: str) -> bool:
        """Whether compiled blocks are searched on a device of this type."""
        return device_type == "cuda" if self.compile_blocks is None else self.compile_blocks

    def compiles_model(self, device_type: str) -> bool:
        """Whether the model compiled whole is searched on a device of this type."""
        return device_type == "cuda" if self.compile_model is None else self.compile_model

    def offloads(self, device_type: str) -> tuple[bool, bool]:
        """(optimizer offload, activation offload) allowed on a device of this type."""
        auto = device_type == "cuda"
        optimizer, activations = self.offload_optimizer, self.offload_activations
        return (
            auto if optimizer is None else optimizer,
            auto if activations is None else activations,
        )

    precisions: tuple[str, ...] = PRECISIONS
    """Precisions to consider; those the device lacks are dropped."""
    optimizers: tuple[str, ...] = ("adamw",)
    """Optimizers to consider; the first is the user's, the rest are opt-in swaps. A name
    of :data:`~autotune.config.OPTIMIZERS`, or a factory's import path (``module:name``;
    ``autotune(optimizer=...)`` puts one first)."""
    checkpointing: bool = True
    """Whether blocks may be checkpointed."""
    selective_checkpointing: bool = True
    """Whether blocks may also be checkpointed selectively (their matrix products,
    convolutions and attention kept, the cheap ops recomputed); needs ``checkpointing``."""
    offload_optimizer: bool | None = None
    """Whether the optimizer may live on the host; ``None``: on CUDA yes, on CPU no (the
    host is the device there, so offload saves nothing)."""
    offload_activations: bool | None = None
    """Whether blocks' saved activations may go to host memory; ``None`` as above."""
    compile_blocks: bool | None = None
    """Whether the blocks may run compiled (``torch.compile`` of each block's forward,
    kept or checkpointed whole), each precision's compiled timeline profiled and dropped
    where it does not pay; ``None``: on CUDA yes, on the CPU no (compiling a block class
    takes its C++ compiler seconds per precision there, about the whole tuning budget).
    Compiling needs blocks (``checkpointing``), and one process (no data parallelism)."""
    compile_model: bool | None = None
    """Whether the whole model may run compiled with its loss (``torch.compile`` of the
    forward and the loss as one graph, shapes static at the micro-batch; the blocks kept
    or checkpointed whole, inside the graph), each precision's timeline profiled and
    dropped where it does not pay; ``None``: on CUDA yes, on the CPU no (compiling the
    model takes its C++ compiler tens of seconds there). One process only."""
    chunked_loss: bool | None = None
    """Whether a causal language model's loss may be chunked (its output layer and
    cross-entropy a slice of the tokens at a time, never the whole logits), its timeline
    profiled and searched; ``None``: where the model takes it and its fp32 logits are at
    least a quarter of what a sample holds through its step."""
    blocks: tuple[str, ...] | None = None
    """Qualified names of the blocks; default ``autotune.find_blocks(model)``."""
    max_micro_batch_size: int = 4096
    """Largest micro-batch considered."""
    micro_batch_sizes: tuple[int, ...] | None = None
    """Only these micro-batch sizes (default: every size that fits)."""
    attention: tuple[str, ...] | None = None
    """Attention implementations to measure, for a model that has a choice (a Hugging Face
    model's ``attn_implementation``: ``eager``, ``sdpa``, ``flash_attention_2`` where
    installed); each is tuned and the fastest verified wins. ``None``: the model's own."""

    def __post_init__(self) -> None:
        value = tuple(self.precisions)
        if not value or any(v not in PRECISIONS for v in value):
            raise ConfigError(
                f"{option('SearchSpace.precisions')} must be a non-empty list from "
                f"{', '.join(PRECISIONS)}; "
                f"got {list(value)}."
            )
        object.__setattr__(self, "precisions", value)
        optimizers = tuple(self.optimizers)
        if not optimizers:
            raise ConfigError(
                f"{option('SearchSpace.optimizers')} must not be empty; the first is yours."
            )
        for o in optimizers:
            check_optimizer(o, f"each of {option('SearchSpace.optimizers')}")
        object.__setattr__(self, "optimizers", optimizers)
        if self.blocks is not None:
            object.__setattr__(self, "blocks", tuple(self.blocks))
        if self.attention is not None:
            names = tuple(dict.fromkeys(self.attention))
            if not names or any(n not in ATTENTION for n in names):
                raise ConfigError(
                    f"SearchSpace.attention must be a non-empty list from {', '.join(ATTENTION)}"
                    f"; got {list(self.attention)!r:.80}."
                )
            object.__setattr__(self, "attention", names)
        if self.micro_batch_sizes is not None:
            sizes = tuple(sorted(set(self.micro_batch_sizes)))
            if not sizes or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes
            ):
                raise ConfigError(
                    f"{option('SearchSpace.micro_batch_sizes')} must be positive integers, got "
                    f"{sizes}."
                )
            object.__setattr__(self, "micro_batch_sizes", sizes)
        for name in ("checkpointing", "selective_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"SearchSpace.{name} must be True or False.")
        for name in (
            "offload_optimizer",
            "offload_activations",
            "compile_blocks",
            "compile_model",
            "chunked_loss",
        ):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(f"SearchSpace.{name} must be True, False or None.")
        if self.max_micro_batch_size < 1:
            raise ConfigError("SearchSpace.max_micro_batch_size must be at least 1.")
