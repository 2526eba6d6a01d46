"""Files autotune writes are whole or not at all, and where they go is checked first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import autotune
from autotune._files import check_writable, write_atomic
from autotune.cli import main
from autotune.errors import ConfigError

WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from autotune._files import write_atomic

    write = write_atomic if sys.argv[2] == "atomic" else Path.write_bytes
    print("ready", flush=True)
    for i in range(10**6):  # 32 MiB of one byte value, then of the next
        write(Path(sys.argv[1]), bytes([i % 256]) * (32 << 20))
    """
)
"""A process writing a large file over and over: the writer, or ``Path.write_bytes``."""


def killed_while_writing(target: Path, how: str, delays: tuple[float, ...]) -> list[str]:
    """What the file held after each SIGKILL of the writer: "whole" or what was wrong."""
    seen = []
    for delay in delays:
        process = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(target), how], stdout=subprocess.PIPE
        )
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait()
        process.stdout.close()
        data = target.read_bytes() if target.exists() else b""
        whole = len(data) == 32 << 20 and data.count(data[:1]) == len(data)
        seen.append("whole" if whole else f"{len(data)} bytes, mixed or short")
    return seen


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real result file (a tiny GPT tuned on CPU, a few seconds)."""
    from autotune.models import gpt_batch, tiny_gpt

    model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    result = autotune.autotune(
        model, gpt_batch(model.config, 4), 0.004, global_batch_size=8, device="cpu",
        space=autotune.SearchSpace(precisions=("fp32",), micro_batch_sizes=(2, 4)),
    )  # fmt: skip
    return result.save(tmp_path_factory.mktemp("result") / "tuned.yaml")


@pytest.mark.slow
def test_a_process_killed_while_writing_leaves_a_whole_file(tmp_path: Path) -> None:
    """SIGKILL at moments spread over repeated writes: the file is always one whole
    version, old or new; ``Path.write_bytes`` (what ``save`` used) leaves it cut short."""
    delays = (0.05, 0.12, 0.2, 0.27, 0.33, 0.41, 0.5, 0.58)
    target = tmp_path / "big.bin"
    write_atomic(target, b"\0" * (32 << 20))
    assert killed_while_writing(target, "atomic", delays) == ["whole"] * len(delays)
    # a write cut short leaves at most its own temporary file beside, never in place
    assert all(
        p.name == "big.bin" or (p.name.startswith(".big.bin.") and p.name.endswith(".tmp"))
        for p in tmp_path.iterdir()
    )
    write_atomic(target, b"\1" * 16)  # a later write clears what the killed writers left
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".big.bin.")] == []
    plain = killed_while_writing(tmp_path / "plain.bin", "plain", delays)
    assert plain.count("whole") < len(delays)  # the test can tell


def test_a_write_that_fails_keeps_the_old_file_and_no_temporary(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out.yaml"
    target.write_text("old: 1\n")
    os.chmod(target, 0o640)

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(ConfigError, match="No space left on device"):
        write_atomic(target, "new: 2\n")
    with pytest.raises(ConfigError, match="No space left on device"):
        autotune.load(saved).save(target)  # save() writes the same way
    monkeypatch.undo()
    assert target.read_text() == "old: 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.yaml"]
    write_atomic(target, "new: 2\n")
    assert target.read_text() == "new: 2\n"
    assert target.stat().st_mode & 0o777 == 0o640  # the file keeps its mode


def test_a_device_file_is_written_in_place() -> None:
    write_atomic(os.devnull, "anything\n")
    assert Path(os.devnull).exists() and not Path(os.devnull).is_file()


@pytest.mark.parametrize(
    ("name", "words"), [("missing/x.yaml", "does not exist"), (".", "is a directory")]
)
def test_an_output_that_cannot_be_written_is_refused_first(
    tmp_path: Path, name: str, words: str
) -> None:
    with pytest.raises(ConfigError, match=words):
        check_writable(tmp_path / name, "-o")


def test_tune_refuses_an_unwritable_output_before_it_tunes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    models = tmp_path / "models.py"
    models.write_text("def model():\n    raise RuntimeError('the model was built')\n")
    out = tmp_path / "missing" / "tuned.yaml"
    code = main(["tune", f"{models}:model", "--batch", f"{models}:model", "--budget-gb", "1",
                 "--device", "cpu", "-o", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "does not exist" in err and str(out.parent) in err
    assert "the model was built" not in err  # refused before anything ran
