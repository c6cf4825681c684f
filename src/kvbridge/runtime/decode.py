"""A decode rank: handshakes with prefill engines, reads requests' KV, reports finished/failed ids.

One :class:`RemoteEngine` per prefill engine holds everything learned at handshake (layout, plan,
lowered plan, agent names): no parallel per-engine dicts. Per request the hot path is
``LoweredPlan.descriptors`` (vectorised) and one posted READ per prefill rank, off this thread.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from ..errors import HandshakeError, IncompatibleLayoutsError, LayoutError, RequestError, TransferError
from ..layout import EngineLayout, engine_from_dict, engine_to_dict
from ..lower import GroupBlocks, LoweredPlan
from ..memory import KVMemory
from ..tensors import host_view
from .memhost import check_memory, host_span, register_memory, transport_device
from ..plan import Rank, TransferPlan, plan_transfer
from ..transport.nixl import NixlTransport
from .metrics import Metrics
from .protocol import (STAGE_SEGMENT_BYTES, Done, ErrorReply, GetMeta, RankMeta, Stage, Staged, StageError, blocks_to_wire,
                       encode_notif, pack, unpack)
from .slots import SlotAllocator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteEngine:
    engine_id: str
    layout: EngineLayout
    plan: TransferPlan
    lowered: LoweredPlan
    agents: dict          # prefill rank -> NIXL agent name (only the ranks this decode rank reads)
    readers: dict         # prefill rank -> number of decode ranks reading it (for the notification)
    endpoints: dict       # prefill rank -> "host:port" of its side channel
    digest0: str          # sha256 of rank (0, 0)'s NIXL metadata: a restarted engine has a new one
    modes: dict           # prefill rank -> "direct" | "staged" (cost model for shuffled blocks, or forced)
    stage_socks: dict     # prefill rank -> DEALER socket for stage requests (ranks that can stage)
    shapes: dict          # prefill rank -> cost.PairShape (auto mode re-decides per request from it)


    def summary(self) -> dict:
        """Plain-data view (what a handshake RPC returns)."""
        return {"engine_id": self.engine_id, "prefill": str(self.layout),
                "modes": {str(p): m for p, m in self.modes.items()}, "agents": {str(p): a for p, a in self.agents.items()}}


@dataclass(frozen=True)
class ReadRequest:
    """What the decode side knows of a request (vLLM's kv_transfer_params)."""

    req_id: str
    engine_id: str
    num_tokens: int
    prefill_blocks: dict[str, GroupBlocks]
    decode_blocks: dict[str, GroupBlocks]
    expires_at: float = float("inf")


@dataclass
class _Read:
    """One posted READ of a request from one prefill rank (staged: into ``slot`` of our staging buffer)."""

    prefill: Rank
    xfer: object
    nbytes: int
    slot: int | None = None    # staged: our staging offset of the segment
    runs: tuple | None = None  # staged: (dst, nbytes) of the runs this segment scatters to
    scatter: object = None     # Future of the scatter from staging into the KV buffer


@dataclass
class _Staging:
    """A staged prefill rank of one request: our staging slot and the runs the packed stream feeds."""

    slot: int
    dst: np.ndarray      # run destinations (absolute), in packed order
    nbytes: np.ndarray
    starts: np.ndarray   # offset of each run in the packed stream


@dataclass
class _InFlight:
    req: ReadRequest
    remote: RemoteEngine
    reads: list
    started: float
    nbytes: int
    ndescs: int
    pending_stage: set = field(default_factory=set)  # prefill ranks asked to stage, last segment not in yet
    staged: dict = field(default_factory=dict)       # prefill rank -> _Staging
    notify_at_end: set = field(default_factory=set)  # staged ranks: their reads carry no notification
    stage_deadline: float = 0.0
    stage_sent: float = 0.0
    started_mono: float = field(default_factory=time.monotonic)

    @property
    def xfers(self) -> list:
        return [r.xfer for r in self.reads]


def fetch_meta(ctx: zmq.Context, endpoint: str, msg: GetMeta, timeout_s: float) -> RankMeta:
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{endpoint}")
        sock.send_multipart(pack(msg))
        try:
            frames = sock.recv_multipart()
        except zmq.Again:
            raise HandshakeError(f"no answer from prefill rank {tuple(msg.prefill_rank)} at tcp://{endpoint} within "
                                 f"{timeout_s:g} s; is the prefill engine running and is the address right?") from None
        reply = unpack(frames)
    finally:
        sock.close(0)
    if isinstance(reply, ErrorReply):
        raise HandshakeError(f"prefill at {endpoint} refused the handshake: {reply.message}")
    if not isinstance(reply, RankMeta):
        raise HandshakeError(f"prefill at {endpoint} answered {type(reply).__name__}, expected rank_meta")
    return reply


class DecodeRank:
    """Decode side of one rank: reads requests' KV from prefill engines into the engine's KV memory
    (``memory``, a :class:`KVMemory` describing tensors the engine allocated)."""

    def __init__(self, engine: EngineLayout, rank: Rank, engine_id: str, memory: KVMemory | None = None, transport=None,
                 handshake_timeout_s: float = 5.0, lease_margin_s: float = 0.05,
                 transfer_mode: str = "auto", staging_bytes: int = 64 << 20, cost_model=None,
                 stage_timeout_s: float = 10.0, transfer_timeout_s: float = 120.0, release_timeout_s: float = 5.0,
                 stage_segment_bytes: int = STAGE_SEGMENT_BYTES, post_threads: int = 1):
        if transfer_mode not in ("auto", "direct", "staged"):
            raise ValueError(f"transfer_mode must be auto, direct or staged, not {transfer_mode!r}")
        self.engine, self.rank, self.engine_id = engine, tuple(rank), engine_id
        self.mem = check_memory(memory, engine, rank)
        self._mem_wire = self.mem.to_wire()  # sent with stage requests
        self.transport = transport or NixlTransport(f"{engine_id}-d{rank[0]}t{rank[1]}", post_threads=post_threads,
                                                    **transport_device(self.mem))
        register_memory(self.transport, self.mem)
        self._host, self._host_base = host_span(self.mem)
        if self._host is None and transfer_mode != "direct":
            transfer_mode = "direct"  # staged scatter needs host-addressable memory (GPU: direct reads)
        from ..cost import CostModel
        self.transfer_mode, self.stage_timeout_s = transfer_mode, stage_timeout_s
        self.stage_segment_bytes = int(stage_segment_bytes)
        self.transfer_timeout_s, self.release_timeout_s = transfer_timeout_s, release_timeout_s
        self._layout_dict = engine_to_dict(engine)  # sent with stage requests
        self._zombies: list = []  # (req_id, staged ranks, reads still in progress after a failure)
        self.cost_model = cost_model or CostModel.load()
        self.staging = np.empty(staging_bytes if transfer_mode != "direct" else 0, dtype=np.uint8)
        self.staging.fill(0)  # touch every page now, not on the first request's critical path
        self.staging_addr = self.transport.register(self.staging) if self.staging.size else 0
        self.slots = SlotAllocator(self.staging.size)
        self.ctx = zmq.Context.instance()
        self.remotes: dict[str, RemoteEngine] = {}
        self.inflight: dict[str, _InFlight] = {}
        self.finished: list[str] = []
        self.failed: dict[str, str] = {}
        self.metrics = Metrics()
        self.handshake_timeout_s = handshake_timeout_s
        self.lease_margin_s = lease_margin_s

    # ---- handshake -----------------------------------------------------------------------------
    def handshake(self, engine_id: str, endpoints: dict[Rank, str]) -> RemoteEngine:
        """Contact the prefill engine's ranks this rank needs; cached per engine id."""
        endpoints = {tuple(k): v for k, v in endpoints.items()}
        cached = self.remotes.get(engine_id)
        if cached is not None:
            # still the same engine? (same endpoints and the same NIXL agent behind rank (0, 0))
            if cached.endpoints == endpoints and self._same_agent(cached, endpoints):
                return cached
            self.forget(engine_id)
        try:
            remote = self._handshake(engine_id, endpoints)
        except (HandshakeError, IncompatibleLayoutsError):
            self.metrics.failed_handshakes += 1
            raise
        self.remotes[engine_id] = remote
        self.metrics.handshakes += 1
        return remote

    def _same_agent(self, cached: "RemoteEngine", endpoints: dict) -> bool:
        try:
            meta = fetch_meta(self.ctx, endpoints[(0, 0)], GetMeta(self.engine_id, self.rank, (0, 0)),
                              self.handshake_timeout_s)
        except HandshakeError:
            return False
        return meta.metadata_sha256 == cached.digest0

    def _get(self, engine_id: str, endpoints: dict, prank: Rank) -> RankMeta:
        if prank not in endpoints:
            raise HandshakeError(f"no endpoint given for prefill rank {prank} of engine {engine_id!r}; "
                                 f"give one per rank, got {sorted(endpoints)}")
        meta = fetch_meta(self.ctx, endpoints[prank], GetMeta(self.engine_id, self.rank, prank), self.handshake_timeout_s)
        if meta.engine_id != engine_id:
            raise HandshakeError(f"endpoint {endpoints[prank]} is engine {meta.engine_id!r}, expected {engine_id!r}")
        if tuple(meta.rank) != prank:
            raise HandshakeError(f"endpoint {endpoints[prank]} is rank {tuple(meta.rank)}, expected {prank}")
        return meta

    def _handshake(self, engine_id: str, endpoints: dict[Rank, str]) -> RemoteEngine:
        first = self._get(engine_id, endpoints, (0, 0))
        try:
            layout = engine_from_dict(first.layout)
        except LayoutError as e:
            raise HandshakeError(f"prefill engine {engine_id!r} sent an invalid layout description: {e}") from e
        if first.model_fingerprint != layout.model.fingerprint:
            raise HandshakeError("prefill layout does not match its own model fingerprint (corrupted metadata)")
        if layout.model.fingerprint != self.engine.model.fingerprint:
            plan_transfer(layout, self.engine)  # raises IncompatibleLayoutsError naming the difference
            raise IncompatibleLayoutsError(f"prefill model {layout.model.name!r} differs from decode model "
                                           f"{self.engine.model.name!r}; serve the same model on both")
        plan = plan_transfer(layout, self.engine)
        metas = {(0, 0): first}
        needed = plan.ranks_to_notify(self.rank)
        for prank in needed:
            if prank not in metas:
                metas[prank] = self._get(engine_id, endpoints, prank)
        agents, bases = {}, {}
        try:
            self._add_peers(engine_id, layout, first, metas, needed, agents, bases)
        except BaseException:
            for agent in agents.values():  # no half-added engine
                self.transport.remove_peer(agent)
            raise
        lowered = LoweredPlan(plan, self.rank, prefill_mems=bases, decode_mem=self.mem)
        readers = {p: len(plan.notifiers_of(p)) for p in needed}
        modes = self._modes(plan, {p: metas[p].staging_bytes for p in needed})
        can_stage = {p for p in plan.prefill_ranks_for(self.rank)
                     if metas[p].staging_bytes and self.staging.size and self.transfer_mode != "direct"}
        socks = {}
        for prank in can_stage:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{endpoints[prank]}")
            socks[prank] = sock
        from ..cost import pair_shapes
        return RemoteEngine(engine_id, layout, plan, lowered, agents, readers, endpoints, first.metadata_sha256,
                            modes, socks, pair_shapes(lowered))

    def _add_peers(self, engine_id, layout, first, metas, needed, agents, bases) -> None:
        for prank in needed:
            m = metas[prank]
            if m.model_fingerprint != first.model_fingerprint or m.layout != first.layout:
                raise HandshakeError(f"prefill rank {prank} of {engine_id!r} reports a different layout than rank (0,0)")
            try:
                p_mem = KVMemory.from_wire(layout, m.memory)
            except LayoutError as e:
                raise HandshakeError(f"prefill rank {prank} of {engine_id!r} sent an invalid memory description: {e}") from e
            if p_mem.rank != prank:
                raise HandshakeError(f"prefill rank {prank} of {engine_id!r} describes the memory of rank {p_mem.rank}")
            agents[prank] = self.transport.add_peer(m.agent_metadata, m.metadata_sha256)
            bases[prank] = p_mem

    def _modes(self, plan: TransferPlan, prefill_staging: dict) -> dict:
        """Direct or staged per prefill rank this rank reads: forced, or chosen by the cost model."""
        reads = plan.prefill_ranks_for(self.rank)
        if self.transfer_mode == "direct" or not self.staging.size:
            return {p: "direct" for p in reads}
        if self.transfer_mode == "staged":
            chosen = {p: "staged" for p in reads}
        else:
            from ..cost import choose_modes
            chosen = {m.prefill: m.mode for m in choose_modes(plan, self.cost_model, decode_ranks=[self.rank])}
        return {p: (chosen.get(p, "direct") if prefill_staging.get(p) else "direct") for p in reads}

    def forget(self, engine_id: str, reason: str = "the prefill engine was forgotten (re-handshake)",
               dead: bool = False) -> None:
        """Drop a remote engine (dead or gone): fail its requests in flight, remove its agents; a later
        handshake starts fresh."""
        for rid, f in list(self.inflight.items()):
            if f.remote.engine_id == engine_id:
                self._fail(rid, f, reason, notify=not dead)
        remote = self.remotes.pop(engine_id, None)
        if remote is not None:
            for agent in remote.agents.values():
                self.transport.remove_peer(agent)
            for sock in remote.stage_socks.values():
                sock.close(0)

    # ---- requests ------------------------------------------------------------------------------
    def start(self, req: ReadRequest) -> None:
        """Validate and post the reads of ``req``. Raises RequestError/HandshakeError before anything moves."""
        if req.req_id in self.inflight:
            raise RequestError(f"request {req.req_id!r} is already in flight on decode rank {self.rank}")
        remote = self.remotes.get(req.engine_id)
        if remote is None:
            raise HandshakeError(f"no handshake with prefill engine {req.engine_id!r} yet; call handshake() first")
        if time.time() > req.expires_at - self.lease_margin_s:
            self.metrics.failed_requests += 1
            self.failed[req.req_id] = "lease expired before the read: the prefill may have freed the blocks"
            return
        t0 = time.perf_counter()
        modes = self._request_modes(remote, req) if self.transfer_mode == "auto" else remote.modes
        direct = [p for p, m in modes.items() if m == "direct"]
        staged = [p for p, m in modes.items() if m == "staged"]
        descs = {d.prefill: d for d in remote.lowered.descriptors(req.num_tokens, req.prefill_blocks,
                                                                    req.decode_blocks, only=direct)}
        f = _InFlight(req, remote, [], time.perf_counter(), 0, 0)
        for prank, agent in remote.agents.items():
            if prank in staged:
                continue
            d = descs.get(prank)
            if d is None or d.count == 0:  # nothing to read here (prefix hit, unread replica): just notify
                self._notify(agent, self._done(req, remote, prank))
                continue
            self._post_descs(f, prank, d)
        if staged:
            wire_p, wire_d = blocks_to_wire(req.prefill_blocks), blocks_to_wire(req.decode_blocks)
            layout = self._layout_dict
            for prank in staged:
                try:
                    remote.stage_socks[prank].send_multipart(pack(Stage(
                        req.req_id, self.engine_id, self.rank, layout, self._mem_wire, req.num_tokens, wire_p, wire_d,
                        self.stage_segment_bytes)), zmq.NOBLOCK)
                    f.pending_stage.add(prank)
                except zmq.Again:  # prefill not connected or its queue is full: read directly
                    self._direct_fallback(f, prank)
            f.stage_deadline = time.monotonic() + self.stage_timeout_s
            f.stage_sent = time.perf_counter()
        self.metrics.post_seconds_sum += time.perf_counter() - t0
        if not f.reads and not f.pending_stage:
            self.finished.append(req.req_id)
            self.metrics.finished_requests += 1
            return
        self.inflight[req.req_id] = f

    def _request_modes(self, remote: RemoteEngine, req: ReadRequest) -> dict:
        """Auto mode, per request: runs merge across consecutive block ids, so a request whose blocks are
        mostly consecutive (on both sides) may be cheaper direct than the handshake-time choice says."""
        from ..cost import request_chunks, request_modes
        chunks, frac = request_chunks(remote.layout.model.groups, req.decode_blocks, req.prefill_blocks,
                                      self.engine.block_size, remote.lowered.chunk_tokens)
        shapes = {p: remote.shapes.get(p) for p in remote.modes}
        staged = request_modes(self.cost_model, {p: s for p, s in shapes.items() if s is not None}, chunks, frac,
                               lambda p: p in remote.stage_socks)
        return {p: staged.get(p, "direct") for p in remote.modes}

    def _done(self, req: ReadRequest, remote: RemoteEngine, prank: Rank, ok: bool = True) -> bytes:
        return encode_notif(Done(req.req_id, self.engine_id, self.rank, remote.readers[prank], ok))

    def _post(self, f: _InFlight, prank: Rank, src, dst, nbytes, notif: bytes | None = None,
              slot: int | None = None, runs=None) -> None:
        notif = self._done(f.req, f.remote, prank) if notif is None else notif
        x = self.transport.read(f.remote.agents[prank], src, dst, nbytes, notif)
        self._track(f, prank, x, int(nbytes.sum()), int(nbytes.size), slot, runs)

    def _post_descs(self, f: _InFlight, prank: Rank, d) -> None:
        """Direct read of a lowered :class:`~kvbridge.lower.Descriptors` (handed over factored)."""
        x = self.transport.read_descs(f.remote.agents[prank], d, self._done(f.req, f.remote, prank))
        self._track(f, prank, x, d.total_bytes, d.count)

    def _track(self, f: _InFlight, prank: Rank, x, nbytes: int, ndescs: int, slot=None, runs=None) -> None:
        f.reads.append(_Read(prank, x, nbytes, slot, runs))
        f.nbytes += nbytes
        f.ndescs += ndescs
        self.metrics.transfers += 1

    def _on_stage_reply(self, msg: Staged | StageError, prank: Rank) -> None:
        from ..staging import offsets
        f = self.inflight.get(msg.req_id)
        if f is None or prank not in f.pending_stage:
            return  # the request failed or was aborted meanwhile, or we fell back to direct reads
        f.stage_deadline = time.monotonic() + self.stage_timeout_s
        if isinstance(msg, StageError):
            f.pending_stage.discard(prank)
            if msg.expired:
                self._fail(f.req.req_id, f, f"prefill rank {prank}: {msg.message}")
            else:
                self._direct_fallback(f, prank)
            return
        if msg.last:
            f.pending_stage.discard(prank)
            self.metrics.stage_wait_seconds_sum += time.perf_counter() - f.stage_sent
        st = f.staged.get(prank)
        if st is None:  # first segment
            if msg.total == 0:
                f.notify_at_end.add(prank)  # nothing to read: Done goes out when the request completes
                return
            off = self.slots.alloc((f.req.req_id, prank), msg.total)
            if off is None:  # our staging is full: read directly, ignore the rest of the segments
                f.pending_stage.discard(prank)
                self._direct_fallback(f, prank)
                return
            req = f.req
            (d,) = f.remote.lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks, only=(prank,))
            if d.total_bytes != msg.total:
                self.slots.free((req.req_id, prank))
                self._fail(req.req_id, f, f"prefill rank {prank} packed {msg.total} B but this rank expects "
                                          f"{d.total_bytes} B: the two sides lower differently (same kvbridge release?)")
                return
            st = f.staged[prank] = _Staging(off, d.dst, d.nbytes, offsets(d.nbytes))
            f.notify_at_end.add(prank)
            self.metrics.staged_transfers += 1
        a, b = np.searchsorted(st.starts, [msg.offset, msg.offset + msg.nbytes])
        if (msg.offset + msg.nbytes > msg.total or a >= st.starts.size or st.starts[a] != msg.offset
                or int(st.nbytes[a:b].sum()) != msg.nbytes):
            self._fail(f.req.req_id, f, f"prefill rank {prank} sent a segment [{msg.offset}, +{msg.nbytes}) that "
                                        "does not start and end on run boundaries of this rank's lowering")
            return
        one = np.ones(1, dtype=np.int64)
        # no notification on segment reads: Done is sent once every segment is read (the prefill frees
        # its staging slot on Done, and segments may complete out of order)
        self._post(f, prank, one * msg.addr, one * (self.staging_addr + st.slot + msg.offset), one * msg.nbytes,
                   notif=b"", slot=st.slot + msg.offset, runs=(st.dst[a:b], st.nbytes[a:b]))

    def _direct_fallback(self, f: _InFlight, prank: Rank) -> None:
        self.metrics.staging_fallbacks += 1
        req = f.req
        for d in f.remote.lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks, only=(prank,)):
            if d.count:
                self._post_descs(f, prank, d)
            else:
                self._notify(f.remote.agents[prank], self._done(req, f.remote, prank))

    def _scatter(self, r: _Read) -> None:
        """Staging -> KV buffer for one staged segment (runs on a post thread)."""
        from ..staging import scatter
        t0 = time.perf_counter()
        dst, nbytes = r.runs
        scatter(self.staging, self._host, dst - self._host_base, nbytes, r.slot)
        self.metrics.scatter_seconds_sum += time.perf_counter() - t0

    def _notify(self, agent: str, msg: bytes) -> None:
        try:
            self.transport.send_notif(agent, msg)
        except TransferError:
            self.metrics.failed_notifications += 1

    def abort(self, req_id: str, engine_id: str | None = None, readers_of: ReadRequest | None = None) -> None:
        """Abort a request: tell its prefill ranks to free the blocks.

        In flight: reads are settled first (a read still in progress keeps its memory until it ends);
        a completed direct read carried its notification, every other prefill rank is told now. Not
        started (``readers_of`` given): every prefill rank this rank notifies is told.
        """
        f = self.inflight.pop(req_id, None)
        self.metrics.aborted_requests += 1
        if f is not None:
            self._notify_failed(f, self._release_reads(f))
            return
        remote = self.remotes.get(readers_of.engine_id) if readers_of else None
        if remote is not None:
            for p, agent in remote.agents.items():
                self._notify(agent, encode_notif(Done(req_id, self.engine_id, self.rank, remote.readers[p], ok=False)))

    def poll(self) -> tuple[list[str], dict[str, str]]:
        """Advance in-flight requests; return (finished ids, {failed id: reason}) since the last call."""
        dead_engines = set()
        self._drain_stage_replies()
        self._reap_zombies()
        now = time.monotonic()
        for rid, f in list(self.inflight.items()):
            if f.pending_stage and now > f.stage_deadline:
                self._fail(rid, f, f"prefill engine {f.remote.engine_id!r} ranks {sorted(f.pending_stage)} did not "
                                   f"answer the stage request within {self.stage_timeout_s:g} s (dead or overloaded)")
                continue
            if now - f.started_mono > self.transfer_timeout_s:
                self._fail(rid, f, f"request not done after transfer_timeout_s={self.transfer_timeout_s:g} s")
                continue
            try:
                states = [self.transport.check(r.xfer) for r in f.reads]
                for r, st in zip(f.reads, states):  # scatter staged segments as their reads complete
                    if st == "DONE" and r.runs is not None and r.scatter is None:
                        r.scatter = self.transport.submit(self._scatter, r)
                scattering = [r.scatter for r in f.reads if r.scatter is not None]
                done = [fut for fut in scattering if fut.done()]
                for fut in done:
                    fut.result()  # raises what the scatter raised
            except TransferError as e:
                self._fail(rid, f, str(e), notify=False)
                if "disconnect" in str(e).lower():
                    dead_engines.add(f.remote.engine_id)
                continue
            except Exception as e:  # noqa: BLE001 - a scatter bug fails the request, not the engine
                self._fail(rid, f, f"scatter failed: {type(e).__name__}: {e}")
                continue
            if f.pending_stage or not all(st == "DONE" for st in states) or len(done) < len(scattering):
                continue
            if time.time() > f.req.expires_at:
                self._fail(rid, f, "the prefill's lease expired during the read: its blocks may have been reused, "
                                   "the data is not trusted")
                continue
            self._release_reads(f)
            del self.inflight[rid]
            for prank in f.notify_at_end:  # staged reads carry no notification: tell the prefill now
                self._notify(f.remote.agents[prank], self._done(f.req, f.remote, prank))
            self.metrics.observe_transfer(time.perf_counter() - f.started)
            self.metrics.transfer_bytes += f.nbytes
            self.metrics.descriptors += f.ndescs
            self.metrics.finished_requests += 1
            self.finished.append(rid)
        for eid in dead_engines:
            self._fail_engine(eid, f"prefill engine {eid!r} disconnected")
        out, failed = self.finished, self.failed
        self.finished, self.failed = [], {}
        return out, failed

    def _fail_engine(self, engine_id: str, reason: str) -> None:
        """Fail every request in flight to a dead engine, then forget it."""
        self.forget(engine_id, reason, dead=True)

    def _drain_stage_replies(self) -> None:
        for remote in self.remotes.values():
            for prank, sock in remote.stage_socks.items():
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = unpack(frames)
                    except HandshakeError:
                        continue
                    if isinstance(msg, (Staged, StageError)):
                        self._on_stage_reply(msg, prank)

    def _release_reads(self, f: _InFlight) -> set:
        """Release a request's reads and staging slots once nothing can still write into them.

        Returns the prefill ranks whose reads did not all complete. A read still in progress (RDMA or
        TCP transports return PROC) is not released: it is parked with its slot until it settles, so
        a late write can never land in memory that was handed to someone else.
        """
        incomplete, parked = set(), []
        for r in f.reads:
            state = self.transport.settle(r.xfer, self.release_timeout_s)
            if r.scatter is not None:
                r.scatter.exception()  # wait: the slot is in use until the scatter ends
            if state is None:
                parked.append(r)
                incomplete.add(r.prefill)
                continue
            if not state:
                incomplete.add(r.prefill)
            self.transport.release(r.xfer)
        if parked:
            self._zombies.append((f.req.req_id, list(f.staged), parked))
        else:
            for prank in f.staged:
                self.slots.free((f.req.req_id, prank))
        return incomplete

    def _reap_zombies(self) -> None:
        for item in list(self._zombies):
            rid, pranks, reads = item
            if all(self.transport.settle(r.xfer, 0) is not None for r in reads):
                for r in reads:
                    self.transport.release(r.xfer)
                for prank in pranks:
                    self.slots.free((rid, prank))
                self._zombies.remove(item)

    def _fail(self, rid: str, f: _InFlight, reason: str, notify: bool = True) -> None:
        """Fail a request: settle and release its reads, then (unless its engine is dead) tell the prefill
        ranks that did not get a Done with a completed read, so they free blocks and staging now."""
        incomplete = self._release_reads(f)
        self.inflight.pop(rid, None)
        self.failed[rid] = reason
        self.metrics.failed_transfers += max(1, len(incomplete))
        self.metrics.failed_requests += 1
        if notify:
            self._notify_failed(f, incomplete)

    def _notify_failed(self, f: _InFlight, incomplete: set) -> None:
        ranks = set(f.pending_stage) | set(f.notify_at_end) | incomplete
        for p in ranks:
            if p in f.remote.agents:
                self._notify(f.remote.agents[p], self._done(f.req, f.remote, p, ok=False))

    def wait(self, timeout_s: float = 60.0, sleep_s: float = 1e-4) -> tuple[list[str], dict[str, str]]:
        """Poll until nothing is in flight (or timeout); returns everything finished/failed meanwhile."""
        done, failed = [], {}
        deadline = time.monotonic() + timeout_s
        while True:
            d, f = self.poll()
            done += d
            failed |= f
            if not self.inflight or time.monotonic() > deadline:
                return done, failed
            time.sleep(sleep_s)

    def stats(self) -> dict:
        return {"metrics": self.metrics.to_json(), "inflight": len(self.inflight),
                "live_handles": self.transport.live_handles(), "peers": len(self.transport.peers),
                "remotes": sorted(self.remotes),
                "nixl": vars(self.transport.stats).copy() if hasattr(self.transport, "stats") else {}}

    def close(self) -> None:
        for eid in list(self.remotes):
            self.forget(eid, "decode rank closing")
        self.transport.close()

    # ---- benchmarks: timed direct and staged reads (appended) ----------------------------------
    def timed_read(self, req: ReadRequest, timeout_s: float = 120.0) -> dict:
        """Post ``req`` and wait for it here (no RPC in the timing); returns seconds, bytes, descriptors."""
        t0 = time.perf_counter()
        self.start(req)
        f = self.inflight.get(req.req_id)
        nbytes, ndescs = (f.nbytes, f.ndescs) if f else (0, 0)
        # poll every 0.2 ms, like an engine loop between steps: a tighter loop steals a core from the
        # copies on a small machine (reads and scatters run on the post threads, packs in the prefill)
        done, failed = self.wait(timeout_s, sleep_s=2e-4)
        if req.req_id in failed or req.req_id not in done:
            raise TransferError(f"request {req.req_id} failed: {failed.get(req.req_id, 'timeout')}")
        return {"seconds": time.perf_counter() - t0, "bytes": nbytes, "descriptors": ndescs}

    def set_transfer_mode(self, mode: str) -> None:
        """Force direct/staged/auto for later handshakes (forgets cached engines so they re-handshake)."""
        if mode not in ("auto", "direct", "staged"):
            raise ValueError(f"transfer_mode must be auto, direct or staged, not {mode!r}")
        if mode != "direct" and not self.staging.size:
            raise ValueError("this decode rank was created without a staging buffer (transfer_mode='direct')")
        self.transfer_mode = mode
        for eid in list(self.remotes):
            self.forget(eid)

    def runs_digest(self, req: ReadRequest) -> str:
        """sha256 of the request's destination runs in this rank's buffer (to compare direct and staged)."""
        import hashlib
        from ..staging import pack
        descs = self.remotes[req.engine_id].lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks)
        h = hashlib.sha256()
        for d in descs:
            out = np.empty(d.total_bytes, dtype=np.uint8)
            pack(self._host, d.dst - self._host_base, d.nbytes, out)
            h.update(out.tobytes())
        return h.hexdigest()

    def clear(self, value: int = 0xA5) -> None:
        """Benchmarks/tests: set every byte of the KV memory to ``value``."""
        for a in self.mem.allocations:
            host_view(a.addr, a.nbytes).fill(value)
