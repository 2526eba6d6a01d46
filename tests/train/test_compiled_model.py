"""The model compiled whole with its loss (``compile_model``): one graph a micro-batch,
nothing recompiled after the first step, and a runner step that costs what the bare
compiled loop an expert writes costs, in ops dispatched and in memory.

Counted, not timed: what a GPU waits on (a launch, a guard, a sync) is what a CPU hides.
The model is the integration tests' GPT-2 at their micro-batch (``tests/tiny_gpt2.py``),
so that inductor compiles its graph once for both (its cache is on disk).
"""

from __future__ import annotations

import copy

import pytest
import torch
from counted_ops import CountedOps
from tiny_gpt2 import MICRO, SEQ, VOCAB, gpt2, padded_rows
from torch import nn
from torch._dynamo.utils import counters

import autotune
from autotune import TrainConfig
from autotune.measure._tracker import CompiledBytesTracker, state_tensors
from autotune.train._compiled import measured_compiling


def batch(n: int = 2 * MICRO, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _bare_loss(model: nn.Module, chunk: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**chunk).loss


def bare_step(model: nn.Module, compiled: object, optimizer: torch.optim.Optimizer) -> None:
    """nanoGPT's step without its clipping: compiled forward and loss per micro-batch, the
    loss over the accumulation, one fused AdamW step, the gradients freed."""
    for chunk in ({k: v[i : i + MICRO] for k, v in batch().items()} for i in (0, MICRO)):
        (compiled(model, chunk) / 2).backward()  # type: ignore[operator]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def peak(step: object, *state: object) -> int:
    tracker = CompiledBytesTracker("cpu")
    tracker.track(state_tensors(*state))
    with tracker:
        step()  # type: ignore[operator]
    return tracker.peak


def test_the_runner_step_is_the_bare_compiled_loops_step() -> None:
    """Through the runner, the model and its loss are one graph per micro-batch, compiled
    once: later steps compile nothing. A step dispatches the bare loop's ops and a few of
    its own, none per block, holds no more memory beyond their few bytes, and learns what
    the eager model learns."""
    config = TrainConfig(
        micro_batch_size=MICRO, grad_accum_steps=2, optimizer="adamw_fused", compile_model=True
    )
    eager = gpt2()
    with autotune.prepare(eager, config.replace(compile_model=False), lr=1e-3) as runner:
        expected = [runner.step(batch()).item() for _ in range(3)]
    with measured_compiling(), autotune.prepare(gpt2(), config, lr=1e-3) as runner:
        graphs = counters["stats"]["unique_graphs"]
        losses = [runner.step(batch()).item()]
        assert counters["stats"]["unique_graphs"] == graphs + 1  # forward and loss: one graph
        assert not counters["graph_break"]
        with CountedOps() as ours:
            losses.append(runner.step(batch()).item())
        losses.append(runner.step(batch()).item())
        assert counters["stats"]["unique_graphs"] == graphs + 1  # nothing compiled again
        ours_peak = peak(lambda: runner.step(batch()), runner.model, runner.optimizer)
    assert losses == pytest.approx(expected, rel=1e-5)

    model = gpt2()
    model.config.use_cache = False  # a training loop's (a cache is for generating)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    compiled = torch.compile(_bare_loss, dynamic=False)
    bare_step(model, compiled, optimizer)
    with CountedOps() as bare:
        bare_step(model, compiled, optimizer)
    bare_peak = peak(lambda: bare_step(model, compiled, optimizer), model, optimizer)
    # The runner's own: the device's finiteness flag and its copy to the host (8 ops a
    # step), the running loss (2 a micro-batch), the label tokens that weigh a micro-batch
    # (4 a micro-batch, on the host's labels); nothing per block.
    assert ours.count <= bare.count + 8 + 2 * 2 + 4 * 2
    assert ours_peak <= bare_peak + 64  # the flag's and the running loss's bytes at most
    assert not any("forward" in vars(m) for m in model.modules())


def test_blocks_checkpointed_inside_the_graph_recompute_as_eager_ones() -> None:
    """A checkpointed block recomputes inside the compiled graph: same losses, less
    memory held through the backward than with every block kept."""
    blocks = autotune.find_blocks(gpt2())
    config = TrainConfig(micro_batch_size=MICRO, optimizer="adamw_fused", compile_model=True)
    peaks, losses = [], []
    for checkpoint in ((), blocks):
        model = gpt2()
        with (
            measured_compiling(),
            autotune.prepare(model, config.replace(checkpoint=checkpoint), lr=1e-3) as runner,
        ):
            losses.append([runner.step(batch(MICRO)).item() for _ in range(2)])
            peaks.append(peak(lambda: runner.step(batch(MICRO)), runner.model, runner.optimizer))
        assert not any("forward" in vars(m) for m in model.modules())  # given back
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert peaks[1] < peaks[0]


def test_a_block_that_updates_running_statistics_is_refused_inside_the_graph() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))
    config = TrainConfig(micro_batch_size=4, compile_model=True, checkpoint=("1",))
    with pytest.raises(autotune.BlockError, match="updates running statistics"):
        autotune.prepare(copy.deepcopy(model), config, loss_fn=lambda out, b: out.mean())


