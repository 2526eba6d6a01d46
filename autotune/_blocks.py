"""Finding the blocks of a model: the units the tuner may checkpoint or offload.

By default the blocks are a model's repeated layers: stacks of layers inside an
``nn.ModuleList`` or ``nn.Sequential`` (transformer layers, residual blocks, hybrid
Mamba/attention layers), opening stages (ResNet, ConvNeXt, Swin) into their layers: finer
blocks give the tuner finer trades of memory for recompute. Blocks come in the order they
run. Users can name the blocks instead; :func:`resolve_blocks` checks those names. Both
only read the model: no forward, no hooks.
"""

from __future__ import annotations

import difflib
import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from autotune._spelling import option
from autotune.errors import BlockError

__all__ = ["eager_module", "find_blocks", "is_compile_wrapper", "resolve_blocks"]

_MIN_SHARE = 0.01
"""Runs holding less of the model's parameters than this are heads, not its layers."""

_U_NET = ("down_blocks", "mid_block", "up_blocks")
"""A U-Net's parts in the order they run, as diffusers names them."""

_RUNS_BEFORE = {
    "mid_block": "up_blocks",  # diffusers' U-Nets and VAE decoders
    "vision_model": "text_model",  # CLIP, SigLIP, ALIGN, BLIP...: the image tower runs first
    "image_model": "text_model",  # FLAVA
    "audio_model": "text_model",  # CLAP
}
"""Children that run before a sibling registered ahead of them, by name: Hugging Face and
diffusers models register these out of the order their forward calls them."""


@dataclass(frozen=True)
class _Stack:
    """Layers of one stack inside one container (or U-Net): candidate blocks."""

    container: str
    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    opens: bool = True  # whether members that are stages give their layers


def find_blocks(model: nn.Module) -> tuple[str, ...]:
    """Find the repeated layers of ``model``: the blocks the tuner may checkpoint.

    Blocks are the outermost runs of layers in an ``nn.ModuleList``/``nn.Sequential``: the
    whole container when its non-leaf children with parameters form a stack (see
    :func:`_stack`), else each run of two or more consecutive same-class children with
    parameters. A U-Net's down blocks, mid block and up blocks are one run (see
    :func:`_u_net`). A member of a run that is a stage gives its layers instead (see
    :func:`_stage_layers`). Runs under 1% of the parameters are heads and dropped (unless
    all are); of the rest, runs of layers win over runs of leaves and of projections (see
    :func:`_projection`). With no run at all, the children of the largest container are the
    blocks: ALBERT's one layer group, which its encoder calls once per layer.

    Args:
        model: The model; it is only read.

    Returns:
        Qualified names as in ``model.named_modules()``, in the order they run (see
        :func:`_run_order`), each module once; of a ``torch.compile`` wrapper, as in the
        module it wraps (they name the same blocks in the wrapper).

    Raises:
        BlockError: The model has no repeated layers and no ``nn.ModuleList``/``nn.Sequential``.
    """
    model = eager_module(model)
    modules = list(model.named_modules())
    name_of = {id(module): name for name, module in modules}  # shared modules count once
    u_nets = [run for name, module in modules if (run := _u_net(name, module, name_of))]
    claimed = {_join(run.container, part) for run in u_nets for part in _U_NET}
    containers = [
        (name, module)
        for name, module in modules
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and name not in claimed
    ]
    runs = [run for name, c in containers for run in _runs_in(name, c, name_of)] + u_nets
    names = {name for run in _select(runs, _numel([model]), name_of) for name in run.names}
    if not names:
        names = _largest_container_children(model, [c for _, c in containers], name_of)
    names = {called for name in names for called in _called(model, name)}
    order = _run_order(model)
    return tuple(sorted(names, key=order.__getitem__))


def resolve_blocks(model: nn.Module, names: Sequence[str] | None) -> tuple[str, ...]:
    """Validate blocks named by the user, or find them when none are named.

    Args:
        model: The model; it is only read.
        names: Qualified submodule names, or ``None`` for :func:`find_blocks`.

    Returns:
        The names in the order they run, as :func:`find_blocks` gives them.

    Raises:
        BlockError: A name is not a submodule, is the root, repeats, or lies inside
            another named block.
    """
    if names is None:
        return find_blocks(model)
    if isinstance(names, str):  # a bare string would be read as one block per character
        raise BlockError(f"blocks must be a list of module names; write [{names!r}].")
    known = dict(model.named_modules())
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(str(name), list(known), n=3)
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
    order = _run_order(model)
    return tuple(sorted(chosen, key=order.__getitem__))


