"""A prefill rank: registers its KV memory, serves its metadata, frees blocks when readers are done."""
from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import zmq

from ..layout import EngineLayout, engine_from_dict, engine_to_dict
from ..lower import GroupBlocks, LoweredPlan
from ..plan import plan_transfer
from ..errors import LayoutError
from ..memory import KVMemory
from ..tensors import host_view
from .memhost import KVBytes, check_memory, register_memory, staging_nbytes, transport_device, wire_key
from ..transport.nixl import NixlTransport, metadata_digest
from .metrics import Metrics
from ..errors import KVBridgeError
from .protocol import (Acquire, Acquired, Done, ErrorReply, GetMeta, RankMeta, Stage, Staged, StageError,
                       blocks_from_wire, decode_notif, pack, unpack)
from .slots import SlotAllocator

log = logging.getLogger(__name__)


def json_key(d: dict) -> str:
    import json
    return json.dumps(d, sort_keys=True)


def new_attempt() -> int:
    """A random, non-zero 63-bit attempt id (0 never names a lease)."""
    return secrets.randbits(63) | 1


@dataclass
class Lease:
    """Blocks held for one attempt of a request. Only this process's monotonic clock decides when the
    lease ends: ``deadline`` (``time.monotonic()``), pushed to ``pinned_at + pin_s`` (once) when a reader
    pins it; Done from every reader of the attempt frees it earlier."""

    req_id: str
    blocks: dict[str, GroupBlocks]
    deadline: float
    attempt: int = 0
    done_ranks: set = field(default_factory=set)
    readers: int | None = None
    staged: set = field(default_factory=set)  # staging slots held for this request
    pinned_at: float | None = None            # monotonic time of the first pin (hard cap from there)
    holders: set = field(default_factory=set)  # readers (decode engine, rank) that pinned it


@dataclass
class _Parked:
    """A stage request waiting for staging space."""
    envelope: list
    msg: Stage
    descs: object
    deadline: float


