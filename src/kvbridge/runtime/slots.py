"""First-fit allocator of byte extents in a staging buffer (both sides of a staged transfer)."""
from __future__ import annotations

ALIGN = 256


class SlotAllocator:
    """Hands out aligned ``[offset, offset + size)`` extents of a buffer of ``capacity`` bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []  # sorted (offset, size)
        self.used: dict[object, tuple[int, int]] = {}

    @staticmethod
    def rounded(size: int) -> int:
        """The extent :meth:`alloc` reserves for ``size`` bytes."""
        return max(ALIGN, -(-int(size) // ALIGN) * ALIGN)

    def alloc(self, key, size: int) -> int | None:
        """Offset of a new extent for ``key``, or None if no free extent is large enough. A key that
        already holds an extent gives it back first (a retried request must not leak the old one)."""
        self.free(key)
        size = self.rounded(size)
        for i, (off, n) in enumerate(self._free):
            if n >= size:
                if n == size:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + size, n - size)
                self.used[key] = (off, size)
                return off
        return None

    def free(self, key) -> bool:
        ext = self.used.pop(key, None)
        if ext is None:
            return False
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

    @property
    def bytes_used(self) -> int:
        return sum(n for _, n in self.used.values())
