"""Side-channel protocol between a decode rank and a prefill rank (ZMQ + msgspec), versioned.

Every message is three frames: ``[MAGIC, version (u16 big-endian), msgpack payload]``. The version is
checked before the payload is decoded, so a peer speaking another version gets a clear error, not a
decode failure. Version 6 speaks:

* GetMeta / RankMeta / ErrorReply: a rank's layout, memory and NIXL agent (GetMeta names the decode's
  agent: Done notifications must come from it; a decode rank that can be pushed to sends its agent's
  metadata too, and ``RankMeta.push`` says the prefill will WRITE into its staging);
* Acquire / Acquired: a read pins a lease bound to an attempt id (``add_request`` issues it, the decode
  presents it) and names its ``read_id`` (the decode's own request id; several reads of one prefill
  request may coexist); the answer is the pin's remaining duration, never a wall-clock time;
  ``Acquire(heartbeat=True)`` refreshes pins and extends queued leases without pinning;
* Stage / Staged / StageError: the prefill packs a request's runs for one decode rank into its staging
  buffer and answers one Staged per packed segment; on the push path (``Stage.path == "push"``) it
  WRITEs each segment into the decode's staging slot (``push_addr``) and answers its Staged only once
  that WRITE completed, in segment order, and its last answer (the last Staged or a StageError) only
  once no WRITE of the request is in flight;
* PushProbe / PushProbed: at handshake a decode rank that can be pushed to times the push path's WRITE:
  the prefill WRITEs a few descriptors from its staging buffer into the decode's probe buffer and
  answers once they completed (``descs == 0``: at once, the side channel's own round trip);
* Done over NIXL notifications: a read settled; ``Done(decline=True)`` settles a read the sender never
  pinned (nothing to read, or aborted before reading);
* every refusal or error carries a :class:`Code`.
"""
from __future__ import annotations

import enum
from typing import Any

import msgspec

from ..errors import HandshakeError

PROTOCOL_VERSION = 7
MAGIC = b"KVB1"


class Code(enum.StrEnum):
    """Every ``code`` a prefill rank answers with (``Acquired.refused``, ``StageError``, ``ErrorReply``);
    both sides compare against these members (a member equals, and hashes as, its wire string)."""

    # refusals of an acquire, stage request or heartbeat: no pin was made
    NOT_REGISTERED = "not_registered"      # no lease for this attempt yet: the decode retries, bounded
    LEASE_EXPIRED = "lease_expired"        # the attempt's lease ended (freed, expired, replaced)
    RESTARTED = "restarted"                # the prefill process is not the one the reader handshook with
    UNKNOWN_READER = "unknown_reader"      # no handshake from this reader (or from another agent)
    DONE = "done"                          # this reader already settled its part of this read
    # a stage request the prefill cannot stage: the pin holds (``ttl_s``), read directly
    FULL = "full"                          # no staging room
    INTERNAL = "internal"                  # packing failed on the prefill
    # bad requests and handshakes
    BAD_REQUEST = "bad_request"            # readers < 1, a readers count that disagrees, too many reads, malformed
    IDENTITY_IN_USE = "identity_in_use"    # GetMeta claims a live reader's identity with another agent
    TOO_MANY_READERS = "too_many_readers"  # the reader table is full of live readers
    WRONG_RANK = "wrong_rank"              # GetMeta for another prefill rank than the one at this address
    UNEXPECTED = "unexpected"              # a message a prefill rank does not serve
    BUSY = "busy"                          # a push probe of this reader is being written already
    ERROR = "error"                        # an error reply with no more specific code

    @classmethod
    def parse(cls, text: str) -> Code | None:
        """The member for ``text`` from the wire, or None (a code this release does not know)."""
        try:
            return cls(text)
        except ValueError:
            return None


# codes that refuse an acquire or stage request: no pin was made
REFUSALS = frozenset({Code.NOT_REGISTERED, Code.LEASE_EXPIRED, Code.RESTARTED, Code.UNKNOWN_READER, Code.DONE})


