"""A prefill rank: registers its KV memory, serves its metadata, frees blocks when readers are done."""
from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from ..errors import HandshakeError, KVBridgeError, LayoutError
from ..layout import EngineLayout, engine_from_dict, engine_to_dict
from ..lower import GroupBlocks, LoweredPlan
from ..memory import KVMemory
from ..modes import TransferPath
from ..plan import plan_transfer
from ..transport.base import Transport
from ..transport.delayed import wrap_from_env
from ..transport.nixl import NixlTransport, metadata_digest
from .config import PrefillConfig
from .lease import (
    Lease,
    LeaseEnded,
    LeaseGranted,
    LeaseRefused,
    LeaseState,
    LeaseTable,
    Outcome,
    PinEnded,
    ReaderTable,
)
from .memhost import KVBytes, check_memory, register_memory, staging_nbytes, transport_device, wire_key
from .metrics import Metrics
from .paths import new_host_buffer, to_host_segment
from .protocol import (
    PUSH_PROBE_MAX_BYTES,
    PUSH_PROBE_MAX_DESCS,
    Acquire,
    Acquired,
    Code,
    Done,
    ErrorReply,
    GetMeta,
    PushProbe,
    PushProbed,
    RankMeta,
    Stage,
    Staged,
    StageError,
    blocks_from_wire,
    decode_notif,
    pack,
    unpack,
)
from .slots import SlotAllocator

log = logging.getLogger(__name__)


def json_key(d: dict) -> str:
    import json
    return json.dumps(d, sort_keys=True)


def _read_id(msg) -> str:
    return msg.read_id or msg.req_id


def _pin_key(msg: Stage) -> tuple:
    return ((msg.decode_engine, tuple(msg.decode_rank)), _read_id(msg))


def _slot_key(msg: Stage) -> tuple:
    """A staging slot is held by one pin: (request, decode engine, decode rank, read id)."""
    return (msg.req_id, msg.decode_engine, tuple(msg.decode_rank), _read_id(msg))


# the paths a stage request may name (cost.TransferPath values that stage on this rank)
STAGE_PATHS = frozenset({TransferPath.STAGED.value, TransferPath.HOST.value, TransferPath.PUSH.value})


def new_attempt() -> int:
    """A random, non-zero 63-bit attempt id (0 never names a lease)."""
    return secrets.randbits(63) | 1


@dataclass
class _Parked:
    """A stage request waiting for staging space."""
    envelope: list
    msg: Stage
    descs: object
    deadline: float


@dataclass
class _Push:
    """A push stage request being written: its segments' WRITEs in segment order, each answered (Staged)
    once it and every earlier one completed; ``error`` (or the pin ending, ``ended``) is answered once no
    WRITE of it is in flight, so the decode never reuses its slot while a WRITE may still land there."""

    envelope: list
    msg: Stage
    agent: str
    pending: deque = field(default_factory=deque)  # (handle, stream offset, bytes, last), in segment order
    error: StageError | None = None
    total: int = 0        # the packed stream's bytes
    ended: bool = False   # the pin ended meanwhile: its staging slot is freed once the WRITEs settled
    posted: bool = False  # every segment was packed and its WRITE posted (or the posting stopped on an error)


