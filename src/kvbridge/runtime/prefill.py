"""A prefill rank: registers its KV memory, serves its metadata, frees blocks when readers are done."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from ..layout import EngineLayout, engine_from_dict, engine_to_dict
from ..lower import GroupBlocks, LoweredPlan
from ..plan import plan_transfer
from ..errors import LayoutError, TransferError
from ..memory import KVMemory
from ..tensors import host_view
from .memhost import check_memory, host_span, register_memory, transport_device, wire_key
from ..transport.nixl import NixlTransport, metadata_digest
from .metrics import Metrics
from .protocol import (Done, ErrorReply, GetMeta, RankMeta, Stage, Staged, StageError, blocks_from_wire,
                       decode_notif, pack, unpack)
from .slots import SlotAllocator

log = logging.getLogger(__name__)


def json_key(d: dict) -> str:
    import json
    return json.dumps(d, sort_keys=True)


@dataclass
class Lease:
    req_id: str
    blocks: dict[str, GroupBlocks]
    expires_at: float
    done_ranks: set = field(default_factory=set)
    readers: int | None = None
    staged: set = field(default_factory=set)  # staging slots held for this request


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
                 staging_bytes: int = 64 << 20, stage_wait_s: float = 2.0):
        self.engine, self.rank, self.engine_id, self.lease_s = engine, tuple(rank), engine_id, lease_s
        # a stage request that finds the staging buffer full waits this long for a slot to free (the
        # previous request's Done is usually in flight) before the prefill says "full, read directly":
        # a direct read of small head slices is many times slower than waiting a few milliseconds
        self.stage_wait_s = stage_wait_s
        self._parked: list[_Parked] = []
        self.mem = check_memory(memory, engine, rank)
        self.transport = transport or NixlTransport(f"{engine_id}-p{rank[0]}t{rank[1]}", multi_threaded=False,
                                                    **transport_device(self.mem))
        register_memory(self.transport, self.mem)
        self._host, self._host_base = host_span(self.mem)
        # staged transfers: runs packed here for one decode rank, read with one descriptor
        self.staging = np.empty(staging_bytes, dtype=np.uint8)
        self.staging.fill(0)  # touch every page now, not on the first request's critical path
        self.staging_addr = self.transport.register(self.staging) if staging_bytes else 0
        self.slots = SlotAllocator(staging_bytes)
        self._lowered: dict = {}  # (decode layout, decode rank) -> LoweredPlan (relative offsets)
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
    def add_request(self, req_id: str, blocks: dict[str, GroupBlocks], lease_s: float | None = None) -> float:
        """Hold ``blocks`` for ``req_id`` until its readers are done or the lease expires; returns expiry."""
        exp = time.time() + (self.lease_s if lease_s is None else lease_s)
        if req_id in self.leases:  # re-registered: its staging slots go back first
            self._release(req_id)
        self.leases[req_id] = Lease(req_id, blocks, exp)
        return exp

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
        now = time.time()
        for rid in [r for r, l in self.leases.items() if l.expires_at < now]:
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
                if lease is None:
                    replies = [StageError(p.msg.req_id, f"request {p.msg.req_id!r} is unknown or its lease expired "
                                                        f"on prefill rank {self.rank}; do not read its blocks",
                                          expired=True)]
                elif (p.msg.decode_engine, tuple(p.msg.decode_rank)) in lease.done_ranks:
                    continue  # the decode rank gave up on it meanwhile: nobody will read it
                else:
                    replies = self._pack_into_slot(p.msg, p.descs)
                    if replies is None:
                        if now < p.deadline:
                            self._parked.append(p)
                            continue
                        replies = [self._full_error(p.msg, p.descs)]
                for reply in replies:
                    self.sock.send_multipart(p.envelope + pack(reply))
            except Exception as e:  # noqa: BLE001 - one bad request must not drop the others or the rank
                log.warning("stage request %s failed while packing: %r", p.msg.req_id, e)
                self.metrics.failed_stage_requests += 1
                self.sock.send_multipart(p.envelope + pack(StageError(p.msg.req_id, f"cannot stage: {e!r}")))

    @staticmethod
    def _failure_reply(body: list[bytes], e: Exception):
        try:
            msg = unpack(body)
        except Exception:  # noqa: BLE001
            msg = None
        if isinstance(msg, Stage):  # the decode fails or falls back on this request only
            return StageError(msg.req_id, f"cannot stage: {type(e).__name__}: {e}")
        return ErrorReply(f"{type(e).__name__}: {e}")

    def _unpark(self, req_id: str, decode_engine: str, decode_rank) -> None:
        key = (req_id, decode_engine, tuple(decode_rank))
        self._parked = [p for p in self._parked
                        if (p.msg.req_id, p.msg.decode_engine, tuple(p.msg.decode_rank)) != key]

    def _answers(self, body: list[bytes], envelope: list[bytes] = ()):
        """Replies to one side-channel message (a stage request gets one per packed segment, as packed)."""
        try:
            msg = unpack(body)
        except Exception as e:  # noqa: BLE001 - answer the peer, keep serving
            yield pack(ErrorReply(str(e)))
            return
        if isinstance(msg, Stage):
            for reply in self._stage(msg, list(envelope)):
                yield pack(reply)
            return
        if not isinstance(msg, GetMeta):
            yield pack(ErrorReply(f"unexpected message {type(msg).__name__}; send get_meta or stage"))
            return
        if tuple(msg.prefill_rank) != self.rank:
            yield pack(ErrorReply(f"this endpoint is prefill rank {self.rank}, not {tuple(msg.prefill_rank)}"))
            return
        md = self.transport.metadata()
        yield pack(RankMeta(self.engine_id, self.rank, engine_to_dict(self.engine), self.engine.model.fingerprint,
                             self.transport.agent_name, md, metadata_digest(md), self.mem.to_wire(),
                             self.staging.size))

    def _stage(self, msg: Stage, envelope: list[bytes]):
        """Answer a stage request: pack this rank's runs of a request for one decode rank into the staging
        buffer, segment by segment, yielding a Staged reply as soon as each segment is packed (the decode
        reads segment k while segment k+1 is packed). With no free staging space the request waits (up to
        ``stage_wait_s``) for a slot instead of failing at once."""
        lease = self.leases.get(msg.req_id)
        if lease is None:
            yield StageError(msg.req_id, f"request {msg.req_id!r} is unknown or its lease expired on prefill "
                                         f"rank {self.rank}; its blocks may be reused: do not read them", expired=True)
            return
        try:
            key = (json_key(msg.decode_layout), tuple(msg.decode_rank), wire_key(msg.decode_memory))
            lp = self._lowered.get(key)
            if lp is None:
                decode = engine_from_dict(msg.decode_layout)
                d_mem = KVMemory.from_wire(decode, msg.decode_memory)
                if d_mem.rank != tuple(msg.decode_rank):
                    raise LayoutError(f"stage request from rank {tuple(msg.decode_rank)} describes rank {d_mem.rank}")
                lp = self._lowered[key] = LoweredPlan(plan_transfer(self.engine, decode), tuple(msg.decode_rank),
                                                      prefill_mems={self.rank: self.mem}, decode_mem=d_mem)
            descs = {d.prefill: d for d in lp.descriptors(msg.num_tokens, blocks_from_wire(msg.prefill_blocks),
                                                          blocks_from_wire(msg.decode_blocks), only=(self.rank,))}
        except Exception as e:  # noqa: BLE001 - a bad request must not take the rank down
            yield StageError(msg.req_id, f"cannot stage: {type(e).__name__}: {e}")
            return
        if (msg.decode_engine, tuple(msg.decode_rank)) in lease.done_ranks:
            yield StageError(msg.req_id, f"decode rank {tuple(msg.decode_rank)} of {msg.decode_engine!r} already "
                                         f"sent Done for {msg.req_id!r}; not staging it again")
            return
        d = descs.get(self.rank)
        self._unpark(msg.req_id, msg.decode_engine, msg.decode_rank)  # a retried request replaces a parked one
        replies = self._pack_into_slot(msg, d)
        if replies is None:
            total = d.total_bytes if d is not None else 0
            if self.slots.rounded(total) > self.slots.capacity or self.stage_wait_s <= 0:
                yield self._full_error(msg, d)
                return
            self.metrics.stage_waits += 1
            self._parked.append(_Parked(envelope, msg, d, time.monotonic() + self.stage_wait_s))
            return
        yield from replies

    def _full_error(self, msg: Stage, d) -> StageError:
        total = d.total_bytes if d is not None else 0
        self.metrics.stage_full += 1
        return StageError(msg.req_id, f"staging buffer full ({self.slots.bytes_used} of {self.slots.capacity} B "
                                      f"used, {total} B asked, waited up to {self.stage_wait_s:g} s); read directly")

    def _pack_into_slot(self, msg: Stage, d):
        """Allocate a staging slot and return a generator of Staged replies that packs segment by
        segment; None when there is no free slot of the size needed."""
        from ..staging import pack as pack_runs
        from ..staging import segment_bounds
        total = d.total_bytes if d is not None else 0
        slot_key = (msg.req_id, msg.decode_engine, tuple(msg.decode_rank))
        off = self.slots.alloc(slot_key, total)
        if off is None:
            return None
        self.leases[msg.req_id].staged.add(slot_key)

        def replies():
            if not total:
                yield Staged(msg.req_id, self.staging_addr + off, 0, 0, 0, True)
                return
            bounds = segment_bounds(d.nbytes, msg.segment_bytes)
            pos = 0
            for i, (a, b) in enumerate(bounds):
                n = pack_runs(self._kv_view(), d.src[a:b] - self._host_base, d.nbytes[a:b], self.staging, off + pos)
                yield Staged(msg.req_id, self.staging_addr + off + pos, n, pos, total, i == len(bounds) - 1)
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
        lease.done_ranks.add((d.decode_engine, tuple(d.decode_rank)))
        lease.readers = d.readers
        if self._parked:
            self._unpark(d.req_id, d.decode_engine, d.decode_rank)
        slot_key = (d.req_id, d.decode_engine, tuple(d.decode_rank))
        if self.slots.free(slot_key):
            lease.staged.discard(slot_key)
        if len(lease.done_ranks) >= d.readers:
            self._release(d.req_id)
            self.freed.append(d.req_id)
            self.metrics.freed_requests += 1

    def _release(self, req_id: str) -> None:
        lease = self.leases.pop(req_id)
        for key in lease.staged:
            self.slots.free(key)

    def stats(self) -> dict:
        return {"metrics": self.metrics.to_json(), "leases": len(self.leases),
                "nixl": vars(self.transport.stats).copy() if hasattr(self.transport, "stats") else {}}

    def close(self) -> None:
        self.sock.close(0)
        self.transport.close()

    # ---- benchmarks ------------------------------------------------------------------------------
    def _kv_view(self) -> np.ndarray:
        if self._host is None:
            raise TransferError(f"prefill rank {self.rank}: staged transfers need host-addressable KV memory "
                                f"(memory is on {self.mem.device}); use transfer_mode='direct'")
        return self._host

    def fill_random(self, seed: int = 0) -> None:
        """Benchmarks: fill the KV memory with a random pattern (period 16 MiB + 4099 B)."""
        pat = np.random.default_rng(seed).integers(0, 256, (16 << 20) + 4099, dtype=np.uint8)
        for a in self.mem.allocations:
            buf = host_view(a.addr, a.nbytes)
            for i in range(0, buf.size, pat.size):
                n = min(pat.size, buf.size - i)
                buf[i:i + n] = pat[:n]
