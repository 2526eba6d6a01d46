"""QLoRA as a first-class case: a Llama whose base is quantized by bitsandbytes (4-bit NF4
or 8-bit), prepared by peft's ``prepare_model_for_kbit_training`` and trained through
LoRA adapters, as a QLoRA user builds it (``from_pretrained`` with a
``BitsAndBytesConfig``, on the CPU backend of bitsandbytes).

The quantized weights (``Params4bit``, ``Int8Params``) and the tensors that dequantize
them (a 4-bit weight's ``quant_state``, an 8-bit layer's row scales), which are neither
parameters nor buffers, count exactly; the gradient checkpointing of every layer that
``prepare_model_for_kbit_training`` turns on gives way to the tuned mask; the peak is
predicted within 1% of the measured one; the user's model is left as it was.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from sweeps import sweep
from torch import nn

import autotune
from autotune import SearchSpace, TrainConfig, TuneResult
from autotune.errors import AutotuneWarning
from autotune.measure._memory_profile import working_copy
from autotune.measure._parameters import parameter_bytes
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import state_tensors
from autotune.verify._verifier import Verifier

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bitsandbytes = pytest.importorskip("bitsandbytes")

CPU = torch.device("cpu")
BLOCKS = tuple(f"base_model.model.model.layers.{i}" for i in range(4))
"""The decoder layers of the peft-wrapped Llama: the blocks."""


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved where ``from_pretrained`` quantizes it on loading."""
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def qlora(base: Path, bits: int = 4, *, double_quant: bool = False) -> nn.Module:
    """A QLoRA model as its users build it: quantized on loading, prepared, adapted."""
    if bits == 4:
        quantization = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=double_quant,
        )
    else:
        quantization = transformers.BitsAndBytesConfig(load_in_8bit=True)
    with warnings.catch_warnings():  # peft calls transformers' deprecated names
        warnings.simplefilter("ignore", FutureWarning)
        model = transformers.LlamaForCausalLM.from_pretrained(
            base, quantization_config=quantization, device_map="cpu"
        )
        model = peft.prepare_model_for_kbit_training(model)
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return peft.get_peft_model(model, lora)


def batch(n: int = 4) -> dict[str, torch.Tensor]:
    ids = torch.randint(128, (n, 32), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}  # one tensor, as causal LM users pass it


def quantization_bytes(model: nn.Module) -> int:
    """The bytes of every tensor that dequantizes a weight, read from bitsandbytes'
    attributes: a 4-bit weight's quant state (nested with double quantization), an
    8-bit layer's row scales (on the weight before its first forward, then on its state)."""
    storages: dict[int, torch.UntypedStorage] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        while state is not None:
            for t in (state.absmax, state.code, state.offset):
                if isinstance(t, torch.Tensor):
                    storages[id(t.untyped_storage())] = t.untyped_storage()
            state = getattr(state, "state2", None)  # the nested state has none
        for owner in (weight, getattr(module, "state", None)):
            scales = getattr(owner, "SCB", None)
            if isinstance(scales, torch.Tensor):
                storages[id(scales.untyped_storage())] = scales.untyped_storage()
    return sum(s.nbytes() for s in storages.values())


def held_bytes(model: nn.Module) -> int:
    """What the model holds: parameter and buffer storages and the quantization state."""
    tensors = [*model.parameters(), *model.buffers()]
    storages = {id(t.untyped_storage()): t.untyped_storage() for t in tensors}
    return sum(s.nbytes() for s in storages.values()) + quantization_bytes(model)


def quantized(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if type(p) is not nn.Parameter]


def hf_checkpointing(model: nn.Module) -> list[bool]:
    return [
        m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")
    ]


def measured_peak(model: nn.Module, sample: Any, config: TrainConfig) -> int:
    """The peak of ``config`` as verification measures it, on the tuner's copy."""
    verifier = Verifier(
        working_copy(model, CPU),
        sample,
        device=CPU,
        budget_bytes=2**40,
        loss_fn=None,
        blocks=BLOCKS,
    )
    measured, error = verifier.trial(config)
    assert error is None and measured is not None
    return measured.peak_bytes


def test_the_blocks_are_the_decoder_layers_of_the_quantized_base(base: Path) -> None:
    for bits in (4, 8):
        assert autotune.find_blocks(qlora(base, bits)) == BLOCKS