class GetMeta(msgspec.Struct, tag="get_meta"):
    decode_engine: str
    decode_rank: tuple[int, int]
    prefill_rank: tuple[int, int]
    decode_agent: str = ""  # the decode rank's NIXL agent: its Done notifications must come from it
    # the push path: the decode agent's NIXL metadata (and its sha256), so the prefill can WRITE into the
    # decode's staging; empty: this decode rank is never pushed to
    decode_agent_metadata: bytes = b""
    decode_metadata_sha256: str = ""


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
    # host staging (the host-staged path, and what a link probe READs to time host memory); 0: none
    staging_addr: int = 0   # the staging buffer (on the KV memory's device): a link probe READs it
    host_staging_addr: int = 0
    host_staging_bytes: int = 0
    # a pin holds for pin_s plus the request's bytes at min_read_rate (0: not said): a path predicted to
    # take longer is avoided
    pin_s: float = 0.0
    min_read_rate: float = 0.0
    push: bool = False  # this rank serves push stage requests from the asking decode rank (it sent its metadata)
    # live leases' tags (runtime/tags.py): host memory of ``tags_words`` uint64 words registered with the
    # rank's agent at ``tags_addr`` (0: none; readers wait for grants), hashed under ``tag_salt``
    tags_addr: int = 0
    tags_words: int = 0
    tag_salt: int = 0


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
    # a modes.TransferPath value: "staged" (device staging), "host" (host staging) or "push"; a str on the wire,
    # so a path the prefill does not stage over is answered (StageError bad_request), not an undecodable message
    path: str = "staged"
    # push: the decode's staging slot the prefill WRITEs the packed stream into (byte 0 of the stream at
    # push_addr), on push_device ("cpu" or "cuda:N"); the slot holds the whole stream
    push_addr: int = 0
    push_device: str = ""


class Acquire(msgspec.Struct, tag="acquire"):
    """Ask a prefill rank to pin the leases of ``reqs`` ((req_id, attempt, read_id)) before direct reads.

    The prefill pins ``(reader, read_id)`` on a lease whose attempt matches (the pin holds until this
    reader's Done for it, ``pin_idle_s`` without a refresh, ``pin_s`` without progress, or its bound
    from the request's size) and answers with
    the remaining duration; it refuses unknown, expired or other attempts (``not_registered``: not yet).
    ``heartbeat``: refresh pins this reader holds, or extend the lease of a request queued at the decode
    (never pins); ``progress``: per entry of ``reqs``, the read's bytes ``(done, inflight)`` so far (read,
    and in transfers posted and not finished): a pin whose read progresses holds past ``pin_s``, up to
    its bound. Durations only: the decode counts down on its own clock from when it sent this.
    """

    decode_engine: str
    decode_rank: tuple[int, int]
    readers: int
    incarnation: str
    reqs: list[tuple[str, int, str]]
    decode_agent: str = ""
    heartbeat: bool = False
    progress: list[tuple[int, int]] = []


class Acquired(msgspec.Struct, tag="acquired"):
    """Answer to :class:`Acquire`: ``granted`` (req_id, attempt, read_id, seconds the pin still holds)
    and ``refused`` (req_id, attempt, read_id, code, message); codes (:class:`Code`): the
    :data:`REFUSALS` and ``bad_request``."""

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
    code: str = ""      # a Code: one of REFUSALS (do not read), full or internal (read directly), bad_request
    ttl_s: float = 0.0  # "full": the lease is pinned for this long; read directly under it
    read_id: str = ""
    attempt: int = 0


class ErrorReply(msgspec.Struct, tag="error"):
    message: str
    code: str = Code.ERROR  # a Code: bad_request, wrong_rank, unexpected, internal, identity_in_use, too_many_readers


# a push probe WRITEs at most this many bytes (first descriptor's start to last one's end) and descriptors
PUSH_PROBE_MAX_BYTES = 16 << 20
PUSH_PROBE_MAX_DESCS = 1024


class PushProbe(msgspec.Struct, tag="push_probe"):
    """Ask a prefill rank to WRITE ``descs`` descriptors of ``nbytes`` each into the asking decode rank's
    memory (descriptor ``i`` from the prefill's staging buffer at ``i * stride`` to ``addr + i * stride``,
    on ``device``) and answer :class:`PushProbed` once every byte was written: the decode times the push
    path at handshake. ``descs == 0`` writes nothing and is answered at once (the side channel's round
    trip). The prefill serves it only to a reader bound at handshake (``decode_agent``, ``incarnation``)
    that it can push to, one at a time per reader, within ``PUSH_PROBE_MAX_BYTES`` and
    ``PUSH_PROBE_MAX_DESCS``."""

    decode_engine: str
    decode_rank: tuple[int, int]
    decode_agent: str
    incarnation: str
    addr: int = 0
    device: str = ""
    descs: int = 0
    nbytes: int = 0
    stride: int = 0


class PushProbed(msgspec.Struct, tag="push_probed"):
    """Answer to :class:`PushProbe`: written (``ok``), or refused or failed (``code``: a :class:`Code`,
    ``message`` says why). ``seconds``: the WRITE's time on the prefill, from handing it to the transport
    to seeing it complete (0 for an empty probe): the decode times the push path by it, without the side
    channel's round trip and either side's scheduling in it."""

    ok: bool
    code: str = ""
    message: str = ""
    seconds: float = 0.0


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


Message = (GetMeta | RankMeta | ErrorReply | Done | Stage | Staged | StageError | Acquire | Acquired | PushProbe
           | PushProbed)
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

    return {
        g: (np.ascontiguousarray(b.block_ids, dtype="<i8").tobytes(), int(b.first_block)) for g, b in blocks.items()
    }


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
