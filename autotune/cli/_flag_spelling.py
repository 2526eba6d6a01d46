"""The options as the command line spells them: its flags, not the Python keywords.

The library marks each option its errors and warnings name (:func:`autotune._spelling.option`,
by its Python spelling); while a command runs, those messages name the flag instead.
A key here that no message marks is a flag the advice never names (``tests/cli`` checks).
"""

from __future__ import annotations

__all__ = ["FLAGS"]

FLAGS: dict[str, str] = {
    "loss_fn=lambda output, batch: ...": (
        "--loss FILE.py:NAME (NAME(output, batch) a function in a file of yours)"
    ),
    "SearchSpace(optimizers=['adamw', 'adamw8bit'])": "--optimizers adamw,adamw8bit",
    "optimizer=<that function> (or its import path as a string)": "--optimizer MODULE:FACTORY",
    "SearchSpace(offload_optimizer=True)": "--offload on",
    "SearchSpace(offload_optimizer=False)": "--offload off",
    "SearchSpace(offload_activations=True)": "--offload on",
    "SearchSpace(checkpointing=True)": "no --no-checkpointing",
    "SearchSpace(checkpointing=False)": "--no-checkpointing",
    "SearchSpace(selective_checkpointing=False)": "--no-selective-checkpointing",
    "SearchSpace(compile_blocks=True)": "--compile-blocks",
    "SearchSpace(blocks=[...])": "--blocks NAME,NAME",
    "SearchSpace.precisions": "--precisions",
    "SearchSpace.optimizers": "--optimizers",
    "SearchSpace.micro_batch_sizes": "--micro-batch-sizes",
    "global_batch_tokens": "--global-batch-tokens",
    "sequence_lengths": "--sequence-lengths",
    "global_batch_size": "--global-batch",
    "eval_batch_size": "--eval-batch",
    "max_tuning_s": "--max-tuning-time",
    "budget_gb": "--budget-gb",
    "budget_gb=24": "--budget-gb 24",
    "loss_fn": "--loss",
}
"""Each option by its Python spelling, as the command line's flag."""
