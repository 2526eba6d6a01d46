"""Finding the blocks of a model: the units the tuner may checkpoint or offload.

By default the blocks are a model's repeated layers: runs of consecutive children of one
class inside an ``nn.ModuleList`` or ``nn.Sequential`` (transformer layers, residual
blocks), opening stages (ResNet, ConvNeXt, Swin) into their layers: finer blocks give the
tuner finer trades of memory for recompute. Users can name the blocks instead;
:func:`resolve_blocks` checks those names. Both only read the model: no forward, no hooks.
"""

from __future__ import annotations

import difflib
import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from autotune.errors import BlockError

__all__ = ["find_blocks", "resolve_blocks"]

_MIN_SHARE = 0.01
"""Runs holding less of the model's parameters than this are heads, not its layers."""


@dataclass(frozen=True)
class _Run:
    """Consecutive children of one class inside one container: candidate blocks."""

    container: str
    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]


def find_blocks(model: nn.Module) -> tuple[str, ...]:
    """Find the repeated layers of ``model``: the blocks the tuner may checkpoint.

    Blocks are the outermost runs of two or more consecutive same-class children with
    parameters in an ``nn.ModuleList``/``nn.Sequential``. A member of a run that is a
    stage gives its layers instead (see :func:`_stage_layers`). Runs under 1% of the
    parameters are heads and dropped (unless all are); of the rest, runs of non-leaf
    modules win over runs of leaves. With no run at all, the children of the largest
    ``nn.Sequential`` are the blocks.

    Args:
        model: The model; it is only read.

    Returns:
        Qualified names as in ``model.named_modules()``, in that order, each module once.

    Raises:
        BlockError: The model has no repeated layers and no ``nn.Sequential``.
    """
    name_of: dict[int, str] = {}  # first name of each module: shared modules count once
    containers: list[tuple[str, nn.ModuleList | nn.Sequential]] = []
    for name, module in model.named_modules():
        name_of[id(module)] = name
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            containers.append((name, module))
    runs = [run for name, c in containers for run in _runs_in(name, c, name_of)]
    names = {name for run in _select(runs, _numel([model]), name_of) for name in run.names}
    if not names:
        names = _sequential_children(model, [c for _, c in containers], name_of)
    order = {name: i for i, name in enumerate(name_of.values())}
    return tuple(sorted(names, key=order.__getitem__))


