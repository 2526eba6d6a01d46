"""Training exactly as tuned: what runs for days in a user's job.

* ``_prepare``: ``prepare()`` and ``apply()``, a model and a config made into a
  ``Runner`` (``_runner``) or an ``Applied`` handle (``_applied``) for any loop;
  ``_fallback``: the handle's fallback ladder (``Ladder``, owned by the handle, which
  switches its own config mid-training).
* ``_checkpoint``, ``_selective``: checkpointed and offloaded blocks;
  ``_offload_activations`` and ``_offload_optimizer``: offload to host memory;
  ``_compiled``: compiled blocks.
* ``_parallel``: DDP and FSDP2 as a config says, and the process group's helpers.
* ``_optimizers``, ``_batch``, ``_loss``, ``_steps``, ``_lengths``, ``_sampler``:
  optimizers by name, batches of any structure, the calling convention and the loss, the
  optimizer step's pieces, sequence lengths and the length-bucketing sampler.
* ``_attention``, ``_hf_checkpointing``, ``_kv_cache``, ``_quantized``: what a Hugging
  Face or quantized model needs set for training.
* ``_workload``: what one training step runs, as the profiler and verifier take it;
  ``_identity``: a model's fingerprint, and what differs from where a result was tuned.

The interface the other layers use is the table below (see :mod:`autotune._interface`);
each name loads its module on first use.

This layer imports neither optuna nor ``autotune.measure``; tests check it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune._interface import interface

if TYPE_CHECKING:
    from autotune.train._applied import Applied
    from autotune.train._attention import set_attention
    from autotune.train._batch import batch_size, bytes_per_sample, map_tensors, resize, tensors_on
    from autotune.train._batch_layout import layouts_of_model
    from autotune.train._checkpoint import (
        apply_checkpointing,
        apply_offloading,
        remove_checkpointing,
    )
    from autotune.train._compiled import compiled_parts, measured_compiling
    from autotune.train._identity import differences, fingerprint
    from autotune.train._lengths import sequence_length, truncate
    from autotune.train._loss import LossFn, call_model, compute_loss, describe_call, raised_in
    from autotune.train._optimizers import (
        OptimizerFactory,
        available,
        build_optimizer,
        factory_name,
        fused_runs,
        not_at_hand,
    )
    from autotune.train._parallel import (
        agree_max,
        broadcast,
        collective,
        gathered_tensors,
        group_size,
        rank,
        rank_zero,
    )
    from autotune.train._prepare import apply, prepare
    from autotune.train._quantized import copy_model, one_per_storage, quantization_state
    from autotune.train._runner import Runner
    from autotune.train._steps import check_finite
    from autotune.train._workload import Workload

INTERFACE = {
    "Applied": "autotune.train._applied",
    "LossFn": "autotune.train._loss",
    "OptimizerFactory": "autotune.train._optimizers",
    "Runner": "autotune.train._runner",
    "Workload": "autotune.train._workload",
    "agree_max": "autotune.train._parallel",
    "apply": "autotune.train._prepare",
    "apply_checkpointing": "autotune.train._checkpoint",
    "apply_offloading": "autotune.train._checkpoint",
    "available": "autotune.train._optimizers",
    "batch_size": "autotune.train._batch",
    "broadcast": "autotune.train._parallel",
    "build_optimizer": "autotune.train._optimizers",
    "bytes_per_sample": "autotune.train._batch",
    "call_model": "autotune.train._loss",
    "check_finite": "autotune.train._steps",
    "collective": "autotune.train._parallel",
    "compiled_parts": "autotune.train._compiled",
    "compute_loss": "autotune.train._loss",
    "copy_model": "autotune.train._quantized",
    "describe_call": "autotune.train._loss",
    "differences": "autotune.train._identity",
    "factory_name": "autotune.train._optimizers",
    "fingerprint": "autotune.train._identity",
    "fused_runs": "autotune.train._optimizers",
    "gathered_tensors": "autotune.train._parallel",
    "group_size": "autotune.train._parallel",
    "layouts_of_model": "autotune.train._batch_layout",
    "map_tensors": "autotune.train._batch",
    "measured_compiling": "autotune.train._compiled",
    "not_at_hand": "autotune.train._optimizers",
    "one_per_storage": "autotune.train._quantized",
    "prepare": "autotune.train._prepare",
    "quantization_state": "autotune.train._quantized",
    "raised_in": "autotune.train._loss",
    "rank": "autotune.train._parallel",
    "rank_zero": "autotune.train._parallel",
    "remove_checkpointing": "autotune.train._checkpoint",
    "resize": "autotune.train._batch",
    "sequence_length": "autotune.train._lengths",
    "set_attention": "autotune.train._attention",
    "tensors_on": "autotune.train._batch",
    "truncate": "autotune.train._lengths",
}
"""What the other layers may import from here, by the private module that defines it."""

__all__ = [
    "Applied",
    "LossFn",
    "OptimizerFactory",
    "Runner",
    "Workload",
    "agree_max",
    "apply",
    "apply_checkpointing",
    "apply_offloading",
    "available",
    "batch_size",
    "broadcast",
    "build_optimizer",
    "bytes_per_sample",
    "call_model",
    "check_finite",
    "collective",
    "compiled_parts",
    "compute_loss",
    "copy_model",
    "describe_call",
    "differences",
    "factory_name",
    "fingerprint",
    "fused_runs",
    "gathered_tensors",
    "group_size",
    "layouts_of_model",
    "map_tensors",
    "measured_compiling",
    "not_at_hand",
    "one_per_storage",
    "prepare",
    "quantization_state",
    "raised_in",
    "rank",
    "rank_zero",
    "remove_checkpointing",
    "resize",
    "sequence_length",
    "set_attention",
    "tensors_on",
    "truncate",
]

__getattr__, __dir__ = interface(__name__, INTERFACE)
