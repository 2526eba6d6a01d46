"""CUDA paths, run for real on a GPU (skipped without one; see conftest)."""

from __future__ import annotations

import copy
import dataclasses
import gc

import pytest
import torch

import autotune
from autotune._format import GIB
from autotune.device._backend import backend_for
from autotune.device._target import discover
from autotune.measure._peak import measure_peak
from autotune.models import gpt_batch, tiny_gpt
from autotune.tuning._estimate import estimate

pytestmark = pytest.mark.cuda
MIB = 2**20


def test_discover_reads_the_device() -> None:
    target = discover("cuda")
    assert target.device.type == "cuda"
    assert target.total_bytes > 1 * GIB
    assert 0 < target.context_bytes < 4 * GIB
    assert target.name


def test_measure_peak_counts_reserved_memory_and_context() -> None:
    device = torch.device("cuda")
    with measure_peak(device, context_bytes=123) as reading:
        x = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
        del x
    assert reading.peak_bytes >= 64 * MIB + 123


def test_budget_cap_raises_out_of_memory_by_type() -> None:
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    with pytest.raises(torch.OutOfMemoryError), measure_peak(device, budget_bytes=256 * MIB):
        torch.empty(512 * MIB, dtype=torch.uint8, device=device)
    # The cap is lifted afterwards.
    y = torch.empty(512 * MIB, dtype=torch.uint8, device=device)
    del y
    torch.cuda.empty_cache()


def test_checkpointing_on_cuda_trains_like_the_original() -> None:
    model = tiny_gpt(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=128)
    batch = gpt_batch(model.config, 8)
    losses = []
    for mask in ((), ("blocks.0", "blocks.1")):
        config = autotune.TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint=mask)
        runner = autotune.prepare(copy.deepcopy(model), config, device="cuda", lr=1e-3)
        losses.append([runner.step(batch).item() for _ in range(3)])
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_selective_checkpointing_on_cuda_trains_like_the_original(precision: str) -> None:
    """The GPU's attention and matmul kernels are kept, the rest recomputed: the same
    losses as keeping every block (bf16: to its precision)."""
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    model = tiny_gpt(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=128)
    batch = gpt_batch(model.config, 8)
    losses = []
    for selective in ((), ("blocks.0", "blocks.1")):
        config = autotune.TrainConfig(
            micro_batch_size=4, grad_accum_steps=2, precision=precision,
            selective_checkpoint=selective,
        )  # fmt: skip
        runner = autotune.prepare(copy.deepcopy(model), config, device="cuda", lr=1e-3)
        losses.append([runner.step(batch).item() for _ in range(3)])
    assert losses[0] == pytest.approx(losses[1], rel=1e-4 if precision == "fp32" else 1e-2)


