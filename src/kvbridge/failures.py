"""Why a read failed: the typed values :meth:`DecodeEndpoint.poll <kvbridge.runtime.decode.DecodeRank.poll>`
(and ``wait``) report as ``{read key: failure}``.

Every failure is a :class:`ReadFailure` carrying the request id, the prefill engine and the prefill rank
it concerns (``prefill_rank`` is None when the failure is not one rank's) and a message; its ``code``
is a short stable name (for counters and logs). An engine reacts to the class:

================================  ==========================================================================
:class:`PeerDisconnected`         the prefill rank went away before the read completed
:class:`PeerRestarted`            the prefill answering now is another process than the one handshook with
:class:`HandshakeFailed`          a background handshake the read waited for failed or ran past its bound
:class:`TransferTimeout`          no progress from one prefill rank within the timeout
:class:`LeaseExpired`             the prefill no longer holds the blocks under this attempt (or the read
                                  outlived its pin): the data is not trusted
:class:`NotRegistered`            the prefill had not registered the request's lease within the grace time
:class:`Aborted`                  the read was aborted, or its engine forgotten, on this decode rank
:class:`RemoteError`              the prefill answered with an error or with data that does not match
:class:`TransferFailed`           the transport failed the read for another reason
================================  ==========================================================================
"""
from __future__ import annotations

from .errors import (
    Aborted,
    HandshakeFailed,
    LeaseExpired,
    NotRegistered,
    PeerDisconnected,
    PeerRestarted,
    ReadFailure,
    RemoteError,
    TransferFailed,
    TransferTimeout,
)

__all__ = ["ReadFailure", "PeerDisconnected", "PeerRestarted", "HandshakeFailed", "TransferTimeout", "LeaseExpired",
           "NotRegistered", "Aborted", "RemoteError", "TransferFailed"]
