"""The CUDA caching allocator's model against the allocator's documented rules
(PyTorch's ``CUDACachingAllocator``: rounding, pools, splits, merges, ``max_split_size``,
release and retry, streams, expandable segments), and against the traces recorded on
GPUs (``tests/data/allocator-traces``: every one replayed to its last segments)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.device._allocator_trace import (
    Divergence,
    Trace,
    read_trace,
    replay,
    segment_of,
)
from autotune.device._caching_allocator import AllocatorSettings, CachingAllocator, OutOfMemory

MiB = 2**20
TRACES = sorted((Path(__file__).parents[1] / "data" / "allocator-traces").glob("*.json.gz"))


def test_sizes_round_to_512_bytes_or_to_power_of_two_divisions() -> None:
    plain = AllocatorSettings()
    assert [plain.round_size(n) for n in (1, 512, 513, 1_000_000)] == [512, 512, 1024, 1_000_448]
    four = AllocatorSettings.parse("roundup_power2_divisions:4")
    assert four.round_size(1_200_000) == MiB + MiB // 4  # quarters of 1 MiB above 1 MiB
    assert four.round_size(2 * MiB) == 2 * MiB  # a power of two stays
    assert four.round_size(1500) == 1536  # not above 512 x 4: plain rounding
    # By size: 1 up to 256 MiB (and below), 2 for [512 MiB, 1 GiB), 4 above.
    listed = AllocatorSettings.parse("roundup_power2_divisions:[256:1,512:2,>:4]")
    assert listed.round_size(600 * MiB) == 768 * MiB
    assert listed.round_size(1100 * MiB) == 1280 * MiB
    assert listed.round_size(300 * MiB) == 300 * MiB


def test_settings_are_read_as_the_allocator_reads_them() -> None:
    conf = (
        "max_split_size_mb:128, roundup_power2_divisions:[256:1,>:4],"
        "expandable_segments:True,garbage_collection_threshold:0.6,pinned_use_host_register:True"
    )
    settings = AllocatorSettings.parse(conf)
    assert settings.max_split_size == 128 * MiB
    assert settings.expandable_segments and settings.garbage_collection_threshold == 0.6
    assert settings.divisions[8] == 1 and settings.divisions[9] == 4
    assert settings.native  # pinned memory's keys change nothing the device reserves
    assert not AllocatorSettings.parse("backend:cudaMallocAsync").native


def test_each_pool_takes_segments_of_its_own_sizes() -> None:
    settings = AllocatorSettings()
    assert settings.segment_size(MiB) == 2 * MiB  # small pool: 2 MiB segments
    assert settings.segment_size(MiB + 512) == 20 * MiB  # 1 to 10 MiB: 20 MiB
    assert settings.segment_size(10 * MiB - 512) == 20 * MiB
    assert settings.segment_size(10 * MiB) == 10 * MiB
    assert settings.segment_size(11 * MiB + 512) == 12 * MiB  # above: up to 2 MiB


def test_small_requests_are_packed_into_2_mib_segments() -> None:
    model = CachingAllocator()
    blocks = [model.malloc(500 * 1024) for _ in range(5)]
    assert [b.address - blocks[0].address for b in blocks[:4]] == [0, 512_000, 1_024_000, 1_536_000]
    assert blocks[4].segment != blocks[0].segment  # 4 x 500 KiB fill 2 MiB; the 5th needs more
    assert model.reserved == 4 * MiB
    assert model.allocated_bytes == 5 * 512_000


def test_a_large_block_is_split_only_where_more_than_1_mib_is_left() -> None:
    model = CachingAllocator()
    a = model.malloc(5 * MiB)  # a 20 MiB segment, split
    b = model.malloc(5 * MiB)
    c = model.malloc(9 * MiB)  # 10 MiB left: 1 MiB would remain, not more: the whole 10
    assert (b.address - a.address, c.address - a.address) == (5 * MiB, 10 * MiB)
    assert (a.size, b.size, c.size) == (5 * MiB, 5 * MiB, 10 * MiB)
    assert model.reserved == 20 * MiB and model.allocated_bytes == 20 * MiB


def test_the_smallest_fitting_block_is_taken_the_lowest_address_first() -> None:
    model = CachingAllocator()
    sizes = (30, 40, 30, 24)
    blocks = [model.malloc(n * MiB) for n in sizes]
    for b in blocks[:3]:
        model.free(b.address)
    taken = model.malloc(25 * MiB)  # the 30s fit best; the first of them
    assert taken.address == blocks[0].address
    assert taken.size == 25 * MiB  # 5 MiB remain: split
    assert model.malloc(28 * MiB).address == blocks[2].address
    assert model.reserved == sum(sizes) * MiB  # nothing new


def test_freed_neighbours_merge_and_only_whole_free_segments_are_given_back() -> None:
    model = CachingAllocator()
    a, b = model.malloc(5 * MiB), model.malloc(5 * MiB)
    other = model.malloc(30 * MiB)
    model.free(a.address)
    model.empty_cache()
    assert model.reserved == 50 * MiB  # the 20 MiB segment is still in use by b
    model.free(b.address)  # merges with a's block and the rest: the segment whole again
    model.free(other.address)
    model.empty_cache()
    assert model.reserved == 0
    assert [e[0] for e in model.events] == ["segment_alloc"] * 2 + ["segment_free"] * 2


def test_max_split_size_keeps_oversize_blocks_whole_and_for_large_requests() -> None:
    model = CachingAllocator(AllocatorSettings.parse("max_split_size_mb:64"))
    big = model.malloc(100 * MiB)
    model.free(big.address)
    small = model.malloc(50 * MiB)  # under 64 MiB: never from an oversize block
    assert small.segment != big.segment
    model.free(small.address)
    too_big = model.malloc(70 * MiB)  # 100 MiB >= 70 + 20: not taken either
    assert too_big.segment not in (big.segment, small.segment)
    taken = model.malloc(90 * MiB)  # 100 MiB < 90 + 20: taken whole, not split
    assert (taken.address, taken.size) == (big.address, 100 * MiB)


def test_a_request_past_the_limit_gives_back_cached_segments_then_retries() -> None:
    model = CachingAllocator(limit=60 * MiB)
    cached = model.malloc(40 * MiB)
    model.free(cached.address)
    model.malloc(50 * MiB)  # 40 + 50 > 60: the cached 40 MiB goes back first
    assert model.reserved == 50 * MiB and model.max_reserved == 50 * MiB
    assert [e[0] for e in model.events] == ["segment_alloc", "segment_free", "segment_alloc"]


def test_an_out_of_memory_error_comes_only_after_every_cached_segment_is_back() -> None:
    model = CachingAllocator(limit=60 * MiB)
    split = model.malloc(5 * MiB)  # keeps its 20 MiB segment in use
    loose = model.malloc(30 * MiB)
    model.free(loose.address)
    with pytest.raises(OutOfMemory):
        model.malloc(45 * MiB)  # 20 in use + 45 > 60, even with the 30 given back
    assert model.reserved == 20 * MiB  # the cached 30 MiB went back on the way
    assert split.address in model.allocated


def test_max_split_size_gives_back_the_largest_oversize_blocks_until_enough() -> None:
    model = CachingAllocator(AllocatorSettings.parse("max_split_size_mb:32"), limit=200 * MiB)
    blocks = [model.malloc(n * MiB) for n in (40, 60, 80)]
    for b in blocks:
        model.free(b.address)
    model.malloc(110 * MiB)  # 180 + 110 > 200, and no cached block is of 110 MiB or more:
    # the largest oversize blocks go back until 110 MiB are back (the 80, then the 60)
    freed = [(a, n) for a, _, n in model.events if a == "segment_free"]
    assert [n for _, n in freed] == [80 * MiB, 60 * MiB]
    assert model.reserved == 150 * MiB


def test_max_split_size_gives_back_just_the_smallest_oversize_block_that_fits() -> None:
    model = CachingAllocator(AllocatorSettings.parse("max_split_size_mb:32"), limit=200 * MiB)
    blocks = [model.malloc(n * MiB) for n in (40, 60, 80)]
    for b in blocks:
        model.free(b.address)
    model.malloc(35 * MiB)  # the 40 is served as it is: 40 < 35 + 20
    model.malloc(45 * MiB)  # 60 < 65: served too
    model.malloc(70 * MiB)  # 80 < 90: served; nothing given back
    assert model.reserved == 180 * MiB and not any(e[0] == "segment_free" for e in model.events)
    model.free(blocks[2].address)
    model.malloc(30 * MiB)  # under 32: not from the cached 80; 180 + 30 > 200: the 80 goes
    assert [n for a, _, n in model.events if a == "segment_free"] == [80 * MiB]


def test_a_block_freed_on_one_stream_serves_no_other() -> None:
    model = CachingAllocator()
    side = model.malloc(30 * MiB, stream=1)
    model.free(side.address)
    assert model.malloc(30 * MiB, stream=0).segment != side.segment
    assert model.malloc(30 * MiB, stream=1).address == side.address


def test_expandable_segments_grow_by_pages_and_give_back_whole_free_pages() -> None:
    model = CachingAllocator(AllocatorSettings.parse("expandable_segments:True"))
    a = model.malloc(5 * MiB)  # one 20 MiB page of the large pool
    b = model.malloc(30 * MiB)  # the 15 MiB left and one more page
    assert model.reserved == 40 * MiB
    assert b.address == a.address + 5 * MiB  # one segment, growing
    assert [e[0] for e in model.events] == ["segment_map", "segment_map"]
    model.free(b.address)
    model.empty_cache()  # a's page stays (a lives in it), the second page goes
    assert model.reserved == 20 * MiB
    model.free(a.address)
    model.empty_cache()
    assert model.reserved == 0


def test_a_recorded_trace_replays_and_a_wrong_address_is_a_divergence() -> None:
    base = 1 << 32
    actions = [
        {"action": "segment_alloc", "addr": base, "size": 2 * MiB, "stream": 0},
        {"action": "alloc", "addr": base, "size": 1000, "stream": 0},
        {"action": "alloc", "addr": base + 1024, "size": 4000, "stream": 0},
        {"action": "free_requested", "addr": base, "size": 1000, "stream": 0},
        {"action": "free_completed", "addr": base, "size": 1000, "stream": 0},
        {"action": "alloc", "addr": base, "size": 512, "stream": 0},
    ]
    blocks = [(512, "active_allocated"), (512, "inactive"), (4096, "active_allocated")]
    end_blocks = [*blocks, (2 * MiB - 5120, "inactive")]
    end = [
        {
            "address": base,
            "total_size": 2 * MiB,
            "stream": 0,
            "segment_type": "small",
            "blocks": [{"size": n, "state": s} for n, s in end_blocks],
        }
    ]
    trace = Trace("", [], actions, end, 2 * MiB, {})
    model = replay(trace)
    assert model.snapshot() == sorted(segment_of(s) for s in trace.end)
    assert model.max_reserved == trace.max_reserved
    wrong = [*actions[:-1], {**actions[-1], "addr": base + 5120}]
    with pytest.raises(Divergence, match="action 5"):
        replay(Trace("", [], wrong, end, 2 * MiB, {}))


@pytest.mark.skipif(not TRACES, reason="no allocator trace recorded on a GPU yet")
@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_every_recorded_trace_ends_with_the_allocator_s_segments(path: Path) -> None:
    trace = read_trace(path)
    model = replay(trace)
    assert model.snapshot() == sorted(segment_of(s) for s in trace.end)
    assert model.max_reserved == trace.max_reserved


def test_the_settings_replayed_are_those_the_allocator_reports_in_force(monkeypatch) -> None:
    """The snapshot carries the settings however they were set (either variable, or
    ``_set_allocator_settings`` at run time): they are the replay's; without a snapshot,
    the environment as the allocator reads it, ``PYTORCH_ALLOC_CONF`` first."""
    from autotune.device._allocator_trace import allocator_conf

    reported = {
        "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6",  # the last one set
        "max_split_size": 128 * MiB,
        "garbage_collection_threshold": 0.6,
        "expandable_segments": True,  # set by the variable before the last call
        "roundup_power2_divisions": {str(1 << k): (4 if k >= 8 else 0) for k in range(16)},
    }
    conf = allocator_conf({"segments": [], "allocator_settings": reported})
    settings = AllocatorSettings.parse(conf)
    assert settings.expandable_segments and settings.garbage_collection_threshold == 0.6
    assert settings.max_split_size == 128 * MiB
    assert settings.divisions == (0,) * 8 + (4,) * 8
    default = {"max_split_size": 2**64 - 1, "garbage_collection_threshold": 0.0}
    assert allocator_conf({"allocator_settings": {**default, "expandable_segments": False}}) == ""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert allocator_conf() == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    assert allocator_conf({"segments": []}) == "expandable_segments:False"


def test_a_capped_replay_gives_back_cached_segments_where_the_uncapped_one_grows() -> None:
    """Under the runner's cap the allocator gives back cached segments before it would
    pass it, and retries: the replay does too, and reserves no more than the cap; a step
    it cannot serve even so is refused, as the device would refuse it."""
    from autotune._profile_data import Line, Requests
    from autotune.device._allocator_trace import CANNOT_RUN, reserved_beyond

    # 30 MiB made and freed, then 40 MiB: uncapped, the first segment stays cached.
    sizes = (Line(30.0 * MiB, 0.0), Line(40.0 * MiB, 0.0))
    requests = Requests("", (), sizes, (0, 0), (0, -1, 1, -2))
    uncapped = reserved_beyond(requests, 1, accum=1)
    assert uncapped == 30 * MiB  # 70 MiB reserved for a live peak of 40
    assert reserved_beyond(requests, 1, accum=1, cap=50 * MiB) == 0
    assert reserved_beyond(requests, 1, accum=1, cap=39 * MiB) == CANNOT_RUN


def test_the_replay_runs_steps_until_the_cache_is_steady() -> None:
    """A run's second step starts from the segments its first cached, and can reserve
    more than the first did: its 6 MiB request now takes the smallest cached block that
    fits (a 12 MiB segment), which pushes the 12 MiB ones into the 20 and 22 MiB
    segments, and the 22 MiB request finds none left: a segment more (verification
    measures four steps). The replay goes on until a step reserves nothing new."""
    from autotune._profile_data import Line, Requests
    from autotune.device._allocator_trace import reserved_beyond

    sizes = tuple(Line(float(n * MiB), 0.0) for n in (6, 12, 12, 22))
    requests = Requests("", (), sizes, (0,) * 4, (0, 1, 2, 3, -3, -4, -1, -2))
    first = CachingAllocator()
    for n in (6, 12, 12, 22):
        first.malloc(n * MiB)
    assert first.max_reserved == 54 * MiB  # one step from nothing: 2 MiB beyond 52 live
    assert reserved_beyond(requests, 1, accum=1) == 76 * MiB - 52 * MiB
