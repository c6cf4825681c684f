"""A prefill rank: registers its KV memory, serves its metadata, frees blocks when readers are done."""
from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import zmq

from ..errors import KVBridgeError
from ..layout import EngineLayout, engine_to_dict
from ..lower import GroupBlocks
from ..memory import KVMemory
from ..transport.base import Transport
from ..transport.delayed import wrap_from_env
from ..transport.nixl import NixlTransport, metadata_digest
from .config import PrefillConfig
from .lease import (
    Effect,
    Lease,
    LeaseEnded,
    LeaseGranted,
    LeaseRefused,
    LeaseState,
    LeaseTable,
    Outcome,
    PinEnded,
    Reader,
)
from .lowerings import Lowerings, json_key
from .memhost import KVBytes, check_memory, register_memory, staging_nbytes, transport_device
from .metrics import Metrics
from .protocol import (
    Acquire,
    Acquired,
    Code,
    Done,
    ErrorReply,
    GetMeta,
    PushProbe,
    RankMeta,
    Stage,
    Staged,
    StageError,
    blocks_from_wire,
    decode_notif,
    pack,
    unpack,
)
from .readers import ReaderAuth
from .stager import STAGE_PATHS, SlotKey, Stager, as_rank, read_id_of, reader_of, ttl_of
from .tags import TagTable

# re-exported: the names this module held before the stage packer, the lowering cache and reader
# authentication moved to their own modules
__all__ = ["STAGE_PATHS", "PrefillRank", "json_key", "new_attempt"]

log = logging.getLogger(__name__)


