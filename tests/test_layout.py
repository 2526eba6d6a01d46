"""The package's layers: imports only point down (see ARCHITECTURE.md).

Checked twice: statically, over the import graph of every module (transitively, since a
module that imports a sibling loads what that sibling imports), and for real, in fresh
interpreters, over what importing a layer loads.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"

BASE = {
    "autotune.errors",
    "autotune.config",
    "autotune._plain",
    "autotune._yaml",
    "autotune._files",
    "autotune.result",
    "autotune._format",
    "autotune.space",
    "autotune._backend",
    "autotune._device",
    "autotune._identity",
    "autotune._blocks",
    "autotune.models",
}
"""Records, names and model structure: importable from every layer."""

ALLOWED = {  # layer -> the layers its modules may import (besides BASE and itself)
    "train": set(),
    "measure": {"train"},
    "plan": {"measure"},
    "verify": {"train", "measure", "plan"},
    "top": {"train", "measure", "plan", "verify"},
    "integrations": {"train", "measure", "plan", "verify", "top"},
    "cli": {"train", "measure", "plan", "verify", "top", "integrations"},
}


def layer(module: str) -> str:
    if module in BASE:
        return "base"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return "top"  # the package, tune, _problem, _estimate


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def imports(module: str) -> frozenset[str]:
    """The autotune modules ``module`` imports when it runs (not under TYPE_CHECKING)."""
    tree = ast.parse(MODULES[module].read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []  # for typing only: never executed
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            out.update(n for n in names if n in MODULES)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{module}: use absolute imports (from autotune.x import y)")
    out.discard(module)
    return frozenset(m for m in out if m.startswith("autotune"))


def closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        for dep in imports(m):
            # Importing a submodule runs its packages' __init__ too.
            chain = [".".join(dep.split(".")[:i]) for i in range(1, dep.count(".") + 2)]
            for d in chain:
                if d not in seen and d in MODULES:
                    seen.add(d)
                    todo.append(d)
    seen.discard(module)
    return seen


def test_the_graph_sees_the_package() -> None:
    assert {"autotune.tune", "autotune.train._runner", "autotune.plan._cost"} <= set(MODULES)
    assert "autotune.train._runner" in closure("autotune.train._prepare")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    mine = layer(module)
    allowed = {"base", mine} | ALLOWED.get(mine, set())
    if mine == "base":
        allowed = {"base"}
    up = sorted(d for d in closure(module) if d != "autotune" and layer(d) not in allowed)
    assert not up, f"{module} ({mine}) reaches up to {up}"


def test_the_planner_reads_profiles_without_the_training_code() -> None:
    for module in (m for m in MODULES if layer(m) == "plan"):
        assert not any(layer(d) == "train" for d in closure(module)), module


def test_the_package_itself_imports_only_the_base() -> None:
    eager = {d for d in imports("autotune") if d != "autotune"}
    assert eager <= BASE, eager - BASE


def loaded_after(statement: str) -> set[str]:
    """Modules loaded by a fresh interpreter after ``statement``."""
    code = f"import sys; {statement}; import json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(out.stdout))


def test_training_loads_neither_optuna_nor_the_tuner() -> None:
    loaded = loaded_after("import autotune; autotune.prepare; autotune.Runner")
    assert "optuna" not in loaded
    assert not {m for m in loaded if m.startswith(("autotune.measure", "autotune.plan"))}
    assert not {m for m in loaded if m.startswith(("autotune.verify", "autotune.tune"))}


def test_the_cost_model_loads_no_training_code() -> None:
    loaded = loaded_after("import autotune.plan._cost")
    assert not {m for m in loaded if m.startswith("autotune.train")}


def test_importing_autotune_loads_neither_torch_nor_optuna() -> None:
    loaded = loaded_after("import autotune; autotune.TrainConfig; autotune.load")
    assert "torch" not in loaded and "optuna" not in loaded


def test_public_names_resolve_and_unknown_ones_fail() -> None:
    import autotune

    for name in autotune.__all__:
        assert getattr(autotune, name) is not None, name
    assert set(autotune.__all__) <= set(dir(autotune))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        autotune.nope  # noqa: B018


def test_every_optimizer_name_can_be_built() -> None:
    from autotune.config import OPTIMIZERS
    from autotune.train import _optimizers

    assert set(_optimizers._SPECS) == set(OPTIMIZERS)
