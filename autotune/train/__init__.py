"""Training exactly as tuned: what runs for days in a user's job.

* ``_prepare``: ``prepare()``, a model and a config made into a ``Runner`` (``_runner``).
* ``_checkpoint``: checkpointed and offloaded blocks; ``_offload_activations`` and
  ``_offload_optimizer``: offload to host memory; ``_host``: that memory's bookkeeping.
* ``_optimizers``, ``_batch``, ``_loss``: optimizers by name, batches of any structure,
  the calling convention and the loss.

This layer imports neither optuna nor ``autotune.measure``; tests check it.
"""
