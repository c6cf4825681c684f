"""First-fit allocator of byte extents in a staging buffer (both sides of a staged transfer)."""
from __future__ import annotations

from collections.abc import Hashable

ALIGN = 256


class SlotAllocator:
    """Hands out aligned ``[offset, offset + size)`` extents of a buffer of ``capacity`` bytes.

    An extent may be charged to a ``group`` (a peer): :meth:`alloc` refuses one that would take the
    group past ``limit`` bytes (a per-peer quota), and :meth:`group_bytes` says what a group holds."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []  # sorted (offset, size)
        self.used: dict[object, tuple[int, int]] = {}
        self._group_of: dict[object, object] = {}   # key -> group it is charged to
        self._group_bytes: dict[object, int] = {}   # group -> bytes its extents hold

    @staticmethod
    def rounded(size: int) -> int:
        """The extent :meth:`alloc` reserves for ``size`` bytes."""
        return max(ALIGN, -(-int(size) // ALIGN) * ALIGN)

    def alloc(self, key: Hashable, size: int, group: Hashable = None, limit: int | None = None) -> int | None:
        """Offset of a new extent for ``key``, or None if no free extent is large enough (or the extent
        would take ``group`` past ``limit`` bytes). A key that already holds an extent gives it back
        first (a retried request must not leak the old one)."""
        self.free(key)
        size = self.rounded(size)
        if group is not None and limit is not None and self._group_bytes.get(group, 0) + size > limit:
            return None
        for i, (off, n) in enumerate(self._free):
            if n >= size:
                if n == size:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + size, n - size)
                self.used[key] = (off, size)
                if group is not None:
                    self._group_of[key] = group
                    self._group_bytes[group] = self._group_bytes.get(group, 0) + size
                return off
        return None

    def free(self, key: Hashable) -> bool:
        ext = self.used.pop(key, None)
        if ext is None:
            return False
        group = self._group_of.pop(key, None)
        if group is not None:
            left = self._group_bytes[group] - ext[1]
            if left:
                self._group_bytes[group] = left
            else:
                del self._group_bytes[group]
        self._free.append(ext)
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for off, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        self._free = merged
        return True

    def rename(self, key: Hashable, new: Hashable) -> bool:
        """The extent of ``key`` is held by ``new`` from now on (False if ``key`` holds none, or ``new``
        holds one already)."""
        if key not in self.used or new in self.used:
            return False
        self.used[new] = self.used.pop(key)
        if key in self._group_of:
            self._group_of[new] = self._group_of.pop(key)
        return True

    def group_bytes(self, group: Hashable) -> int:
        """Bytes held by the extents charged to ``group``."""
        return self._group_bytes.get(group, 0)

    @property
    def bytes_used(self) -> int:
        return sum(n for _, n in self.used.values())
