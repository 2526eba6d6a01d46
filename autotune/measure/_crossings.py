"""The tensors a block's forward makes, takes as an argument or returns whose free a
mixed mask can move, from the uniform runs' lives (see
:class:`~autotune._profile_data.Crossing`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from autotune._profile_data import CHECKPOINT, KEEP, SELECTIVE, Crossing, Line, PhaseKey
from autotune.measure._timeline import Lives, occurrences
from autotune.measure._tracker import Life, PhaseRecord

__all__ = ["crossings"]

_OWN = ("fwd", "bwd")
"""The labels of a block's own phases (the others lie between blocks)."""
_HOLDING = (CHECKPOINT, SELECTIVE)
"""The variants that hold a block's arguments until its backward."""

_T = TypeVar("_T")
_Born = tuple[tuple[PhaseKey, int], int]
"""Where a storage was made, the same in every run: its phase by key and occurrence,
and how many storages that phase had made before."""


def crossings(
    runs: Mapping[tuple[int, int], list[PhaseRecord]],
    lives: Mapping[tuple[int, int], Lives],
    sizes: tuple[int, int],
    variants: Sequence[int],
) -> tuple[Crossing, ...]:
    """The tensors some block's forward makes, takes as an argument or returns that the
    variants' runs (every block kept, every block checkpointed, ...) free in different
    phases, at micro-batch sizes ``sizes``, with the blocks that hold each in each run
    (their arguments where checkpointed, what their ops saved for backward where kept); a
    variant not run reads as the kept run. Tensors that do not match across the runs (by
    where they were made, and their bytes) are left out."""
    b1, b2 = sizes
    if any((b, v) not in lives for b in sizes for v in variants):
        return ()
    index = _phase_index(runs[b1, KEEP])
    ends = {(b, v): _ends(runs[b, v], lives[b, v].lives, index) for b in sizes for v in variants}
    taken = {
        (b, v): _keyed(runs[b, v], lives[b, v].arguments)
        for b in sizes
        for v in variants
        if v in _HOLDING
    }
    saving = _keyed(runs[b2, KEEP], lives[b2, KEEP].saved)
    every = {born for arguments in taken.values() for born in arguments}
    every |= {
        born for v in variants for born in _keyed(runs[b2, v], dict.fromkeys(lives[b2, v].returned))
    }
    made = {born for born in ends[b2, KEEP] if born[0][0].label == "fwd"} - every
    # Each block's forward and backward phases, by micro-batch and index: the block's own.
    own = {(key.micro, i): key.block for (key, _), i in index.items() if key.label in _OWN}
    out = []
    for born in sorted(every | made, key=repr):
        both = {v: (ends[b1, v].get(born), ends[b2, v].get(born)) for v in variants}
        if born in made and _within_maker(born, both, own):
            continue  # its maker's phases, replayed from the maker's own run: exact already
        holders = {v: tuple(sorted(taken[b2, v].get(born, ()))) for v in variants if v in _HOLDING}
        holders[KEEP] = tuple(sorted(saving.get(born, ())))  # kept blocks hold what they saved
        maker = born[0][0].block if born in made else None
        crossing = _crossing(born, sizes, both, holders, maker)
        if crossing is not None:
            out.append(crossing)
    return tuple(out)


_End = tuple[int, int, bool, int]
"""Where a storage was freed (a phase's index in its micro-batch), its bytes, whether it
was freed before that phase's peak, and where Python let go of it."""


def _crossing(
    born: _Born,
    sizes: tuple[int, int],
    ends: dict[int, tuple[_End | None, _End | None]],
    holders: dict[int, tuple[int, ...]],
    maker: int | None = None,
) -> Crossing | None:
    """The crossing made at ``born`` (inside block ``maker``'s forward, where it is
    neither an argument nor an output) from its ``ends`` at both sizes in each variant's
    run; ``None`` where it is not the same tensor in every run, or every run frees it in
    the same phase (nothing moves)."""
    seen = {v: (one, two) for v, (one, two) in ends.items() if one is not None and two is not None}
    if len(seen) != len(ends):
        return None
    if any(len({pair[i][1] for pair in seen.values()}) != 1 for i in (0, 1)):
        return None  # not the same tensor in every run
    where = {pair[0][0] for pair in seen.values()}
    if any(one[0] != two[0] for one, two in seen.values()) or len(where) == 1:
        return None
    n = max(seen) + 1
    chosen = [seen.get(v, seen[KEEP])[1] for v in range(n)]
    (b1, b2), (one, two) = sizes, seen[KEEP]
    return Crossing(
        micro=born[0][0].micro,
        size=Line.through(b1, one[1], b2, two[1]),
        ends=tuple(e[0] for e in chosen),
        early=tuple(e[2] for e in chosen),
        holders=tuple(holders.get(v, ()) for v in range(n)),
        dropped=two[3],
        maker=maker,
    )


def _within_maker(
    born: _Born,
    ends: dict[int, tuple[_End | None, _End | None]],
    own: dict[tuple[int, int], int | None],
) -> bool:
    """Whether every run frees the storage made at ``born`` in its maker's own forward or
    backward (most of a block's activations: saved until its backward where kept, freed
    in its forward where checkpointed)."""
    key = born[0][0]
    return all(
        end is not None and own.get((key.micro, end[0])) == key.block
        for pair in ends.values()
        for end in pair
    )


def _phase_index(reference: list[PhaseRecord]) -> dict[tuple[PhaseKey, int], int]:
    """Each phase of micro-batches 1 and 2 (by key and occurrence) to its index among
    its micro-batch's phases."""
    out = {}
    counts: dict[int, int] = {}
    for key in occurrences(reference):
        micro = key[0].micro
        if micro in (1, 2):
            out[key] = counts.get(micro, 0)
            counts[micro] = out[key] + 1
    out.update({(PhaseKey(m, "after the micro-batch"), 0): n for m, n in counts.items()})
    return out


def _ends(
    records: list[PhaseRecord], lives: list[Life], index: dict[tuple[PhaseKey, int], int]
) -> dict[_Born, _End]:
    """Each storage made in micro-batch 1 or 2 of a run, where it ended (a phase not
    within its micro-batch: the number of phases)."""
    keys = occurrences(records)
    out = {}
    for life in lives:
        made = keys[life.born[0]]
        if made not in index:
            continue
        micro = made[0].micro
        end = _within(keys, index, micro, life.end)
        dropped = _within(keys, index, micro, life.dropped)
        early = life.early and end != _within(keys, index, micro, None)
        out[made, life.born[1]] = (end, life.nbytes, early, dropped)
    return out


def _within(
    keys: list[tuple[PhaseKey, int]],
    index: dict[tuple[PhaseKey, int], int],
    micro: int,
    at: int | None,
) -> int:
    """The index of record ``at`` among micro-batch ``micro``'s phases (the number of
    phases where it is another's, or ``None``)."""
    key = keys[at] if at is not None else None
    if key is not None and key[0].micro == micro and key in index:
        return index[key]
    return index[PhaseKey(micro, "after the micro-batch"), 0]


def _keyed(records: list[PhaseRecord], by_birth: Mapping[tuple[int, int], _T]) -> dict[_Born, _T]:
    """``by_birth`` (by :attr:`Life.born`) keyed by where each storage was made, the same
    in every run."""
    keys = occurrences(records)
    return {(keys[phase], n): value for (phase, n), value in by_birth.items()}
