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
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..errors import HandshakeError, TransferError
from .base import Cancellable, DirectRead, TransportBookkeeping, check_cancel

if TYPE_CHECKING:
    from ..lower import LoweredPlan
    from ..prepped import Prepared

R = TypeVar("R")


class LoopbackRegistry:
    """Agents of one process: name -> transport."""

    def __init__(self) -> None:
        self.agents: dict[str, LoopbackTransport] = {}
        self.lock = threading.Lock()


DEFAULT_REGISTRY = LoopbackRegistry()


class LoopbackTransport(TransportBookkeeping):
    name = "loopback"

    def __init__(self, agent_name: str, registry: LoopbackRegistry | None = None) -> None:
        super().__init__()
        self.agent_name = agent_name
        self.registry = registry or DEFAULT_REGISTRY
        with self.registry.lock:
            if agent_name in self.registry.agents:
                raise HandshakeError(f"a loopback agent named {agent_name!r} exists already")
            self.registry.agents[agent_name] = self
        self._regions: dict[int, int] = {}  # addr -> nbytes
        self._ids = itertools.count()
        self._notifs: defaultdict[str, list[bytes]] = defaultdict(list)
        self._nlock = threading.Lock()
        self.bytes_moved = 0
        self.descriptors_moved = 0

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
        self.peer_added(name)
        return name

    def _peer(self, name: str) -> LoopbackTransport:
        t = self.registry.agents.get(name)
        if name not in self.peers or t is None:
            raise TransferError(f"remote agent {name!r} is not a peer (removed or never added)", peer=name)
        return t

    # ---- reads ---------------------------------------------------------------------------------
    def _check_inside(self, regions: dict[int, int], addrs: np.ndarray, nbytes: np.ndarray, side: str) -> np.ndarray:
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

    def _copy(self, peer: str, remote: Any, local: Any, nbytes: Any, notif: bytes, write: bool = False) -> int:
        """A READ (``remote`` -> ``local``) or, ``write``, a WRITE (``local`` -> ``remote``); the notification
        goes to the peer either way (as NIXL delivers it to the remote agent)."""
        src = self._peer(peer)
        remote, local, nbytes = (np.asarray(a, dtype=np.int64) for a in (remote, local, nbytes))
        if not (remote.shape == local.shape == nbytes.shape):
            raise TransferError("descriptor lists differ in length")
        ri = self._check_inside(src._regions, remote, nbytes, "remote")
        li = self._check_inside(self._regions, local, nbytes, "local")
        if write:
            copy_between_regions(src._regions, ri, remote, self._regions, li, local, nbytes)
        else:
            copy_between_regions(self._regions, li, local, src._regions, ri, remote, nbytes)
        self.bytes_moved += int(nbytes.sum())
        self.descriptors_moved += int(nbytes.size)
        if notif:
            src._deliver(self.agent_name, notif)
        h = next(self._ids)
        self.track(h)
        return h

    def read(self, peer: str, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray, notif: bytes = b"",
             remote_device: str | None = None, cancel: Cancellable | None = None,
             local_device: str | None = None) -> int:
        check_cancel(cancel, peer)
        return self._copy(peer, remote, local, nbytes, notif)

    def write(self, peer: str, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, notif: bytes = b"",
              remote_device: str | None = None, local_device: str | None = None) -> int:
        """See :meth:`~kvbridge.transport.base.Transport.write`: copied at once, bounds-checked on both sides."""
        return self._copy(peer, remote, local, nbytes, notif, write=True)

    def post(self, peer: str, work: DirectRead, notif: bytes = b"", cancel: Cancellable | None = None,
             remote_device: str | None = None) -> int:
        """See :meth:`~kvbridge.transport.base.Transport.post`: the prepared lists' indices are expanded
        back to addresses and copied at once."""
        prep = work.prep
        check_cancel(cancel, prep.peer)
        geo = prep.geometry
        req = geo.request(work.ranges, work.prefill_blocks, work.decode_blocks)
        lrows, rrows = geo.rows(req)
        la, ll = geo.addresses(lrows, req.local_ids)
        ra, _ = geo.addresses(rrows, req.remote_ids)
        if req.tail is not None:
            ra, la, ll = (np.concatenate([a, b]) for a, b in zip((ra, la, ll), req.tail))
        return self._copy(prep.peer, ra, la, ll, notif)

    def prepare(self, peer: str, lowered: LoweredPlan, prank: tuple[int, int]) -> Prepared | None:
        from ..prepped import Prepared, PreparedGeometry
        self._peer(peer)
        geo = PreparedGeometry(lowered, prank)
        if not len(geo.local_rows):
            return None
        self.stats.dlists_prepared += 2 if geo.local_span_rows is None else 4
        return Prepared(peer, geo)

    def unprepare(self, prep: Prepared | None) -> None:
        if prep is not None and not prep.released:
            prep.released = True
            self.stats.dlists_released += 2 if prep.geometry.local_span_rows is None else 4

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        fut: Future[R] = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)
        return fut

    # ---- completion ----------------------------------------------------------------------------
    def check(self, handle: int) -> str:
        if not self.is_live(handle):
            raise TransferError(f"unknown or released handle {handle}")
        return "DONE"

    def settle(self, handle: int, timeout_s: float = 0.0) -> bool | None:
        return self.is_live(handle)

    def release(self, handle: int) -> None:
        self.untrack(handle)

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
        self.remove_all_peers()


def copy_between_regions(dst_regions: dict[int, int], di: np.ndarray, dst: np.ndarray, src_regions: dict[int, int],
                         si: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
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
