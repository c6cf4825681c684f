"""In-process loopback transport: several agents in one process share a registry; reads are memory
copies (:func:`kvbridge.staging.copy_runs`), bounds-checked against the registered regions of both agents first (like
NIXL's ``NIXL_ERR_NOT_FOUND``), and a read's notification is delivered to the peer in-process when the
read completes. Implements :class:`~kvbridge.transport.base.Transport`, so runtime tests can run
without starting NIXL processes. Reads complete when posted (``check`` answers "DONE").
"""
from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from concurrent.futures import Future

import numpy as np

from ..errors import HandshakeError, TransferError
from .base import TransportStats


class LoopbackRegistry:
    """Agents of one process: name -> transport."""

    def __init__(self) -> None:
        self.agents: dict[str, "LoopbackTransport"] = {}
        self.lock = threading.Lock()


DEFAULT_REGISTRY = LoopbackRegistry()


class LoopbackTransport:
    name = "loopback"

    def __init__(self, agent_name: str, registry: LoopbackRegistry | None = None):
        self.agent_name = agent_name
        self.registry = registry or DEFAULT_REGISTRY
        with self.registry.lock:
            if agent_name in self.registry.agents:
                raise HandshakeError(f"a loopback agent named {agent_name!r} exists already")
            self.registry.agents[agent_name] = self
        self._regions: dict[int, int] = {}  # addr -> nbytes
        self._peers: set[str] = set()
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._notifs: dict[str, list[bytes]] = defaultdict(list)
        self._nlock = threading.Lock()
        self.bytes_moved = 0
        self.descriptors_moved = 0
        self.stats = TransportStats()

    # ---- memory --------------------------------------------------------------------------------
    def register_region(self, addr: int, nbytes: int, device: str = "cpu") -> int:
        if device != "cpu":
            raise TransferError("the loopback transport moves host memory only")
        self._regions[int(addr)] = int(nbytes)
        self.stats.regions_registered += 1
        return int(addr)

    def deregister_region(self, addr: int) -> None:
        if self._regions.pop(int(addr), None) is not None:
            self.stats.regions_deregistered += 1

    def register(self, buf) -> int:
        from ..tensors import buffer_region
        return self.register_region(*buffer_region(buf))

    def deregister(self, buf) -> None:
        from ..tensors import buffer_region
        self.deregister_region(buffer_region(buf)[0])

    # ---- peers ---------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return self.agent_name.encode()

    def add_peer(self, metadata: bytes, digest: str | None = None) -> str:
        if digest is not None:
            from .nixl import metadata_digest
            if metadata_digest(metadata) != digest:
                raise HandshakeError("agent metadata does not match its checksum; not adding it")
        name = metadata.decode()
        if name not in self.registry.agents:
            raise HandshakeError(f"no loopback agent {name!r} in this process")
        if name not in self._peers:
            self._peers.add(name)
            self.stats.peers_added += 1
        return name

    def remove_peer(self, name: str) -> None:
        if name in self._peers:
            self._peers.discard(name)
            self.stats.peers_removed += 1

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    def _peer(self, name: str) -> "LoopbackTransport":
        t = self.registry.agents.get(name)
        if name not in self._peers or t is None:
            raise TransferError(f"remote agent {name!r} is not a peer (removed or never added)", peer=name)
        return t

    # ---- reads ---------------------------------------------------------------------------------
    def _check_inside(self, regions: dict, addrs: np.ndarray, nbytes: np.ndarray, side: str) -> np.ndarray:
        """Index (into ``sorted(regions)``) of the region holding each descriptor; raises if any is outside."""
        if not addrs.size:
            return np.zeros(0, np.int64)
        bases = np.array(sorted(regions), dtype=np.int64)
        if not bases.size:
            raise TransferError(f"{side}: no registered memory")
        sizes = np.array([regions[int(b)] for b in bases], dtype=np.int64)
        i = np.searchsorted(bases, addrs, side="right") - 1
        j = np.maximum(i, 0)
        bad = (i < 0) | (addrs + nbytes > bases[j] + sizes[j])
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise TransferError(f"{side} descriptor {k} [{int(addrs[k]):#x}, +{int(nbytes[k])}) is outside every "
                                "registered region (NIXL would answer NIXL_ERR_NOT_FOUND)")
        return i

    def _copy(self, peer: str, remote, local, nbytes, notif: bytes) -> int:
        src = self._peer(peer)
        remote, local, nbytes = (np.asarray(a, dtype=np.int64) for a in (remote, local, nbytes))
        if not (remote.shape == local.shape == nbytes.shape):
            raise TransferError("descriptor lists differ in length")
        ri = self._check_inside(src._regions, remote, nbytes, "remote")
        li = self._check_inside(self._regions, local, nbytes, "local")
        copy_between_regions(self._regions, li, local, src._regions, ri, remote, nbytes)
        self.bytes_moved += int(nbytes.sum())
        self.descriptors_moved += int(nbytes.size)
        if notif:
            src._deliver(self.agent_name, notif)
        h = next(self._ids)
        self._live.add(h)
        self.stats.handles_created += 1
        return h

    def read(self, peer, remote, local, nbytes, notif=b"", remote_device=None):
        return self._copy(peer, remote, local, nbytes, notif)

    def read_descs(self, peer, descs, notif=b"", remote_device=None, cancel=None):
        if cancel is not None and cancel.cancelled:
            raise TransferError("read cancelled before it was posted", peer=peer)
        return self._copy(peer, descs.src, descs.dst, descs.nbytes, notif)

    def post(self, peer, work, notif=b"", cancel=None, remote_device=None):
        """See :meth:`NixlTransport.post`."""
        from ..lower import Descriptors
        if isinstance(work, Descriptors):
            return self.read_descs(peer, work, notif, remote_device, cancel=cancel)
        return self.read_prepped(work.prep, work.ranges, work.prefill_blocks, work.decode_blocks, notif, work.size,
                                 cancel=cancel)

    def prepare(self, peer: str, lowered, prank):
        from ..prepped import Prepared, PreparedGeometry
        self._peer(peer)
        geo = PreparedGeometry(lowered, prank)
        if not len(geo.local_rows):
            return None
        self.stats.dlists_prepared += 2 if geo.local_span_rows is None else 4
        return Prepared(peer, geo)

    def unprepare(self, prep) -> None:
        if prep is not None and not prep.released:
            prep.released = True
            self.stats.dlists_released += 2 if prep.geometry.local_span_rows is None else 4

    def read_prepped(self, prep, ranges, prefill_blocks, decode_blocks, notif=b"", size=None, cancel=None):
        if cancel is not None and cancel.cancelled:
            raise TransferError("read cancelled before it was posted", peer=prep.peer)
        peer, geo = prep.peer, prep.geometry
        req = geo.request(ranges, prefill_blocks, decode_blocks)
        lrows, rrows = geo.rows(req)
        la, ll = geo.addresses(lrows, req.local_ids)
        ra, _ = geo.addresses(rrows, req.remote_ids)
        if req.tail is not None:
            ra, la, ll = (np.concatenate([a, b]) for a, b in zip((ra, la, ll), req.tail))
        return self._copy(peer, ra, la, ll, notif)

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)
        return fut

    # ---- completion ----------------------------------------------------------------------------
    def check(self, handle) -> str:
        if handle not in self._live:
            raise TransferError(f"unknown or released handle {handle}")
        return "DONE"

    def settle(self, handle, timeout_s: float = 0.0) -> bool | None:
        return handle in self._live

    def release(self, handle) -> None:
        if handle in self._live:
            self._live.discard(handle)
            self.stats.handles_released += 1

    def live_handles(self) -> int:
        return len(self._live)

    # ---- notifications -------------------------------------------------------------------------
    def _deliver(self, sender: str, msg: bytes) -> None:
        with self._nlock:
            self._notifs[sender].append(bytes(msg))

    def get_notifs(self) -> dict[str, list[bytes]]:
        with self._nlock:
            out, self._notifs = dict(self._notifs), defaultdict(list)
        return out

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._peer(peer)._deliver(self.agent_name, msg)

    def close(self) -> None:
        with self.registry.lock:
            self.registry.agents.pop(self.agent_name, None)
        for addr in list(self._regions):
            self.deregister_region(addr)
        for p in list(self._peers):
            self.remove_peer(p)


def copy_between_regions(dst_regions: dict, di: np.ndarray, dst: np.ndarray, src_regions: dict, si: np.ndarray,
                         src: np.ndarray, nbytes: np.ndarray) -> None:
    """Copy runs between registered host regions with :func:`kvbridge.staging.copy_runs` (the one run-copy
    routine), once per (source region, destination region) pair; ``di``/``si`` index ``sorted(regions)``."""
    from ..staging import copy_runs
    from ..tensors import host_view
    if not nbytes.size:
        return
    d_bases, s_bases = sorted(dst_regions), sorted(src_regions)
    pair = si * len(d_bases) + di
    for p in np.unique(pair).tolist():
        m = pair == p
        sb, db = s_bases[p // len(d_bases)], d_bases[p % len(d_bases)]
        copy_runs(host_view(db, dst_regions[db]), dst[m] - db, host_view(sb, src_regions[sb]), src[m] - sb, nbytes[m])


__all__ = ["LoopbackTransport", "LoopbackRegistry", "copy_between_regions"]