def test_the_chunked_loss_compiled_with_the_model_steps_as_one_plain_batch() -> None:
    """The chunked loss inside the model's graph (``compile_model`` with ``chunked_loss``,
    timelines the tuner searches): an SGD step over 8 padded rows of 3 to 32 label tokens
    in micro-batches of 4 is one plain PyTorch step of the 8 rows, through the runner and
    through ``apply()`` in a loop that takes ``model(**batch).loss`` over the step's
    tokens as Hugging Face's Trainer does (``num_items_in_batch``), the logits never
    made whole; the model's forward given back."""
    rows, model = padded_rows(), gpt2()
    reference = copy.deepcopy(model)
    reference(**rows).loss.backward()
    update = torch.cat([-p.grad.flatten() for p in reference.parameters()])  # SGD at lr 1

    def error(work: nn.Module) -> float:
        pairs = zip(work.parameters(), model.parameters(), strict=True)
        moved = torch.cat([(a - b).detach().flatten() for a, b in pairs])
        return float((moved - update).norm() / update.norm())

    config = TrainConfig(
        micro_batch_size=MICRO, grad_accum_steps=2, optimizer="sgd", compile_model=True,
        chunked_loss=True,
    )  # fmt: skip
    work = copy.deepcopy(model)
    with measured_compiling(), autotune.prepare(work, config, lr=1.0, device="cpu") as runner:
        runner.step(rows)
    assert error(work) <= 1e-5
    work = copy.deepcopy(model)
    tokens = (rows["labels"][:, 1:] != -100).sum()  # the step's, the Trainer's count
    with measured_compiling(), autotune.apply(work, config, lr=1.0, device="cpu") as handle:
        graphs = counters["stats"]["unique_graphs"]
        optimizer = torch.optim.SGD(work.parameters(), lr=1.0)
        for chunk, _ in handle.micro_batches(rows):
            output = work(**chunk, num_items_in_batch=tokens)
            assert output.logits is None
            output.loss.backward()
        optimizer.step()
        assert counters["stats"]["unique_graphs"] == graphs + 1  # the compiled chunked loss
    assert error(work) <= 1e-5
    assert not any("forward" in vars(m) for m in work.modules())


def test_a_stream_of_lengths_compiles_two_graphs_and_no_step_runs_eagerly() -> None:
    """A padding collator's stream: 10 widths, more than dynamo's 8 graphs. The first
    compiles the static graph the tuner measures, the second one graph of symbolic
    lengths for every width after it; nothing reaches the recompile limit. Where a limit
    is reached all the same, code runs eagerly and the runner says so, once."""
    widths = [32, 24, 17, 30, 9, 28, 13, 21, 11, 26]

    def rows(width: int) -> dict[str, torch.Tensor]:
        ids = batch()["input_ids"][:, :width]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    config = TrainConfig(micro_batch_size=MICRO, grad_accum_steps=2, compile_model=True)
    torch._dynamo.reset()  # the dynamic graph of an earlier test's stream
    with autotune.prepare(gpt2(), config, lr=1e-3) as runner:
        graphs = counters["stats"]["unique_graphs"]
        for width in widths:
            runner.step(rows(width))  # an AutotuneWarning would fail the test
        assert counters["stats"]["unique_graphs"] - graphs <= 2
        # Code dynamo must compile a graph per shape of (here a static function of the
        # loop's own) reaches the limit: the steps after it say so, once.
        doubled = torch.compile(lambda x: 2 * x, dynamic=False)
        with torch._dynamo.config.patch(recompile_limit=1):
            for n in (1, 2, 3):
                doubled(torch.ones(n))
            with pytest.warns(autotune.AutotuneWarning, match="recompile limit .* eagerly"):
                runner.step(rows(widths[0]))
            doubled(torch.ones(4))
            runner.step(rows(widths[1]))  # said once
