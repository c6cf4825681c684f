"""Side-channel protocol between a decode rank and a prefill rank (ZMQ + msgspec), versioned.

Every message is three frames: ``[MAGIC, version (u16 big-endian), msgpack payload]``. The version is
checked before the payload is decoded, so a peer speaking another version gets a clear error, not a
decode failure. Version history:

1. initial: GetMeta / RankMeta / ErrorReply; Stage / Staged / StageError (staged transfers: the
   prefill packs a request's runs for one decode rank into its staging buffer, answering one Staged
   per packed segment); Done notifications over NIXL.
2. leases bound to attempts: ``add_request`` issues an attempt id that the decode presents in
   Acquire / Stage / Done; a direct read starts only after an Acquire the prefill granted (it pins
   the lease and answers the pin's remaining duration, never a wall-clock time); GetMeta names the
   decode's NIXL agent (Done notifications must come from it); errors carry a ``code``.
4. per-reader pins (issue 20): every read names a ``read_id`` (the decode's own request id; several
   reads of one prefill request may coexist) in Acquire / Stage / Done and the answers; Acquire and
   Stage name the decode's NIXL agent; ``Acquire(heartbeat=True)`` refreshes pins / extends queued
   leases without pinning; ``Done(decline=True)`` settles a read the sender never pinned (nothing to
   read, or aborted before reading); refusal codes include ``not_registered`` (retry briefly).
"""
from __future__ import annotations

from typing import Any

import msgspec

from ..errors import HandshakeError

PROTOCOL_VERSION = 4  # 2: memory descriptions (engine-owned memory); 3: lease attempts, acquire; 4: read ids, pins
MAGIC = b"KVB1"


class GetMeta(msgspec.Struct, tag="get_meta"):
    decode_engine: str
    decode_rank: tuple[int, int]
    prefill_rank: tuple[int, int]
    decode_agent: str = ""  # the decode rank's NIXL agent: its Done notifications must come from it


class RankMeta(msgspec.Struct, tag="rank_meta"):
    engine_id: str
    rank: tuple[int, int]
    layout: dict[str, Any]
    model_fingerprint: str
    agent_name: str
    agent_metadata: bytes
    metadata_sha256: str
    memory: dict[str, Any]  # the rank's KVMemory.to_wire(): registered regions, per-layer addresses, strides
    staging_bytes: int = 0


# the prefill answers (and the decode reads) a stage request per segment of about this size, so
# packing, reading and scattering overlap; 64 MiB beat 4/16/32 MiB on the benchmark here
STAGE_SEGMENT_BYTES = 64 << 20


class Stage(msgspec.Struct, tag="stage"):
    """Ask a prefill rank to pack its part of ``req_id`` for ``decode_rank`` into its staging buffer.

    Block ids travel as little-endian int64 bytes, per group, with the group's first block index.
    """

    req_id: str
    decode_engine: str
    decode_rank: tuple[int, int]
    decode_layout: dict[str, Any]
    decode_memory: dict[str, Any]  # the decode rank's KVMemory.to_wire(): the prefill packs in the order it scatters
    num_tokens: int
    prefill_blocks: dict[str, tuple[bytes, int]]
    decode_blocks: dict[str, tuple[bytes, int]]
    segment_bytes: int = STAGE_SEGMENT_BYTES
    attempt: int = 0        # the lease's attempt id (from add_request); a stage request also pins the lease
    readers: int = 0        # decode ranks that notify this prefill rank for the request (from the plan)
    incarnation: str = ""   # sha256 of the prefill rank's metadata this decode rank handshook with
    read_id: str = ""       # the decode's id of this read (its pin); "" means req_id
    decode_agent: str = ""  # the decode rank's NIXL agent (must be the one bound at handshake)


class Acquire(msgspec.Struct, tag="acquire"):
    """Ask a prefill rank to pin the leases of ``reqs`` ((req_id, attempt, read_id)) before direct reads.

    The prefill pins ``(reader, read_id)`` on a lease whose attempt matches (the pin holds until this
    reader's Done for it, ``pin_idle_s`` without a refresh, or the hard cap ``pin_s``) and answers with
    the remaining duration; it refuses unknown, expired or other attempts (``not_registered``: not yet).
    ``heartbeat``: refresh pins this reader holds, or extend the lease of a request queued at the decode
    (never pins). Durations only: the decode counts down on its own clock from when it sent this.
    """

    decode_engine: str
    decode_rank: tuple[int, int]
    readers: int
    incarnation: str
    reqs: list[tuple[str, int, str]]
    decode_agent: str = ""
    heartbeat: bool = False


