"""TrainConfig validation and the YAML schema of TuneResult."""

from __future__ import annotations

import pytest

import autotune
from autotune._plain_data import config_from_dict
from autotune.config import TrainConfig
from autotune.errors import ConfigError
from autotune.result import Breakdown, Measurement, ModelInfo, TargetInfo, TrialRecord, TuneResult


def make_result(**changes: object) -> TuneResult:
    config = TrainConfig(
        micro_batch_size=4, grad_accum_steps=8, precision="bf16", checkpoint=("h.0", "h.1")
    )
    m = Measurement(peak_bytes=1000, step_s=0.5, samples_per_s=64.0)
    fields = dict(
        config=config,
        predicted=m,
        measured=Measurement(990, 0.52, 61.5),
        budget_bytes=2000,
        target=TargetInfo("cpu", "Test CPU", 10**10, "2.13.0"),
        model=ModelInfo("GPT", "abc123", 1_000_000, ("h.0", "h.1", "h.2")),
        breakdown=Breakdown(100, 100, 200, 500, 100),
        fallbacks=(config.replace(micro_batch_size=2, grad_accum_steps=16),),
        trials=(TrialRecord(config, m, None, "out of memory"),),
        tuning_s=12.5,
    )
    fields.update(changes)
    return TuneResult(**fields)  # type: ignore[arg-type]


def test_defaults_are_the_safe_baseline() -> None:
    c = TrainConfig()
    assert (c.micro_batch_size, c.grad_accum_steps, c.precision) == (1, 1, "fp32")
    assert c.checkpoint == () and c.offload_activations == ()
    assert c.optimizer == "adamw" and c.offload_optimizer is False
    assert TrainConfig(micro_batch_size=4, grad_accum_steps=8).effective_batch_size == 32


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size must be an integer from 1"),
        ({"grad_accum_steps": True}, "grad_accum_steps must be an integer from 1"),
        ({"precision": "fp8"}, "precision must be one of fp32, bf16, fp16"),
        ({"optimizer": "lion"}, "optimizer must be one of"),
        ({"checkpoint": "h.0"}, "checkpoint must be a list of block names"),
        ({"checkpoint": ("a",), "offload_activations": ("a",)}, "both checkpoint and offload"),
        (
            {"checkpoint": ("a", "b"), "selective_checkpoint": ("b",)},
            r"\['b'\] are in both checkpoint and selective_checkpoint",
        ),
        ({"selective_checkpoint": "h.0"}, "selective_checkpoint must be a list of block names"),
    ],
)
def test_invalid_knobs_say_what_is_wrong(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        TrainConfig(**kwargs)  # type: ignore[arg-type]


def test_lists_become_tuples_so_configs_hash() -> None:
    c = TrainConfig(checkpoint=["h.0"])  # type: ignore[arg-type]
    assert c.checkpoint == ("h.0",)
    assert hash(c) == hash(TrainConfig(checkpoint=("h.0",)))


def test_yaml_round_trip(tmp_path) -> None:
    result = make_result()
    path = result.save(tmp_path / "tuned.yaml")
    assert autotune.load(path) == result
    text = path.read_text()
    assert "effective_batch_size: 32" in text
    assert text.startswith("#")


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d["config"].update(batch=3), "unknown key 'config.batch'"),
        (lambda d: d.update(extra=1), "unknown key 'extra'"),
        (lambda d: d["config"].update(micro_batch_size="4"), "config.micro_batch_size must be int"),
        (lambda d: d["config"].update(checkpoint="h.0"), "config.checkpoint must be a list"),
        (lambda d: d["measured"].update(peak_bytes=1.5), "measured.peak_bytes must be int"),
        (
            lambda d: d["config"].update(offload_optimizer="yes"),
            "config.offload_optimizer must be bool",
        ),
        (lambda d: d.pop("budget_bytes"), "missing key 'budget_bytes'"),
        (lambda d: d["config"].update(effective_batch_size=31), "effective_batch_size is 31"),
        (lambda d: d["config"].update(precision="fp64"), "precision must be one of"),
        (
            lambda d: d["fallbacks"][0].update(grad_accum_steps=0),
            "grad_accum_steps must be an integer from 1",
        ),
    ],
)
def test_bad_yaml_names_the_key(tmp_path, edit, words: str) -> None:
    import yaml

    data = make_result().to_dict()
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=words):
        autotune.load(path)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("config: [unclosed", "not valid YAML"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("!!python/object:os.system {}", "not valid YAML"),
        ("", "the top level must be a mapping"),
    ],
)
def test_malformed_or_unsafe_yaml_is_rejected(tmp_path, text: str, words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        autotune.load(path)


def test_missing_file_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        autotune.load(tmp_path / "nope.yaml")


def test_config_from_dict_decodes_knobs() -> None:
    c = config_from_dict({"micro_batch_size": 2, "checkpoint": ["a"], "precision": "fp16"})
    assert c == TrainConfig(micro_batch_size=2, checkpoint=("a",), precision="fp16")
    with pytest.raises(ConfigError, match="unknown key 'micro'"):
        config_from_dict({"micro": 2})


LAUGHS = "\n".join(
    ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]" for i in range(8)]
    + ["config: *i"]
)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (LAUGHS, "aliases"),  # a billion strings once expanded, and once printed
        ("config: " + "[" * 5000 + "]" * 5000, "nested deeper than"),
        ("budget_bytes: " + "9" * 5000, "cannot read"),
    ],
    ids=["billion-laughs", "deep-nesting", "5000-digits"],
)
def test_hostile_yaml_is_a_short_config_error(tmp_path, text: str, words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as caught:
        autotune.load(path)
    assert len(str(caught.value)) < 400


def test_a_key_given_twice_is_refused_not_last_one_wins(tmp_path) -> None:
    path = make_result().save(tmp_path / "twice.yaml")
    text = path.read_text()
    assert text.count("  micro_batch_size:") >= 1
    path.write_text(
        text.replace("  micro_batch_size:", "  micro_batch_size: 3\n  micro_batch_size:", 1)
    )
    with pytest.raises(ConfigError, match=r"line \d+: key 'micro_batch_size' is given twice"):
        autotune.load(path)


def test_a_file_too_large_or_not_a_file_is_refused_at_once(tmp_path) -> None:
    import os
    import time

    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (16 * 2**20 - 100))  # under the 16 MiB once read: minutes
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"big.yaml is 16,384 KiB; .*at most 256 KiB read"):
        autotune.load(path)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opening it would wait for a writer for ever
    with pytest.raises(ConfigError, match=r"fifo\.yaml is not a regular file"):
        autotune.load(fifo)
    assert time.perf_counter() - started < 2


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d["config"].update(micro_batch_size=10**29), "micro_batch_size must be"),
        (lambda d: d.update(budget_bytes=-1), "budget_bytes must be between 0"),
        (lambda d: d["measured"].update(peak_bytes=-5), "measured.peak_bytes must be"),
        (lambda d: d["measured"].update(samples_per_s=float("nan")), "finite number"),
        (lambda d: d["predicted"].update(step_s=float("inf")), "finite number"),
        (lambda d: d["config"].update(precision="x" * 10**5), "precision must be one of"),
        (lambda d: d.update({"y" * 10**5: 1}), "unknown key"),
    ],
    ids=["huge-micro-batch", "negative-budget", "negative-peak", "nan", "inf", "huge-str", "key"],
)
def test_values_out_of_range_are_refused_in_a_short_line(tmp_path, edit, words: str) -> None:
    import yaml

    data = make_result().to_dict()
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=words) as caught:
        autotune.load(path)
    assert len(str(caught.value)) < 400
