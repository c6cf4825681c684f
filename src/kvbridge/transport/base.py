"""The transport seam: everything the runtime asks of a transport, without naming NIXL.

Implemented by :class:`~kvbridge.transport.nixl.NixlTransport` (cross-process, NIXL/UCX) and
:class:`~kvbridge.transport.loopback.LoopbackTransport` (agents in one process, memmove copies); both
keep their peers, live handles and counters through :class:`TransportBookkeeping`.
Memory is registered as raw regions ``(addr, nbytes, device)`` (engine-owned memory); ``register`` of a
buffer is a convenience over :meth:`Transport.register_region`.

Reads take one of two entry points:

* :meth:`Transport.post` -- a direct read of one request from one prefill rank, as a :class:`DirectRead`
  (the request validated against the lists :meth:`Transport.prepare` made at handshake);
* :meth:`Transport.read` -- explicit descriptor lists ``(remote[i], local[i], nbytes[i])``: a staged
  segment, the direct read of a staged rank whose staging was full, tools and tests.

Writes (the push path: a prefill rank WRITEs a packed segment into a decode rank's staging) take
:meth:`Transport.write`, the mirror of :meth:`Transport.read`, posted and completed the same way.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from ..errors import TransferError

if TYPE_CHECKING:
    from ..lower import LoweredPlan
    from ..prepped import Prepared

R = TypeVar("R")


@dataclass
class TransportStats:
    """Counters every transport keeps (leak checks compare created/released, added/removed)."""
    handles_created: int = 0
    handles_released: int = 0
    regions_registered: int = 0
    regions_deregistered: int = 0
    peers_added: int = 0
    peers_removed: int = 0
    dlists_prepared: int = 0
    dlists_released: int = 0
    inline_posts: int = 0  # reads posted on the caller's thread (NixlTransport.inline_post_bytes)


class Cancellable(Protocol):
    """Something a caller may give up before its read is handed to the transport library."""

    @property
    def cancelled(self) -> bool: ...


@dataclass(slots=True)
class DirectRead:
    """A request validated for one prefill rank, to post through that rank's prepared lists: the one work
    item of :meth:`Transport.post`.

    ``nonempty`` is known on the caller's thread; the sizes (``count``: descriptors before merging,
    ``total_bytes``) are worked out once, on first use: the post thread's, or the caller's when it may post
    the read itself (``NixlTransport.inline_post_bytes`` > 0: arithmetic over the read's ranges)."""

    prefill: tuple[int, int]
    prep: Prepared
    ranges: dict[Any, Any]
    prefill_blocks: dict[Any, Any]
    decode_blocks: dict[Any, Any]
    nonempty: bool
    _size: tuple[int, int] | None = None

    def size(self) -> tuple[int, int]:
        """``(descriptors, bytes)`` of this read (computed once)."""
        s = self._size
        if s is None:
            s = self._size = self.prep.geometry.size(self.ranges)
        return s

    @property
    def count(self) -> int:
        return self.size()[0]

    @property
    def total_bytes(self) -> int:
        return self.size()[1]


class XferHandle(Protocol):
    """Opaque per-transfer handle; released exactly once with :meth:`Transport.release`."""


def elapsed_s(handle: object) -> float | None:
    """The transport's own time of a completed transfer (seconds from the moment it was handed to the
    wire, ``posted_ns``, to the moment it was first known complete, ``done_ns``, both ``perf_counter_ns``),
    without the caller's queueing or scheduling in it; None where the handle does not say (a loopback
    transfer, or one not yet seen complete)."""
    posted, done = int(getattr(handle, "posted_ns", 0) or 0), int(getattr(handle, "done_ns", 0) or 0)
    return (done - posted) / 1e9 if posted and done >= posted else None


@runtime_checkable
class Transport(Protocol):
    name: str
    agent_name: str
    stats: TransportStats

    # ---- memory --------------------------------------------------------------------------------
    def register_region(self, addr: int, nbytes: int, device: str = "cpu") -> int:
        """Register ``nbytes`` at ``addr`` ("cpu" or "cuda:N") as one region; returns ``addr``."""

    def deregister_region(self, addr: int) -> None: ...

    def register(self, buf: Any) -> int:
        """Convenience: register a contiguous buffer (numpy array, or torch tensor on its device, e.g. a
        staging buffer) as one region; returns its base address."""

    def deregister(self, buf: Any) -> None: ...

    # ---- peers and metadata --------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's metadata, for a peer's :meth:`add_peer`."""

    def add_peer(self, metadata: bytes, digest: str | None = None) -> str:
        """Add a remote agent from its metadata (``digest``: sha256, checked first); returns its name."""

    def remove_peer(self, name: str) -> None: ...

    @property
    def peers(self) -> frozenset[str]: ...

    # ---- reads ---------------------------------------------------------------------------------
    def prepare(self, peer: str, lowered: LoweredPlan, prank: tuple[int, int]) -> Prepared | None:
        """At handshake: prepared lists for reading ``prank`` of ``lowered`` (None: nothing to read)."""

    def unprepare(self, prep: Prepared | None) -> None: ...

    def post(self, peer: str, work: DirectRead, notif: bytes = b"", cancel: Cancellable | None = None,
             remote_device: str | None = None) -> XferHandle:
        """Post one direct read, the request's notification riding on it (sent to the peer once every byte
        has arrived). ``cancel``: checked before the read is handed to the library (a cancelled read is
        never posted). Returns at once; the work is done off the caller's thread."""

    def read(self, peer: str, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray, notif: bytes = b"",
             remote_device: str | None = None, cancel: Cancellable | None = None,
             local_device: str | None = None) -> XferHandle:
        """Post a READ of ``nbytes[i]`` bytes from ``remote[i]`` (peer memory on ``remote_device``, "cpu"
        or "cuda:N") to ``local[i]`` (our memory on ``local_device``; None: this agent's own kind);
        ``notif`` and ``cancel`` as in :meth:`post`."""

    def write(self, peer: str, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, notif: bytes = b"",
              remote_device: str | None = None, local_device: str | None = None) -> XferHandle:
        """Post a WRITE of ``nbytes[i]`` bytes from ``local[i]`` (our memory on ``local_device``; None: this
        agent's own kind) to ``remote[i]`` (peer memory on ``remote_device``): the mirror of :meth:`read`,
        off the caller's thread, completed through :meth:`check` / :meth:`settle` / :meth:`release`."""

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        """Run ``fn(*args)`` off the caller's thread (a staged scatter); returns a Future."""

    # ---- completion ----------------------------------------------------------------------------
    def check(self, handle: Any) -> str:
        """"DONE" or "PROC"; raises :class:`~kvbridge.errors.TransferError` on failure."""

    def settle(self, handle: Any, timeout_s: float = 5.0) -> bool | None:
        """Wait up to ``timeout_s`` for the transfer to end: True completed, False failed, None still running."""

    def release(self, handle: Any) -> None: ...

    def live_handles(self) -> int:
        """Transfer handles created and not yet released (for leak checks)."""

    # ---- notifications -------------------------------------------------------------------------
    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending agent."""

    def send_notif(self, peer: str, msg: bytes) -> None: ...

    def close(self) -> None: ...


class TransportBookkeeping:
    """What every transport keeps the same way: its peers, its live transfer handles and its counters
    (:class:`TransportStats`), under one lock (handshakes may run on a background thread and posts on
    worker threads), and the buffer conveniences over ``register_region``."""

    stats: TransportStats

    def __init__(self) -> None:
        self.stats = TransportStats()
        self._peers: set[str] = set()
        self._live: set[int] = set()
        self._lock = threading.Lock()

    def register_region(self, addr: int, nbytes: int, device: str = "cpu") -> int:
        raise NotImplementedError

    def deregister_region(self, addr: int) -> None:
        raise NotImplementedError

    def register(self, buf: Any) -> int:
        """Register a contiguous buffer (numpy array, or torch tensor on its own device) as one region."""
        from ..tensors import buffer_region
        return self.register_region(*buffer_region(buf))

    def deregister(self, buf: Any) -> None:
        from ..tensors import buffer_region
        self.deregister_region(buffer_region(buf)[0])

    # ---- peers ---------------------------------------------------------------------------------
    def peer_added(self, name: str) -> None:
        """Count ``name`` as a peer (once)."""
        with self._lock:
            if name not in self._peers:
                self._peers.add(name)
                self.stats.peers_added += 1

    def peer_removed(self, name: str) -> bool:
        """Forget peer ``name``; False if it was not a peer."""
        with self._lock:
            if name not in self._peers:
                return False
            self._peers.discard(name)
            self.stats.peers_removed += 1
            return True

    @property
    def peers(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._peers)

    def remove_all_peers(self) -> None:
        """Remove every peer (at close)."""
        for p in sorted(self.peers):
            self.remove_peer(p)

    def remove_peer(self, name: str) -> None:
        self.peer_removed(name)

    # ---- transfer handles ----------------------------------------------------------------------
    def track(self, key: int) -> None:
        """Count a new transfer handle ``key`` as live."""
        with self._lock:
            self._live.add(key)
        self.stats.handles_created += 1

    def untrack(self, key: int) -> bool:
        """Stop tracking handle ``key``; False if it was not live (released already, or never made)."""
        with self._lock:
            if key not in self._live:
                return False
            self._live.discard(key)
        self.stats.handles_released += 1
        return True

    def is_live(self, key: int) -> bool:
        """Whether handle ``key`` was tracked and not released."""
        with self._lock:
            return key in self._live

    def live_handles(self) -> int:
        with self._lock:
            return len(self._live)


def check_cancel(cancel: Cancellable | None, peer: str) -> None:
    """Raise :class:`~kvbridge.errors.TransferError` if the caller gave the read up before it was posted."""
    if cancel is not None and cancel.cancelled:
        raise TransferError("read cancelled before it was posted", peer=peer)


__all__ = ["elapsed_s", "Transport", "TransportStats", "TransportBookkeeping", "DirectRead", "XferHandle",
           "Cancellable", "check_cancel"]