def _runs_in(
    name: str, container: nn.ModuleList | nn.Sequential, name_of: dict[int, str]
) -> list[_Stack]:
    """The stacks and maximal same-class runs (length >= 2) in one container.

    Children without parameters split the container; in each part, a stack (see
    :func:`_stack`) is one run, and so is each run of one class outside the stack.
    """
    runs = []
    for has_params, part in itertools.groupby(container, _has_params):
        layers = list(part)
        start, stop = _stack(layers) if has_params else (0, 0)
        rest = [list(g) for _, g in itertools.groupby(layers[:start], type)]
        rest += [list(g) for _, g in itertools.groupby(layers[stop:], type)]
        for group in [layers[start:stop], *rest] if has_params else []:
            modules = tuple(group)  # a module listed twice gets one name, so it is one block
            if len(modules) >= 2:
                runs.append(_Stack(name, tuple(name_of[id(m)] for m in modules), modules))
    return runs


def _stack(layers: list[nn.Module]) -> tuple[int, int]:
    """Where in ``layers`` (consecutive children with parameters) a stack of layers lies.

    Non-leaf ``layers`` are a stack when their classes repeat with a period of at most half
    their number (one class; Jamba's Mamba and attention layers, ABAB or AAAB AAAB, the last
    period maybe cut short). Else, from the first to the last of its members, one class
    that is more than half of them makes a stack with the layers between: Zamba2's hybrid
    layers among its Mamba layers, irregularly placed, but not MobileNet's stem and last
    conv around its inverted residuals.

    Returns:
        The stack's start and stop, ``(0, 0)`` for none.
    """
    if len(layers) < 2 or any(map(_is_leaf, layers)):
        return 0, 0
    classes = [type(m) for m in layers]
    if any(classes[p:] == classes[:-p] for p in range(1, len(classes) // 2 + 1)):
        return 0, len(layers)
    main, count = Counter(classes).most_common(1)[0]
    if 2 * count <= len(classes):
        return 0, 0
    return classes.index(main), len(classes) - classes[::-1].index(main)


def _u_net(name: str, module: nn.Module, name_of: dict[int, str]) -> _Stack | None:
    """A U-Net's down blocks, mid block and up blocks as one run, or None for no U-Net.

    diffusers' U-Nets, VAE encoders and decoders and ControlNets hold ``down_blocks`` and/or
    ``up_blocks`` lists and a ``mid_block``. Their blocks differ in class, and each runs its
    resnets and attentions (two lists) interleaved, which their registration order does not
    show: so they stay whole, and are not opened into their layers.
    """
    parts = dict(module.named_children())
    if not any(isinstance(parts.get(part), nn.ModuleList) for part in _U_NET):
        return None
    parts = {part: parts[part] for part in _U_NET if part in parts}  # in the order they run
    layers = [m for p in parts.values() for m in (p if isinstance(p, nn.ModuleList) else [p])]
    modules = tuple(m for m in layers if _has_params(m))
    return _Stack(name, tuple(name_of[id(m)] for m in modules), modules, opens=False)


def _select(runs: list[_Stack], total: int, name_of: dict[int, str]) -> list[_Stack]:
    """The outermost runs, stages opened into layers; less heads (too small); of layers if any."""
    members = {name for run in runs for name in run.names}  # blocks never hold blocks
    runs = [r for r in runs if not any(p in members for p in (r.container, *_parents(r.container)))]
    runs = [_open_stages(run, name_of) if run.opens else run for run in runs]
    sizes = [_numel(run.modules) for run in runs]
    floor = min(_MIN_SHARE * total, max(sizes, default=0))  # never drop every run
    # size cut first, then layers over leaves and projections: big nn.Linears beat tiny heads
    runs = [run for run, size in zip(runs, sizes, strict=True) if size >= floor]
    return [r for r in runs if not all(_is_leaf(m) or _projection(m) for m in r.modules)] or runs


def _open_stages(run: _Stack, name_of: dict[int, str]) -> _Stack:
    """``run`` with each member that is a stage replaced by the stage's layers, in order."""
    modules = tuple(m for member in run.modules for m in _stage_layers(member) or (member,))
    return _Stack(run.container, tuple(name_of[id(m)] for m in modules), modules)


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


def _largest_container_children(
    model: nn.Module, containers: list[nn.ModuleList | nn.Sequential], name_of: dict[int, str]
) -> set[str]:
    """Children with parameters of the largest container, the outermost of equals.

    A plain ``nn.Sequential``, two differing layers (a two-layer Jamba), or ALBERT's
    ``albert_layer_groups``: one group, shared by all its layers, holding one layer.
    """
    largest = max(containers, key=lambda c: _numel([c]), default=None)  # first of equals
    names = {name_of[id(m)] for m in largest or () if _has_params(m)}
    if not names:
        top = ", ".join(name for name, _ in model.named_children()) or "(none)"
        raise BlockError(
            f"found no repeated layers in {type(model).__name__}: no nn.ModuleList or "
            "nn.Sequential holds children with parameters. "
            f"Name the blocks yourself with {option('SearchSpace(blocks=[...])')} (its "
            f"top-level children are: {top}), or tune without checkpointing and offload, "
            f"which need no blocks: {option('SearchSpace(checkpointing=False)')}."
        )
    return names


def _run_order(model: nn.Module) -> dict[str, tuple[float, ...]]:
    """A sort key per module name that puts modules in the order they run.

    That is registration order (as ``named_modules``), level by level, but for the children
    of :data:`_RUNS_BEFORE`, each moved to just before its sibling.
    """
    keys: dict[str, tuple[float, ...]] = {"": ()}
    for name, module in model.named_modules():
        children = [child for child, _ in module.named_children()]
        for rank, child in enumerate(children):
            key: float = rank
            if _RUNS_BEFORE.get(child) in children[:rank]:
                key = children.index(_RUNS_BEFORE[child]) - 0.5
            keys[_join(name, child)] = (*keys[name], key)
    return keys


def _called(model: nn.Module, name: str) -> list[str]:
    """``name``, or for a container nobody calls (``nn.ModuleList``, ``nn.ModuleDict``: a
    layer as ``[attention, feed-forward]``) its children with parameters, opened alike."""
    module = model.get_submodule(name)
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [name]
    return [
        called
        for child, m in module.named_children()
        if _has_params(m)
        for called in _called(model, _join(name, child))
    ]


def _parents(name: str) -> list[str]:
    """Qualified names of the modules enclosing ``name``, outermost first, root excluded."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_leaf(module: nn.Module) -> bool:
    return next(module.children(), None) is None


def _projection(module: nn.Module) -> bool:
    """Whether all parameters of ``module`` lie in one ``nn.Linear``: a projection, no layer.

    Segformer's per-stage MLPs, DPT's readout projections: one per input, side by side.
    Their widths may chain as a stack's do (8 -> 16, then 16 -> 16): the Linear tells.
    """
    owners = [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]
    return len(owners) == 1 and isinstance(owners[0], nn.Linear)


def _join(prefix: str, name: str) -> str:
    """The qualified name of child ``name`` of the module called ``prefix``."""
    return f"{prefix}.{name}" if prefix else name


def _numel(modules: Iterable[nn.Module]) -> int:
    """Parameters held by ``modules``, a parameter shared between them counted once."""
    sizes = {id(p): p.numel() for m in modules for p in m.parameters()}
    return sum(sizes.values())


def eager_module(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(model)`` wraps (``model`` itself when it is no wrapper).

    The wrapper and its module share parameters, and the wrapper hands attribute lookups
    on to its module, so a block name of the module names the same block in the wrapper.
    """
    while is_compile_wrapper(model):
        model = model._orig_mod  # type: ignore[assignment]
    return model


def is_compile_wrapper(m: object) -> bool:
    """Whether ``m`` is ``torch.compile``'s module wrapper (checked without importing
    dynamo, which takes a second)."""
    return type(m).__name__ == "OptimizedModule" and isinstance(
        getattr(m, "_orig_mod", None), nn.Module
    )