class PrefillRank:
    """Prefill side of one rank: registers the engine's KV memory (``memory``, a :class:`KVMemory`
    describing tensors the engine allocated), serves its metadata and stage requests on a ZMQ
    side channel, holds requests' blocks under leases until their readers are done."""

    def __init__(self, engine: EngineLayout, rank: tuple[int, int], engine_id: str, memory: KVMemory | None = None,
                 host: str = "127.0.0.1", port: int = 0, lease_s: float = 30.0, transport=None,
                 staging_bytes: int = 64 << 20, stage_wait_s: float = 2.0, pin_s: float = 120.0,
                 lowered_cache: int = 64, lowered_per_peer: int = 16, staging_peer_share: float = 0.5):
        self.engine, self.rank, self.engine_id, self.lease_s = engine, tuple(rank), engine_id, lease_s
        # a pinned lease (a reader asked to read it) lives until every reader's Done, or at most pin_s
        # after the first pin; readers count the granted remainder down on their own clock
        self.pin_s = pin_s
        # readers this rank handshook with: (decode engine, decode rank) -> NIXL agent name (bounded)
        self._readers: OrderedDict = OrderedDict()
        self._digests: OrderedDict = OrderedDict()  # metadata digests this process has served
        self._lowered_cap, self._lowered_per_peer = lowered_cache, lowered_per_peer
        # a stage request that finds the staging buffer full waits this long for a slot to free (the
        # previous request's Done is usually in flight) before the prefill says "full, read directly":
        # a direct read of small head slices is many times slower than waiting a few milliseconds
        self.stage_wait_s = stage_wait_s
        self._parked: list[_Parked] = []
        self.mem = check_memory(memory, engine, rank)
        self.transport = transport or NixlTransport(f"{engine_id}-p{rank[0]}t{rank[1]}", multi_threaded=False,
                                                    **transport_device(self.mem))
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
        self.slots = SlotAllocator(self.staging_bytes)
        # per-peer quota: one decode engine's staging slots (all its ranks together) hold at most this
        # share of the buffer, so a slow, stuck or dead decode engine cannot starve the others
        if not 0 < staging_peer_share <= 1:
            raise ValueError(f"staging_peer_share must be in (0, 1], not {staging_peer_share!r}")
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
        self.leases: dict[str, Lease] = {}
        self.freed: list[str] = []
        self.expired: list[str] = []
        self.metrics = Metrics()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, req_id: str, blocks: dict[str, GroupBlocks], lease_s: float | None = None,
                    attempt: int | None = None) -> int:
        """Hold ``blocks`` for ``req_id`` until its readers are done or the lease (a duration, on this
        process's monotonic clock) runs out; returns the attempt id the decode must present
        (``ReadRequest.attempt``). Pass ``attempt`` to use the same id on every rank of the engine
        (the engine's scheduler draws one per request attempt); by default a random one is drawn."""
        attempt = int(attempt) if attempt else new_attempt()
        if req_id in self.leases:  # re-registered: its staging slots go back first
            self._release(req_id)
        self.leases[req_id] = Lease(req_id, blocks, time.monotonic() + (self.lease_s if lease_s is None else lease_s),
                                    attempt)
        return attempt

    def take_freed(self) -> dict:
        out = {"freed": self.freed, "expired": self.expired}
        self.freed, self.expired = [], []
        return out

    # ---- event loop ----------------------------------------------------------------------------
    def serve_once(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            # REQ peers (handshake) put an empty delimiter frame after the identity; DEALER peers
            # (stage requests) do not: answer in the same envelope
            envelope = frames[:2] if len(frames) > 2 and frames[1] == b"" else frames[:1]
            try:
                for answer in self._answers(frames[len(envelope):], envelope):
                    self.sock.send_multipart(envelope + answer)
            except Exception as e:  # noqa: BLE001 - a request that fails while packing must not stop the rank
                log.warning("side-channel request failed: %r", e)
                self.metrics.failed_stage_requests += 1
                self.sock.send_multipart(envelope + pack(self._failure_reply(frames[len(envelope):], e)))
        for agent, msgs in self.transport.get_notifs().items():
            for m in msgs:
                self._on_notif(agent, m)
        now = time.monotonic()
        for rid in [r for r, l in self.leases.items() if l.deadline < now]:
            self._release(rid)
            self.expired.append(rid)
            self.metrics.expired_requests += 1
        if self._parked:
            self._retry_parked()

    def _retry_parked(self) -> None:
        """Serve stage requests that waited for staging space, in arrival order (first fit). A request
        whose lease is gone, or whose decode rank already sent its Done (it aborted or failed), is
        dropped; one that still does not fit waits until its deadline, then gets "full"."""
        now = time.monotonic()
        parked, self._parked = self._parked, []
        for p in parked:
            lease = self.leases.get(p.msg.req_id)
            try:
                if lease is None or lease.attempt != p.msg.attempt:
                    replies = [self._expired_error(p.msg.req_id)]
                elif (p.msg.decode_engine, tuple(p.msg.decode_rank)) in lease.done_ranks:
                    continue  # the decode rank gave up on it meanwhile: nobody will read it
                else:
                    replies = self._pack_into_slot(p.msg, p.descs)
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
                    code="internal", ttl_s=self._ttl(lease) if lease is not None else 0.0)))

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
            return StageError(msg.req_id, f"cannot stage: {text}", code="internal",
                              ttl_s=self._ttl(lease) if ok else 0.0)
        return ErrorReply(text, code="internal")

    # ---- leases: attempts, pins, reader identities ----------------------------------------------
    def _ttl(self, lease: Lease) -> float:
        return max(0.0, lease.deadline - time.monotonic())

    def _expired_error(self, req_id: str) -> StageError:
        self.metrics.refused_reads += 1
        return StageError(req_id, f"request {req_id!r} is unknown, expired or re-registered (another attempt) on "
                                  f"prefill rank {self.rank}; its blocks may be reused: do not read them",
                          expired=True, code="lease_expired")

    def _check_reader(self, req_id: str, attempt: int, reader: tuple, incarnation: str):
        """The live lease of ``req_id`` for ``attempt`` if ``reader`` may read it; else (code, message)."""
        if incarnation and incarnation not in self._digests:
            return "restarted", (f"prefill rank {self.rank} of {self.engine_id!r} is not the process this decode "
                                 "rank handshook with (restarted); handshake again")
        if reader not in self._readers:
            self.metrics.forged_messages += 1
            return "unknown_reader", (f"decode rank {reader[1]} of {reader[0]!r} has not handshaken with prefill "
                                      f"rank {self.rank}; handshake first")
        lease = self.leases.get(req_id)
        if lease is None or lease.attempt != attempt:
            if lease is not None:
                self.metrics.stale_messages += 1
            return "lease_expired", (f"request {req_id!r} attempt {attempt} is unknown, expired or re-registered on "
                                     f"prefill rank {self.rank}; its blocks may be reused: do not read them")
        return lease

    def _pin(self, lease: Lease, reader: tuple, readers: int) -> float:
        """Pin ``lease`` for ``reader``: it now ends on every reader's Done, or ``pin_s`` after the first
        pin at the latest; returns the seconds it still holds."""
        now = time.monotonic()
        if lease.pinned_at is None:
            lease.pinned_at = now
            lease.deadline = max(lease.deadline, now + self.pin_s)
        if lease.readers is None and readers >= 1:
            lease.readers = readers
        lease.holders.add(reader)
        return max(0.0, lease.deadline - now)

    def _acquire(self, msg: Acquire) -> Acquired:
        reader = (msg.decode_engine, tuple(msg.decode_rank))
        granted, refused = [], []
        for rid, attempt in msg.reqs:
            got = self._check_reader(rid, attempt, reader, msg.incarnation)
            if isinstance(got, Lease):
                granted.append((rid, attempt, self._pin(got, reader, msg.readers)))
            else:
                self.metrics.refused_reads += 1
                refused.append((rid, attempt, *got))
        return Acquired(granted, refused)

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

    def _unpark(self, req_id: str, decode_engine: str, decode_rank) -> None:
        key = (req_id, decode_engine, tuple(decode_rank))
        self._parked = [p for p in self._parked
                        if (p.msg.req_id, p.msg.decode_engine, tuple(p.msg.decode_rank)) != key]

    def _answers(self, body: list[bytes], envelope: list[bytes] = ()):
        """Replies to one side-channel message (a stage request gets one per packed segment, as packed)."""
        try:
            msg = unpack(body)
        except KVBridgeError as e:  # noqa: BLE001 - answer the peer, keep serving
            yield pack(ErrorReply(str(e), code="bad_request"))
            return
        except Exception:  # noqa: BLE001
            yield pack(ErrorReply("malformed side-channel message", code="bad_request"))
            return
        if isinstance(msg, Stage):
            for reply in self._stage(msg, list(envelope)):
                yield pack(reply)
            return
        if isinstance(msg, Acquire):
            yield pack(self._acquire(msg))
            return
        if not isinstance(msg, GetMeta):
            yield pack(ErrorReply(f"unexpected message {type(msg).__name__}; send get_meta, acquire or stage",
                                  code="unexpected"))
            return
        if tuple(msg.prefill_rank) != self.rank:
            yield pack(ErrorReply(f"this endpoint is prefill rank {self.rank}, not {tuple(msg.prefill_rank)}",
                                  code="wrong_rank"))
            return
        md = self.transport.metadata()
        # the reader's identity from the handshake: its Done notifications must come from this agent
        self._remember(self._readers, (msg.decode_engine, tuple(msg.decode_rank)), msg.decode_agent, 4096)
        self._remember(self._digests, metadata_digest(md), True, 8)
        yield pack(RankMeta(self.engine_id, self.rank, engine_to_dict(self.engine), self.engine.model.fingerprint,
                             self.transport.agent_name, md, metadata_digest(md), self.mem.to_wire(),
                             self.staging_bytes))

    def _stage(self, msg: Stage, envelope: list[bytes]):
        """Answer a stage request: pack this rank's runs of a request for one decode rank into the staging
        buffer, segment by segment, yielding a Staged reply as soon as each segment is packed (the decode
        reads segment k while segment k+1 is packed). With no free staging space the request waits (up to
        ``stage_wait_s``) for a slot instead of failing at once."""
        reader = (msg.decode_engine, tuple(msg.decode_rank))
        lease = self._check_reader(msg.req_id, msg.attempt, reader, msg.incarnation)
        if not isinstance(lease, Lease):  # stage slots only for readers that hold the lease
            self.metrics.refused_reads += 1
            code, text = lease
            yield StageError(msg.req_id, text, expired=code in ("lease_expired", "restarted"), code=code)
            return
        if reader in lease.done_ranks:
            yield StageError(msg.req_id, f"decode rank {tuple(msg.decode_rank)} of {msg.decode_engine!r} already "
                                         f"sent Done for {msg.req_id!r}; not staging it again", expired=True,
                             code="done")
            return
        ttl = self._pin(lease, reader, msg.readers)
        try:
            lp = self._lowering(msg)
            descs = {d.prefill: d for d in lp.descriptors(msg.num_tokens, blocks_from_wire(msg.prefill_blocks),
                                                          blocks_from_wire(msg.decode_blocks), only=(self.rank,))}
        except KVBridgeError as e:  # a bad request must not take the rank down
            yield StageError(msg.req_id, f"cannot stage: {e}", code="bad_request", ttl_s=ttl)
            return
        except Exception:  # noqa: BLE001
            yield StageError(msg.req_id, f"cannot stage {msg.req_id!r}: internal error on prefill rank {self.rank}",
                             code="bad_request", ttl_s=ttl)
            return
        d = descs.get(self.rank)
        self._unpark(msg.req_id, msg.decode_engine, msg.decode_rank)  # a retried request replaces a parked one
        replies = self._pack_into_slot(msg, d)
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
                                      "read directly", code="full", ttl_s=self._ttl(lease))

    def _pack_into_slot(self, msg: Stage, d):
        """Allocate a staging slot and return a generator of Staged replies that packs segment by
        segment; None when there is no free slot of the size needed."""
        from ..staging import segment_bounds
        total = d.total_bytes if d is not None else 0
        slot_key = (msg.req_id, msg.decode_engine, tuple(msg.decode_rank))
        off = self.slots.alloc(slot_key, total, group=msg.decode_engine, limit=self.staging_peer_bytes)
        if off is None:
            return None
        lease = self.leases[msg.req_id]
        lease.staged.add(slot_key)

        def replies():
            if not total:
                yield Staged(msg.req_id, self.staging_addr + off, 0, 0, 0, True, self._ttl(lease))
                return
            bounds = segment_bounds(d.nbytes, msg.segment_bytes)
            pos = 0
            for i, (a, b) in enumerate(bounds):
                n = self._kv.pack(d.src[a:b], d.nbytes[a:b], self.staging, off + pos)
                yield Staged(msg.req_id, self.staging_addr + off + pos, n, pos, total, i == len(bounds) - 1,
                             self._ttl(lease))
                pos += n
        return replies()

    def _on_notif(self, agent: str, raw: bytes) -> None:
        try:
            d: Done = decode_notif(raw)
        except Exception:  # noqa: BLE001
            self.metrics.unknown_notifications += 1
            log.warning("ignoring malformed notification from %s", agent)
            return
        lease = self.leases.get(d.req_id)
        if lease is None:
            self.metrics.unknown_notifications += 1
            log.info("notification for unknown or expired request %s from %s", d.req_id, agent)
            return
        reader = (d.decode_engine, tuple(d.decode_rank))
        if lease.attempt != d.attempt:  # a late Done of an earlier attempt, or a guess: not this lease's
            self.metrics.stale_messages += 1
            log.info("ignoring Done for %s attempt %s (lease attempt differs) from %s", d.req_id, d.attempt, agent)
            return
        bound = self._readers.get(reader)
        if bound is None or (bound and bound != agent) or d.readers < 1 or (
                lease.readers is not None and d.readers != lease.readers):
            self.metrics.forged_messages += 1  # not the agent that handshook as this reader, or a bad count
            log.warning("ignoring Done for %s from agent %s claiming to be %s (readers=%s)", d.req_id, agent,
                        reader, d.readers)
            return
        lease.done_ranks.add(reader)
        if lease.readers is None:
            lease.readers = d.readers
        if self._parked:
            self._unpark(d.req_id, d.decode_engine, d.decode_rank)
        slot_key = (d.req_id, d.decode_engine, tuple(d.decode_rank))
        if self.slots.free(slot_key):
            lease.staged.discard(slot_key)
        if len(lease.done_ranks) >= lease.readers:
            self._release(d.req_id)
            self.freed.append(d.req_id)
            self.metrics.freed_requests += 1

    def _release(self, req_id: str) -> None:
        lease = self.leases.pop(req_id)
        for key in lease.staged:
            self.slots.free(key)

    def stats(self) -> dict:
        return {"metrics": self.metrics.to_json(), "leases": len(self.leases), "staging_used": self.slots.bytes_used,
                "staging_by_peer": {e: self.slots.group_bytes(e) for e in {k[1] for k in self.slots.used}},
                "pinned_leases": sum(lease.pinned_at is not None for lease in self.leases.values()),
                "parked_stage_requests": len(self._parked), "lowered_cached": len(self._lowered),
                "nixl": vars(self.transport.stats).copy() if hasattr(self.transport, "stats") else {}}

    def close(self) -> None:
        self.sock.close(0)
        self.transport.close()

    # ---- benchmarks ------------------------------------------------------------------------------
    def fill_random(self, seed: int = 0) -> None:
        """Benchmarks: fill the KV memory with a random pattern (period 16 MiB + 4099 B)."""
        pat = np.random.default_rng(seed).integers(0, 256, (16 << 20) + 4099, dtype=np.uint8)
        for a in self.mem.allocations:
            buf = host_view(a.addr, a.nbytes)
            for i in range(0, buf.size, pat.size):
                n = min(pat.size, buf.size - i)
                buf[i:i + n] = pat[:n]
