"""Keep freed per-request arrays in the process heap (glibc ``mallopt``).

The hot path of a direct read of small head slices builds a few large arrays per request (655,360
descriptors = ~10 MB for a 32k-token request of an 80-layer model at prefill TP 8 -> decode TP 4).
glibc serves blocks that large with ``mmap`` and gives them back to the kernel on ``free``, so every
request page-faults fresh, zeroed pages in: measured here, that alone took the lowering from ~0.9 ms to
4-5 ms (median). :func:`tune_malloc` raises glibc's mmap and trim thresholds so those blocks are reused
from the heap instead. kvbridge's own rank processes (``kvbridge demo``/``bench``, tests) call it; an
engine that embeds kvbridge may call it once at start-up (or set ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_TOP_PAD_`` in its environment). The cost: up to
``trim_bytes`` of freed heap memory is kept by the process instead of returned to the kernel.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
_TUNED: bool | None = None


def tune_malloc(mmap_threshold: int = 32 << 20, trim_bytes: int = 512 << 20, top_pad: int = 64 << 20) -> bool:
    """Apply the settings once per process; True if glibc accepted them (False elsewhere, harmless)."""
    global _TUNED
    if _TUNED is not None:
        return _TUNED
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        _TUNED = False
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)))  # at most 32 MiB on 64-bit glibc
    ok = bool(mallopt(M_TRIM_THRESHOLD, int(trim_bytes))) and ok
    ok = bool(mallopt(M_TOP_PAD, int(top_pad))) and ok
    _TUNED = ok
    return ok


def malloc_tuned() -> bool:
    return bool(_TUNED)


__all__ = ["tune_malloc", "malloc_tuned"]
