"""Checkpointing changes nothing a model learns: gradients and buffers as without it, every
key/value cache off while training, and a block it cannot recompute named in a clear error."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autotune
from autotune import TrainConfig
from autotune.errors import BlockError


class ConvBlock(nn.Module):
    """A residual conv block with BatchNorm: its running statistics change as it runs."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.stats = nn.BatchNorm2d(channels, momentum=None)  # a cumulative mean: counts steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.stats(self.norm(self.conv(x))))


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), ConvBlock(8), ConvBlock(8), ConvBlock(8), nn.Flatten()
    )


def trained(model: nn.Module, config: TrainConfig, batch: object, steps: int = 2) -> nn.Module:
    """A copy of ``model`` after ``steps`` optimizer steps with ``config``."""
    work = copy.deepcopy(model)
    torch.manual_seed(1)
    loss_fn = lambda output, batch: output.pow(2).mean()  # noqa: E731
    with autotune.prepare(work, config, lr=1e-2, device="cpu", loss_fn=loss_fn) as runner:
        for _ in range(steps):
            runner.step(batch)
    return work


def test_checkpointed_batchnorm_updates_its_statistics_once() -> None:
    """Recomputed in backward, BatchNorm would update its running statistics twice."""
    model = convnet()
    batch = torch.randn(4, 3, 8, 8)
    blocks = autotune.find_blocks(model)
    assert blocks == ("1", "2", "3")
    plain = trained(model, TrainConfig(micro_batch_size=4), batch)
    # With accumulation, plain's statistics came from whole batches: compare with its twin.
    twin = trained(model, TrainConfig(micro_batch_size=2, grad_accum_steps=2), batch)
    for config in (
        TrainConfig(micro_batch_size=4, checkpoint=blocks),
        TrainConfig(micro_batch_size=2, grad_accum_steps=2, checkpoint=blocks[1:]),
        TrainConfig(micro_batch_size=4, selective_checkpoint=blocks),
        TrainConfig(
            micro_batch_size=2,
            grad_accum_steps=2,
            checkpoint=blocks[:1],
            selective_checkpoint=blocks[1:],
        ),
    ):
        work = trained(model, config, batch)
        if config.grad_accum_steps == 1:
            assert work.state_dict()["1.norm.num_batches_tracked"].item() == 2
        reference = plain if config.grad_accum_steps == 1 else twin
        for name, tensor in reference.state_dict().items():
            assert torch.equal(work.state_dict()[name], tensor), (config.describe(), name)
    assert work.get_submodule("1").forward.__func__ is ConvBlock.forward  # unwrapped on close


def test_checkpointed_eval_mode_batchnorm_is_left_alone() -> None:
    model = convnet().eval()  # running statistics are read, not written
    batch = torch.randn(2, 3, 8, 8)
    with autotune.apply(model, TrainConfig(checkpoint=("1", "2", "3"))) as handle:
        before = copy.deepcopy(model.state_dict())
        handle.backward(handle.model(batch).sum())
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


class Flaky(nn.Module):
    """A block whose forward depends on state it changes: its recomputation differs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.linear(x)
        return torch.tanh(y) if self.calls % 2 else y


def test_a_block_that_recomputes_differently_is_named_in_a_block_error() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Flaky(), Flaky())
    with autotune.apply(model, TrainConfig(checkpoint=("2",))) as handle:
        loss = handle.model(torch.randn(4, 8)).sum()
        with pytest.raises(BlockError, match=r"block '2' cannot be checkpointed") as caught:
            handle.backward(loss)
    assert "SearchSpace(blocks=[...])" in str(caught.value)


class Drifting(nn.Module):
    """A block whose recomputation runs an op its forward did not."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            x = x.sin()
        return torch.tanh(self.linear(x))


def test_a_selective_block_that_recomputes_other_ops_is_named_in_a_block_error() -> None:
    """Selective checkpointing finds no kept output for an op the forward never ran."""
    model = nn.Sequential(nn.Linear(8, 8), Drifting(), nn.Linear(8, 8))
    with autotune.apply(model, TrainConfig(selective_checkpoint=("1",))) as handle:
        loss = handle.model(torch.randn(4, 8)).sum()
        with pytest.raises(BlockError, match=r"block '1' cannot be checkpointed"):
            handle.backward(loss)