@pytest.mark.parametrize(("bits", "double_quant"), [(4, False), (4, True), (8, False)])
def test_quantized_weights_and_their_state_count_exactly(
    base: Path, bits: int, double_quant: bool
) -> None:
    model = qlora(base, bits, double_quant=double_quant)
    with torch.no_grad():  # an 8-bit layer moves its scales to its state in its first forward
        model(**batch(1))
    assert quantized(model) and quantization_bytes(model) > 0
    # every storage the model holds is state the tracker counts, and only those
    tracked = {id(t.untyped_storage()): t.untyped_storage() for t in state_tensors(model)}
    assert sum(s.nbytes() for s in tracked.values()) == held_bytes(model)
    every, trainable = parameter_bytes(model)
    frozen = sum(t.untyped_storage().nbytes() for t in quantized(model))
    assert every == held_bytes(model) - sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert frozen + quantization_bytes(model) < every
    assert trainable == sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    # the tuner's copy holds what the model holds: bitsandbytes' Params4bit deep-copies
    # its quant state apart from its layer's, which the copy links back
    work = working_copy(model, CPU)
    assert held_bytes(work) == held_bytes(model)
    for layer in work.modules():
        if isinstance(layer, bitsandbytes.nn.Linear4bit):
            assert layer.quant_state is layer.weight.quant_state
            assert layer.weight.module is layer


@pytest.mark.slow
@pytest.mark.parametrize("bits", sweep([4, 8], [4]))
def test_the_peak_is_predicted_within_1_percent(base: Path, bits: int) -> None:
    model = qlora(base, bits)
    sample = batch()
    peaks = {}
    for checkpoint in ((), BLOCKS):
        config = TrainConfig(
            micro_batch_size=2, grad_accum_steps=2, precision="bf16", checkpoint=checkpoint
        )
        predicted, parts = autotune.estimate(model, sample, config, device="cpu")
        measured = measured_peak(model, sample, config)
        assert predicted == pytest.approx(measured, rel=0.01), (checkpoint, predicted, measured)
        assert parts.parameters == parameter_bytes(model)[0]
        assert parts.other >= 0  # the batch and the buffers, not a negative remainder
        peaks[len(checkpoint)] = measured
    # the tuned mask decides what recomputes, not the model's own checkpointing of every
    # layer (prepare_model_for_kbit_training turned it on)
    assert peaks[len(BLOCKS)] < 0.8 * peaks[0]
    assert all(hf_checkpointing(model))  # the user's model keeps its own setting


@pytest.mark.slow
def test_an_offloaded_optimizer_keeps_master_weights_of_the_adapters_only(base: Path) -> None:
    model = qlora(base)
    sample = batch()
    config = TrainConfig(
        micro_batch_size=2, grad_accum_steps=2, precision="bf16", offload_optimizer=True
    )
    predicted, _ = autotune.estimate(model, sample, config, device="cpu")
    assert predicted == pytest.approx(measured_peak(model, sample, config), rel=0.01)


