"""Training exactly as tuned: what runs for days in a user's job.

* ``_prepare``: ``prepare()`` and ``apply()``, a model and a config made into a
  ``Runner`` (``_runner``) or an ``Applied`` handle (``_applied``) for any loop;
  ``_fallback``: the handle's fallback ladder (``Ladder``, owned by the handle, which
  switches its own config mid-training).
* ``_checkpoint``: checkpointed (whole or selectively) and offloaded blocks (and Hugging
  Face's own checkpointing turned off); ``_offload_activations`` and
  ``_offload_optimizer``: offload to host memory; ``_compiled``: compiled blocks, the
  recompiles dynamo gave up on, and the tuner's compiled code handed to the job.
* ``_parallel``: DDP and FSDP2 as a config says, and the process group's helpers.
* ``_optimizers``, ``_batch``, ``_loss``, ``_steps``, ``_lengths``, ``_sampler``:
  optimizers by name, batches of any structure, the calling convention and the loss, the
  optimizer step's pieces, sequence lengths and the length-bucketing sampler.
* ``_attention``, ``_quantized``: what a Hugging Face or quantized model needs set for
  training (its attention, its KV cache off, a quantized layer's state).
* ``_runner``: the ``Runner``, and the ``Workload``, what one training step runs, as the
  profiler and verifier take it; ``_identity``: a model's fingerprint, and what differs
  from where a result was tuned.

The interface the other layers use is ``__all__``: the names imported below. The
modules behind them are private to the package (``tests/test_layout.py`` holds both).
"""

from __future__ import annotations

from autotune.train._applied import Applied
from autotune.train._attention import set_attention
from autotune.train._batch import (
    batch_size,
    bytes_per_sample,
    counted_tokens,
    map_tensors,
    resize,
    split,
    step_batch,
    tensors_on,
    widest_bytes,
    widest_first,
)
from autotune.train._batch_layout import layouts_of_model
from autotune.train._checkpoint import (
    apply_checkpointing,
    apply_offloading,
    copying_buffers,
    remove_checkpointing,
)
from autotune.train._chunked_loss import chunked_loss, why_not_chunked
from autotune.train._compiled import (
    compile_artifacts,
    compiled_parts,
    counted_allocations,
    load_compile_cache,
    measured_compiling,
)
from autotune.train._compiled_model import any_batch_size
from autotune.train._fallback import snapshot, written_buffers
from autotune.train._identity import differences, fingerprint, refuse_another_model
from autotune.train._lengths import sequence_length, truncate
from autotune.train._loss import (
    LossFn,
    LossMean,
    call_model,
    check_loss_mean,
    compute_loss,
    describe_call,
    own_mean,
    raised_in,
)
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
    following_gathered,
    group_size,
    rank,
    rank_zero,
)
from autotune.train._prepare import apply, prepare
from autotune.train._quantized import copy_model, one_per_storage, quantization_state
from autotune.train._runner import Runner, Workload
from autotune.train._steps import LoopRefusals, check_finite

__all__ = [
    "Applied",
    "LoopRefusals",
    "LossFn",
    "LossMean",
    "OptimizerFactory",
    "Runner",
    "Workload",
    "agree_max",
    "any_batch_size",
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
    "check_loss_mean",
    "chunked_loss",
    "collective",
    "compile_artifacts",
    "compiled_parts",
    "compute_loss",
    "copy_model",
    "copying_buffers",
    "counted_allocations",
    "counted_tokens",
    "describe_call",
    "differences",
    "factory_name",
    "fingerprint",
    "following_gathered",
    "fused_runs",
    "group_size",
    "layouts_of_model",
    "load_compile_cache",
    "map_tensors",
    "measured_compiling",
    "not_at_hand",
    "one_per_storage",
    "own_mean",
    "prepare",
    "quantization_state",
    "raised_in",
    "rank",
    "rank_zero",
    "refuse_another_model",
    "remove_checkpointing",
    "resize",
    "sequence_length",
    "set_attention",
    "snapshot",
    "split",
    "step_batch",
    "tensors_on",
    "truncate",
    "why_not_chunked",
    "widest_bytes",
    "widest_first",
    "written_buffers",
]
