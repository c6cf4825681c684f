"""Direct reads through prepared descriptor lists, as two hook calls for the decode rank.

At handshake :func:`prepare` asks the transport to turn the lowered templates of each prefill rank this
decode rank reads into prepared lists. Per request :func:`direct_reads` validates the request once and
hands out, per prefill rank, a :class:`~kvbridge.transport.base.DirectRead` (no sizes and no descriptors
are worked out on the caller's thread), which the transport's ``post(peer, work, notif)`` posts.

``KVBRIDGE_PREPPED_SPANS`` sets the span levels of the prepared lists (:mod:`kvbridge.prepped`; default
``64``, ``0`` for none): where a read's runs are whole blocks on both sides (MLA, cross-layer blocks),
stretches of consecutive blocks are posted as spans through a second list pair, chosen per request on
the post thread (the caller's thread does the same work with or without spans).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import HandshakeError, TransferError
from ..transport.base import DirectRead

if TYPE_CHECKING:
    from ..prepped import Prepared
    from ..transport.base import Transport


def reads_something(d: DirectRead | None) -> bool:
    """Whether a hand-over from :func:`direct_reads` (or None) reads any byte, without sizing it."""
    return d is not None and d.nonempty


def prepare(transport: Transport, remote: Any, previous: dict[Any, Prepared] | None = None) -> dict[Any, Prepared]:
    """{prefill rank: prepared lists} for the ranks of ``remote`` this decode rank reads (a rank it reads
    nothing from has none). ``previous``: the lists of an earlier handshake with the same engine id,
    released first. Raises :class:`~kvbridge.errors.HandshakeError` naming the rank whose lists the
    transport could not prepare (the lists made before it are released)."""
    release(transport, previous)
    out: dict[Any, Prepared] = {}
    for prank, agent in remote.agents.items():
        if not remote.lowered.by_prefill.get(prank):
            continue
        try:
            p = transport.prepare(agent, remote.lowered, prank)
        except BaseException as e:
            release(transport, out)
            if isinstance(e, TransferError):
                raise HandshakeError(f"could not prepare the descriptor lists for reading prefill rank {prank} "
                                     f"of {remote.engine_id!r}: {e}") from e
            raise
        if p is not None:
            out[prank] = p
    return out


def release(transport: Transport, preps: dict[Any, Prepared] | None) -> None:
    for p in (preps or {}).values():
        transport.unprepare(p)


def direct_reads(preps: dict[Any, Prepared] | None, remote: Any, req: Any, direct: list[Any]) -> dict[Any, DirectRead]:
    """{prefill rank: DirectRead} for the direct ranks of ``req`` that this rank reads from (a rank
    without prepared lists has nothing to read); raises RequestError.

    The caller's thread: the request is validated once (argmax/argmin per block-id array, integer
    arithmetic; :meth:`~kvbridge.lower.LoweredPlan.validate`, also when every rank is staged) and each
    prepared rank is told whether it reads anything; sizes and index arrays are worked out on the post
    thread."""
    ranges = remote.lowered.validate(req.num_tokens, req.prefill_blocks, req.decode_blocks)
    out: dict[Any, DirectRead] = {}
    for p in direct:
        prep = preps.get(p) if preps else None
        if prep is not None:
            out[p] = DirectRead(p, prep, ranges, req.prefill_blocks, req.decode_blocks,
                                prep.geometry.reads_any(ranges))
    return out
