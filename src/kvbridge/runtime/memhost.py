"""What a rank does with the engine's KV memory: check it, register it, address it for copies."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from ..errors import LayoutError
from ..layout import engine_to_dict
from ..memory import KVMemory
from ..tensors import host_view, is_torch_tensor

if TYPE_CHECKING:
    from ..layout import EngineLayout
    from ..staging import DeviceCopies, RunSlice
    from ..transport.base import Transport

# a staging buffer or a KV byte buffer: a 1-D uint8 numpy array, or a uint8 torch tensor on the memory's
# device (torch is never imported here)
Buffer = Any

_enc = msgspec.msgpack.Encoder()


def check_memory(memory: object, engine: EngineLayout, rank: Sequence[int]) -> KVMemory:
    """The rank's :class:`KVMemory`, checked against the engine layout it is used with."""
    if not isinstance(memory, KVMemory):
        raise LayoutError(f"rank {tuple(rank)}: give the engine's KV memory as a kvbridge.KVMemory "
                          f"(kvbridge.describe_memory(...)); got {type(memory).__name__}")
    if tuple(memory.rank) != tuple(rank):
        raise LayoutError(f"the memory describes rank {memory.rank}, this endpoint is rank {tuple(rank)}")
    if memory.engine != engine and engine_to_dict(memory.engine) != engine_to_dict(engine):
        raise LayoutError(f"the memory was described for {memory.engine}, this endpoint serves {engine}")
    return memory


def transport_device(mem: KVMemory) -> dict[str, Any]:
    """NIXL memory type and device of the rank's KV memory (one device per rank)."""
    dev = mem.device
    if dev == "mixed":
        raise LayoutError(
            f"rank {mem.rank}: KV memory on several devices {sorted({a.device for a in mem.allocations})}; "
            f"one rank's cache must live on one device"
        )
    if dev == "cpu":
        return {"mem_type": "DRAM", "device_id": 0}
    return {"mem_type": "VRAM", "device_id": mem.allocations[0].device_id}


def register_memory(transport: Transport, mem: KVMemory) -> None:
    """Register every distinct allocation once, as its own region."""
    for a in mem.allocations:
        transport.register_region(a.addr, a.nbytes, a.device)


def deregister_memory(transport: Transport, mem: KVMemory) -> None:
    for a in mem.allocations:
        transport.deregister_region(a.addr)


def host_span(mem: KVMemory) -> tuple[np.ndarray | None, int]:
    """One uint8 view over ``[lowest, highest)`` address of the rank's host allocations, and its base
    (absolute run addresses minus the base index it). Only bytes inside the allocations are ever
    touched through it (runs are checked to lie in them). None for GPU memory."""
    if mem.device != "cpu" or not mem.allocations:
        return None, 0
    lo = mem.allocations[0].addr
    hi = max(a.end for a in mem.allocations)
    return host_view(lo, hi - lo), lo


def torch_of(mem: KVMemory) -> ModuleType | None:
    """The torch module when the engine described ``mem`` with torch tensors (never imported here)."""
    return next((sys.modules["torch"] for t in mem.keepalive if is_torch_tensor(t)), None)