class Acquired(msgspec.Struct, tag="acquired"):
    """Answer to :class:`Acquire`: ``granted`` (req_id, attempt, read_id, seconds the pin still holds)
    and ``refused`` (req_id, attempt, read_id, code, message); codes: ``not_registered``,
    ``lease_expired``, ``restarted``, ``unknown_reader``, ``done``, ``bad_request``."""

    granted: list[tuple[str, int, str, float]]
    refused: list[tuple[str, int, str, str, str]]
    heartbeat: bool = False


class Staged(msgspec.Struct, tag="staged"):
    """One packed segment: bytes ``[offset, offset + nbytes)`` of the ``total``-byte packed stream (the
    runs in lowered-plan order) are at ``addr``. Segments are answered as they are packed (pipelined);
    ``last`` marks the final one."""

    req_id: str
    addr: int
    nbytes: int
    offset: int = 0
    total: int = 0
    last: bool = True
    ttl_s: float = 0.0  # seconds the prefill's pin on the lease still holds (from when it answered)
    read_id: str = ""
    attempt: int = 0


class StageError(msgspec.Struct, tag="stage_error"):
    """The prefill cannot stage ``req_id``: ``expired`` (lease gone: do not read) or no room (read directly)."""

    req_id: str
    message: str
    expired: bool = False
    code: str = ""      # not_registered | lease_expired | restarted | unknown_reader | full | bad_request |
    #                     internal | done
    ttl_s: float = 0.0  # "full": the lease is pinned for this long; read directly under it
    read_id: str = ""
    attempt: int = 0


class ErrorReply(msgspec.Struct, tag="error"):
    message: str
    code: str = "error"  # bad_request | wrong_rank | unexpected | internal | identity_in_use | too_many_readers


class Done(msgspec.Struct, tag="done"):
    """NIXL notification from a decode rank to a prefill rank: this rank is done with the request.

    ``readers``: how many decode ranks of that decode engine read from this prefill rank (from the
    plan); the prefill settles the read ``read_id`` when it has heard from all of them. A Done releases
    the sender's pin ``(reader, read_id)`` (ignored if it holds none); ``decline``: the sender holds no
    pin and settles its part without reading (nothing to read here, or aborted before reading).
    """

    req_id: str
    decode_engine: str
    decode_rank: tuple[int, int]
    readers: int
    ok: bool = True
    attempt: int = 0  # the lease's attempt: a Done of another attempt (stale, forged) is ignored
    read_id: str = ""
    decline: bool = False


Message = GetMeta | RankMeta | ErrorReply | Done | Stage | Staged | StageError | Acquire | Acquired
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Message)


def pack(msg: Message, version: int = PROTOCOL_VERSION) -> list[bytes]:
    return [MAGIC, version.to_bytes(2, "big"), _enc.encode(msg)]


def unpack(frames: list[bytes]) -> Message:
    if len(frames) != 3 or frames[0] != MAGIC:
        raise HandshakeError("peer did not speak the kvbridge side-channel protocol (bad magic/frames); "
                             "check the host:port points at a kvbridge prefill rank")
    version = int.from_bytes(frames[1], "big")
    if version != PROTOCOL_VERSION:
        raise HandshakeError(f"peer speaks kvbridge protocol version {version}, this process speaks "
                             f"{PROTOCOL_VERSION}; run the same kvbridge release on prefill and decode")
    try:
        msg: Message = _dec.decode(frames[2])
        return msg
    except msgspec.DecodeError as e:
        raise HandshakeError(f"malformed side-channel message: {e}") from e


def blocks_to_wire(blocks: dict[str, Any]) -> dict[str, tuple[bytes, int]]:
    import numpy as np
    return {g: (np.ascontiguousarray(b.block_ids, dtype="<i8").tobytes(), int(b.first_block)) for g, b in blocks.items()}


def blocks_from_wire(wire: dict[str, tuple[bytes, int]]) -> dict[str, Any]:
    import numpy as np

    from ..lower import GroupBlocks
    return {g: GroupBlocks(np.frombuffer(ids, dtype="<i8").astype(np.int64), first) for g, (ids, first) in wire.items()}


def encode_notif(d: Done) -> bytes:
    return MAGIC + _enc.encode(d)


def decode_notif(b: bytes) -> Done:
    if not b.startswith(MAGIC):
        raise ValueError("not a kvbridge notification")
    msg = _dec.decode(b[len(MAGIC):])
    if not isinstance(msg, Done):
        raise ValueError("not a Done notification")
    return msg
