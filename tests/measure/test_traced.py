"""Memory profiles traced on fake tensors equal the real ones, byte for byte (issue 27)."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from sweeps import SWEEP, sweep

from autotune._blocks import find_blocks
from autotune._profile_data import profile_to_json
from autotune.config import Timeline, TrainConfig
from autotune.measure._fake import is_traced, traced
from autotune.measure._memory_profile import memory_profile
from autotune.measure._profiler import Profiler
from autotune.measure._tracker import LiveBytesTracker
from autotune.models import gpt_batch, tiny_gpt
from autotune.train import prepare

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

Built = tuple[torch.nn.Module, Any, Any]


def _memory(
    built: Built,
    precisions: tuple[str, ...],
    optimizers: tuple[str, ...],
    selective: bool = True,
    blocks: bool = True,
) -> Any:
    """The memory profile (every variant, selective too; of the model whole without
    ``blocks``) as JSON, times left out."""
    model, batch, loss_fn = built
    names = tuple(find_blocks(model)) if blocks else ()
    profiler = Profiler(model, batch, names, device=torch.device("cpu"), loss_fn=loss_fn)
    profile, _ = memory_profile(
        profiler,
        tuple(Timeline(p) for p in precisions),
        optimizers,
        device_name="cpu",
        context_bytes=0,
        selective=selective,
    )
    return _bytes_only(json.loads(profile_to_json(profile)))


def _bytes_only(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: _bytes_only(v)
            for k, v in value.items()
            if not (k.endswith("_s") or k in ("seconds", "time"))
        }
    if isinstance(value, list):
        return [_bytes_only(v) for v in value]
    return value


def _real_and_traced(
    build: Callable[[], Built],
    precisions: tuple[str, ...],
    optimizers: tuple[str, ...],
    selective: bool = True,
    blocks: bool = True,
) -> tuple[Any, Any]:
    real = _memory(build(), precisions, optimizers, selective, blocks)
    with traced():
        fake = _memory(build(), precisions, optimizers, selective, blocks)
    return real, fake


def _gpt() -> Built:
    torch.manual_seed(0)
    model = tiny_gpt(n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    return model, gpt_batch(model.config, 4), None


def _frozen_gpt() -> Built:
    model, batch, loss = _gpt()
    for p in (*model.blocks[0].parameters(), *model.wte.parameters()):
        p.requires_grad_(False)  # frozen: no gradient, no optimizer state
    return model, batch, loss


def test_a_traced_profile_is_the_real_one_byte_for_byte() -> None:
    real, fake = _real_and_traced(_gpt, ("fp32", "bf16"), ("adamw",))
    assert real["precisions"]["fp32"]["phases"]  # a timeline, not an empty record
    assert fake == real


def test_frozen_parameters_trace_as_they_run() -> None:
    real, fake = _real_and_traced(_frozen_gpt, ("fp32",), ("adamw",))
    assert fake == real
    every = sum(p.numel() * 4 for p in _gpt()[0].parameters())
    assert real["grad_bytes"] < every  # the frozen ones hold no gradient


@pytest.mark.parametrize(
    "name", sweep(["llama", "lora-llama", "bert", "resnet"], ["llama", "resnet"])
)
def test_hugging_face_models_trace_as_they_run(name: str) -> None:
    """With their attention masks: Hugging Face's helpers that read a mask read a real
    one of its shape under tracing, as they would a batch with nothing padded. BERT's
    LayerNorm and ResNet's BatchNorm keep float32 statistics of a bf16 input, which the
    fake kernels give bf16: counted as the real kernels keep them."""
    from zoo import BY_NAME

    case = BY_NAME[name]
    if missing := case.missing():
        pytest.skip(f"{name} needs {', '.join(missing)}")
    real, fake = _real_and_traced(case.build, ("bf16",), ("adamw",))
    assert fake == real


def _llama_311m() -> Built:
    """A LLaMA of 311M parameters (4 layers of width 2048, a 32k vocabulary, untied): few
    layers, so that its real profile costs CI half a minute, not five."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (4, 8))
    return model, {"input_ids": ids, "labels": ids}, None


@SWEEP  # a minute and a half of CI; benchmarks/traced.py --large checks more, larger
def test_a_300m_model_traces_as_it_runs() -> None:
    """Past 300M parameters, byte for byte: the model whole, fp32, SGD with momentum (one
    state a parameter). AdamW and checkpointing at this size would double or triple the
    real profile's minute of CI; the small models check them, and benchmarks/traced.py
    --large a 349M LLaMA and GPT-2 medium with all of it."""
    pytest.importorskip("transformers")
    real, fake = _real_and_traced(_llama_311m, ("fp32",), ("sgd",), selective=False, blocks=False)
    assert real["param_bytes"] >= 4 * 300e6  # fp32
    assert real["precisions"]["fp32"]["phases"] and fake == real


def test_a_fake_tensor_counts_under_the_device_it_stands_for() -> None:
    with traced():
        tracker = LiveBytesTracker("cpu")
        with tracker:
            x = torch.empty(1000, dtype=torch.float32)
            y = x * 2
        assert is_traced(y) and tracker.live == tracker.peak == 8000
        meta = LiveBytesTracker("meta")  # its storage is on meta, which holds nothing
        with meta:
            torch.empty(10)
        assert meta.peak == 0


def test_a_traced_model_trains_a_step_without_reading_a_value() -> None:
    """No move of the model (a fake one cannot be moved) and no non-finite check (it
    reads the gradients); the user's real models are unaffected."""
    with traced():
        model, batch, _ = _gpt()
        runner = prepare(model, TrainConfig(micro_batch_size=4), device="cpu")
        loss = runner.step(batch)
        assert is_traced(loss) and is_traced(next(model.parameters()))
    model, batch, _ = _gpt()
    work = copy.deepcopy(model)
    assert not is_traced(prepare(work, TrainConfig(micro_batch_size=4), device="cpu").step(batch))


def test_a_truncated_normal_initialisation_is_not_drawn_on_a_fake_tensor() -> None:
    """torch redraws until every value is within the bounds, which reads them (ViT and
    DeiT initialise so: they trace byte for byte in benchmarks/traced.py)."""
    with traced():
        weight = torch.nn.init.trunc_normal_(torch.empty(64, 64), std=0.02)
        assert is_traced(weight)
    real = torch.nn.init.trunc_normal_(torch.empty(64, 64), a=-0.01, b=0.01)
    assert real.abs().max() <= 0.01 and real.std() > 0  # drawn, as before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_grouped_matmul_traces_as_the_cpu_runs_it(dtype: torch.dtype) -> None:
    """Mixture-of-experts layers' ``_grouped_mm``: the meta kernel takes bf16 only (as
    CUDA's), the CPU's float32 too; traced, its output is the CPU's (shape, dtype, layout)."""
    tokens, experts = torch.randn(12, 16, dtype=dtype), torch.randn(3, 16, 8, dtype=dtype)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    real = torch._grouped_mm(tokens, experts, offs=offs)
    with traced() as mode:
        fake = torch._grouped_mm(*(mode.from_tensor(t) for t in (tokens, experts)),
                                 offs=mode.from_tensor(offs))  # fmt: skip
    assert is_traced(fake)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


def test_hugging_face_helpers_are_given_back() -> None:
    masks = pytest.importorskip("transformers.masking_utils")
    before = masks.find_packed_sequence_indices
    with traced():
        assert masks.find_packed_sequence_indices is not before
    assert masks.find_packed_sequence_indices is before