class _CudaBytes:
    """``__cuda_array_interface__`` of ``nbytes`` device bytes at ``addr``: ``torch.as_tensor`` wraps it
    without a copy (an allocation of the engine's, known by address)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "strides": None, "version": 3}


class KVBytes:
    """The rank's KV memory as byte buffers for staged copies, on the memory's own device.

    Memory the engine described with torch tensors (CPU or CUDA) is seen as one uint8 torch tensor per
    registered allocation on that device (``bufs``) and one over the span of all of them, and the staging
    buffer is a torch tensor there too: pack and scatter are :class:`kvbridge.staging.DeviceCopies`
    (index tensors and copies on the device, runs given as a :class:`kvbridge.staging.RunSlice` of the
    lowering's descriptors or as addresses), the same code for CPU and CUDA tensors. Other host memory
    (numpy arrays, raw host regions) is one numpy view over its span and a numpy staging buffer. A run
    never crosses an allocation (lowering never merges across two)."""

    def __init__(self, mem: KVMemory) -> None:
        self.device: str = mem.device
        self.torch: Any = torch_of(mem)  # the torch module (ModuleType: its attributes are Any to mypy)
        self.cuda = self.device != "cpu"
        self.copies: DeviceCopies | None = None  # for torch memory: pack and scatter on the device
        self.bases: np.ndarray | None  # each buffer's absolute address (None: not usable)
        self.bufs: list[Buffer] | None
        if self.torch is None:
            if self.cuda:  # device memory known only by address (RawRegion): torch if the engine loaded it
                self.torch = sys.modules.get("torch")
                if self.torch is None:
                    self.bases = self.bufs = None
                    return
            else:
                buf, lo = host_span(mem)
                self.bases, self.bufs = np.array([lo], np.int64), [buf]
                return
        from ..staging import DeviceCopies
        torch = self.torch
        self.bases = np.array([a.addr for a in mem.allocations], np.int64)
        lo, hi = min(a.addr for a in mem.allocations), max(a.end for a in mem.allocations)
        if self.cuda:
            self.bufs = [torch.as_tensor(_CudaBytes(a.addr, a.nbytes), device=self.device) for a in mem.allocations]
            span = torch.as_tensor(_CudaBytes(lo, hi - lo), device=self.device)
        else:
            self.bufs = [torch.from_numpy(host_view(a.addr, a.nbytes)) for a in mem.allocations]
            span = torch.from_numpy(host_view(lo, hi - lo))
        # one byte tensor over [lowest, highest) address of the allocations: a request's runs in every
        # allocation move with one index operation; only bytes inside the allocations are ever indexed
        self.copies = DeviceCopies(torch, span, lo)

    @property
    def usable(self) -> bool:
        """Staged copies can run on this memory (False: device memory and no torch)."""
        return self.bufs is not None

    def new_staging(self, nbytes: int) -> Buffer:
        """A staging buffer of ``nbytes`` on the memory's device, every page touched now (not on the first
        request's critical path): a torch tensor there for torch memory, else a numpy array."""
        if self.torch is not None:
            return self.torch.zeros(int(nbytes), dtype=self.torch.uint8, device=self.device)
        out = np.empty(int(nbytes), dtype=np.uint8)
        out.fill(0)
        return out

    def _groups(self, addrs: np.ndarray) -> list[tuple[Buffer, np.ndarray, np.ndarray | None]]:
        """(buffer, addresses relative to it, run indices or None) per allocation the runs at ``addrs`` lie
        in: one stable sort, so many allocations (a tensor per layer) cost O(runs log runs), not a pass
        over the runs per allocation."""
        bufs, bases = self.bufs, self.bases
        assert bufs is not None and bases is not None, "staged copies on memory that is not usable"
        if len(bufs) == 1:
            return [(bufs[0], addrs - bases[0], None)]
        which = np.searchsorted(bases, addrs, side="right") - 1
        order = np.argsort(which, kind="stable")
        w = which[order]
        edges = [0, *(np.flatnonzero(np.diff(w)) + 1).tolist(), w.size]
        out: list[tuple[Buffer, np.ndarray, np.ndarray | None]] = []
        for a, b in zip(edges[:-1], edges[1:]):
            idx = order[a:b]
            i = int(w[a])
            out.append((bufs[i], addrs[idx] - bases[i], idx))
        return out

    def pack(self, src: np.ndarray | RunSlice, nbytes: np.ndarray, staging: Buffer, offset: int) -> int:
        """Runs (absolute addresses ``src``, or a :class:`kvbridge.staging.RunSlice` of a request's
        descriptors) of lengths ``nbytes`` one after the other into ``staging`` from ``offset``; returns
        the bytes packed, the copy finished (a peer reads the buffer next)."""
        from ..staging import RunSlice, copy_runs, offsets
        nbytes = np.asarray(nbytes, np.int64)
        total = int(nbytes.sum())
        if offset + total > staging_nbytes(staging):
            raise ValueError(f"staging buffer too small: {offset + total} bytes needed, "
                             f"{staging_nbytes(staging)} available")
        if self.copies is not None:
            return int(self.copies.pack(src, nbytes, staging, offset))
        if isinstance(src, RunSlice):
            src = src.addresses()
        pos = offsets(nbytes) + offset
        for buf, rel, m in self._groups(np.asarray(src, np.int64)):
            copy_runs(staging, pos if m is None else pos[m], buf, rel, nbytes if m is None else nbytes[m])
        return total

    def scatter(self, staging: Buffer, dst: np.ndarray | RunSlice, nbytes: np.ndarray, offset: int) -> int:
        """Inverse of :meth:`pack`: the packed runs of ``staging`` from ``offset`` to ``dst`` (absolute
        addresses or a :class:`kvbridge.staging.RunSlice`); returns when the bytes are in the KV memory."""
        from ..staging import RunSlice, copy_runs, offsets
        nbytes = np.asarray(nbytes, np.int64)
        if self.copies is not None:
            return int(self.copies.scatter(staging, dst, nbytes, offset))
        if isinstance(dst, RunSlice):
            dst = dst.addresses()
        pos = offsets(nbytes) + offset
        for buf, rel, m in self._groups(np.asarray(dst, np.int64)):
            copy_runs(buf, rel, staging, pos if m is None else pos[m], nbytes if m is None else nbytes[m])
        return int(nbytes.sum())


def staging_nbytes(buf: Buffer) -> int:
    """Bytes of a staging buffer (numpy array or torch tensor)."""
    return int(buf.nbytes) if isinstance(buf, np.ndarray) else int(buf.numel() * buf.element_size())


def to_host(buf: Buffer) -> np.ndarray:
    """A host numpy copy or view of a staging buffer (for checks and digests)."""
    return buf if isinstance(buf, np.ndarray) else buf.detach().cpu().numpy()


def wire_key(d: dict[str, Any]) -> bytes:
    """A cache key for a memory description received on the wire."""
    return _enc.encode(d)
