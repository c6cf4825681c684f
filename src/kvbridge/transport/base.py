"""The transport seam: everything the runtime asks of a transport, without naming NIXL.

Implemented by :class:`~kvbridge.transport.nixl.NixlTransport` (cross-process, NIXL/UCX) and
:class:`~kvbridge.transport.loopback.LoopbackTransport` (agents in one process, memmove copies).
Memory is registered as raw regions ``(addr, nbytes, device)`` (engine-owned memory); ``register`` of a
numpy array is a convenience over :meth:`Transport.register_region`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


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


class XferHandle(Protocol):
    """Opaque per-transfer handle; released exactly once with :meth:`Transport.release`."""


@runtime_checkable
class Transport(Protocol):
    name: str
    agent_name: str
    stats: TransportStats

    # ---- memory --------------------------------------------------------------------------------
    def register_region(self, addr: int, nbytes: int, device: str = "cpu") -> int:
        """Register ``nbytes`` at ``addr`` ("cpu" or "cuda:N") as one region; returns ``addr``."""

    def deregister_region(self, addr: int) -> None: ...

    def register(self, buf) -> int:
        """Convenience: register a contiguous buffer (numpy array, or torch tensor on its device, e.g. a
        staging buffer) as one region; returns its base address."""

    def deregister(self, buf: np.ndarray) -> None: ...

    # ---- peers and metadata --------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's metadata, for a peer's :meth:`add_peer`."""

    def add_peer(self, metadata: bytes, digest: str | None = None) -> str:
        """Add a remote agent from its metadata (``digest``: sha256, checked first); returns its name."""

    def remove_peer(self, name: str) -> None: ...

    @property
    def peers(self) -> frozenset[str]: ...

    # ---- reads ---------------------------------------------------------------------------------
    def read(self, peer: str, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray,
             notif: bytes = b"", remote_device: str | None = None) -> XferHandle:
        """Post a READ of ``nbytes[i]`` bytes from ``remote[i]`` (peer memory on ``remote_device``, "cpu"
        or "cuda:N") to ``local[i]``."""

    def read_descs(self, peer: str, descs, notif: bytes = b"", remote_device: str | None = None,
                   cancel=None) -> XferHandle:
        """Post a READ of a :class:`~kvbridge.lower.Descriptors` (prefill side remote, decode side local).
        ``cancel``: an object whose ``cancelled`` is checked before the read is handed to the library."""

    def post(self, peer: str, work, notif: bytes = b"", cancel=None, remote_device: str | None = None) -> XferHandle:
        """Post one direct read of a lowered work item (a ``Descriptors`` or a ``PreppedWork``), the
        request's notification riding on it; ``cancel`` as in :meth:`read_descs`."""

    def prepare(self, peer: str, lowered, prank):
        """At handshake: prepared lists for reading ``prank`` of ``lowered`` (None: nothing to read)."""

    def unprepare(self, prep) -> None: ...

    def read_prepped(self, prep, ranges: dict, prefill_blocks, decode_blocks, notif: bytes = b"",
                     size=None, cancel=None) -> XferHandle:
        """Post a READ of one validated request through prepared lists (see :mod:`kvbridge.prepped`).
        ``size``: ``(descriptors, bytes)``, a zero-argument callable returning them (to be called off the
        caller's thread), or None."""

    def submit(self, fn, *args):
        """Run ``fn(*args)`` off the caller's thread (a staged scatter); returns a Future."""

    # ---- completion ----------------------------------------------------------------------------
    def check(self, handle: XferHandle) -> str:
        """"DONE" or "PROC"; raises :class:`~kvbridge.errors.TransferError` on failure."""

    def settle(self, handle: XferHandle, timeout_s: float = 5.0) -> bool | None:
        """Wait up to ``timeout_s`` for the transfer to end: True completed, False failed, None still running."""

    def release(self, handle: XferHandle) -> None: ...

    def live_handles(self) -> int:
        """Transfer handles created and not yet released (for leak checks)."""

    # ---- notifications -------------------------------------------------------------------------
    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending agent."""

    def send_notif(self, peer: str, msg: bytes) -> None: ...

    def close(self) -> None: ...
