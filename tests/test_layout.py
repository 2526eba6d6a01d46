"""The package's layers: imports only point down (see ARCHITECTURE.md).

Checked twice: statically, over the import graph of every module (transitively, since a
module that imports a sibling loads what that sibling imports), and for real, in fresh
interpreters, over what importing a layer loads.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from autotune._interface import typing_imports

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"

BASE = {
    "autotune.errors",
    "autotune._profile_data",
    "autotune._spelling",
    "autotune.config",
    "autotune._plain_data",
    "autotune._yaml",
    "autotune._files",
    "autotune.result",
    "autotune._format",
    "autotune.space",
    "autotune._blocks",
    "autotune._interface",
    "autotune._version",
    "autotune.models",
}
"""Records, names and model structure: importable from every layer."""

ALLOWED = {  # layer -> the layers its modules may import (besides BASE and itself)
    "device": set(),
    "train": {"device"},
    "measure": {"device", "train"},
    "jobs": set(),
    "cost": {"device", "measure", "jobs"},
    "verify": {"device", "train", "measure", "jobs", "cost"},
    "tuning": {"device", "train", "measure", "cost", "jobs", "verify"},
    "integrations": {"device", "train", "measure", "cost", "jobs", "verify", "tuning"},
    "cli": {"device", "train", "measure", "cost", "jobs", "verify", "tuning", "integrations"},
}
LAYERS = set(ALLOWED)


def layer(module: str) -> str:
    if module in BASE:
        return "base"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return "top"  # the package's __init__: the public names, loaded lazily


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def interface(package: str) -> dict[str, str]:
    """The package's lazy names, by their defining module (its typing block); a
    subpackage imports its names plainly, and has none."""
    return typing_imports(MODULES[package].read_text()) if package == "autotune" else {}


def parsed(module: str) -> ast.Module:
    """``module``'s syntax tree, without what runs only for type checking."""
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []  # for typing only: never executed
    return tree