def new_attempt() -> int:
    """A random, non-zero 63-bit attempt id (0 never names a lease)."""
    return secrets.randbits(63) | 1


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
        self.engine, self.rank, self.engine_id, self.lease_s = engine, as_rank(rank), engine_id, lease_s
        # leases (runtime/lease.py): a pin (a reader's acquire or stage request) holds until that reader's
        # Done, pin_idle_s (default lease_s) without a refresh (its heartbeats), pin_s without progress (its
        # heartbeats report bytes read), or pin_s + the request's bytes at min_read_rate after it was made;
        # readers count the granted remainder down on their own clock
        self.pin_s, self.min_read_rate = pin_s, min_read_rate
        self.table = LeaseTable(lease_s, pin_s, pin_idle_s, min_read_rate=min_read_rate)
        self.metrics = Metrics()
        # reader authentication (runtime/readers.py): the readers this rank handshook with, each bound to
        # the NIXL agent it named (:attr:`readers`), and the metadata digests this process served
        self.auth = ReaderAuth(self.rank, engine_id, self.metrics, max_readers, reader_idle_s)
        self.readers = self.auth.table
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
        # live leases' tags in registered host memory: a decode READs them to trust an optimistic READ
        # without waiting for this rank's grant (runtime/tags.py); 0: this transport cannot register it
        self.tags = TagTable()
        try:
            self.tags_addr = int(self.transport.register(self.tags.words))
        except Exception as e:  # noqa: BLE001 - readers then wait for grants, as without tags
            log.info("prefill rank %s: lease tags not registered (%r); readers wait for grants", self.rank, e)
            self.tags_addr = 0
        # the stage packer (runtime/stager.py): staging buffers on the KV memory's device and their host
        # mirror, their slots, stage requests parked for space, the push path's WRITEs and probes
        kv = KVBytes(self.mem)
        if not kv.usable and staging_bytes:
            log.warning("prefill rank %s: KV memory on %s given by address and torch is not loaded: no staging "
                        "(decode ranks read directly); describe the memory with torch tensors to stage on the "
                        "device", self.rank, self.mem.device)
            staging_bytes = 0
        self.stager = Stager(self.rank, kv, self.transport, lambda frames: self.sock.send_multipart(frames),
                             self.metrics, self.auth, lambda req_id: self.leases.get(req_id), staging_bytes,
                             staging_peer_share, stage_wait_s)
        st = self.stager
        self.staging, self.staging_bytes, self.staging_addr = st.staging, st.staging_bytes, st.staging_addr
        self.host_staging, self.host_staging_addr = st.host_staging, st.host_staging_addr
        self.slots, self.staging_peer_bytes, self.stage_wait_s = st.slots, st.staging_peer_bytes, st.stage_wait_s
        # the lowering cache (runtime/lowerings.py): a stage request's plan per decode layout and rank
        self.lowerings = Lowerings(engine, self.rank, self.mem, lowered_cache, lowered_per_peer)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
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
        # (req_id, reader, read_id) -> perf_counter_ns of its grant
        self._pinned_at: dict[tuple[str, Reader, str], int] = {}
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
        if self.tags_addr:  # before the parameters are issued (this returns first)
            self.tags.set(req_id, attempt)
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

    def _effects(self, effects: Sequence[Effect]) -> None:
        """Act on what the lease machine did: staging slots of ended pins go back, ended leases are
        reported (``take_freed``)."""
        for e in effects:
            if isinstance(e, PinEnded):
                (eng, rank), read_id = e.pin
                t = self._pinned_at.pop((e.req_id, (eng, as_rank(rank)), read_id), 0)
                if t:  # granted -> ended (the reader's Done, mostly; a timeout too)
                    self.metrics.observe_phase("pin_held", (time.perf_counter_ns() - t) / 1e9)
                self.stager.pin_ended((e.req_id, eng, tuple(rank), read_id))
            elif isinstance(e, LeaseEnded):
                self.tags.clear(e.req_id, e.attempt)  # first: no reader may trust a READ ending after this
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
        if self.stager.parked:
            return parked_s
        if self.stager.pushes or self.stager.probes:  # WRITEs in flight (an RDMA WRITE completes with no event)
            return min(notif_s, parked_s)
        if self._pinned_at:
            return notif_s
        if self.table.leases:
            return min(idle_s, 0.05)
        return idle_s

    def take_freed(self) -> dict[str, list[str]]:
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
        if self.stager.parked:
            self.stager.retry_parked()
        if self.stager.pushes:
            work += self.stager.advance_pushes()
        if self.stager.probes:
            work += self.stager.advance_probes()
        if work:
            self.metrics.observe_phase("serve_turn", (time.perf_counter_ns() - t_turn) / 1e9)
        return work

    def _failure_reply(self, body: list[bytes], e: Exception) -> StageError | ErrorReply:
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
                              ttl_s=ttl_of(lease, msg) if ok and lease is not None else 0.0, read_id=read_id_of(msg),
                              attempt=msg.attempt)
        return ErrorReply(text, code=Code.INTERNAL)

    # ---- leases: attempts, pins, reader identities ----------------------------------------------
    def _acquire(self, msg: Acquire) -> Acquired:
        reader = reader_of(msg)
        granted: list[tuple[str, int, str, float]] = []
        refused: list[tuple[str, int, str, str, str]] = []
        bad = self.auth.check(reader, msg.decode_agent, msg.incarnation)
        now = time.monotonic()
        progress = msg.progress if len(msg.progress) == len(msg.reqs) else [None] * len(msg.reqs)
        for item, done in zip(msg.reqs, progress):
            rid, attempt, read_id = cast(tuple[str, int, str], (tuple(item) + ("",))[:3])
            read_id = read_id or rid
            got: LeaseGranted | LeaseRefused
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

    def _answers(self, body: list[bytes], envelope: Sequence[bytes] = ()) -> Iterator[list[bytes]]:
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
            answer = self.stager.push_probe(msg, list(envelope))
            if answer is not None:  # else answered once its WRITE completed (Stager.advance_probes)
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
        reader = reader_of(msg)
        refusal = self.auth.bind(reader, msg.decode_agent, self.table.pins_held)
        if refusal is not None:
            yield pack(refusal)
            return
        self.auth.served(metadata_digest(md))
        push = self.stager.bind_push(reader, msg)
        yield pack(RankMeta(self.engine_id, self.rank, engine_to_dict(self.engine), self.engine.model.fingerprint,
                             self.transport.agent_name, md, metadata_digest(md), self.mem.to_wire(),
                             self.staging_bytes, self.staging_addr, self.host_staging_addr,
                             staging_nbytes(self.host_staging), float(self.pin_s), float(self.min_read_rate),
                             push=push, tags_addr=self.tags_addr, tags_words=int(self.tags.words.size) if
                             self.tags_addr else 0, tag_salt=self.tags.salt))

    def _stage(self, msg: Stage, envelope: list[bytes]) -> Iterator[Staged | StageError]:
        """Answer a stage request: pin the lease for this reader's read (as an acquire does), pack this
        rank's runs of the request for one decode rank into the staging buffer, segment by segment,
        yielding a Staged reply as soon as each segment is packed (the decode reads segment k while
        segment k+1 is packed). With no free staging space the request waits (up to ``stage_wait_s``)
        for a slot instead of failing at once."""
        reader = reader_of(msg)
        read_id = read_id_of(msg)
        bad = self.auth.check(reader, msg.decode_agent, msg.incarnation)
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
            lp = self.lowerings.get(msg)
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
        yield from self.stager.stage(msg, descs.get(self.rank), lease, ttl, envelope)

    def _on_notif(self, agent: str, raw: bytes) -> None:
        try:
            d: Done = decode_notif(raw)
        except Exception:  # noqa: BLE001
            self.metrics.unknown_notifications += 1
            log.warning("ignoring malformed notification from %s", agent)
            return
        reader = reader_of(d)
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

    def stats(self) -> dict[str, Any]:
        return {"metrics": self.metrics.to_json(), "leases": len(self.leases), "staging_used": self.slots.bytes_used,
                "staging_by_peer": {e: self.slots.group_bytes(e)
                                    for e in {cast(SlotKey, k)[1] for k in self.slots.used}},
                "pinned_leases": sum(bool(lease.pins) for lease in self.leases.values()),
                "pins": sum(len(lease.pins) for lease in self.leases.values()), "readers": len(self.readers),
                "parked_stage_requests": len(self.stager.parked), "lowered_cached": len(self.lowerings),
                "pushing": len(self.stager.pushes), "push_peers": len(self.stager.push_peers),
                "push_probes": len(self.stager.probes),
                "nixl": vars(self.transport.stats).copy() if hasattr(self.transport, "stats") else {}}

    def close(self) -> None:
        self.stager.close()  # WRITEs still in flight: let them end before the memory goes
        self.sock.close(0)
        self.transport.close()
