"""Staging extent allocator: first fit, coalescing, and no leak when a key is reused."""
from kvbridge.runtime.slots import ALIGN, SlotAllocator


def test_alloc_free_coalesce():
    a = SlotAllocator(4 * ALIGN)
    assert a.alloc("x", ALIGN) == 0
    assert a.alloc("y", 2 * ALIGN) == ALIGN
    assert a.alloc("z", 2 * ALIGN) is None  # only one extent of ALIGN left
    assert a.free("x") and a.free("y")
    assert a.alloc("w", 4 * ALIGN) == 0  # freed neighbours merged back into one extent
    assert not a.free("nope")


def test_reusing_a_key_gives_the_old_extent_back():
    a = SlotAllocator(4 * ALIGN)
    a.alloc("r1", 2 * ALIGN)
    a.alloc("r1", 2 * ALIGN)  # a retried request with the same id
    assert a.bytes_used == 2 * ALIGN
    a.free("r1")
    assert a.bytes_used == 0 and a.alloc("all", 4 * ALIGN) == 0


def test_group_quota_bounds_one_peer_and_comes_back_on_free():
    a = SlotAllocator(8 * ALIGN)
    assert a.alloc("a1", ALIGN, group="A", limit=2 * ALIGN) == 0
    assert a.alloc("a2", ALIGN, group="A", limit=2 * ALIGN) == ALIGN
    assert a.alloc("a3", ALIGN, group="A", limit=2 * ALIGN) is None  # A is at its quota: room is left
    assert a.alloc("b1", 4 * ALIGN, group="B", limit=4 * ALIGN) == 2 * ALIGN  # another peer still gets space
    assert a.group_bytes("A") == 2 * ALIGN and a.group_bytes("B") == 4 * ALIGN
    # a retried key gives its old extent back first: A holds a1 only, and a1 + 2 x ALIGN is past the quota
    assert a.alloc("a2", 2 * ALIGN, group="A", limit=2 * ALIGN) is None
    assert a.group_bytes("A") == ALIGN
    for k in ("a1", "a2", "b1"):
        a.free(k)
    assert a.group_bytes("A") == a.group_bytes("B") == a.bytes_used == 0
    assert a.alloc("big", 8 * ALIGN) == 0  # ungrouped: no quota
