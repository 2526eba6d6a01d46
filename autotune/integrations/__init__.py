"""Training as tuned inside the trainers people already use.

* ``transformers``: ``training_arguments(result, output_dir)`` and ``AutotuneCallback``
  for Hugging Face ``Trainer`` (``autotune[hf]``).
* ``lightning``: the ``Autotune`` callback, which tunes at fit start as Lightning's
  ``BatchSizeFinder`` does (``autotune[lightning]``).
* ``accelerate``: ``accelerator(result)``, an ``Accelerator`` set as tuned
  (``autotune[accelerate]``).
* ``_export``: the same settings as plain files (``autotune export``).
* ``hf_config``: ``causal_lm(config.json, seq_len)``, a Hugging Face model from its config
  alone and a sample batch, to plan without weights (``autotune plan --hf-config``).

Each trainer's module imports its trainer when it is imported, and nothing here is
imported by ``import autotune``.

The interface the other layers use is ``__all__``: the names imported below. The
modules behind them are private to the package (``tests/test_layout.py`` holds both).
"""

from __future__ import annotations

from autotune.integrations._export import TARGETS, export

__all__ = [
    "TARGETS",
    "export",
]
