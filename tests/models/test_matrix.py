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
tests/test_tune.py tunes a GPT end to end in CI, and the trainers' tests Hugging Face
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