def test_selective_checkpointing_keeps_the_matrix_products_and_recomputes_the_rest() -> None:
    """Gradients as without checkpointing, fewer bytes held than keeping the block, more
    than checkpointing it, and the recomputation runs no matrix product again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotune.measure._tracker import LiveBytesTracker

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    width = 64
    model = nn.Sequential(
        nn.Linear(width, width),
        *(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                        nn.Linear(4 * width, width)) for _ in range(3)),
    )  # fmt: skip
    x = torch.randn(32, width)
    grads, held, backward_ops = {}, {}, {}
    for name, config in (
        ("kept", TrainConfig()),
        ("checkpointed", TrainConfig(checkpoint=("1", "2", "3"))),
        ("selective", TrainConfig(selective_checkpoint=("1", "2", "3"))),
    ):
        work = copy.deepcopy(model)
        with autotune.apply(work, config) as handle:
            tracker = LiveBytesTracker("cpu")
            with tracker:
                start = tracker.live
                loss = handle.model(x).square().mean()
                held[name] = tracker.live - start  # the activations saved for backward
            ops = Ops()
            with ops:
                handle.backward(loss)
            backward_ops[name] = ops.names
            grads[name] = [p.grad.clone() for p in work.parameters()]
    assert held["kept"] > held["selective"] > held["checkpointed"]
    for name in ("checkpointed", "selective"):
        assert all(torch.equal(a, b) for a, b in zip(grads["kept"], grads[name], strict=True))
    # Kept, the backward runs only the gradients' matrix products (mm); checkpointed, the
    # recomputation runs the forward's (addmm) again; selective, it finds them kept.
    assert "addmm" in backward_ops["checkpointed"]
    assert "addmm" not in backward_ops["selective"]
    for recomputed in ("native_layer_norm", "gelu"):  # the cheap ops run again
        assert recomputed in backward_ops["selective"]
        assert recomputed not in backward_ops["kept"]


def t5_like(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A tiny encoder-decoder whose decoder stack keeps a config of its own."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ids = torch.randint(1, 90, (4, 12))
    if name == "t5":
        config = transformers.T5Config(
            vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        return transformers.T5ForConditionalGeneration(config), {"input_ids": ids, "labels": ids}
    bert = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "intermediate_size": 37}  # fmt: skip
    model = transformers.EncoderDecoderModel(
        encoder=transformers.BertModel(transformers.BertConfig(**bert)),
        decoder=transformers.BertLMHeadModel(
            transformers.BertConfig(**bert, is_decoder=True, add_cross_attention=True)
        ),
    )
    model.config.decoder_start_token_id, model.config.pad_token_id = 1, 0
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("name", ["t5", "encoder-decoder"])
def test_an_encoder_decoder_checkpoints_with_its_gradients_unchanged(name: str) -> None:
    """The decoder stacks' own configs build a cache the recomputation would append to."""
    model, batch = t5_like(name)
    blocks = autotune.find_blocks(model)
    assert any(b.startswith("decoder.") for b in blocks)
    grads = {}
    configs = {
        "plain": TrainConfig(micro_batch_size=4),
        "checkpointed": TrainConfig(micro_batch_size=4, checkpoint=blocks),
        "selective": TrainConfig(micro_batch_size=4, selective_checkpoint=blocks),
    }
    for name, config in configs.items():
        work = copy.deepcopy(model)
        torch.manual_seed(1)  # the same dropout masks: checkpoint replays the RNG
        with autotune.apply(work, config) as handle:
            handle.backward(handle.model(**batch).loss)
            grads[name] = {
                n: p.grad.clone() for n, p in work.named_parameters() if p.grad is not None
            }
    plain = grads["plain"]
    for name in ("checkpointed", "selective"):
        assert plain.keys() == grads[name].keys()
        assert all(torch.equal(grads[name][n], g) for n, g in plain.items()), name


def test_every_cache_in_the_model_is_off_while_applied_and_back_on_undo() -> None:
    model, _ = t5_like("encoder-decoder")
    configs = [model.config.encoder, model.config.decoder, model.decoder.config]
    configs = [c for c in configs if c.use_cache]
    assert configs  # the decoder's own config caches by default
    with autotune.apply(model, TrainConfig()):
        assert not any(c.use_cache for c in configs)
    assert all(c.use_cache for c in configs)


class MovingAverage(nn.Module):
    """Reads a running average, then updates it (a VQ codebook's or a normalizer's way);
    its other buffer is a table created under inference mode (no version counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("average", torch.ones(8))
        with torch.inference_mode():
            self.register_buffer("table", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor, cache: dict[str, float] | None = None) -> torch.Tensor:
        y = self.linear(x) + self.average + self.table * (cache or {}).get("scale", 1.0)
        with torch.no_grad():
            self.average.mul_(0.9).add_(0.1 * y.mean(0))
        return y


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MovingAverage(), MovingAverage()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, cache={"scale": 3.0})  # a block's own argument, not a kv cache
        return x


def test_the_recomputation_reads_the_buffers_as_the_forward_did() -> None:
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 8)
    results = []
    layers = ("layers.0", "layers.1")
    for config in (
        TrainConfig(),
        TrainConfig(checkpoint=layers),
        TrainConfig(selective_checkpoint=layers),
    ):
        work = copy.deepcopy(model)
        with autotune.apply(work, config) as handle:
            handle.backward(handle.model(x).square().sum())
            results.append(([p.grad.clone() for p in work.parameters()], work.state_dict()))
    (plain, plain_state), *wrapped = results
    for checkpointed, state in wrapped:
        assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed, strict=True))
        assert all(torch.equal(state[k], v) for k, v in plain_state.items())