class PrefillRank:
    """Prefill side of one rank: registers the engine's KV memory (``memory``, a :class:`KVMemory`
    describing tensors the engine allocated), serves its metadata and stage requests on a ZMQ
    side channel, holds requests' blocks under leases until their readers are done."""

    def __init__(self, engine: EngineLayout, rank: tuple[int, int], engine_id: str, memory: KVMemory | None = None,
                 transport: Transport | None = None, config: PrefillConfig | None = None, **options: Any) -> None:
        """``config``: the rank's options (:class:`~kvbridge.runtime.config.PrefillConfig`; keyword
        ``options`` replace its fields, e.g. ``port=5600``); ``transport``: a transport over this rank's
        memory (default: a NIXL agent)."""
        cfg = self.config = PrefillConfig.resolve(config, options)
        host, port, lease_s, pin_s, pin_idle_s = cfg.host, cfg.port, cfg.lease_s, cfg.pin_s, cfg.pin_idle_s
        staging_bytes, stage_wait_s, staging_peer_share = cfg.staging_bytes, cfg.stage_wait_s, cfg.staging_peer_share
        lowered_cache, lowered_per_peer = cfg.lowered_cache, cfg.lowered_per_peer
        max_readers, reader_idle_s, min_read_rate = cfg.max_readers, cfg.reader_idle_s, cfg.min_read_rate
        self.engine, self.rank, self.engine_id, self.lease_s = engine, tuple(rank), engine_id, lease_s
        # leases (runtime/lease.py): a pin (a reader's acquire or stage request) holds until that reader's
        # Done, pin_idle_s (default lease_s) without a refresh (its heartbeats), pin_s without progress (its
        # heartbeats report bytes read), or pin_s + the request's bytes at min_read_rate after it was made;
        # readers count the granted remainder down on their own clock
        self.pin_s, self.min_read_rate = pin_s, min_read_rate
        self.table = LeaseTable(lease_s, pin_s, pin_idle_s, min_read_rate=min_read_rate)
        # readers this rank handshook with: (decode engine, decode rank) bound to a NIXL agent (bounded,
        # never evicting a live reader)
        self.readers = ReaderTable(max_readers, reader_idle_s)
        self._digests: OrderedDict = OrderedDict()  # metadata digests this process has served
        self._lowered_cap, self._lowered_per_peer = lowered_cache, lowered_per_peer
        # a stage request that finds the staging buffer full waits this long for a slot to free (the
        # previous request's Done is usually in flight) before the prefill says "full, read directly":
        # a direct read of small head slices is many times slower than waiting a few milliseconds
        self.stage_wait_s = stage_wait_s
        self._parked: list[_Parked] = []
        self.mem = check_memory(memory, engine, rank)
        # bytes of one block of each group in this rank's memory (a lease's size bounds its pins)
        self._block_bytes = {g: sum(v.num_layers * r.tokens_per_block * v.num_units * v.unit_bytes
                                    for v in r.components) for g, r in self.mem.regions.items()}
        # NIXL's thread-safe mode: an engine serves this endpoint from more than one thread (PrefillServer: its
        # own thread and the engine's step, one at a time) next to NIXL's progress thread. KVBRIDGE_DELAY_LINK
        # (tests only) slows its WRITEs (transport/delayed.py)
        self.transport = wrap_from_env(transport or NixlTransport(f"{engine_id}-p{rank[0]}t{rank[1]}",
                                                                  multi_threaded=True, **transport_device(self.mem)))
        register_memory(self.transport, self.mem)
        # staged transfers: runs packed here for one decode rank, read with one descriptor. The staging
        # buffer lives on the KV memory's device (VRAM there on a GPU) and packing runs there (torch ops
        # for torch tensors, CPU or CUDA; numpy for other host memory)
        self._kv = KVBytes(self.mem)
        if not self._kv.usable and staging_bytes:
            log.warning("prefill rank %s: KV memory on %s given by address and torch is not loaded: no staging "
                        "(decode ranks read directly); describe the memory with torch tensors to stage on the "
                        "device", self.rank, self.mem.device)
            staging_bytes = 0
        self.staging = self._kv.new_staging(staging_bytes) if staging_bytes else np.empty(0, np.uint8)
        self.staging_bytes = staging_nbytes(self.staging)
        self.staging_addr = self.transport.register(self.staging) if self.staging_bytes else 0
        # host staging mirrors the staging buffer (same slots): the host-staged path packs on the device,
        # copies device -> host here, and the decode READs host -> host (pinned on a CUDA rank)
        self.host_staging = (
            new_host_buffer(self._kv, self.staging_bytes) if self.staging_bytes else np.empty(0, np.uint8)
        )
        self.host_staging_addr = self.transport.register(self.host_staging) if self.staging_bytes else 0
        self.slots = SlotAllocator(self.staging_bytes)
        # per-peer quota: one decode engine's staging slots (all its ranks together) hold at most this
        # share of the buffer, so a slow, stuck or dead decode engine cannot starve the others
        self.staging_peer_bytes = int(self.staging_bytes * staging_peer_share)
        # (decode layout, decode rank) -> (LoweredPlan, decode engine that caused it): LRU, bounded in
        # total and per decode engine
        self._lowered: OrderedDict = OrderedDict()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.freed: list[str] = []
        self.expired: list[str] = []
        self.metrics = Metrics()
        self._pinned_at: dict[tuple, int] = {}  # (req_id, reader, read_id) -> perf_counter_ns of its grant
        # the push path: readers' NIXL agent metadata from their handshake (reader -> (agent, metadata,
        # sha256)), the agents added to this rank's transport for WRITEs (added at a reader's first push
        # stage request, removed when the reader is evicted or rebound), push stage requests being written
        self._push_meta: dict[tuple, tuple[str, bytes, str]] = {}
        self._push_peers: dict[tuple, str] = {}
        self._pushes: dict[tuple, _Push] = {}  # slot key -> its push
        # push probes being written (reader -> (envelope, WRITE handle)): one at a time per reader
        self._probes: dict[tuple, tuple[list, Any]] = {}
        self._kind = ""  # the kind of side-channel message being answered (its phase)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, req_id: str, blocks: dict[str, GroupBlocks], lease_s: float | None = None,
                    attempt: int | None = None, reads: int = 1) -> int:
        """Hold ``blocks`` for ``req_id`` until its readers are done or the lease (a duration, on this
        process's monotonic clock) runs out; returns the attempt id the decode must present
        (``ReadRequest.attempt``). Pass ``attempt`` to use the same id on every rank of the engine
        (the engine's scheduler draws one per request attempt); by default a random one is drawn.
        ``reads``: how many reads (decode requests, each its own ``read_id``) the blocks are held for at
        least (vLLM ``n > 1``: the decode runs ``n`` children of one prompt); raise it later with
        :meth:`expect_reads`."""
        attempt = int(attempt) if attempt else new_attempt()
        # re-registered: the old attempt's lease is REPLACED (its pins end, its staging slots go back)
        self._effects(self.table.register(req_id, blocks, attempt, time.monotonic(), lease_s, reads=reads,
                                          nbytes=self._bytes_of(blocks)))
        return attempt

    def _bytes_of(self, blocks: dict[str, GroupBlocks]) -> int:
        """Bytes of ``blocks`` in this rank's memory (what its readers may read at most)."""
        return sum(len(b.block_ids) * self._block_bytes.get(g, 0) for g, b in blocks.items())

    def expect_reads(self, req_id: str, attempt: int, reads: int) -> bool:
        """The live lease of ``attempt`` of ``req_id`` is held until ``reads`` reads are done (only ever
        raised; vLLM ``n > 1``: another sibling of the request's prompt points its readers at this lease).
        False if that lease is no longer live (its readers then find it ended: a typed refusal)."""
        ok = self.table.expect(req_id, int(attempt), int(reads), time.monotonic())
        if not ok:
            log.warning("prefill rank %s: cannot hold %s (attempt %s) for %d reads: the lease is not live",
                        self.rank, req_id, attempt, reads)
        return ok

    @property
    def leases(self) -> dict[str, Lease]:
        """Live leases by request id (read-only view of :attr:`table`)."""
        return self.table.leases

    def _effects(self, effects) -> None:
        """Act on what the lease machine did: staging slots of ended pins go back, ended leases are
        reported (``take_freed``)."""
        for e in effects:
            if isinstance(e, PinEnded):
                (eng, rank), read_id = e.pin
                t = self._pinned_at.pop((e.req_id, (eng, tuple(rank)), read_id), 0)
                if t:  # granted -> ended (the reader's Done, mostly; a timeout too)
                    self.metrics.observe_phase("pin_held", (time.perf_counter_ns() - t) / 1e9)
                key = (e.req_id, eng, tuple(rank), read_id)
                push = self._pushes.get(key)
                if push is not None:  # WRITEs from the slot may be in flight: it is freed once they settled
                    push.ended = True
                else:
                    self.slots.free(key)
                lease = self.table.get(e.req_id)
                if lease is not None:
                    lease.staged.discard(key)
                if self._parked:
                    self._unpark(e.req_id, eng, rank, read_id)
            elif isinstance(e, LeaseEnded):
                if e.state is LeaseState.FREED:
                    self.freed.append(e.req_id)
                    self.metrics.freed_requests += 1
                elif e.state is LeaseState.EXPIRED:
                    self.expired.append(e.req_id)
                    self.metrics.expired_requests += 1

    def idle_hint(self, notif_s: float, parked_s: float, idle_s: float) -> float:
        """How long a serving loop may wait for a side-channel message before it must serve anyway:
        ``parked_s`` with stage requests parked for staging space, ``notif_s`` while pins are held (NIXL
        notifications, readers' Done, have no file descriptor to wait on), a lease tick (at most 50 ms)
        while leases are held, else ``idle_s``."""
        if self._parked:
            return parked_s
        if self._pushes or self._probes:  # WRITEs in flight (an RDMA WRITE completes with no event)
            return min(notif_s, parked_s)
        if self._pinned_at:
            return notif_s
        if self.table.leases:
            return min(idle_s, 0.05)
        return idle_s

    def take_freed(self) -> dict:
        out = {"freed": self.freed, "expired": self.expired}
        self.freed, self.expired = [], []
        return out

    # ---- event loop ----------------------------------------------------------------------------
    def serve_once(self) -> int:
        """One serving turn: answer every side-channel message waiting, act on NIXL notifications (Done),
        expire leases and pins, retry parked stage requests. Returns how many messages and notifications
        it handled."""
        t_turn = time.perf_counter_ns()
        work = 0
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            work += 1
            # REQ peers (handshake) put an empty delimiter frame after the identity; DEALER peers
            # (stage requests) do not: answer in the same envelope
            envelope = frames[:2] if len(frames) > 2 and frames[1] == b"" else frames[:1]
            t0, first, self._kind = time.perf_counter_ns(), 0, ""
            try:
                for answer in self._answers(frames[len(envelope):], envelope):
                    self.sock.send_multipart(envelope + answer)
                    first = first or time.perf_counter_ns()
            except Exception as e:  # noqa: BLE001 - a request that fails while packing must not stop the rank
                log.warning("side-channel request failed: %r", e)
                self.metrics.failed_stage_requests += 1
                self.sock.send_multipart(envelope + pack(self._failure_reply(frames[len(envelope):], e)))
            kind = self._kind  # what _answers found ("acquire", "stage", or "" for the rest)
            if kind:
                t1 = time.perf_counter_ns()
                if kind == "stage":
                    self.metrics.observe_phase("stage_first", ((first or t1) - t0) / 1e9)
                self.metrics.observe_phase(kind, (t1 - t0) / 1e9)
        for agent, msgs in self.transport.get_notifs().items():
            for m in msgs:
                work += 1
                self._on_notif(agent, m)
        self._effects(self.table.tick(time.monotonic()))
        if self._parked:
            self._retry_parked()
        if self._pushes:
            work += self._advance_pushes()
        if self._probes:
            work += self._advance_probes()
        if work:
            self.metrics.observe_phase("serve_turn", (time.perf_counter_ns() - t_turn) / 1e9)
        return work

    def _retry_parked(self) -> None:
        """Serve stage requests that waited for staging space, in arrival order (first fit). A request
        whose lease is gone, or whose pin ended meanwhile (its reader's Done: it aborted or failed; or a
        timeout), is dropped; one that still does not fit waits until its deadline, then gets "full"."""
        now = time.monotonic()
        parked, self._parked = self._parked, []
        for p in parked:
            lease = self.leases.get(p.msg.req_id)
            try:
                if lease is None or lease.attempt != p.msg.attempt:
                    replies = [self._expired_error(p.msg)]
                elif _pin_key(p.msg) not in lease.pins:
                    continue  # the reader gave up on it meanwhile: nobody will read it
                else:
                    replies = self._pack_into_slot(p.msg, p.descs, p.envelope)
                    if replies is None:
                        if now < p.deadline:
                            self._parked.append(p)
                            continue
                        replies = [self._full_error(p.msg, p.descs, lease)]
                for reply in replies:
                    self.sock.send_multipart(p.envelope + pack(reply))
            except Exception as e:  # noqa: BLE001 - one bad request must not drop the others or the rank
                log.warning("stage request %s failed while packing: %r", p.msg.req_id, e)
                self.metrics.failed_stage_requests += 1
                self.sock.send_multipart(p.envelope + pack(StageError(
                    p.msg.req_id, f"prefill rank {self.rank} failed packing {p.msg.req_id!r}; read it directly",
                    code=Code.INTERNAL, ttl_s=self._ttl(lease, p.msg) if lease is not None else 0.0,
                    read_id=_read_id(p.msg), attempt=p.msg.attempt)))

    def _failure_reply(self, body: list[bytes], e: Exception):
        """A typed error reply for a request that raised while being served: a kvbridge error's message
        (it says what to change), never a Python exception's text."""
        try:
            msg = unpack(body)
        except Exception:  # noqa: BLE001
            msg = None
        text = str(e) if isinstance(e, KVBridgeError) else f"internal error on prefill rank {self.rank}"
        if isinstance(msg, Stage):  # the decode falls back to a direct read of this request only
            lease = self.leases.get(msg.req_id)
            ok = lease is not None and lease.attempt == msg.attempt
            return StageError(msg.req_id, f"cannot stage: {text}", code=Code.INTERNAL,
                              ttl_s=self._ttl(lease, msg) if ok else 0.0, read_id=_read_id(msg),
                              attempt=msg.attempt)
        return ErrorReply(text, code=Code.INTERNAL)

    # ---- leases: attempts, pins, reader identities ----------------------------------------------
    def _ttl(self, lease: Lease, msg: Stage) -> float:
        """Seconds the pin of ``msg``'s reader still holds (0 if it holds none)."""
        pin = lease.pins.get(_pin_key(msg))
        return max(0.0, pin.deadline - time.monotonic()) if pin is not None else 0.0

    def _expired_error(self, msg: Stage) -> StageError:
        self.metrics.refused_reads += 1
        return StageError(msg.req_id, f"request {msg.req_id!r} is unknown, expired or re-registered (another "
                                      f"attempt) on prefill rank {self.rank}; its blocks may be reused: do not read "
                                      "them", expired=True, code=Code.LEASE_EXPIRED, read_id=_read_id(msg),
                          attempt=msg.attempt)

    def _check_reader(self, reader: tuple, agent: str, incarnation: str) -> tuple[Code, str] | None:
        """None if ``reader`` (as ``agent``) may read from this process; else (code, message)."""
        if incarnation and incarnation not in self._digests:
            return Code.RESTARTED, (f"prefill rank {self.rank} of {self.engine_id!r} is not the process this "
                                       "decode rank handshook with (restarted); handshake again")
        bound = self.readers.agent_of(reader)
        if bound is None or agent != bound:
            self.metrics.forged_messages += 1
            return Code.UNKNOWN_READER, (f"decode rank {reader[1]} of {reader[0]!r} has not handshaken with "
                                            f"prefill rank {self.rank} as agent {agent!r}; handshake first")
        self.readers.touch(reader, time.monotonic())
        return None

    def _acquire(self, msg: Acquire) -> Acquired:
        reader = (msg.decode_engine, tuple(msg.decode_rank))
        granted, refused = [], []
        bad = self._check_reader(reader, msg.decode_agent, msg.incarnation)
        now = time.monotonic()
        progress = msg.progress if len(msg.progress) == len(msg.reqs) else [None] * len(msg.reqs)
        for item, done in zip(msg.reqs, progress):
            rid, attempt, read_id = (tuple(item) + ("",))[:3]
            read_id = read_id or rid
            if bad is not None:
                got = LeaseRefused(rid, attempt, read_id, *bad)
            elif msg.heartbeat:
                got = self.table.heartbeat(rid, attempt, reader, read_id, now,
                                           None if done is None else (int(done[0]), int(done[1])))
            else:
                got = self.table.acquire(rid, attempt, reader, read_id, msg.readers, now)
            if isinstance(got, LeaseGranted):
                granted.append((rid, attempt, read_id, got.ttl_s))
                if not msg.heartbeat:
                    self._pinned_at.setdefault((rid, reader, read_id), time.perf_counter_ns())
            else:
                self._count_refusal(got)
                refused.append((rid, attempt, read_id, got.code, got.message))
        return Acquired(granted, refused, heartbeat=msg.heartbeat)

    def _count_refusal(self, r: LeaseRefused) -> None:
        self.metrics.refused_reads += 1
        if r.code is Code.NOT_REGISTERED:
            self.metrics.not_registered += 1
        elif r.code is Code.LEASE_EXPIRED and r.req_id in self.leases:  # another attempt: stale or guessed
            self.metrics.stale_messages += 1

    def _remember(self, d: OrderedDict, key, value, cap: int) -> None:
        d[key] = value
        d.move_to_end(key)
        while len(d) > cap:
            d.popitem(last=False)

    def _lowering(self, msg: Stage) -> LoweredPlan:
        """The lowered plan for the stage request's decode layout and rank: LRU cache, bounded in total
        and per decode engine (distinct layouts from one peer evict that peer's oldest first)."""
        key = (json_key(msg.decode_layout), tuple(msg.decode_rank), wire_key(msg.decode_memory))
        hit = self._lowered.get(key)
        if hit is not None:
            self._lowered.move_to_end(key)
            return hit[0]
        decode = engine_from_dict(msg.decode_layout)
        d_mem = KVMemory.from_wire(decode, msg.decode_memory)
        if d_mem.rank != tuple(msg.decode_rank):
            raise LayoutError(f"stage request from rank {tuple(msg.decode_rank)} describes rank {d_mem.rank}")
        lp = LoweredPlan(plan_transfer(self.engine, decode), tuple(msg.decode_rank),
                         prefill_mems={self.rank: self.mem}, decode_mem=d_mem)
        mine = [k for k, (_, owner) in self._lowered.items() if owner == msg.decode_engine]
        if len(mine) >= self._lowered_per_peer:
            del self._lowered[mine[0]]
        self._remember(self._lowered, key, (lp, msg.decode_engine), self._lowered_cap)
        return lp

    def _unpark(self, req_id: str, decode_engine: str, decode_rank, read_id: str) -> None:
        key = (req_id, decode_engine, tuple(decode_rank), read_id)
        self._parked = [p for p in self._parked if _slot_key(p.msg) != key]

    def _answers(self, body: list[bytes], envelope: list[bytes] = ()):
        """Replies to one side-channel message (a stage request gets one per packed segment, as packed)."""
        try:
            msg = unpack(body)
        except KVBridgeError as e:  # noqa: BLE001 - answer the peer, keep serving
            yield pack(ErrorReply(str(e), code=Code.BAD_REQUEST))
            return
        except Exception:  # noqa: BLE001
            yield pack(ErrorReply("malformed side-channel message", code=Code.BAD_REQUEST))
            return
        if isinstance(msg, Stage):
            self._kind = "stage"
            for reply in self._stage(msg, list(envelope)):
                yield pack(reply)
            return
        if isinstance(msg, Acquire):
            self._kind = "" if msg.heartbeat else "acquire"
            yield pack(self._acquire(msg))
            return
        if isinstance(msg, PushProbe):
            answer = self._push_probe(msg, list(envelope))
            if answer is not None:  # else answered once its WRITE completed (_advance_probes)
                yield pack(answer)
            return
        if not isinstance(msg, GetMeta):
            yield pack(ErrorReply(f"unexpected message {type(msg).__name__}; send get_meta, acquire or stage",
                                  code=Code.UNEXPECTED))
            return
        if tuple(msg.prefill_rank) != self.rank:
            yield pack(ErrorReply(f"this endpoint is prefill rank {self.rank}, not {tuple(msg.prefill_rank)}",
                                  code=Code.WRONG_RANK))
            return
        md = self.transport.metadata()
        # the reader's identity from the handshake: its Done notifications must come from this agent. A
        # live reader's identity is never rebound to another agent, nor evicted by a flood of new ones
        reader = (msg.decode_engine, tuple(msg.decode_rank))
        refusal = self.readers.bind(reader, msg.decode_agent, time.monotonic(), self.table.pins_held)
        if refusal is not None:
            self.metrics.forged_messages += refusal is Code.IDENTITY_IN_USE
            why = ("is bound to another NIXL agent that is still live" if refusal is Code.IDENTITY_IN_USE
                   else f"cannot be added: {len(self.readers)} live readers fill the table")
            yield pack(ErrorReply(f"decode rank {reader[1]} of {reader[0]!r} {why} on prefill rank {self.rank}; "
                                  "use a distinct decode engine id per engine", code=refusal))
            return
        self._remember(self._digests, metadata_digest(md), True, 8)
        push = self._bind_push(reader, msg)
        yield pack(RankMeta(self.engine_id, self.rank, engine_to_dict(self.engine), self.engine.model.fingerprint,
                             self.transport.agent_name, md, metadata_digest(md), self.mem.to_wire(),
                             self.staging_bytes, self.staging_addr, self.host_staging_addr,
                             staging_nbytes(self.host_staging), float(self.pin_s), float(self.min_read_rate),
                             push=push))

    def _stage(self, msg: Stage, envelope: list[bytes]):
        """Answer a stage request: pin the lease for this reader's read (as an acquire does), pack this
        rank's runs of the request for one decode rank into the staging buffer, segment by segment,
        yielding a Staged reply as soon as each segment is packed (the decode reads segment k while
        segment k+1 is packed). With no free staging space the request waits (up to ``stage_wait_s``)
        for a slot instead of failing at once."""
        reader = (msg.decode_engine, tuple(msg.decode_rank))
        read_id = _read_id(msg)
        bad = self._check_reader(reader, msg.decode_agent, msg.incarnation)
        got = (LeaseRefused(msg.req_id, msg.attempt, read_id, *bad) if bad is not None else
               self.table.acquire(msg.req_id, msg.attempt, reader, read_id, msg.readers, time.monotonic()))
        if isinstance(got, LeaseRefused):  # stage slots only for readers that hold a pin
            self._count_refusal(got)
            yield StageError(msg.req_id, got.message, expired=got.code in (Code.LEASE_EXPIRED, Code.RESTARTED,
                                                                            Code.DONE),
                             code=got.code, read_id=read_id, attempt=msg.attempt)
            return
        ttl = got.ttl_s
        self._pinned_at.setdefault((msg.req_id, reader, read_id), time.perf_counter_ns())
        lease = self.leases[msg.req_id]
        if msg.path not in STAGE_PATHS:
            yield StageError(msg.req_id, f"cannot stage over path {msg.path!r}: this prefill rank stages over "
                                         f"{', '.join(sorted(STAGE_PATHS))}", code=Code.BAD_REQUEST, ttl_s=ttl,
                             read_id=read_id, attempt=msg.attempt)
            return
        try:
            lp = self._lowering(msg)
            descs = {d.prefill: d for d in lp.descriptors(msg.num_tokens, blocks_from_wire(msg.prefill_blocks),
                                                          blocks_from_wire(msg.decode_blocks), only=(self.rank,))}
        except KVBridgeError as e:  # a bad request must not take the rank down
            yield StageError(msg.req_id, f"cannot stage: {e}", code=Code.BAD_REQUEST, ttl_s=ttl, read_id=read_id,
                             attempt=msg.attempt)
            return
        except Exception:  # noqa: BLE001
            yield StageError(msg.req_id, f"cannot stage {msg.req_id!r}: internal error on prefill rank {self.rank}",
                             code=Code.BAD_REQUEST, ttl_s=ttl, read_id=read_id, attempt=msg.attempt)
            return
        d = descs.get(self.rank)
        if msg.path == TransferPath.PUSH:
            bad_push = self._push_check(msg, reader)
            if bad_push is not None:
                yield StageError(msg.req_id, f"cannot push: {bad_push}; read it", code=Code.BAD_REQUEST, ttl_s=ttl,
                                 read_id=read_id, attempt=msg.attempt)
                return
        self._unpark(*_slot_key(msg))  # a retried request replaces a parked one
        replies = self._pack_into_slot(msg, d, envelope)
        if replies is None:
            total = d.total_bytes if d is not None else 0
            if self.slots.rounded(total) > min(self.slots.capacity, self.staging_peer_bytes) or self.stage_wait_s <= 0:
                yield self._full_error(msg, d, lease)
                return
            self.metrics.stage_waits += 1
            self._parked.append(_Parked(envelope, msg, d, time.monotonic() + self.stage_wait_s))
            return
        yield from replies

    def _full_error(self, msg: Stage, d, lease: Lease) -> StageError:
        total = d.total_bytes if d is not None else 0
        self.metrics.stage_full += 1
        held = self.slots.group_bytes(msg.decode_engine)
        if held + self.slots.rounded(total) > self.staging_peer_bytes:
            self.metrics.stage_quota_full += 1
            why = (f"decode engine {msg.decode_engine!r} holds {held} B of its {self.staging_peer_bytes} B share "
                   f"of the {self.slots.capacity} B staging buffer")
        else:
            why = f"staging buffer full: {self.slots.bytes_used} of {self.slots.capacity} B used"
        return StageError(msg.req_id, f"cannot stage {total} B ({why}; waited up to {self.stage_wait_s:g} s); "
                                      "read directly", code=Code.FULL, ttl_s=self._ttl(lease, msg),
                          read_id=_read_id(msg), attempt=msg.attempt)

    def _pack_into_slot(self, msg: Stage, d, envelope: list | None = None):
        """Allocate a staging slot (held by the reader's pin) and return a generator of Staged replies
        that packs segment by segment; None when there is no free slot of the size needed. A push stage
        request's generator packs and posts each segment's WRITE and yields nothing: its answers go out
        as the WRITEs complete (:meth:`_advance_pushes`)."""
        from ..staging import RunSlice, run_lengths, segment_bounds
        total = d.total_bytes if d is not None else 0
        slot_key = _slot_key(msg)
        off = self.slots.alloc(slot_key, total, group=msg.decode_engine, limit=self.staging_peer_bytes)
        if off is None:
            return None
        lease = self.leases[msg.req_id]
        lease.staged.add(slot_key)
        read_id = _read_id(msg)
        if msg.path == TransferPath.PUSH and total:
            return self._push_segments(msg, d, off, list(envelope or ()))

        host = msg.path == TransferPath.HOST  # the decode READs host staging: each packed segment is copied there
        base = self.host_staging_addr if host else self.staging_addr

        def replies():
            if not total:
                yield Staged(msg.req_id, base + off, 0, 0, 0, True, self._ttl(lease, msg), read_id,
                             msg.attempt)
                return
            lengths = run_lengths(d)  # the runs' addresses stay factored: computed where the copy runs
            bounds = segment_bounds(lengths, msg.segment_bytes)
            pos = 0
            for i, (a, b) in enumerate(bounds):
                n = self._kv.pack(RunSlice(d, "src", a, b), lengths[a:b], self.staging, off + pos)
                if host:
                    to_host_segment(self.staging, self.host_staging, off + pos, n)
                yield Staged(msg.req_id, base + off + pos, n, pos, total, i == len(bounds) - 1,
                             self._ttl(lease, msg), read_id, msg.attempt)
                pos += n
        return replies()

    # ---- the push path: WRITE packed segments into the decode's staging --------------------------
    def _bind_push(self, reader: tuple, msg: GetMeta) -> bool:
        """Remember the reader's agent metadata from its handshake (the push path), and forget the agents
        of readers no longer bound as they were (evicted from the reader table, or rebound to another
        agent). True if this reader can be pushed to."""
        for r, (agent, _, _) in list(self._push_meta.items()):
            if self.readers.agent_of(r) != agent:
                del self._push_meta[r]
                self._drop_push_peer(r)
        md = bytes(msg.decode_agent_metadata)
        if not md or not self.staging_bytes or metadata_digest(md) != msg.decode_metadata_sha256:
            return False
        old = self._push_meta.get(reader)
        if (old is not None and old[1] != md and not any(k[1:3] == reader for k in self._pushes)
                and reader not in self._probes):
            # new metadata (a restarted decode process, or memory it registered since): added anew at the
            # reader's next push stage request or probe (never while one of its pushes or probes is in flight)
            self._drop_push_peer(reader)
        self._push_meta[reader] = (msg.decode_agent, md, msg.decode_metadata_sha256)
        return True

    def _drop_push_peer(self, reader: tuple) -> None:
        name = self._push_peers.pop(reader, None)
        if name is not None and name not in self._push_peers.values():
            self.transport.remove_peer(name)

    def _push_agent(self, reader: tuple) -> str:
        """The transport's peer name of ``reader``'s agent (added on its first push stage request)."""
        name = self._push_peers.get(reader)
        if name is not None:
            return name
        meta = self._push_meta.get(reader)
        if meta is None:
            raise HandshakeError(f"decode rank {reader[1]} of {reader[0]!r} sent no NIXL agent metadata at its "
                                 f"handshake with prefill rank {self.rank}")
        name = self.transport.add_peer(meta[1], meta[2])
        if name != meta[0]:
            self.transport.remove_peer(name)
            raise HandshakeError(f"decode rank {reader[1]} of {reader[0]!r} sent the metadata of agent {name!r}, "
                                 f"not of {meta[0]!r}")
        self._push_peers[reader] = name
        return name

    def _push_check(self, msg: Stage, reader: tuple) -> str | None:
        """Why this push stage request cannot be served (None: it can; the reader's agent is added)."""
        if not msg.push_addr:
            return "the stage request names no staging slot of the decode (push_addr)"
        if _slot_key(msg) in self._pushes:
            return "this read's segments are being written already"
        try:
            self._push_agent(reader)
        except KVBridgeError as e:
            return str(e)
        return None

    def _push_segments(self, msg: Stage, d, off: int, envelope: list):
        """Pack each segment into this rank's staging slot at ``off`` and post its WRITE to the same stream
        offset of the decode's slot (``msg.push_addr``); a generator that yields nothing (its answers go
        out as the WRITEs complete). A failure stops the posting; it is answered once nothing is in flight."""
        from ..staging import RunSlice, run_lengths, segment_bounds
        reader = (msg.decode_engine, tuple(msg.decode_rank))
        job = self._pushes[_slot_key(msg)] = _Push(envelope, msg, self._push_peers[reader], total=d.total_bytes)
        one = np.ones(1, dtype=np.int64)
        try:
            lengths = run_lengths(d)
            bounds = segment_bounds(lengths, msg.segment_bytes)
            pos = 0
            for i, (a, b) in enumerate(bounds):
                n = self._kv.pack(RunSlice(d, "src", a, b), lengths[a:b], self.staging, off + pos)
                h = self.transport.write(job.agent, one * (self.staging_addr + off + pos), one * (msg.push_addr + pos),
                                         one * n, remote_device=msg.push_device or None)
                job.pending.append((h, pos, n, i == len(bounds) - 1))
                self.metrics.pushed_segments += 1
                pos += n
        except Exception as e:  # noqa: BLE001 - answered typed once the WRITEs posted so far settled
            job.error = self._push_error(msg, e)
        finally:
            job.posted = True
        return
        yield  # (a generator: the stage request's answers are the WRITEs' completions)

    def _push_error(self, msg: Stage, e: BaseException) -> StageError:
        self.metrics.failed_pushes += 1
        log.warning("prefill rank %s: pushing %s to decode rank %s of %r failed: %r", self.rank, msg.req_id,
                    tuple(msg.decode_rank), msg.decode_engine, e)
        lease = self.leases.get(msg.req_id)
        ok = lease is not None and lease.attempt == msg.attempt
        text = str(e) if isinstance(e, KVBridgeError) else type(e).__name__
        return StageError(msg.req_id, f"prefill rank {self.rank} could not WRITE {msg.req_id!r} into the decode's "
                                      f"staging: {text}", code=Code.INTERNAL,
                          ttl_s=self._ttl(lease, msg) if ok and lease is not None else 0.0, read_id=_read_id(msg),
                          attempt=msg.attempt)

    def _advance_pushes(self) -> int:
        """Answer the push stage requests' segments whose WRITEs completed (in segment order); a failed
        WRITE, or a pin that ended, is answered once none of the request's WRITEs is in flight (then its
        staging slot is freed if its pin ended). Returns how many answers went out."""
        sent = 0
        for key, job in list(self._pushes.items()):
            msg = job.msg
            while job.pending and job.error is None and not job.ended:
                h, pos, n, last = job.pending[0]
                try:
                    state = self.transport.check(h)
                except Exception as e:  # noqa: BLE001 - a typed answer, never a dead rank
                    job.error = self._push_error(msg, e)
                    break
                if state != "DONE":
                    break
                job.pending.popleft()
                self.transport.release(h)
                lease = self.leases.get(msg.req_id)
                ttl = self._ttl(lease, msg) if lease is not None else 0.0
                self.sock.send_multipart(job.envelope + pack(Staged(
                    msg.req_id, msg.push_addr + pos, n, pos, job.total, last, ttl, _read_id(msg), msg.attempt)))
                sent += 1
            if job.error is not None or job.ended:
                if any(self.transport.settle(h, 0) is None for h, *_ in job.pending):
                    continue  # a WRITE is still in flight: answer once it settled
                for h, *_ in job.pending:
                    self.transport.release(h)
                job.pending.clear()
                self.sock.send_multipart(job.envelope + pack(job.error or StageError(
                    msg.req_id, f"the pin of read {_read_id(msg)!r} ended while its segments were being written; "
                                "do not use them", expired=True, code=Code.LEASE_EXPIRED, read_id=_read_id(msg),
                    attempt=msg.attempt)))
                sent += 1
            if job.posted and not job.pending:
                del self._pushes[key]
                if job.ended:
                    self.slots.free(key)
        return sent

    # ---- the push probe: a reader times the push path's WRITE at its handshake ---------------------
    def _push_probe(self, msg: PushProbe, envelope: list) -> PushProbed | None:
        """Post the WRITE a push probe asks for (from this rank's staging buffer into the reader's probe
        buffer); None: answered once it completed (:meth:`_advance_probes`), never waited for here.
        Refused typed: a reader not bound at handshake as this agent or not pushed to, one with a probe
        in flight, or more than ``PUSH_PROBE_MAX_BYTES`` / ``PUSH_PROBE_MAX_DESCS``."""
        reader = (msg.decode_engine, tuple(msg.decode_rank))
        bad = self._check_reader(reader, msg.decode_agent, msg.incarnation)
        if bad is not None:
            return PushProbed(False, bad[0], bad[1])
        if reader not in self._push_meta:
            return PushProbed(False, Code.BAD_REQUEST, f"prefill rank {self.rank} does not push to decode rank "
                                                       f"{reader[1]} of {reader[0]!r} (no staging, or no agent "
                                                       "metadata at its handshake)")
        if reader in self._probes:
            return PushProbed(False, Code.BUSY, "a push probe of this decode rank is being written already")
        descs, nbytes, stride = int(msg.descs), int(msg.nbytes), int(msg.stride)
        if descs == 0:
            return PushProbed(True)  # the side channel's round trip
        extent = (descs - 1) * stride + nbytes
        if (descs < 0 or nbytes <= 0 or stride < 0 or (descs > 1 and stride < nbytes) or not msg.addr
                or descs > PUSH_PROBE_MAX_DESCS or extent > min(PUSH_PROBE_MAX_BYTES, self.staging_bytes)):
            return PushProbed(False, Code.BAD_REQUEST, f"a push probe writes 1..{PUSH_PROBE_MAX_DESCS} descriptors "
                                                       f"within {min(PUSH_PROBE_MAX_BYTES, self.staging_bytes)} B "
                                                       "to a named address")
        try:
            agent = self._push_agent(reader)
            offs = np.arange(descs, dtype=np.int64) * stride
            h = self.transport.write(agent, self.staging_addr + offs, msg.addr + offs,
                                     np.full(descs, nbytes, np.int64), remote_device=msg.device or None)
        except Exception as e:  # noqa: BLE001 - a typed answer, never a dead rank
            text = str(e) if isinstance(e, KVBridgeError) else type(e).__name__
            return PushProbed(False, Code.INTERNAL, f"prefill rank {self.rank} could not WRITE the probe: {text}")
        self._probes[reader] = (envelope, h)
        return self._advance_probe(reader)

    def _advance_probe(self, reader: tuple) -> PushProbed | None:
        """The answer of ``reader``'s probe if its WRITE ended (its handle released), else None."""
        envelope, h = self._probes[reader]
        try:
            if self.transport.check(h) != "DONE":
                return None
            answer = PushProbed(True)
        except Exception as e:  # noqa: BLE001
            text = str(e) if isinstance(e, KVBridgeError) else type(e).__name__
            answer = PushProbed(False, Code.INTERNAL, f"the probe's WRITE failed on prefill rank {self.rank}: {text}")
        del self._probes[reader]
        self.transport.release(h)
        return answer

    def _advance_probes(self) -> int:
        """Answer the push probes whose WRITEs ended; returns how many answers went out."""
        sent = 0
        for reader in list(self._probes):
            envelope = self._probes[reader][0]
            answer = self._advance_probe(reader)
            if answer is not None:
                self.sock.send_multipart(envelope + pack(answer))
                sent += 1
        return sent

    def _on_notif(self, agent: str, raw: bytes) -> None:
        try:
            d: Done = decode_notif(raw)
        except Exception:  # noqa: BLE001
            self.metrics.unknown_notifications += 1
            log.warning("ignoring malformed notification from %s", agent)
            return
        reader = (d.decode_engine, tuple(d.decode_rank))
        bound = self.readers.agent_of(reader)
        if bound is None or (bound and bound != agent):
            self.metrics.forged_messages += 1  # not the agent that handshook as this reader
            log.warning("ignoring Done for %s from agent %s claiming to be %s", d.req_id, agent, reader)
            return
        self.readers.touch(reader, time.monotonic())
        read_id = d.read_id or d.req_id
        event = self.table.decline if d.decline else self.table.release
        outcome, effects = event(d.req_id, d.attempt, reader, read_id, d.readers, d.ok, time.monotonic())
        if outcome is Outcome.UNKNOWN:
            self.metrics.unknown_notifications += 1
            log.info("notification for unknown or ended request %s from %s", d.req_id, agent)
        elif outcome is Outcome.STALE:  # a late Done of an earlier attempt, or a guess: not this lease's
            self.metrics.stale_messages += 1
        elif outcome is Outcome.BAD_COUNT:
            self.metrics.forged_messages += 1
        elif not outcome.effective:  # not the holder of the pin it names, a decline from the holder, twice
            self.metrics.ignored_notifications += 1
            log.info("ignoring Done (%s) for %s read %s from %s: %s", "decline" if d.decline else "release",
                     d.req_id, read_id, reader, outcome.value)
        self._effects(effects)

    def stats(self) -> dict:
        return {"metrics": self.metrics.to_json(), "leases": len(self.leases), "staging_used": self.slots.bytes_used,
                "staging_by_peer": {e: self.slots.group_bytes(e) for e in {k[1] for k in self.slots.used}},
                "pinned_leases": sum(bool(lease.pins) for lease in self.leases.values()),
                "pins": sum(len(lease.pins) for lease in self.leases.values()), "readers": len(self.readers),
                "parked_stage_requests": len(self._parked), "lowered_cached": len(self._lowered),
                "pushing": len(self._pushes), "push_peers": len(self._push_peers), "push_probes": len(self._probes),
                "nixl": vars(self.transport.stats).copy() if hasattr(self.transport, "stats") else {}}

    def close(self) -> None:
        for job in self._pushes.values():  # WRITEs still in flight: let them end before the memory goes
            for h, *_ in job.pending:
                if self.transport.settle(h, 1.0) is not None:
                    self.transport.release(h)
        self._pushes.clear()
        for _, h in self._probes.values():
            if self.transport.settle(h, 1.0) is not None:
                self.transport.release(h)
        self._probes.clear()
        self.sock.close(0)
        self.transport.close()
