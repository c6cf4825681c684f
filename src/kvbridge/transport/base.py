"""The transport interface: register memory, read descriptor pairs from a peer, poll, release."""
from __future__ import annotations

from typing import Protocol

import numpy as np


class XferHandle(Protocol):
    """Opaque per-transfer handle; released exactly once with :meth:`Transport.release`."""


class Transport(Protocol):
    name: str

    def register(self, buf: np.ndarray) -> int:
        """Register ``buf`` (uint8, contiguous) for transfers; returns its base address."""

    def deregister(self, buf: np.ndarray) -> None: ...

    def read(self, peer: str, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray,
             notif: bytes = b"") -> XferHandle:
        """Post a READ of ``nbytes[i]`` bytes from ``remote[i]`` (peer memory) to ``local[i]``."""

    def read_descs(self, peer: str, descs, notif: bytes = b"") -> XferHandle:
        """Post a READ of a :class:`~kvbridge.lower.Descriptors` (prefill side remote, decode side local);
        a transport may expand its factored form straight into its own descriptor format."""

    def check(self, handle: XferHandle) -> str:
        """"DONE" or "PROC"; raises :class:`~kvbridge.errors.TransferError` on failure."""

    def settle(self, handle: XferHandle, timeout_s: float = 5.0) -> bool | None:
        """Wait up to ``timeout_s`` for the transfer to end: True completed, False failed, None still running."""

    def release(self, handle: XferHandle) -> None: ...

    def live_handles(self) -> int:
        """Transfer handles created and not yet released (for leak checks)."""
