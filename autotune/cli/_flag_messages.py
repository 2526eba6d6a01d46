"""Messages in the command line's words: the flags, not the Python keywords.

The library's errors and warnings name what a Python caller passes (``budget_gb``,
``SearchSpace(optimizers=[...])``); on the command line the same advice names the flag.
"""

from __future__ import annotations

__all__ = ["cli_words"]

_WORDS: tuple[tuple[str, str], ...] = (  # longest first: the generic names come last
    (
        "loss_fn=lambda output, batch: ...",
        "--loss FILE.py:NAME (NAME(output, batch) a function in a file of yours)",
    ),
    ("SearchSpace(optimizers=['adamw', 'adamw8bit'])", "--optimizers adamw,adamw8bit"),
    ("optimizer=<that function> (or its import path as a string)", "--optimizer MODULE:FACTORY"),
    ("SearchSpace(offload_optimizer=True)", "--offload on"),
    ("SearchSpace(offload_activations=True)", "--offload on"),
    ("SearchSpace(checkpointing=True)", "no --no-checkpointing"),
    ("SearchSpace.precisions", "--precisions"),
    ("SearchSpace.optimizers", "--optimizers"),
    ("SearchSpace.micro_batch_sizes", "--micro-batch-sizes"),
    ("SearchSpace.blocks", "--blocks"),
    ("SearchSpace(blocks=[...])", "--blocks NAME,NAME"),
    ("global_batch_tokens", "--global-batch-tokens"),
    ("sequence_lengths", "--sequence-lengths"),
    ("global_batch_size", "--global-batch"),
    ("eval_batch_size", "--eval-batch"),
    ("budget_gb", "--budget-gb"),
    ("n_trials", "--trials"),
    ("timeout_s", "--timeout"),
    ("pass loss_fn", "pass --loss"),
    ("loss_fn", "--loss"),
)


def cli_words(message: str) -> str:
    """``message`` with each Python keyword of the API replaced by its command-line flag."""
    for python, flag in _WORDS:
        message = message.replace(python, flag)
    return message