def snapshot(model: nn.Module) -> dict[str, Any]:
    """What tuning must leave as it was."""
    return {
        "params": {
            n: (type(p), p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()
        },
        "quant": [
            (m.weight.quant_state, m.weight.quant_state.absmax.clone(), m.weight.module, m)
            for m in model.modules()
            if isinstance(m, bitsandbytes.nn.Linear4bit)
        ],
        "checkpointing": hf_checkpointing(model),
        "use_cache": model.config.use_cache,
        "training": model.training,
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
    }


def assert_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert after["params"].keys() == before["params"].keys()
    for name, (kind, value, grad) in before["params"].items():
        now = after["params"][name]
        assert now[0] is kind and torch.equal(now[1], value) and now[2] is grad, name
    assert before["quant"]
    for (state, absmax, owner, layer), (state2, absmax2, owner2, _) in zip(
        before["quant"], after["quant"], strict=True
    ):
        assert state2 is state and torch.equal(absmax2, absmax) and owner2 is owner is layer
    for key in ("checkpointing", "use_cache", "training", "hooks"):
        assert after[key] == before[key], key
    assert all(p.grad is None for p in model.parameters())


@pytest.fixture(scope="module")
def tuned(base: Path) -> tuple[nn.Module, TuneResult, dict[str, Any]]:
    """A QLoRA Llama tuned under a budget between its least and its largest peak."""
    model = qlora(base)
    before = snapshot(model)
    space = SearchSpace(
        micro_batch_sizes=[1, 2, 4, 8], precisions=["bf16"], optimizers=["adamw8bit", "adamw"]
    )
    result = autotune.autotune(
        model, batch(), 0.0012, global_batch_size=8, space=space, device="cpu"
    )
    return model, result, before


@pytest.mark.slow
def test_a_qlora_llama_is_tuned_with_its_peak_predicted_within_1_percent(
    tuned: tuple[nn.Module, TuneResult, dict[str, Any]], tmp_path: Path
) -> None:
    model, result, before = tuned
    assert result.measured is not None and result.measured.peak_bytes <= result.budget_bytes
    assert result.predicted.peak_bytes == pytest.approx(result.measured.peak_bytes, rel=0.01)
    for trial in result.trials:
        if trial.measured is not None:
            assert trial.predicted.peak_bytes == pytest.approx(
                trial.measured.peak_bytes, rel=0.01
            ), trial.config.describe()
    assert result.breakdown.parameters == parameter_bytes(model)[0]
    assert result.model.blocks == BLOCKS
    assert_unchanged(model, before)
    # the result reads back (a negative "other" once made it unreadable) and trains the model
    result.save(tmp_path / "tuned.yaml")
    loaded = autotune.load(tmp_path / "tuned.yaml")
    assert loaded.config == result.config
    work = working_copy(model, CPU)
    sample = batch(8)
    with autotune.prepare(work, loaded, device="cpu") as runner:
        assert not any(hf_checkpointing(work))  # the tuned mask, not every layer
        runner.step(sample)  # allocates the optimizer state
        with measure_peak(
            CPU, existing=[*state_tensors(work, runner.optimizer), sample["input_ids"]]
        ) as reading:
            runner.step(sample)
    assert reading.peak_bytes <= result.budget_bytes
    assert reading.peak_bytes == pytest.approx(result.predicted.peak_bytes, rel=0.01)


def test_paged_optimizers_are_their_unpaged_twins_off_cuda(base: Path) -> None:
    from autotune.train._optimizers import build_optimizer
    from autotune.tuning._options import TuneOptions
    from autotune.tuning._problem import make_problem

    model = qlora(base)
    for paged, twin in (("paged_adamw8bit", "AdamW8bit"), ("paged_adamw", "AdamW32bit")):
        assert TrainConfig(optimizer=paged).optimizer == paged
        params = [p for p in model.parameters() if p.requires_grad]
        assert type(build_optimizer(paged, params, 1e-3)).__name__ == twin
    space = SearchSpace(optimizers=["paged_adamw8bit", "adamw8bit", "paged_adamw"])
    with pytest.warns(AutotuneWarning, match="paged_adamw8bit as adamw8bit"):
        problem = make_problem(
            model, batch(), TuneOptions(budget_gb=1.0, device="cpu", space=space)
        )
    # paged_adamw's twin, AdamW, is searched as the CPU's fused AdamW
    assert problem.space.optimizers == ("adamw8bit", "adamw_fused")


@pytest.mark.slow  # the tuned fixture
@pytest.mark.parametrize(
    ("optimizer", "optim"),
    [
        ("adamw8bit", "adamw_bnb_8bit"),
        ("paged_adamw8bit", "paged_adamw_8bit"),
        ("paged_adamw", "paged_adamw_32bit"),
    ],
)
def test_the_optim_names_qlora_users_set(
    tuned: tuple[nn.Module, TuneResult, dict[str, Any]],
    tmp_path: Path,
    optimizer: str,
    optim: str,
) -> None:
    from autotune.integrations.transformers import _check_args, training_arguments

    _, result, _ = tuned
    result = dataclasses.replace(result, config=result.config.replace(optimizer=optimizer))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = training_arguments(result, str(tmp_path))
    assert args.optim == optim  # a real TrainingArguments took the name
    assert args.weight_decay == 0.01
    # the user's own names: paged or not, the same states pass; other states warn
    same = {
        "adamw8bit": ("adamw_8bit", "paged_adamw_8bit"),
        "paged_adamw8bit": ("adamw_bnb_8bit", "adamw_8bit"),
        "paged_adamw": ("adamw_torch",),
    }[optimizer]
    for name in same:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _check_args(dataclasses.replace(args, optim=name), result)
    with pytest.warns(AutotuneWarning, match="optim='sgd'"):
        _check_args(dataclasses.replace(args, optim="sgd"), result)


@pytest.mark.slow
def test_the_trainer_trains_a_qlora_llama_as_tuned(
    tuned: tuple[nn.Module, TuneResult, dict[str, Any]], tmp_path: Path
) -> None:
    from autotune.integrations.transformers import AutotuneCallback, training_arguments

    model, result, _ = tuned
    work = working_copy(model, CPU)
    rows = [{"input_ids": ids, "labels": ids} for ids in batch(8)["input_ids"]]
    args = training_arguments(
        result, str(tmp_path), max_steps=2, report_to=[], save_strategy="no", disable_tqdm=True
    )
    during: list[list[bool]] = []

    class Probe(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, model: nn.Module, **kwargs: Any) -> None:
            during.append(hf_checkpointing(model))

    trainer = transformers.Trainer(
        model=work, args=args, train_dataset=rows, callbacks=[AutotuneCallback(result), Probe()]
    )
    with measure_peak(CPU, existing=state_tensors(work), budget_bytes=result.budget_bytes) as r:
        trainer.train()
    assert trainer.state.global_step == 2
    assert during and not any(any(flags) for flags in during)  # the tuned mask ran
    assert all(hf_checkpointing(work))  # and the model's own setting is back
    # the Trainer's step clips gradients (max_grad_norm 1): a little above the runner's
    assert r.peak_bytes == pytest.approx(result.predicted.peak_bytes, rel=0.03)
