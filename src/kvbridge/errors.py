"""Typed errors. Every message states the observed values, the constraint, and what to change."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar


class KVBridgeError(Exception):
    """Base class of every error kvbridge raises on purpose."""


class LayoutError(KVBridgeError, ValueError):
    """A model, engine or memory layout description is invalid on its own."""


class IncompatibleLayoutsError(KVBridgeError, ValueError):
    """Two engines cannot exchange KV (different models, dtypes, unsupported topology)."""


class ConfigImportError(LayoutError):
    """A Hugging Face config.json could not be turned into a model description."""


class ConfigError(KVBridgeError, ValueError):
    """An option (of a rank, a transfer mode, a connector's extra config) is unknown or has a bad value."""


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


class PeerGoneError(TransferError):
    """The transport reports the remote agent disconnected (NIXL ``NIXL_ERR_REMOTE_DISCONNECT``): the
    peer process died or its network went away. Raised by the transport; the runtime reacts to this
    class, never to an error's text."""


class TransportUnavailableError(KVBridgeError, ImportError):
    """The NIXL Python package is not installed or cannot create an agent."""


class ReadFailure(KVBridgeError, RuntimeError):
    """Why a request's read failed, as :meth:`DecodeRank.poll` reports it (``{req_id: failure}``).

    Subclasses say what happened; every one carries the request id, the prefill engine and rank it
    concerns (``prefill_rank`` is None when the failure is not one rank's) and a message; ``str()``
    is the message. Values are picklable (they cross process pipes).
    """

    code: ClassVar[str] = "failed"

    def __init__(self, message: str, *, req_id: str = "", engine_id: str = "",
                 prefill_rank: Sequence[int] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.req_id = req_id
        self.engine_id = engine_id
        self.prefill_rank = None if prefill_rank is None else tuple(prefill_rank)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_failure, (type(self), self.message, self.req_id, self.engine_id, self.prefill_rank))

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(req_id={self.req_id!r}, engine_id={self.engine_id!r}, "
                f"prefill_rank={self.prefill_rank}, message={self.message!r})")

    def __eq__(self, other: object) -> bool:
        return (type(self) is type(other) and (self.message, self.req_id, self.engine_id, self.prefill_rank)
                == (other.message, other.req_id, other.engine_id, other.prefill_rank))

    __hash__ = None  # type: ignore[assignment]  # equal by value, mutable (an Exception): not hashable


def _rebuild_failure(cls: type[ReadFailure], message: str, req_id: str, engine_id: str,
                     prefill_rank: Sequence[int] | None) -> ReadFailure:
    return cls(message, req_id=req_id, engine_id=engine_id, prefill_rank=prefill_rank)


class PeerDisconnected(ReadFailure):
    """The prefill rank went away (NIXL reported a disconnect) before the read completed."""

    code = "disconnected"


class PeerRestarted(PeerDisconnected):
    """The prefill rank answering now is not the process this rank handshook with: handshake again."""

    code = "restarted"


class TransferTimeout(ReadFailure):
    """No progress from one prefill rank within the timeout (frozen, overloaded or unreachable)."""

    code = "timeout"


class LeaseExpired(ReadFailure):
    """The prefill does not hold the request's blocks under this attempt any more (expired, freed,
    re-registered) or the read outlived the pin the prefill granted: the data is not trusted."""

    code = "lease_expired"


class NotRegistered(LeaseExpired):
    """The prefill had not registered the request's lease (its engine registers a request when its
    step ends) and still had not when the decode stopped asking (``register_grace_s``)."""

    code = "not_registered"


class HandshakeFailed(PeerDisconnected):
    """A read waited for a prefill engine's background handshake (``DecodeRank.connect``, or a
    re-handshake after the engine disconnected or restarted), which failed or did not finish within
    ``connect_timeout_s`` (the message says which and why): the engine cannot be reached."""

    code = "handshake_failed"


class Aborted(ReadFailure):
    """The request was aborted or its engine forgotten on this decode rank before the read completed."""

    code = "aborted"


class RemoteError(ReadFailure):
    """The prefill answered with an error, or with data that does not match this rank's lowering."""

    code = "remote_error"


class TransferFailed(ReadFailure):
    """The transport failed the read for another reason than a disconnect (see the message)."""

    code = "transfer_failed"


class IllegalTransition(KVBridgeError, RuntimeError):
    """A read state machine got an event its current state does not accept (a kvbridge bug)."""
