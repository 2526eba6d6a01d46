"""The CUDA caching allocator's policy, modelled: what it reserves for a sequence of
allocations and frees, by its own rules.

The allocator is deterministic: given the requests and frees of a run on its streams,
the segments it takes from the driver follow from PyTorch's ``CUDACachingAllocator``
(native backend, default pools), whose rules this module follows:

* sizes rounded up to 512 bytes, or to a power-of-two division where
  ``roundup_power2_divisions`` says so;
* requests up to 1 MiB from the small pool, carved from 2 MiB segments; larger ones from
  the large pool, whose new segments are 20 MiB for requests under 10 MiB and the request
  rounded up to 2 MiB above;
* the smallest free block of the request's stream that fits (lowest address among
  equals), split where the rest is worth keeping (512 bytes in the small pool, more than
  1 MiB in the large), never a block of ``max_split_size_mb`` or more;
* freed blocks merged with free neighbours of their segment; whole free segments given
  back on ``empty_cache``, and before a request that would pass the memory limit fails
  (first the oversize block that fits, then every whole free segment);
* with ``expandable_segments``, one segment a pool and stream that grows by mapping
  pages (2 MiB small, 20 MiB large) instead.

Addresses of new segments are the driver's: a model replaying a recorded trace takes
them from the trace (:mod:`autotune.device._allocator_trace`), otherwise from a counter.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from autotune._profile_data import Segment

__all__ = ["AllocatorSettings", "Block", "CachingAllocator", "OutOfMemory"]

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
UNLIMITED = 1 << 63


class OutOfMemory(Exception):
    """A request the model cannot serve within the limit, as CUDA would raise."""


@dataclass(frozen=True)
class AllocatorSettings:
    """The allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``) that decide what it reserves."""

    max_split_size: int = UNLIMITED
    """Blocks this large or larger are never split (``max_split_size_mb``)."""
    max_non_split_rounding: int = LARGE_BUFFER
    """How much larger than a request an unsplittable block may be and still serve it."""
    divisions: tuple[int, ...] = (0,) * 16
    """``roundup_power2_divisions`` for sizes in [2^(20+k), 2^(21+k)) bytes, k = 0..15."""
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    large_segment_size: int = LARGE_BUFFER
    """The segment of a large-pool request under 10 MiB, and an expandable large page."""
    native: bool = True
    """Whether the allocator is the native one this models (not ``cudaMallocAsync``)."""

    @classmethod
    def parse(cls, conf: str) -> AllocatorSettings:
        """The settings a ``PYTORCH_CUDA_ALLOC_CONF`` string sets, e.g.
        ``"max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4],expandable_segments:True"``.

        Raises:
            ValueError: a value that is no number where the allocator wants one.
        """
        values: dict[str, str] = {}
        for key, value in re.findall(r"(\w+)\s*:\s*(\[[^\]]*\]|[^,\s]+)", conf):
            values[key] = value
        out = cls()
        for key, value in values.items():
            if key == "max_split_size_mb":
                out = _replace(out, max_split_size=max(int(value), 20) << 20)
            elif key == "max_non_split_rounding_mb":
                out = _replace(out, max_non_split_rounding=int(value) << 20)
            elif key == "roundup_power2_divisions":
                out = _replace(out, divisions=_divisions(value))
            elif key == "expandable_segments":
                out = _replace(out, expandable_segments=value.lower() == "true")
            elif key == "garbage_collection_threshold":
                out = _replace(out, garbage_collection_threshold=float(value))
            elif key == "large_segment_size_mb":
                out = _replace(out, large_segment_size=int(value) << 20)
            elif key == "backend":
                out = _replace(out, native=value == "native")
        return out  # the other keys (pinned memory, locks) change nothing it reserves

    def round_size(self, n: int) -> int:
        """The bytes a request of ``n`` takes."""
        if n < MIN_BLOCK:
            return MIN_BLOCK
        d = self.divisions[min(max(n.bit_length() - 1 - 20, 0), 15)]
        if d > 1 and n > MIN_BLOCK * d:
            floor = 1 << (n.bit_length() - 1)
            if floor == n:
                return n
            step = floor // d
            return n if n % step == 0 else n - n % step + step
        return -(-n // MIN_BLOCK) * MIN_BLOCK

    def segment_size(self, s: int) -> int:
        """The segment a new request of rounded size ``s`` takes from the driver."""
        if s <= SMALL_SIZE:
            return SMALL_BUFFER
        if s < MIN_LARGE_ALLOC:
            return self.large_segment_size
        return -(-s // ROUND_LARGE) * ROUND_LARGE


def _replace(settings: AllocatorSettings, **changes: object) -> AllocatorSettings:
    return dataclasses.replace(settings, **changes)  # type: ignore[arg-type]


def _divisions(value: str) -> tuple[int, ...]:
    """The division table of a ``roundup_power2_divisions`` value: ``N`` for every size,
    or ``[K:V, ..., >:V]`` by size in MiB (the first entry also covers the sizes below it,
    ``>`` those above the last)."""
    table = [0] * 16
    if not value.startswith("["):
        return tuple([int(value)] * 16)
    last = -1
    for key, v in re.findall(r"(>|\d+)\s*:\s*(\d+)", value):
        if key == ">":
            for i in range(last + 1, 16):
                table[i] = int(v)
            continue
        index = min(max(int(key).bit_length() - 1, 0), 15)
        for i in range(0 if last < 0 else index, index + 1):
            table[i] = int(v)
        last = index
    return tuple(table)


@dataclass(eq=False)
class Block:
    """A stretch of a segment: allocated to a request, or free in its pool."""

    address: int
    size: int
    stream: int
    small: bool
    segment: int
    """The segment's first address (an expandable segment's reservation)."""
    allocated: bool = False
    requested: int = 0
    mapped: bool = True
    expandable: bool = False
    prev: Block | None = None
    next: Block | None = None
    age: int = 0

    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.address)

    @property
    def whole(self) -> bool:
        """Whether it is its segment, unsplit."""
        return self.prev is None and self.next is None


@dataclass
class _Pool:
    """Free blocks in (stream, size, address) order."""

    small: bool
    keys: list[tuple[int, int, int]] = field(default_factory=list)
    blocks: dict[tuple[int, int, int], Block] = field(default_factory=dict)
    calls: int = 0

    def insert(self, block: Block) -> None:
        key = block.key()
        bisect.insort(self.keys, key)
        self.blocks[key] = block
        block.age = self.calls

    def remove(self, block: Block) -> None:
        key = block.key()
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]

    def from_(self, key: tuple[int, int, int]) -> Iterator[Block]:
        """Free blocks at ``key`` and after, in order."""
        for k in self.keys[bisect.bisect_left(self.keys, key) :]:
            yield self.blocks[k]


class CachingAllocator:
    """The caching allocator of one device, by its rules.

    Args:
        settings: Its settings (``PYTORCH_CUDA_ALLOC_CONF``).
        limit: The most it may reserve (device memory less the context, or a cap); a
            request past it is served after giving back cached segments, or refused.
        segment_address: The address the driver gives a new segment (or an expandable
            segment's reservation) of a size; default: the next free range.
    """

    def __init__(
        self,
        settings: AllocatorSettings | None = None,
        *,
        limit: int = UNLIMITED,
        segment_address: Callable[[int], int] | None = None,
    ) -> None:
        self.settings = settings or AllocatorSettings()
        self.limit = limit
        self._top = 1 << 40
        """The end of the highest segment yet: the driver's next address, by default."""
        self._address = segment_address or self._above
        self.pools = (_Pool(small=True), _Pool(small=False))
        self.allocated: dict[int, Block] = {}
        """Blocks in use, by address."""
        self.segments: dict[int, Block] = {}
        """Each plain segment's first block, by address."""
        self.expandable: dict[tuple[bool, int], _Expandable] = {}
        self.reserved = 0
        self.max_reserved = 0
        self.allocated_bytes = 0
        self.max_allocated = 0
        self.events: list[tuple[str, int, int]] = []
        """What it asked of the driver: (``segment_alloc``, ``segment_free``,
        ``segment_map`` or ``segment_unmap``, address, bytes), in order."""

    # -- requests ----------------------------------------------------------------------

    def malloc(self, n: int, stream: int = 0) -> Block:
        """Serve a request of ``n`` bytes on ``stream``.

        Raises:
            OutOfMemory: nothing cached fits, and a new segment would pass the limit even
                after every cached segment is given back.
        """
        s = self.settings.round_size(n)
        pool = self.pools[0] if s <= SMALL_SIZE else self.pools[1]
        block = self._free_block(pool, s, stream)
        if block is None:
            if self.settings.garbage_collection_threshold > 0 and self.limit < UNLIMITED:
                self._collect_garbage()
            block = self._new_block(pool, s, stream)
        if block is None and self._release_oversize(pool, s, stream):
            block = self._new_block(pool, s, stream)
        if block is None:  # the last resort: every cached segment back, then once more
            self.empty_cache()
            block = self._new_block(pool, s, stream)
        if block is None:
            raise OutOfMemory(
                f"cannot allocate {s} bytes: {self.reserved} reserved, limit {self.limit}"
            )
        block = self._split(pool, block, s)
        block.allocated, block.requested = True, n
        self.allocated[block.address] = block
        self.allocated_bytes += block.size
        self.max_allocated = max(self.max_allocated, self.allocated_bytes)
        return block

    def free(self, address: int) -> None:
        """Free the block at ``address``; it merges with free neighbours of its segment."""
        block = self.allocated.pop(address)
        block.allocated = False
        self.allocated_bytes -= block.size
        pool = self.pools[0] if block.small else self.pools[1]
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and other.mapped == block.mapped:
                pool.remove(other)
                if other is block.prev:
                    block.address, block.prev = other.address, other.prev
                    if other.prev is not None:
                        other.prev.next = block
                    if other.address in self.segments:
                        self.segments[other.address] = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                block.size += other.size
        pool.insert(block)

    def empty_cache(self) -> None:
        """Give back every whole free segment (unmap an expandable segment's free pages)."""
        for pool in (self.pools[1], self.pools[0]):
            for block in [b for b in pool.blocks.values() if b.whole and not b.expandable]:
                self._release(pool, block)
            for block in [b for b in pool.blocks.values() if b.expandable]:
                self.expandable[(pool.small, block.stream)].unmap(self, pool, block)

    # -- the rules -----------------------------------------------------------------------

    def _free_block(self, pool: _Pool, s: int, stream: int) -> Block | None:
        """The smallest free block of ``stream`` that fits ``s``, taken out of the pool."""
        pool.calls += 1
        settings = self.settings
        found, later = None, pool.from_((stream, s, 0))
        for block in later:
            if block.stream != stream:
                return None
            if block.expandable and not settings.expandable_segments:
                continue
            found = block
            break
        if found is None:
            return None
        # Of expandable blocks, not the one before the unmapped space when a block whose
        # reach is smaller fits: the space stays for requests that need it.
        for block in later:
            if not found.expandable or block.stream != stream:
                break
            if _reach(block) >= _reach(found):
                break
            found = block
        big = settings.max_split_size
        if s < big <= found.size:
            return None
        if s >= big and found.size >= s + settings.max_non_split_rounding:
            return None
        pool.remove(found)
        return found

    def _new_block(self, pool: _Pool, s: int, stream: int) -> Block | None:
        """A block of a new segment (or of newly mapped pages) for ``s``, or ``None``."""
        if self.settings.expandable_segments:
            segment = self.expandable.get((pool.small, stream))
            if segment is None:
                segment = _Expandable(self, pool.small, stream)
                self.expandable[(pool.small, stream)] = segment
            return segment.grow(self, pool, s)
        size = self.settings.segment_size(s)
        if self.reserved + size > self.limit:
            return None
        address = self._address(size)
        block = Block(address, size, stream, pool.small, segment=address)
        self.segments[address] = block
        self._reserve(size, "segment_alloc", address)
        return block

    def _split(self, pool: _Pool, block: Block, s: int) -> Block:
        """``block`` cut to ``s`` where the rest is worth keeping; the rest back in the pool."""
        rest = block.size - s
        settings = self.settings
        if pool.small or settings.expandable_segments:
            split = rest >= MIN_BLOCK
        else:
            split = s < settings.max_split_size and rest > SMALL_SIZE
        if not split:
            return block
        remainder = Block(
            block.address + s,
            rest,
            block.stream,
            block.small,
            block.segment,
            expandable=block.expandable,
            prev=block,
            next=block.next,
        )
        if block.next is not None:
            block.next.prev = remainder
        block.next, block.size = remainder, s
        pool.insert(remainder)
        return block

    def _release_oversize(self, pool: _Pool, s: int, stream: int) -> bool:
        """Give back the smallest cached unsplittable block that fits ``s`` or, failing
        that, the largest ones until as much as ``s`` is back."""
        big = self.settings.max_split_size
        if big == UNLIMITED:
            return False
        key = max(s, big)
        at = bisect.bisect_left(pool.keys, (stream, key, 0))
        if at < len(pool.keys) and pool.keys[at][0] == stream:
            self._release(pool, pool.blocks[pool.keys[at]])
            return True
        released = 0
        for k in reversed(pool.keys[:at]):
            block = pool.blocks[k]
            if released >= key or block.size < big or block.stream != stream:
                break
            released += block.size
            self._release(pool, block)
        return released >= key

    def _release(self, pool: _Pool, block: Block) -> None:
        """Give a cached block's segment back (the block is the whole segment)."""
        pool.remove(block)
        self.segments.pop(block.address, None)
        self._reserve(-block.size, "segment_free", block.address)

    def _collect_garbage(self) -> None:
        """Give back the large pool's unsplit cached blocks not reused for longest, until
        reserved bytes are under the threshold's share of the limit."""
        pool = self.pools[1]
        threshold = int(self.settings.garbage_collection_threshold * self.limit)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        while reclaimed < target:
            old = [b for b in pool.blocks.values() if b.whole and not b.expandable]
            if not old:
                return
            mean = sum(pool.calls - b.age for b in old) / len(old)
            freed = [b for b in old if pool.calls - b.age >= mean]
            for block in freed:
                reclaimed += block.size
                self._release(pool, block)
            if not freed:
                return

    def _reserve(self, nbytes: int, action: str, address: int) -> None:
        self.reserved += nbytes
        self.max_reserved = max(self.max_reserved, self.reserved)
        self.events.append((action, address, abs(nbytes)))

    def snapshot(self) -> list[Segment]:
        """The segments as a profile keeps them (see :class:`~autotune._profile_data.Requests`),
        in address order; an expandable segment once per mapped stretch, as torch's
        snapshot lists it."""
        out: list[Segment] = []
        for first in self.segments.values():
            blocks = tuple((b.size, b.allocated) for b in _from(first))
            out.append((first.address, first.stream, first.small, False, blocks))
        for segment in self.expandable.values():
            for address, blocks_ in _stretches(segment):
                out.append((address, segment.stream, segment.small, True, tuple(blocks_)))
        return sorted(out)

    def restore(
        self, address: int, blocks: list[tuple[int, bool]], *, small: bool, stream: int
    ) -> None:
        """Put a segment as a snapshot lists it (blocks' size and whether allocated) in
        the model, its free blocks cached."""
        made: list[Block] = []
        at = address
        for size, allocated in blocks:
            block = Block(at, size, stream, small, address, allocated=allocated)
            if made:
                made[-1].next, block.prev = block, made[-1]
            made.append(block)
            at += size
        pool = self.pools[0] if small else self.pools[1]
        for block in made:
            if block.allocated:
                self.allocated[block.address] = block
                self.allocated_bytes += block.size
            else:
                pool.insert(block)
        self.segments[address] = made[0]
        self.reserved += at - address
        self._cover(address, at - address)
        self.reset_peak()

    def restore_expandable(
        self, stretches: list[tuple[int, list[tuple[int, bool]]]], *, small: bool, stream: int
    ) -> None:
        """Put an expandable segment's mapped stretches (as :meth:`restore` takes one) in
        the model, its reservation taken to begin at the first."""
        stretches = sorted(stretches)
        segment = _Expandable(self, small, stream, base=stretches[0][0])
        self._cover(segment.base, segment.size)
        pool = self.pools[0] if small else self.pools[1]
        chain: list[Block] = []
        at = segment.base
        for address, blocks in stretches:
            if address > at:
                chain.append(_unmapped(segment, at, address - at))
            for size, allocated in blocks:
                chain.append(Block(address, size, stream, small, segment.base, allocated=allocated,
                                   expandable=True))  # fmt: skip
                address += size
            at = address
        chain.append(_unmapped(segment, at, segment.base + segment.size - at))
        for a, b in itertools.pairwise(chain):
            a.next, b.prev = b, a
        segment.first = chain[0]
        for block in chain:
            if block.allocated:
                self.allocated[block.address] = block
                self.allocated_bytes += block.size
            elif block.mapped:
                pool.insert(block)
        self.reserved += sum(b.size for b in chain if b.mapped)
        self.expandable[(small, stream)] = segment
        self.reset_peak()

    def _above(self, size: int) -> int:
        """A new segment's address: above every segment yet, 2 MiB aligned."""
        address = self._top
        self._top = -(-(address + size) // ROUND_LARGE) * ROUND_LARGE
        return address

    def _cover(self, address: int, size: int) -> None:
        self._top = max(self._top, -(-(address + size) // ROUND_LARGE) * ROUND_LARGE)

    def reset_peak(self) -> None:
        """Start the peaks again from what is held now."""
        self.max_reserved, self.max_allocated = self.reserved, self.allocated_bytes


class _Expandable:
    """One pool's growing segment on one stream: a reservation of address space whose
    pages are mapped as requests need them, at the lowest address that lets the free
    mapped bytes reach the request."""

    def __init__(
        self, owner: CachingAllocator, small: bool, stream: int, base: int | None = None
    ) -> None:
        self.small, self.stream = small, stream
        self.page = SMALL_BUFFER if small else owner.settings.large_segment_size
        self.size = self.page * (1 << 20)  # address space enough for any device
        self.base = owner._address(self.size) if base is None else base
        self.first = Block(
            self.base, self.size, stream, small, self.base, mapped=False, expandable=True
        )

    def blocks(self) -> Iterator[Block]:
        return _from(self.first)

    def grow(self, owner: CachingAllocator, pool: _Pool, s: int) -> Block | None:
        """A free mapped block of at least ``s`` bytes, mapping pages where needed: from
        the lowest unmapped stretch that, with the free block before it, reaches ``s``."""
        for block in self.blocks():
            if block.mapped:
                continue
            start = block.prev if _free(block.prev) else block
            assert start is not None
            run = 0
            for b in _from(start):
                if b.allocated:
                    break
                run += b.size
                if run >= s:
                    break
            if run < s:
                continue
            have = start.size if start.mapped else 0
            need = math.ceil((s - have) / self.page) * self.page
            if owner.reserved + need > owner.limit:
                return None
            if start.mapped:
                pool.remove(start)
            else:
                self._map(owner, start, s)
            while start.size < s:  # the stretch after joins it, mapped where it is not
                after = start.next
                assert after is not None and not after.allocated
                if after.mapped:
                    pool.remove(after)
                else:
                    self._map(owner, after, s - start.size)
                start.size += after.size
                start.next = after.next
                if after.next is not None:
                    after.next.prev = start
            return start
        return None

    def _map(self, owner: CachingAllocator, target: Block | None, wanted: int) -> None:
        """Map the pages of unmapped ``target`` that ``wanted`` bytes need."""
        assert target is not None and not target.mapped
        need = min(math.ceil(wanted / self.page) * self.page, target.size)
        if target.size > need:  # the rest stays unmapped
            rest = Block(
                target.address + need,
                target.size - need,
                self.stream,
                self.small,
                self.base,
                mapped=False,
                expandable=True,
                prev=target,
                next=target.next,
            )
            if target.next is not None:
                target.next.prev = rest
            target.next, target.size = rest, need
        target.mapped = True
        owner._reserve(need, "segment_map", target.address)

    def unmap(self, owner: CachingAllocator, pool: _Pool, block: Block) -> None:
        """Unmap the whole pages inside a free block; partial pages stay mapped."""
        offset = block.address - self.base  # pages count from the reservation's start
        low = self.base + -(-offset // self.page) * self.page
        high = self.base + (offset + block.size) // self.page * self.page
        if high <= low:
            return
        pool.remove(block)
        pieces = [
            (block.address, low - block.address, True),
            (low, high - low, False),
            (high, block.address + block.size - high, True),
        ]
        prev, after = block.prev, block.next
        made = []
        for address, size, mapped in pieces:
            if size:
                made.append(
                    Block(address, size, self.stream, self.small, self.base, mapped=mapped,
                          expandable=True)
                )  # fmt: skip
        for a, b in itertools.pairwise([prev, *made, after]):
            if a is not None:
                a.next = b
            if b is not None:
                b.prev = a
        if prev is None:
            self.first = made[0]
        for piece in made:
            if piece.mapped:
                pool.insert(piece)
        owner._reserve(-(high - low), "segment_unmap", low)
        self._coalesce()

    def _coalesce(self) -> None:
        """Join neighbouring unmapped stretches into one."""
        for block in list(self.blocks()):
            after = block.next
            if not block.mapped and after is not None and not after.mapped:
                block.size += after.size
                block.next = after.next
                if after.next is not None:
                    after.next.prev = block


def _stretches(segment: _Expandable) -> list[tuple[int, list[tuple[int, bool]]]]:
    """An expandable segment's mapped stretches: (address, blocks' (size, allocated))."""
    out = []
    stretch: list[Block] = []
    for block in [*segment.blocks(), None]:
        if block is not None and block.mapped:
            stretch.append(block)
        elif stretch:
            out.append((stretch[0].address, [(b.size, b.allocated) for b in stretch]))
            stretch = []
    return out


def _unmapped(segment: _Expandable, address: int, size: int) -> Block:
    return Block(address, size, segment.stream, segment.small, segment.base, mapped=False,
                 expandable=True)  # fmt: skip


def _reach(block: Block) -> int:
    """A free block's size with the unmapped space right after it."""
    after = block.next
    return block.size + (after.size if after is not None and not after.mapped else 0)


def _free(block: Block | None) -> bool:
    return block is not None and block.mapped and not block.allocated


def _from(block: Block) -> Iterator[Block]:
    b: Block | None = block
    while b is not None:
        yield b
        b = b.next
