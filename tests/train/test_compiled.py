"""Compiled blocks: what a compiled block holds is counted to the byte, and compiling a
block, alone or beneath a checkpoint, changes nothing it learns.

These compile with inductor's C++ backend (a few seconds per graph on a small CPU); the
blocks are small and every test compiles the same block class, whose code inductor
caches.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from counted_ops import CountedOps
from pointwise_chain import Block
from torch import nn

from autotune.errors import BlockError
from autotune.measure._tracker import CompiledBytesTracker
from autotune.train._checkpoint import apply_checkpointing, remove_checkpointing
from autotune.train._compiled import (
    compile_blocks,
    counted_allocations,
    is_compiled,
    uncompile_blocks,
)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(32, 1))


def storage_bytes(tensors: list[torch.Tensor], leave_out: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` that none of ``leave_out`` shares."""
    known = {t.untyped_storage().data_ptr() for t in leave_out}
    seen = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if t.untyped_storage().data_ptr() not in known
    }
    return sum(seen.values())


def grown_and_held(width: int) -> tuple[int, int]:
    """(live bytes the tracker saw a compiled block's forward add, the bytes of its output
    and saved tensors). Each width is a graph of its own, compiled here, untracked."""
    block = Block(width)
    compile_blocks(block, [""])
    x = torch.randn(4, 16, width, requires_grad=True)
    block(x).sum().backward()  # compiled here, its code loaded
    tracker = CompiledBytesTracker("cpu")
    tracker.track([*block.parameters(), x])
    with tracker:
        start = tracker.live
        y = block(x)
        grown = tracker.live - start
    assert type(y.grad_fn).__name__ == "CompiledFunctionBackward"  # it ran compiled
    saved = [t for t in y.grad_fn.saved_tensors if isinstance(t, torch.Tensor)]
    assert len(saved) >= 3
    return grown, storage_bytes([*saved, y], [*block.parameters(), x])


def test_the_tracker_counts_a_compiled_blocks_saved_activations_to_the_byte() -> None:
    """The forward of a compiled block leaves its output and what its compiled backward
    saved (read from the compiled autograd node): the tracker's live bytes grow by exactly
    their bytes, though the code was compiled before the tracker began."""
    grown, held = grown_and_held(48)
    assert grown == held > 0


def test_compiled_code_takes_the_counted_route_only_while_a_step_is_tracked() -> None:
    """Outside a tracked step compiled code allocates by inductor's fast path, code
    compiled during a tracked step included: no buffer goes through the dispatcher."""
    block = Block(56)
    compile_blocks(block, [""])
    x = torch.randn(4, 16, 56, requires_grad=True)
    with CompiledBytesTracker("cpu"):
        block(x).sum().backward()  # compiled and loaded while tracked
    counts = []
    for counted in (False, True, False):
        allocations = CountedOps(lambda op: op is torch.ops.aten.empty_strided.default)
        with counted_allocations() if counted else contextlib.nullcontext(), allocations as seen:
            block(x).sum().backward()
        counts.append(seen.count)
    assert counts[0] == counts[2] == 0 < counts[1]


def steps(work: nn.Module, n: int = 3) -> list[float]:
    """Losses of ``n`` SGD steps on a fixed batch."""
    torch.manual_seed(1)
    x, target = torch.randn(8, 16, 32), torch.randn(8, 16, 1)
    opt = torch.optim.SGD(work.parameters(), lr=0.1)
    losses = []
    for _ in range(n):
        loss = (work(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("checkpointed", [False, True])
def test_compiled_blocks_train_as_eager_ones(checkpointed: bool) -> None:
    """Compiled (and checkpointed over the compiled forward, which the recomputation runs
    again), the blocks' losses match the eager model's within fp32's rounding."""
    eager = model()
    plain = steps(copy.deepcopy(eager))
    work = copy.deepcopy(eager)
    compile_blocks(work, ["0", "1"])
    if checkpointed:
        apply_checkpointing(work, ["0", "1"])
    losses = steps(work)
    assert losses == pytest.approx(plain, rel=1e-5)
    assert losses[-1] < losses[0]  # it learned


def test_a_wrapped_block_is_not_compiled_and_compiling_is_undone() -> None:
    work = model()
    apply_checkpointing(work, ["0"])
    with pytest.raises(BlockError, match="compile the blocks first"):
        compile_blocks(work, ["1", "0"])
    assert not is_compiled(work[1])  # the error left every block as it was
    remove_checkpointing(work)
    with pytest.raises(BlockError, match="'9'"):
        compile_blocks(work, ["9"])
    compile_blocks(work, ["0"])
    with pytest.raises(BlockError, match="'0' is compiled, and selective checkpointing"):
        apply_checkpointing(work, ["1", "0"], selective=True)
    assert "_autotune_original_forward" not in vars(work[1])  # the error wrapped none
    compile_blocks(work, ["0", "1"])
    assert is_compiled(work[0]) and is_compiled(work[1]) and "forward" in vars(work[0])
    uncompile_blocks(work)
    assert not is_compiled(work[0]) and "forward" not in vars(work[0])
