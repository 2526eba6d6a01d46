"""The compatibility matrix: autotune on over 60 real architectures built from tiny random configs.

Each case (``zoo.CASES``) is one test running every check of ``matrix_checks``: the blocks
``find_blocks`` returns, checkpointed, offloaded and bf16 training steps equal to the plain
ones (gradients, losses and buffers bit for bit) and ``estimate``. A failure lists every
check that failed for the case, not only the first. CI runs one case of each kind of
architecture (``REPRESENTATIVE``); ``python -m pytest -m sweep`` runs the rest. Two cases
are also tuned end to end with ``-m sweep``. ``python benchmarks/matrix.py`` prints the same checks as a table, and
with ``--tuned`` tunes every case marked ``tuned``.
"""

from __future__ import annotations

from typing import Any

import pytest
from matrix_checks import run_case, tuned_end_to_end
from sweeps import sweep
from zoo import BY_NAME, CASES, Case

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


REPRESENTATIVE = (
    "gpt2", "llama", "mixtral", "mamba", "jamba", "lora-llama", "distilbert", "t5",
    "whisper", "clip", "vit", "resnet", "timm-vit-tiny",
)  # fmt: skip
"""One case of each kind of architecture (decoder, mixture of experts, state space,
hybrid, adapters, encoder, encoder-decoder, audio, two towers, vision, timm), run by
CI; every case runs with ``-m sweep`` and in ``python benchmarks/matrix.py``."""


@pytest.mark.parametrize("name", sweep([case.name for case in CASES], REPRESENTATIVE))
def test_case(name: str) -> None:
    outcome = run_case(case_or_skip(name))
    if outcome.problems:
        pytest.fail(outcome.report(), pytrace=False)


TUNED_HERE = ["gpt2", "resnet"]
"""Of the cases marked ``tuned``, a decoder and a BatchNorm vision model (``-m sweep``;
tests/tuning/test_tune.py tunes a GPT end to end in CI, and the trainers' tests Hugging Face
models); every one is tuned by ``python benchmarks/matrix.py --tuned`` (10 minutes on a
2-core VM)."""


@pytest.mark.slow
@pytest.mark.parametrize("name", sweep(TUNED_HERE, []))
def test_tuned_end_to_end(name: str) -> None:
    """The winner fits, as predicted, and the user's model is left as it was (see
    :func:`matrix_checks.tuned_end_to_end`)."""
    case = case_or_skip(name)
    assert case.tuned
    assert tuned_end_to_end(case) == []


LEAST = ["gpt2", "t5", "vit", "resnet", "mamba"]
"""A decoder, an encoder-decoder, a vision transformer, a BatchNorm CNN and a state-space
model: the least budget each tunes in (CI: the decoder and the CNN; ``-m sweep``: all)."""


@pytest.mark.slow
@pytest.mark.parametrize("name", sweep(LEAST, ["gpt2", "resnet"]))
def test_the_least_budget_said_is_refused_below_and_tunes_above(name: str) -> None:
    """A budget too small says the least that tunes, over every setting the search could
    choose (the global batch whole as well as accumulated): 1% under it is refused with
    the same figure, 1% over it tunes, within it."""
    import autotune
    from autotune._format import format_bytes

    model, batch, loss_fn = case_or_skip(name).build()
    space = autotune.SearchSpace(precisions=("fp32",), selective_checkpointing=False)
    common: dict[str, Any] = {
        "loss_fn": loss_fn, "device": "cpu", "global_batch_size": 8, "space": space,
    }  # fmt: skip
    with pytest.raises(autotune.BudgetTooSmallError) as tiny:
        autotune.autotune(model, batch, 2**-20, **common)
    least = tiny.value.minimum_bytes
    assert tiny.value.peak_bytes < least and format_bytes(least) in str(tiny.value)
    with pytest.raises(autotune.BudgetTooSmallError) as under:
        autotune.autotune(model, batch, 0.99 * least / 2**30, **common)
    assert under.value.minimum_bytes == least
    result = autotune.autotune(model, batch, 1.01 * least / 2**30, n_trials=8, **common)
    assert result.measured.peak_bytes <= result.budget_bytes
