"""The data parallelism of a tuned result in other tools' words: the ``torchrun`` command
line, accelerate's DDP or FSDP2 settings, and DeepSpeed's ZeRO-3.

FSDP2 as tuned is every block a unit, resharded after forward unless the result keeps it
gathered, bf16 as ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, and the
optimizer on the host as ``CPUOffloadPolicy``. What another tool cannot say exactly is a
warning, as for the other knobs.
"""

from __future__ import annotations

from typing import Any

from autotune.errors import ConfigError
from autotune.integrations._export_file import Export, origin
from autotune.result import TuneResult

__all__ = ["accelerate_parallel", "deepspeed_parallel", "launch_warnings", "to_torchrun"]


def _torchrun_command(result: TuneResult, path: str) -> tuple[dict[str, Any], list[str]]:
    """The ``torchrun`` launch of ``result``, read from ``path`` (its settings and what the
    script must do)."""
    c = result.config
    command = f"torchrun --nproc-per-node {c.world_size} train.py"
    notes = [
        f"train.py: torch.distributed.init_process_group() (nccl on GPUs, gloo on CPUs), "
        f"then runner = autotune.prepare(model, autotune.load({path!r})) and "
        f"runner.step(batch) with {c.effective_batch_size} samples per rank and step "
        f"(a DistributedSampler; global batch {c.global_batch_size})",
        "several machines: add --nnodes, --node-rank and --rdzv-endpoint; the ranks in all "
        f"must add up to {c.world_size}, the world size it was tuned for",
    ]
    return {"nproc_per_node": c.world_size, "command": command}, notes


def accelerate_parallel(result: TuneResult, settings: dict[str, Any]) -> list[str]:
    """Turn ``settings`` (an accelerate config) into the result's DDP or FSDP2; warnings."""
    c = result.config
    cpu = result.target.device.split(":")[0] == "cpu"
    settings["num_processes"] = c.world_size
    if c.parallel == "ddp":
        settings["distributed_type"] = "MULTI_CPU" if cpu else "MULTI_GPU"
        return []
    settings["distributed_type"] = "FSDP"
    classes = result.model.block_classes
    fsdp: dict[str, Any] = {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": ",".join(classes) or "BLOCK_CLASS",
        "fsdp_reshard_after_forward": set(c.keep_gathered) != set(result.model.blocks),
        "fsdp_offload_params": c.offload_optimizer,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_activation_checkpointing": bool(c.checkpoint or c.selective_checkpoint),
    }
    settings["fsdp_config"] = fsdp
    warnings = []
    if not classes:
        warnings.append(
            "fsdp_transformer_layer_cls_to_wrap: put the class name of the blocks "
            f"({', '.join(result.model.blocks)}) in place of BLOCK_CLASS."
        )
    if c.keep_gathered and set(c.keep_gathered) != set(result.model.blocks):
        warnings.append(
            f"keep_gathered ({', '.join(c.keep_gathered)}): accelerate reshards every unit "
            "or none; this file reshards every unit (less memory than tuned, an all-gather "
            "more): autotune.prepare(model, result) keeps exactly these gathered."
        )
    if c.selective_checkpoint:
        warnings.append(
            f"selective_checkpoint ({', '.join(c.selective_checkpoint)}): accelerate's "
            "fsdp_activation_checkpointing recomputes whole units; autotune recomputes only "
            "these blocks' cheap ops: autotune.prepare(model, result) does exactly that."
        )
    ckpt = c.checkpoint
    if ckpt and set(ckpt) != set(result.model.blocks):
        warnings.append(
            f"checkpoint: accelerate's fsdp_activation_checkpointing covers every unit; "
            f"autotune checkpoints {len(ckpt)} of {len(result.model.blocks)} ({', '.join(ckpt)})"
            ": less memory than tuned and slower."
        )
    return warnings


def deepspeed_parallel(result: TuneResult, settings: dict[str, Any]) -> list[str]:
    """Turn ``settings`` (a DeepSpeed config) into ZeRO-3 (FSDP) or plain data
    parallelism (DDP) over the world size; warnings."""
    c = result.config
    settings["train_batch_size"] = c.global_batch_size
    if c.parallel == "ddp":
        return []
    zero: dict[str, Any] = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
    }
    if c.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    settings["zero_optimization"] = zero
    warnings = [
        "ZeRO-3 is not FSDP2: its prefetch, bucket and persistence settings "
        "(stage3_prefetch_bucket_size, stage3_param_persistence_threshold, "
        "stage3_max_live_parameters) hold other buffers than the per-rank peak autotune "
        "measured; check the peak with the first steps of the run."
    ]
    if c.keep_gathered:
        warnings.append(
            f"keep_gathered ({', '.join(c.keep_gathered)}): ZeRO-3 has no per-unit "
            "resharding; stage3_max_reuse_distance keeps recently used parameters gathered."
        )
    return warnings


def launch_warnings(result: TuneResult, tool: str) -> list[str]:
    """What a trainer's settings file leaves to the launch: the ranks and the sharding."""
    c = result.config
    if c.parallel == "none":
        return []
    out = [
        f"parallel {c.parallel} over {c.world_size} ranks: launch {c.world_size} processes "
        f"(autotune export --to torchrun); the batch settings here are per rank."
    ]
    if c.parallel == "fsdp":
        how = {
            "hf": "TrainingArguments(fsdp='full_shard', fsdp_config={'fsdp_version': 2, "
            "'reshard_after_forward': ...}) or export --to accelerate",
            "lightning": "Trainer(strategy=ModelParallelStrategy()) with fully_shard on each "
            "block in configure_model(); Lightning's 'fsdp' strategy is FSDP1",
        }[tool]
        out.append(f"fsdp: this file does not shard; {how}.")
    return out


def to_torchrun(result: TuneResult, path: str = "tuned.yaml") -> Export:
    """The ``torchrun`` command line of a data-parallel result, saved at ``path``."""
    if result.config.parallel == "none":
        raise ConfigError(
            "this result trains on one process; torchrun is for a result tuned with "
            "world_size (under torchrun, or planned with --world-size)."
        )
    settings, notes = _torchrun_command(result, path)
    return Export("torchrun", settings, (), (*origin(result, "torchrun command"), *notes))
