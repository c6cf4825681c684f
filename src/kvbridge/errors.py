"""Typed errors. Every message states the observed values, the constraint, and what to change."""
from __future__ import annotations


class KVBridgeError(Exception):
    """Base class of every error kvbridge raises on purpose."""


class LayoutError(KVBridgeError, ValueError):
    """A model, engine or memory layout description is invalid on its own."""


class IncompatibleLayoutsError(KVBridgeError, ValueError):
    """Two engines cannot exchange KV (different models, dtypes, unsupported topology)."""


class ConfigImportError(LayoutError):
    """A Hugging Face config.json could not be turned into a model description."""


class RequestError(KVBridgeError, ValueError):
    """A per-request input is invalid (block ids out of range, more blocks than the prefill sent).

    Raised before any byte moves; the engine stays usable.
    """


class HandshakeError(KVBridgeError, RuntimeError):
    """The side-channel handshake failed (no listener, timeout, version, checksum, mismatch)."""


class TransferError(KVBridgeError, RuntimeError):
    """A transfer failed after it was posted (remote died, transport error)."""

    def __init__(self, message: str, *, request_id: str | None = None, peer: str | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.peer = peer


class TransportUnavailableError(KVBridgeError, ImportError):
    """The NIXL Python package is not installed or cannot create an agent."""
