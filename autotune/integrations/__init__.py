"""Training as tuned inside the trainers people already use.

* ``transformers``: ``training_arguments(result, output_dir)`` and ``AutotuneCallback``
  for Hugging Face ``Trainer`` (``autotune[hf]``).
* ``lightning``: the ``Autotune`` callback, which tunes at fit start as Lightning's
  ``BatchSizeFinder`` does (``autotune[lightning]``).
* ``accelerate``: ``accelerator(result)``, an ``Accelerator`` set as tuned
  (``autotune[accelerate]``).
* ``_export``: the same settings as plain files (``autotune export``).

Each module imports its trainer when it is imported, and nothing here is imported by
``import autotune``.
"""
