"""The compatibility matrix: autotune on over 60 real architectures built from tiny random configs.

Each case (``zoo.CASES``) is one test running every check of ``matrix_checks``: the blocks
``find_blocks`` returns, checkpointed, offloaded and bf16 training steps equal to the plain
ones (gradients, losses and buffers bit for bit) and ``estimate``. A failure lists every
check that failed for the case, not only the first. A few cases per family are also tuned
end to end (marked slow). ``python benchmarks/matrix.py`` prints the same checks as a table.
"""

from __future__ import annotations

import pytest
import torch
from matrix_checks import MICRO, run_case
from zoo import BY_NAME, CASES, Case

import autotune

pytestmark = [
    # Importing diffusers imports torch._inductor, whose torch/utils/mkldnn.py still uses
    # ``torch.jit.script_method``, deprecated by torch itself. As an error it would fail
    # that import inside diffusers' guarded optional imports, silently changing diffusers.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


def case_or_skip(name: str) -> Case:
    """The case, skipped where a package it builds with is not installed (timm,
    torchvision, diffusers and peft are in the test extra, not the package's needs)."""
    case = BY_NAME[name]
    if missing := case.missing():
        pytest.skip(f"{name} needs {', '.join(missing)}")
    return case


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_case(name: str) -> None:
    outcome = run_case(case_or_skip(name))
    if outcome.problems:
        pytest.fail(outcome.report(), pytrace=False)


TUNED = [case.name for case in CASES if case.tuned]


@pytest.mark.slow
@pytest.mark.parametrize("name", TUNED)
def test_tuned_end_to_end(name: str) -> None:
    """Tuned at a budget halfway between the peaks with no block and with every block
    checkpointed (micro-batch 4, accumulation 2: gradients live beside the second
    micro-batch's activations, as in every accumulating config the search weighs): the
    winner fits, as predicted, and the user's model is left as it was."""
    model, batch, loss_fn = case_or_skip(name).build()
    blocks = autotune.find_blocks(model)
    common = {"loss_fn": loss_fn, "device": "cpu"}
    plain = autotune.TrainConfig(micro_batch_size=MICRO, grad_accum_steps=2)
    kept, _ = autotune.estimate(model, batch, plain, **common)
    ckpt, _ = autotune.estimate(model, batch, plain.replace(checkpoint=blocks), **common)
    assert ckpt < kept, (ckpt, kept)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = autotune.autotune(
        model,
        batch,
        (kept + ckpt) / 2 / 2**30,
        global_batch_size=8,
        space=autotune.SearchSpace(micro_batch_sizes=(2, 4, 8)),
        n_trials=20,
        **common,
    )
    measured, predicted = result.measured.peak_bytes, result.predicted.peak_bytes
    assert measured <= result.budget_bytes, result.config.describe()
    assert abs(measured - predicted) <= 0.03 * measured, (measured, predicted)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
