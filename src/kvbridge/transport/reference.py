"""In-process reference transport: performs descriptor pairs as memory copies between numpy buffers.

Every descriptor is bounds-checked against the registered buffers first (like NIXL's
``NIXL_ERR_NOT_FOUND``), so a lowering bug is an error, never a stray write.
"""
from __future__ import annotations

import ctypes
import itertools

import numpy as np

from ..errors import TransferError


class ReferenceTransport:
    name = "reference"

    def __init__(self, agent: str = "ref") -> None:
        self.agent = agent
        self._bufs: dict[int, np.ndarray] = {}
        self._live: set[int] = set()
        self._ids = itertools.count()
        self.bytes_moved = 0
        self.descriptors_moved = 0

    def register(self, buf: np.ndarray) -> int:
        if buf.dtype != np.uint8 or not buf.flags.c_contiguous:
            raise ValueError("register a contiguous uint8 buffer")
        addr = buf.ctypes.data
        self._bufs[addr] = buf
        return addr

    def register_region(self, addr: int, nbytes: int, device: str = "cpu") -> int:
        from ..tensors import host_view
        if device != "cpu":
            raise TransferError("the reference transport moves host memory only")
        self._bufs[addr] = host_view(addr, nbytes)
        return addr

    def deregister_region(self, addr: int) -> None:
        self._bufs.pop(addr, None)

    def deregister(self, buf: np.ndarray) -> None:
        self._bufs.pop(buf.ctypes.data, None)

    def _check_inside(self, addrs: np.ndarray, nbytes: np.ndarray, side: str) -> None:
        if not addrs.size:
            return
        bases = np.array(sorted(self._bufs), dtype=np.int64)
        sizes = np.array([self._bufs[int(b)].size for b in bases], dtype=np.int64)
        i = np.searchsorted(bases, addrs, side="right") - 1
        bad = (i < 0) | (addrs + nbytes > bases[np.maximum(i, 0)] + sizes[np.maximum(i, 0)])
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise TransferError(f"{side} descriptor {k} [{int(addrs[k]):#x}, +{int(nbytes[k])}) is outside every "
                                "registered buffer (NIXL would answer NIXL_ERR_NOT_FOUND)")

    def read_descs(self, peer, descs, notif=b""):
        return self.read(peer, descs.src, descs.dst, descs.nbytes, notif)

    def read(self, peer, remote, local, nbytes, notif=b""):
        remote = np.asarray(remote, dtype=np.int64)
        local = np.asarray(local, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.int64)
        if not (remote.shape == local.shape == nbytes.shape):
            raise TransferError("descriptor lists differ in length")
        self._check_inside(remote, nbytes, "remote")
        self._check_inside(local, nbytes, "local")
        for s, d, n in zip(remote.tolist(), local.tolist(), nbytes.tolist()):
            ctypes.memmove(d, s, n)
        self.bytes_moved += int(nbytes.sum())
        self.descriptors_moved += int(nbytes.size)
        h = next(self._ids)
        self._live.add(h)
        return h

    def check(self, handle) -> str:
        if handle not in self._live:
            raise TransferError(f"unknown or released handle {handle}")
        return "DONE"

    def settle(self, handle, timeout_s: float = 0.0) -> bool | None:
        return handle in self._live  # copies are done when read() returns

    def release(self, handle) -> None:
        self._live.discard(handle)

    def live_handles(self) -> int:
        return len(self._live)
