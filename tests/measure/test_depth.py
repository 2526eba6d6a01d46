"""A deep model profiled on copies with 3 and 4 of its blocks, extended to its depth: the
same timelines, state and per-rank predictions as the profile of the whole model."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import pytest
import torch
from sweeps import sweep
from torch import nn

from autotune import TrainConfig
from autotune._blocks import find_blocks
from autotune._profile_data import Profile, TimeCurve
from autotune.config import Timeline
from autotune.cost._cost_model import CostModel
from autotune.cost._sharded import Layout
from autotune.measure._depth import deepen, deepen_time, shallow_copies
from autotune.measure._memory_profile import memory_profile
from autotune.measure._profiler import Profiler
from autotune.models import gpt_batch, tiny_gpt

CPU = torch.device("cpu")


def profiled(model: nn.Module, sample: Any, blocks: tuple[str, ...]) -> Profile:
    profiler = Profiler(model, sample, blocks, device=CPU, loss_fn=None)
    profile, _ = memory_profile(
        profiler,
        [Timeline("fp32"), Timeline("bf16")],
        ["adamw"],
        device_name="cpu",
        context_bytes=0,
        sharded=True,
    )
    return profile


def whole_and_deepened(model: nn.Module, sample: Any) -> tuple[Profile, Profile]:
    blocks = find_blocks(model)
    copies = shallow_copies(model, blocks)
    assert copies is not None
    (three, names3), (four, names4) = copies.copy(3), copies.copy(4)
    deep = deepen(profiled(three, sample, names3), profiled(four, sample, names4), model, blocks)
    return profiled(copy.deepcopy(model), sample, blocks), deep


def hf_models() -> list[tuple[nn.Module, Any]]:
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(96, (4, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    gpt2 = transformers.GPT2Config(n_layer=7, n_embd=32, n_head=2, vocab_size=96, n_positions=32)
    llama = transformers.LlamaConfig(
        num_hidden_layers=6,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return [
        (transformers.GPT2LMHeadModel(gpt2), batch),
        (transformers.LlamaForCausalLM(llama), batch),
    ]


@pytest.mark.parametrize("which", sweep(["gpt", "hf"], ["gpt"]))
def test_copies_of_3_and_4_blocks_give_the_whole_models_timelines(which: str) -> None:
    if which == "gpt":
        model = tiny_gpt(n_layer=6, n_embd=64, n_head=2, block_size=32, vocab_size=128)
        cases = [(model, gpt_batch(model.config, 4))]
    else:
        cases = hf_models()
    for model, sample in cases:
        whole, deep = whole_and_deepened(model, sample)
        assert deep.blocks == whole.blocks and deep.layout == whole.layout
        assert deep.optimizers["adamw"].state_bytes == whole.optimizers["adamw"].state_bytes
        for name in (Timeline("fp32"), Timeline("bf16")):
            for a, b in ((whole.precisions[name], deep.precisions[name]),
                         (whole.sharded[Timeline("bf16")], deep.sharded[Timeline("bf16")])):  # fmt: skip
                assert b.base_bytes == a.base_bytes
                assert [p.key for p in b.phases] == [p.key for p in a.phases]
                for x, y in zip(a.phases, b.phases, strict=True):
                    assert (x.block, x.grads) == (y.block, y.grads), x.key
                    for u, v in zip(x.delta + x.peak, y.delta + y.peak, strict=True):
                        assert u.const == pytest.approx(v.const, abs=2), x.key
                        assert u.slope == pytest.approx(v.slope, abs=2), x.key
        # So every per-rank prediction is the whole profile's.
        blocks = whole.blocks
        for parallel, world in (("none", 1), ("ddp", 2), ("fsdp", 2), ("fsdp", 4)):
            layout = Layout(parallel, world, ()) if world > 1 else None
            for precision in ("fp32", "bf16"):
                for checkpoint in ((), blocks[1:4], blocks):
                    config = TrainConfig(
                        micro_batch_size=6,
                        precision=precision,
                        checkpoint=checkpoint,
                        parallel=parallel,
                        world_size=world,
                    )
                    expected = CostModel(whole, layout).memory(config)[0]
                    got = CostModel(deep, layout).memory(config)[0]
                    assert got == pytest.approx(expected, rel=1e-4), config.describe()


def test_the_copies_leave_the_model_as_it_was_and_copy_no_dropped_block() -> None:
    model = tiny_gpt(n_layer=7, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copies = shallow_copies(model, find_blocks(model))
    assert copies is not None
    for (shallow, names), kept in zip(
        (copies.copy(3), copies.copy(4)), ((0, 1, 6), (0, 1, 2, 6)), strict=True
    ):
        assert names == tuple(f"blocks.{i}" for i in range(len(kept)))
        assert len(shallow.blocks) == len(kept)  # type: ignore[arg-type]
        for i, k in enumerate(kept):
            theirs = model.blocks[k].state_dict()
            for key, value in shallow.blocks[i].state_dict().items():  # type: ignore[index]
                assert torch.equal(value, theirs[key])
        outside = sum(p.numel() for n, p in model.named_parameters() if "blocks" not in n)
        per_block = sum(p.numel() for p in model.blocks[0].parameters())
        assert sum(p.numel() for p in shallow.parameters()) == outside + len(kept) * per_block
        assert shallow.head.weight is shallow.wte.weight  # tied weights stay tied
    assert len(model.blocks) == 7
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def stack(widths: list[int]) -> nn.Module:
    layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    return nn.Sequential(nn.Linear(8, widths[0]), nn.Sequential(*layers))


@pytest.mark.parametrize(
    ("model", "blocks"),
    [
        (stack([16] * 5), None),  # 4 blocks: copies of 3 and 4 would save nothing
        (stack([16] * 7 + [8]), None),  # the last layer has other shapes
        (stack([16] * 8), ("1.0", "1.1", "1.2", "1.3", "1.4", "1.5")),  # not all the layers
    ],
)
def test_blocks_that_are_not_uniform_layers_are_not_copied(
    model: nn.Module, blocks: tuple[str, ...] | None
) -> None:
    assert shallow_copies(model, blocks or find_blocks(model)) is None


def test_a_model_that_is_its_layers_is_copied_too() -> None:
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(8)))
    shallow = shallow_copies(model, find_blocks(model))
    assert shallow is not None
    copies = [shallow.copy(3), shallow.copy(4)]
    assert [names for _, names in copies] == [("0", "1", "2"), ("0", "1", "2", "3")]
    assert [len(m) for m, _ in copies] == [3, 4]  # type: ignore[arg-type]
    assert copies[1][0](torch.ones(2, 16)).shape == (2, 16)


def test_the_time_grows_by_a_middle_blocks_share_of_the_forward_per_block() -> None:
    """Blocks of 1, 2, 2 and 1 s in a 10 s forward: 8 blocks take 4 more middle ones,
    8 s more, 1.8x; checkpointing recomputes 14 s of blocks instead of 6."""
    model = tiny_gpt(n_layer=8, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    _, deep = whole_and_deepened(model, gpt_batch(model.config, 4))
    curve = TimeCurve((1, 4), (1.0, 2.0), (4,), (0.3,))
    timed = {p: dataclasses.replace(pp, time=curve) for p, pp in deep.precisions.items()}
    out = deepen_time(dataclasses.replace(deep, precisions=timed), (1.0, 2.0, 2.0, 1.0), 10.0)
    got = out.precisions[Timeline("fp32")].time
    assert got is not None
    assert got.seconds == pytest.approx((1.8, 3.6))
    assert got.ckpt_ratio == pytest.approx((0.3 * (14 / 6) / 1.8,))
    assert out.block_weights == pytest.approx((1 / 14, *(2 / 14,) * 6, 1 / 14))
