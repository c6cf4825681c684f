"""Direct reads through prepared descriptor lists (issue 14), as a few hook calls for ``decode.py``.

At handshake :func:`prepare` asks the transport (when it has ``prepare``) to turn the lowered templates
of each prefill rank this decode rank reads into prepared lists. Per request :func:`direct_reads`
validates the request once and hands out, per prefill rank, either a :class:`PreppedWork` (no sizes
and no descriptors are worked out on the caller's thread) or, where nothing was prepared, the
lowered :class:`~kvbridge.lower.Descriptors`. The transport's ``post(peer, work, notif)`` posts either.

``KVBRIDGE_PREPPED=0`` turns the prepared path off (every direct read takes the old path).
``KVBRIDGE_PREPPED_SPANS`` sets the span levels of the prepared lists (:mod:`kvbridge.prepped`; default
``64``, ``0`` for none): where a read's runs are whole blocks on both sides (MLA, cross-layer blocks),
stretches of consecutive blocks are posted as spans through a second list pair, chosen per request on
the post thread (the caller's thread does the same work with or without spans).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)
ENABLED = os.environ.get("KVBRIDGE_PREPPED", "1") != "0"


@dataclass(slots=True)
class PreppedWork:
    """A validated request for one prefill rank, to post through prepared lists (a work item: like
    :class:`~kvbridge.lower.Descriptors` it has ``prefill``/``count``/``total_bytes``).

    ``nonempty`` is known on the caller's thread; the sizes (``count``, ``total_bytes``: descriptors before
    merging, bytes) are worked out on first use, which is the post thread's (the transport's ``post`` hands
    :meth:`size` to the transport), so the caller's thread never computes them."""

    prefill: tuple
    prep: object
    ranges: dict
    prefill_blocks: dict
    decode_blocks: dict
    nonempty: bool
    _size: tuple | None = None

    def size(self) -> tuple[int, int]:
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


def reads_something(d) -> bool:
    """Whether a hand-over from :func:`direct_reads` (or None) reads any byte, without sizing it."""
    if d is None:
        return False
    return d.nonempty if isinstance(d, PreppedWork) else d.count > 0


def prepare(transport, remote, previous: dict | None = None) -> dict:
    """{prefill rank: prepared lists} for the ranks of ``remote`` this decode rank reads; {} when the
    transport cannot prepare (the old path is used). A rank that fails to prepare falls back alone.
    ``previous``: the lists of an earlier handshake with the same engine id, released first."""
    release(transport, previous)
    if not ENABLED or not hasattr(transport, "prepare"):
        return {}
    out = {}
    for prank, agent in remote.agents.items():
        if not remote.lowered.by_prefill.get(prank):
            continue
        try:
            p = transport.prepare(agent, remote.lowered, prank)
        except Exception as e:  # noqa: BLE001 - the old path still works
            log.warning("could not prepare descriptor lists for prefill rank %s of %s: %r; reading it through "
                        "per-request lists", prank, remote.engine_id, e)
            continue
        if p is not None:
            out[prank] = p
    return out


def release(transport, preps: dict | None) -> None:
    for p in (preps or {}).values():
        transport.unprepare(p)


def direct_reads(preps: dict | None, remote, req, direct) -> dict:
    """{prefill rank: PreppedWork | Descriptors} for the direct ranks of ``req``; raises RequestError.

    The caller's thread: the request is validated once (argmax/argmin per block-id array, integer
    arithmetic; :meth:`~kvbridge.lower.LoweredPlan.validate`, also when every rank is staged) and each
    prepared rank is told whether it reads anything; sizes and index arrays are worked out on the post
    thread. Ranks without
    prepared lists take the old path (descriptors lowered here)."""
    lowered = remote.lowered
    ranges = lowered.validate(req.num_tokens, req.prefill_blocks, req.decode_blocks)
    out, rest = {}, None
    for p in direct:
        prep = preps.get(p) if preps else None
        if prep is None:
            rest = [p] if rest is None else rest + [p]
            continue
        out[p] = PreppedWork(p, prep, ranges, req.prefill_blocks, req.decode_blocks, prep.geometry.reads_any(ranges))
    if rest:
        for d in lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks, only=rest,
                                         ranges=ranges):
            out[d.prefill] = d
    return out
