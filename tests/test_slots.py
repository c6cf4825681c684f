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