def resolve_blocks(model: nn.Module, names: Sequence[str] | None) -> tuple[str, ...]:
    """Validate blocks named by the user, or find them when none are named.

    Args:
        model: The model; it is only read.
        names: Qualified submodule names, or ``None`` for :func:`find_blocks`.

    Returns:
        The names in ``model.named_modules()`` order.

    Raises:
        BlockError: A name is not a submodule, is the root, repeats, or lies inside
            another named block.
    """
    if names is None:
        return find_blocks(model)
    if isinstance(names, str):  # a bare string would be read as one block per character
        raise BlockError(f"blocks must be a list of module names; write [{names!r}].")
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    for name in names:
        if name not in order:
            close = difflib.get_close_matches(str(name), list(order), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise BlockError(f"{type(model).__name__} has no submodule named {name!r}.{hint}")
        if name == "":
            raise BlockError("the root module ('') cannot be a block; name its submodules.")
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise BlockError(f"blocks are named more than once: {', '.join(repeated)}.")
    chosen = set(names)
    for name in names:
        outer = next((p for p in _parents(name) if p in chosen), None)
        if outer is not None:
            raise BlockError(f"block {name!r} lies inside block {outer!r}: name one of them.")
    return tuple(sorted(chosen, key=order.__getitem__))


def _runs_in(
    name: str, container: nn.ModuleList | nn.Sequential, name_of: dict[int, str]
) -> list[_Run]:
    """Maximal runs (length >= 2) of consecutive same-class children holding parameters."""
    runs = []
    for cls, group in itertools.groupby(container, key=_run_key):
        modules = tuple(group)  # a module listed twice gets one name, so it is one block
        if cls is not None and len(modules) >= 2:
            runs.append(_Run(name, tuple(name_of[id(m)] for m in modules), modules))
    return runs


def _select(runs: list[_Run], total: int, name_of: dict[int, str]) -> list[_Run]:
    """The outermost runs, stages opened into layers; less heads (too small); of layers if any."""
    members = {name for run in runs for name in run.names}  # blocks never hold blocks
    runs = [r for r in runs if not any(p in members for p in (r.container, *_parents(r.container)))]
    runs = [_open_stages(run, name_of) for run in runs]
    sizes = [_numel(run.modules) for run in runs]
    floor = min(_MIN_SHARE * total, max(sizes, default=0))  # never drop every run
    # size cut first, then layers over leaves: a big run of nn.Linear beats two tiny heads
    runs = [run for run, size in zip(runs, sizes, strict=True) if size >= floor]
    return [r for r in runs if not all(map(_is_leaf, r.modules))] or runs


def _open_stages(run: _Run, name_of: dict[int, str]) -> _Run:
    """``run`` with each member that is a stage replaced by the stage's layers, in order."""
    modules = tuple(m for member in run.modules for m in _stage_layers(member) or (member,))
    return _Run(run.container, tuple(name_of[id(m)] for m in modules), modules)


def _stage_layers(module: nn.Module) -> list[nn.Module] | None:
    """The layers of ``module`` if it is a stage (a thin wrapper around a stack), else None.

    A stage is an ``nn.ModuleList``/``nn.Sequential``, or has one as a direct child, of
    non-leaf modules mostly of one class, holding over half of the stage's parameters:
    ``ResNetStage.layers``, ``ConvNextStage.layers``, ``SwinStage.blocks``. One level only:
    a bottleneck's own convs stay inside it. A transformer layer is no stage: its sublayers
    differ in class, its experts sit one level down (``mlp.experts``), and experts held
    directly are told apart by their router (a matrix outside them, one row per expert).
    """
    for child in (module, *module.children()):
        if not isinstance(child, (nn.ModuleList, nn.Sequential)) or len(child) == 0:
            continue
        layers = list(child)
        inside = {id(p) for m in layers for p in m.parameters()}
        rows = {p.shape[0] for p in module.parameters() if p.dim() == 2 and id(p) not in inside}
        if (
            2 * Counter(map(type, layers)).most_common(1)[0][1] > len(layers)
            and not any(map(_is_leaf, layers))
            and 2 * _numel(layers) > _numel([module])
            and (len(layers) == 1 or len(layers) not in rows)  # no router: not experts
        ):
            return [m for m in layers if _has_params(m)]
    return None


def _sequential_children(
    model: nn.Module, sequentials: list[nn.ModuleList | nn.Sequential], name_of: dict[int, str]
) -> set[str]:
    """Children with parameters of the largest ``nn.Sequential``: a plain stack of layers."""
    sequentials = [s for s in sequentials if isinstance(s, nn.Sequential)]
    largest = max(sequentials, key=lambda s: _numel([s]), default=None)
    names = {name_of[id(m)] for m in largest or () if _has_params(m)}
    if not names:
        top = ", ".join(name for name, _ in model.named_children()) or "(none)"
        raise BlockError(
            f"found no repeated layers in {type(model).__name__}: no nn.ModuleList or "
            "nn.Sequential holds two consecutive same-class children with parameters. "
            f"Name the blocks yourself with SearchSpace(blocks=[...]); its top-level "
            f"children are: {top}."
        )
    return names


def _parents(name: str) -> list[str]:
    """Qualified names of the modules enclosing ``name``, outermost first, root excluded."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_leaf(module: nn.Module) -> bool:
    return next(module.children(), None) is None


def _run_key(module: nn.Module | None) -> type[nn.Module] | None:
    """A child's class, or None for one without parameters: it breaks a run, starts none."""
    return type(module) if module is not None and _has_params(module) else None


def _numel(modules: Iterable[nn.Module]) -> int:
    """Parameters held by ``modules``, a parameter shared between them counted once."""
    sizes = {id(p): p.numel() for m in modules for p in m.parameters()}
    return sum(sizes.values())
