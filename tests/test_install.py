"""The installed package, as a user's script imports it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_folder_named_autotune_beside_a_script_does_not_shadow_the_package(
    tmp_path: Path,
) -> None:
    # A clone of the repository, or any folder of that name, next to the user's script:
    # with setuptools' editable import hook it became an empty namespace package.
    (tmp_path / "autotune" / "docs").mkdir(parents=True)
    (tmp_path / "train.py").write_text(
        "import autotune\nprint(autotune.__version__, callable(autotune.find_blocks))\n"
    )
    done = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[1] == "True"