def test_selective_checkpointing_is_predicted_on_cuda() -> None:
    """Its peak between keeping and checkpointing every block, and predicted from the
    profile within the CUDA target, beside a partial full-checkpoint mask."""
    model = tiny_gpt(n_layer=4, n_embd=256, n_head=4, block_size=256, vocab_size=1024)
    sample = gpt_batch(model.config, 8)
    blocks = tuple(f"blocks.{i}" for i in range(4))
    base = autotune.TrainConfig(micro_batch_size=8, precision="bf16")
    if not torch.cuda.is_bf16_supported():
        base = base.replace(precision="fp32")
    peaks = {}
    for name, config in (
        ("kept", base),
        ("selective", base.replace(selective_checkpoint=blocks)),
        ("checkpointed", base.replace(checkpoint=blocks)),
        ("mixed", base.replace(checkpoint=blocks[:1], selective_checkpoint=blocks[2:])),
    ):
        predicted, _ = estimate(model, sample, config, device="cuda")
        peaks[name] = measured = _cuda_peak(model, config)
        assert abs(predicted - measured) <= 0.08 * measured, (name, predicted, measured)
    assert peaks["kept"] > peaks["selective"] > peaks["checkpointed"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_on_cuda(precision: str) -> None:
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    model = tiny_gpt(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=128)
    runner = autotune.prepare(
        model, autotune.TrainConfig(micro_batch_size=8, precision=precision), device="cuda"
    )
    loss = runner.step(gpt_batch(model.config, 8))
    assert loss.device.type == "cuda" and torch.isfinite(loss)
    assert (runner.scaler is not None) == (precision == "fp16")


def test_autotune_on_cuda_fits_and_predicts() -> None:
    model = tiny_gpt(n_layer=4, n_embd=256, n_head=4, block_size=256, vocab_size=1024)
    sample = gpt_batch(model.config, 8)
    target = discover("cuda")
    budget = target.context_bytes + 512 * MIB
    result = autotune.autotune(model, sample, budget / GIB, global_batch_size=64, device="cuda")
    assert result.measured.peak_bytes <= result.budget_bytes
    assert result.config.effective_batch_size == 64
    err = abs(result.predicted.peak_bytes - result.measured.peak_bytes) / result.measured.peak_bytes
    assert err <= 0.08, (result.predicted, result.measured)
    assert next(model.parameters()).device.type == "cpu"  # the user's model stayed put


def test_budget_below_the_context_is_too_small() -> None:
    model = tiny_gpt(n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    with pytest.raises(autotune.BudgetTooSmallError):
        autotune.autotune(model, gpt_batch(model.config, 4), 0.01, device="cuda")


# --- offload ---------------------------------------------------------------------------


def _train(model: torch.nn.Module, config: autotune.TrainConfig, steps: int = 3):
    torch.manual_seed(0)
    work = copy.deepcopy(model)
    runner = autotune.prepare(work, config, device="cuda", lr=1e-3)
    batch = gpt_batch(work.config, config.effective_batch_size, seed=1)
    losses = [runner.step(batch).item() for _ in range(steps)]
    return losses, [p.detach().cpu() for p in work.parameters()]


@pytest.mark.parametrize(
    "config",
    [
        autotune.TrainConfig(micro_batch_size=4, grad_accum_steps=2, offload_optimizer=True),
        autotune.TrainConfig(micro_batch_size=8, offload_activations=("blocks.0", "blocks.1")),
        autotune.TrainConfig(
            micro_batch_size=4,
            grad_accum_steps=2,
            precision="bf16",
            offload_activations=("blocks.1",),
            offload_optimizer=True,
        ),
        # The host unscales fp16 gradients with a scale that has landed on the host.
        autotune.TrainConfig(micro_batch_size=8, precision="fp16", offload_optimizer=True),
    ],
    ids=lambda c: c.describe(),
)
def test_offload_on_cuda_trains_like_no_offload(config: autotune.TrainConfig) -> None:
    if config.precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    model = tiny_gpt(n_layer=2, n_embd=128, n_head=4, block_size=64, vocab_size=256)
    plain = config.replace(offload_optimizer=False, offload_activations=())
    losses, weights = _train(model, config)
    ref_losses, ref_weights = _train(model, plain)
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    # Not element by element: the host's AdamW and the GPU's round differently in the last
    # bit, and where a gradient is rounding noise (the key bias's is zero in exact
    # arithmetic) Adam scales that bit to a step of ``lr``; in bf16 and fp16 a last-bit
    # weight change also rounds the low-precision copy differently. Measured on an H200
    # (2026-11-26): two plain runs identical; offload against plain 8e-6 (fp32), 6.8e-3
    # (bf16), 4.9e-3 (fp16) of the distance the weights moved. A lost or doubled update
    # of three is 0.3 or more.
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    tuned = torch.cat([w.flatten() for w in weights])
    ref = torch.cat([w.flatten() for w in ref_weights])
    assert (tuned - ref).norm() <= 5e-2 * (ref - start).norm()


def _held_outside_the_model() -> tuple[int, int]:
    """The CUDA context (after a training step has loaded cuBLAS and its kernels) and
    what earlier tests' tensors still reserve: what autotune counts beside a model."""
    gc.collect()
    torch.cuda.empty_cache()
    warm = tiny_gpt(n_layer=1, n_embd=64, n_head=2, block_size=32, vocab_size=128)
    autotune.prepare(warm, autotune.TrainConfig(micro_batch_size=2), device="cuda").step(
        gpt_batch(warm.config, 2)
    )
    del warm
    gc.collect()
    torch.cuda.empty_cache()
    backend = backend_for(torch.device("cuda", torch.cuda.current_device()))
    return backend.context_bytes(), backend.reserved()


def _cuda_peak(model: torch.nn.Module, config: autotune.TrainConfig) -> int:
    """The verified peak of ``config``, context included as in ``estimate``."""
    from autotune.verify._verifier import Verifier

    sample = gpt_batch(model.config, 4)
    context, foreign = _held_outside_the_model()
    verifier = Verifier(
        copy.deepcopy(model),
        sample,
        device=torch.device("cuda"),
        budget_bytes=64 * GIB,
        loss_fn=None,
        context_bytes=context,
        foreign_bytes=foreign,
    )
    measured, error = verifier.trial(config)
    assert error is None and measured is not None
    return measured.peak_bytes


def test_offload_frees_device_memory_on_cuda() -> None:
    model = tiny_gpt(n_layer=4, n_embd=512, n_head=8, block_size=256, vocab_size=1024)
    params = sum(p.numel() * 4 for p in model.parameters())
    base = autotune.TrainConfig(micro_batch_size=16)
    kept = _cuda_peak(model, base)
    host_opt = _cuda_peak(model, base.replace(offload_optimizer=True))
    assert kept - host_opt >= 1.5 * params  # AdamW's two states (and the gradients) left
    blocks = tuple(f"blocks.{i}" for i in range(4))
    host_acts = _cuda_peak(model, base.replace(offload_activations=blocks))
    assert host_acts < 0.9 * kept


def test_offload_is_predicted_on_cuda() -> None:
    model = tiny_gpt(n_layer=4, n_embd=256, n_head=4, block_size=256, vocab_size=1024)
    sample = gpt_batch(model.config, 8)
    for config in (
        autotune.TrainConfig(micro_batch_size=8, offload_optimizer=True),
        autotune.TrainConfig(micro_batch_size=8, offload_activations=("blocks.1", "blocks.2")),
    ):
        predicted, _ = estimate(model, sample, config, device="cuda")
        measured = _cuda_peak(model, config)
        assert abs(predicted - measured) <= 0.08 * measured, (
            config.describe(),
            predicted,
            measured,
        )


def test_bandwidth_probe_on_cuda() -> None:
    from autotune.measure._collectives import measure_transfer

    facts = measure_transfer(discover("cuda"))
    assert facts.d2h_bytes_per_s > 2e9 and facts.h2d_bytes_per_s > 2e9  # PCIe 3 x16 or better


def test_autotune_on_cuda_offloads_when_nothing_else_fits() -> None:
    model = tiny_gpt(n_layer=4, n_embd=512, n_head=8, block_size=128, vocab_size=1024)
    sample = gpt_batch(model.config, 8)
    params = sum(p.numel() * 4 for p in model.parameters())
    context, foreign = _held_outside_the_model()
    # Weights, gradients and 1.5 AdamW states: below weights + gradients + two states
    # (4 x params), above weights + gradients and the activations (offloaded optimizer).
    budget = context + foreign + int(3.5 * params)
    space = autotune.SearchSpace(compile_blocks=False)  # no compiler context beyond ours
    result = autotune.autotune(
        model, sample, budget / GIB, global_batch_size=16, device="cuda", space=space
    )
    assert result.config.offload_optimizer
    assert result.measured.peak_bytes <= result.budget_bytes


def test_a_step_on_cuda_reads_nothing_off_the_device_and_copies_its_batch_async() -> None:
    """A step with fused AdamW in bf16, its batch in pageable host memory: not one sync
    (torch's sync debug mode raises at the first), the batch pinned once for the step."""
    model = tiny_gpt()
    config = autotune.TrainConfig(
        micro_batch_size=4, grad_accum_steps=2, precision="bf16", optimizer="adamw_fused"
    )
    batch = gpt_batch(model.config, 8)
    with autotune.prepare(model, config, device="cuda") as runner:
        runner.step(batch)  # the optimizer's state made
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner.step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runner.check_steps()


@pytest.mark.parametrize("settings", ["", "expandable_segments:True"])
def test_a_recorded_step_replays_to_the_allocator_s_segments(settings: str, tmp_path) -> None:
    """The allocator's model, fed two training steps as recorded, ends with the segments
    the real allocator holds and its reserved peak (the setting changed at run time, as
    torch allows, the model told the same)."""
    from autotune.device._allocator_trace import read_trace, recording, replay, segment_of

    device = torch.device("cuda")
    torch.cuda.memory._set_allocator_settings(settings or "expandable_segments:False")
    try:
        model = tiny_gpt(n_layer=4, n_embd=256, n_head=4, block_size=128, vocab_size=512)
        runner = autotune.prepare(model, autotune.TrainConfig(micro_batch_size=8), device=device)
        batch = tuple(t.to(device) for t in gpt_batch(model.config, 8))
        runner.step(batch)
        path = tmp_path / "trace.json.gz"
        with recording(path, device):
            runner.step(batch)
            runner.step(batch)
        trace = read_trace(path)
        if settings:  # set at run time: the environment does not say it
            trace = dataclasses.replace(trace, settings=settings)
        model_end = replay(trace)
        assert model_end.snapshot() == sorted(segment_of(s) for s in trace.end)
        assert model_end.max_reserved == trace.max_reserved
        runner.close()
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        gc.collect()
        torch.cuda.empty_cache()