@cache
def imports(module: str) -> frozenset[str]:
    """The autotune modules ``module`` imports when it runs (not under TYPE_CHECKING); a
    name from a subpackage's interface counts as its defining module."""
    out: set[str] = set()
    for node in ast.walk(parsed(module)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            table = interface(node.module) if node.module in MODULES else {}
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            names += [table[a.name] for a in node.names if a.name in table]
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
    assert {
        "autotune.tuning._autotune",
        "autotune.train._runner",
        "autotune.cost._cost_model",
    } <= set(MODULES)
    assert "autotune.train._runner" in closure("autotune.train._prepare")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    mine = layer(module)
    allowed = {"base", mine} | ALLOWED.get(mine, set())
    if mine == "base":
        allowed = {"base"}
    up = sorted(d for d in closure(module) if d != "autotune" and layer(d) not in allowed)
    assert not up, f"{module} ({mine}) reaches up to {up}"


def test_the_chooser_reads_profiles_without_the_training_code() -> None:
    for module in (m for m in MODULES if layer(m) == "cost"):
        assert not any(layer(d) == "train" for d in closure(module)), module


def test_a_layer_uses_another_only_through_its_interface() -> None:
    """Outside a subpackage, nothing imports its private modules: only the names of its
    ``__init__``'s interface."""
    reaching = []
    for module in MODULES:
        mine = layer(module)
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                private = len(parts) > 2 and parts[2].startswith("_")
                if private and parts[1] in LAYERS and parts[1] != mine and module != "autotune":
                    reaching.append(f"{module} -> {target}")
    assert not reaching, reaching


@pytest.mark.parametrize("package", sorted(f"autotune.{p}" for p in LAYERS))
def test_each_interface_is_its_plain_imports(package: str) -> None:
    """A subpackage's interface is ``__all__``: each name imported plainly from one of its
    own private modules, and listed twice only (no table, no typing block)."""
    tree = ast.parse(MODULES[package].read_text())
    imported = {
        a.asname or a.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module != "__future__"
        for a in node.names
    }
    assert not any(isinstance(n, ast.If) for n in tree.body), "a typing block"
    assigned = [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets]
    assert assigned == ["__all__"], assigned
    module = importlib.import_module(package)
    assert sorted(imported) == sorted(module.__all__)
    for name, where in imported.items():
        assert where and where.startswith(f"{package}._"), (name, where)
        assert getattr(module, name) is getattr(importlib.import_module(where), name), name


def test_the_package_lists_each_public_name_twice() -> None:
    """The root's names: imported (the lazy ones in its typing block) and in ``__all__``."""
    import autotune

    tree = ast.parse(MODULES["autotune"].read_text())
    eager = {
        a.asname or a.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module not in ("__future__", "typing")
        for a in node.names
    } - {"lazy_names"}
    lazy = set(interface("autotune"))
    assert not eager & lazy
    assert sorted(eager | lazy) == sorted(autotune.__all__)
    assert all(getattr(autotune, name) is not None for name in lazy)


def test_no_private_module_at_the_top_but_the_base() -> None:
    top = {m for m in MODULES if m.count(".") == 1 and m.split(".")[1].startswith("_")}
    assert top <= BASE, top - BASE


def test_no_file_name_in_two_subpackages() -> None:
    """One file per name: a module's name says which concept it defines, wherever it is."""
    where: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            where.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_no_import_circle() -> None:
    """No module imports itself back, through any chain of modules that run."""
    circles = [m for m in MODULES if m != "autotune" and m in closure(m) - {"autotune"}]
    assert not circles, circles


def test_no_function_over_60_lines() -> None:
    """Counted from ``def`` to the last line, the docstring left out (a public function's
    documentation is not the length this guards against)."""
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                doc = node.body[0]
                if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                    lines -= doc.end_lineno - doc.lineno + 1  # type: ignore[operator]
                if lines > 60:
                    long.append(f"{module}.{node.name}: {lines}")
    assert not long, long


def test_no_private_name_is_imported_from_another_module() -> None:
    """A module's private names (``_MARGIN``) are its own: a sibling that needs one gets a
    public name for it (a private module of the same package may be imported whole)."""
    reaching = [
        f"{module} <- {node.module}.{a.name}"
        for module, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autotune")
        for a in node.names
        if a.name.startswith("_")
        and not a.name.startswith("__")
        and f"{node.module}.{a.name}" not in MODULES
    ]
    assert reaching == []


def test_every_kind_of_run_makes_its_problem_with_one_function() -> None:
    """A tuning run and a plan build their ``Problem`` with ``make_problem``: no other
    module calls the class itself. An estimate has none (no budget, nothing searched)."""
    from autotune.tuning import _autotune, _estimate, _plan_ahead, _problem

    runs = (_autotune, _plan_ahead)
    assert all(run.make_problem is _problem.make_problem for run in runs)
    assert not hasattr(_estimate, "make_problem")
    built = [
        f"{module}:{node.lineno}"
        for module, path in MODULES.items()
        if module != "autotune.tuning._problem"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Problem"
    ]
    assert built == []


ONE_MEANING: dict[str, str | None] = {
    "rank": "autotune.train._parallel",  # this process's rank in its group
    "run": None,  # no module-level name: each kind of run is a function of its own
    "plan": "autotune.cli._plan",  # the command that plans for a GPU not here
}
"""Words that once named several things (issue 49), and the module whose function is
the one thing each names."""


def test_each_overloaded_word_names_one_function_and_is_imported_as_itself() -> None:
    """No module-level function, class or variable of another module takes the word, and
    no import renames a name to it or it to another name."""
    misuses = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.col_offset == 0:
                names = [node.name]
            elif isinstance(node, ast.Assign) and node.col_offset == 0:
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                renamed = [a for a in node.names if a.asname and a.asname != a.name]
                misuses += [
                    f"{module}: {a.name} as {a.asname}"
                    for a in renamed
                    if {a.name.split(".")[-1], a.asname} & set(ONE_MEANING)
                ]
                continue
            else:
                continue
            misuses += [
                f"{module}: {name}" for name in names if ONE_MEANING.get(name, module) != module
            ]
    assert misuses == []


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
    assert not {m for m in loaded if m.startswith(("autotune.measure", "autotune.cost"))}
    assert not {m for m in loaded if m.startswith(("autotune.verify", "autotune.tuning"))}


def test_the_cost_model_loads_no_training_code() -> None:
    loaded = loaded_after("from autotune.cost import CostModel; CostModel")
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


def _defined_names() -> set[str]:
    """Every function, class, method, argument, field and variable the package defines."""
    names: set[str] = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_architecture_names_only_what_exists() -> None:
    """Every file, folder, function and class ARCHITECTURE.md names exists: in its
    backquotes, and every call and file in its diagram of a run. The page stays short
    (150 lines at most), a map a reader can hold."""
    import re

    root = PACKAGE.parent
    text = (root / "ARCHITECTURE.md").read_text()
    assert len(text.splitlines()) <= 150
    diagram = text.split("```")[1]
    quoted = re.findall(r"`([^`\s]+)`", text.replace(diagram, ""))
    files = [q for q in quoted if q.endswith((".py", ".md", "/"))]
    files += re.findall(r"[\w/]+\.py", diagram)
    names = [q for q in quoted if q not in files and re.fullmatch(r"[A-Za-z_][\w.]*", q)]
    names += re.findall(r"(\w+)\(", diagram)
    names += [w for w in re.findall(r"\b[a-z]+_[a-z_]+\b", diagram)]
    everywhere = {p.name for p in PACKAGE.rglob("*.py")}
    missing = [
        f
        for f in files
        if not (root / f).exists()
        and not (PACKAGE / f).exists()
        and ("/" in f.rstrip("/") or f not in everywhere)
    ]
    defined = _defined_names()
    missing += [n for n in names if n.split(".")[-1] not in defined]
    assert missing == []


def _module_names(tree: ast.Module) -> set[str]:
    """The names a module defines or imports at its top level."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_no_function_gives_a_module_level_name_a_second_meaning() -> None:
    """Inside a function (its arguments, its locals, the functions it nests), no name is
    one the module defines or imports at its top level: within one module a name means
    one thing. A ``global`` statement is the module's own name, not a second one."""
    shadowed = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = _module_names(tree)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = fn.args
            names = {
                x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x
            }
            declared: set[str] = set()
            for node in ast.walk(fn):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not fn:
                    names.add(node.name)
                elif isinstance(node, ast.Global):
                    declared.update(node.names)
            shadowed += [f"{module}:{fn.lineno} {fn.name}: {n}" for n in (names & top) - declared]
    assert shadowed == []


def test_no_test_imports_the_benchmarks() -> None:
    """The tests stand on the package and on ``tests/`` alone: no test module imports the
    ``benchmarks`` package (a benchmark may run a test's model at a larger size, never
    the other way round), so a benchmark's edit cannot break CI."""
    importing = []
    for path in PACKAGE.parent.joinpath("tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            if "benchmarks" in roots:
                importing.append(f"{path.name}:{node.lineno}")
    assert importing == []
