"""The packed stream of a staged transfer (``kvbridge/staging.py``) and the staging allocator
(``runtime/slots.py``), by hypothesis: ``offsets`` are the runs' starts one after the other;
``segment_bounds`` cuts the runs into consecutive ranges that cover every run exactly once, each cut on a
run boundary at a multiple of ``segment_bytes``; ``pack`` then ``scatter`` moves every byte of every run and
nothing else, from any staging offset, into a buffer that is exactly large enough; the allocator's extents
never overlap, stay inside the buffer, hold at least the bytes asked (aligned), respect a group's quota, and
come back whole when freed."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.runtime.slots import ALIGN, SlotAllocator
from kvbridge.staging import offsets, pack, scatter, segment_bounds

lengths_st = st.lists(st.integers(1, 40), min_size=0, max_size=30)


@settings(max_examples=200, deadline=None)
@given(lengths_st, st.integers(1, 120))
def test_segments_cover_every_run_once_on_run_boundaries(lengths, segment_bytes):
    nbytes = np.asarray(lengths, np.int64)
    starts = offsets(nbytes)
    assert starts.tolist() == [sum(lengths[:i]) for i in range(len(lengths))]
    bounds = segment_bounds(nbytes, segment_bytes)
    if not lengths:
        assert bounds == []
        return
    assert bounds[0][0] == 0 and bounds[-1][1] == len(lengths)
    assert all(a < b for a, b in bounds) and all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))
    for a, b in bounds:  # a segment's runs start in one window of segment_bytes; the next starts a new one
        windows = {int(s) // segment_bytes for s in starts[a:b]}
        assert len(windows) == 1
        if b < len(lengths):
            assert int(starts[b]) // segment_bytes not in windows


@settings(max_examples=150, deadline=None)
@given(lengths_st, st.integers(0, 64), st.data())
def test_pack_then_scatter_moves_every_run_and_nothing_else(lengths, staging_offset, data):
    nbytes = np.asarray(lengths, np.int64)
    total = int(nbytes.sum())
    gaps = data.draw(st.lists(st.integers(0, 8), min_size=len(lengths), max_size=len(lengths)))
    src = np.cumsum(np.asarray([0] + [n + g for n, g in zip(lengths, gaps)][:-1], np.int64)) if lengths else \
        np.zeros(0, np.int64)
    size = int(src[-1] + nbytes[-1]) + 8 if lengths else 8
    rng = np.random.default_rng(len(lengths) + staging_offset)
    buf = rng.integers(0, 256, size, dtype=np.uint8)
    out = np.zeros(staging_offset + total, np.uint8)  # exactly large enough
    assert pack(buf, src, nbytes, out, staging_offset) == total
    assert not out[:staging_offset].any()
    back = np.full(size, 7, np.uint8)
    assert scatter(out, back, src, nbytes, staging_offset) == total
    mask = np.zeros(size, bool)
    for s, n in zip(src.tolist(), lengths):
        mask[s:s + n] = True
    assert np.array_equal(back[mask], buf[mask]) and (back[~mask] == 7).all()
    if total:
        with pytest.raises(ValueError):
            pack(buf, src, nbytes, out, staging_offset + 1)  # one byte short


def holes(held: dict, cap: int) -> list[int]:
    """Sizes of the free gaps between the extents held."""
    spans = sorted((off, off + SlotAllocator.rounded(s)) for off, s, _ in held.values())
    edges = [0] + [x for span in spans for x in span] + [cap]
    return [b - a for a, b in zip(edges[::2], edges[1::2]) if b > a]


slot_op = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 5), st.integers(1, 5 * ALIGN), st.sampled_from([None, "A", "B"])),
    st.tuples(st.just("free"), st.integers(0, 5)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(slot_op, max_size=40), st.integers(0, 16), st.integers(1, 8))
def test_slot_extents_never_overlap_and_come_back_whole(ops, blocks, quota_blocks):
    cap, limit = blocks * ALIGN, quota_blocks * ALIGN
    a = SlotAllocator(cap)
    held: dict = {}   # key -> (offset, size asked, group)
    for o in ops:
        if o[0] == "alloc":
            _, k, size, group = o
            held.pop(k, None)  # a key that holds an extent gives it back first
            used_by_group = sum(SlotAllocator.rounded(s) for _, s, g in held.values() if g == group)
            off = a.alloc(k, size, group=group, limit=limit if group else None)
            if off is not None:
                held[k] = (off, size, group)
                assert off % ALIGN == 0 and off + size <= cap
                if group:
                    assert used_by_group + SlotAllocator.rounded(size) <= limit
            elif not group or used_by_group + SlotAllocator.rounded(size) <= limit:
                # refused within the quota: no free extent of that size exists
                assert max(holes(held, cap), default=0) < SlotAllocator.rounded(size)
        else:
            assert a.free(o[1]) == (held.pop(o[1], None) is not None)
        spans = sorted((off, off + SlotAllocator.rounded(s)) for off, s, _ in held.values())
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:])), spans  # no overlap
        assert all(e <= cap for _, e in spans)
        assert a.bytes_used == sum(e - s for s, e in spans)
        for g in ("A", "B"):
            assert a.group_bytes(g) == sum(SlotAllocator.rounded(s) for _, s, gg in held.values() if gg == g)
    for k in list(held):
        a.free(k)
    assert a.bytes_used == 0 and (cap == 0 or a.alloc("all", cap) == 0)  # merged back into one extent


def test_freed_neighbours_anywhere_in_the_buffer_merge_into_one_extent():
    a = SlotAllocator(4 * ALIGN)
    for k in "wxyz":
        a.alloc(k, ALIGN)
    a.free("x")
    a.free("y")  # two free neighbours not at offset 0: one extent of 2 x ALIGN
    assert a.alloc("big", 2 * ALIGN) == ALIGN
