"""SearchSpace: what the tuner may turn, validated with messages that say what to pass."""

from __future__ import annotations

import pytest

from autotune import ConfigError, SearchSpace


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precisions": ()}, "SearchSpace.precisions must be a non-empty list"),
        ({"precisions": ("fp8",)}, "from fp32, bf16, fp16; got \\['fp8'\\]"),
        ({"optimizers": ("lion",)}, "each of SearchSpace.optimizers must be one of"),
        ({"micro_batch_sizes": (4, 0)}, "micro_batch_sizes must be positive integers"),
        ({"micro_batch_sizes": (True,)}, "micro_batch_sizes must be positive integers"),
        ({"micro_batch_sizes": ()}, "micro_batch_sizes must be positive integers"),
        ({"offload_optimizer": "yes"}, "offload_optimizer must be True, False or None"),
        ({"offload_activations": 1.5}, "offload_activations must be True, False or None"),
        ({"max_micro_batch_size": 0}, "max_micro_batch_size must be at least 1"),
        ({"selective_checkpointing": "no"}, "selective_checkpointing must be True or False"),
        ({"checkpointing": None}, "checkpointing must be True or False"),
    ],
)
def test_bad_spaces_are_clear_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SearchSpace(**kwargs)  # type: ignore[arg-type]


def test_lists_become_tuples_and_sizes_are_sorted_once() -> None:
    space = SearchSpace(
        precisions=["bf16"],
        blocks=["a", "b"],
        micro_batch_sizes=[8, 2, 8, 4],  # type: ignore[arg-type]
    )
    assert space.precisions == ("bf16",) and space.blocks == ("a", "b")
    assert space.micro_batch_sizes == (2, 4, 8)
    hash(space)  # frozen and hashable: it keys kept studies


@pytest.mark.parametrize(("device", "expected"), [("cuda", (True, True)), ("cpu", (False, False))])
def test_offload_defaults_follow_the_device(device: str, expected: tuple[bool, bool]) -> None:
    assert SearchSpace().offloads(device) == expected
    assert SearchSpace(offload_optimizer=True).offloads("cpu")[0] is True
    assert SearchSpace(offload_activations=False).offloads("cuda")[1] is False
