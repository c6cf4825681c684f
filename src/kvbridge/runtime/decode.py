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
from ..layout import EngineLayout, engine_from_dict
from ..lower import GroupBlocks, LoweredPlan
from ..memory import rank_memory
from ..plan import Rank, TransferPlan, plan_transfer
from ..transport.nixl import NixlTransport
from .metrics import Metrics
from .protocol import Done, ErrorReply, GetMeta, RankMeta, encode_notif, pack, unpack

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
class _InFlight:
    req: ReadRequest
    remote: RemoteEngine
    xfers: list
    started: float
    nbytes: int
    ndescs: int


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
    def __init__(self, engine: EngineLayout, rank: Rank, engine_id: str, transport=None,
                 handshake_timeout_s: float = 5.0, lease_margin_s: float = 0.05):
        self.engine, self.rank, self.engine_id = engine, tuple(rank), engine_id
        self.mem = rank_memory(engine, *rank)
        self.buf = np.empty(self.mem.size, dtype=np.uint8)
        self.transport = transport or NixlTransport(f"{engine_id}-d{rank[0]}t{rank[1]}")
        self.base = self.transport.register(self.buf)
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
        for prank in needed:
            m = metas[prank]
            if m.model_fingerprint != first.model_fingerprint or m.layout != first.layout:
                raise HandshakeError(f"prefill rank {prank} of {engine_id!r} reports a different layout than rank (0,0)")
            if m.buffer_size < rank_memory(layout, *prank).size:
                raise HandshakeError(f"prefill rank {prank} registered {m.buffer_size} B, its layout needs "
                                     f"{rank_memory(layout, *prank).size} B")
            agents[prank] = self.transport.add_peer(m.agent_metadata, m.metadata_sha256)
            bases[prank] = m.base_addr
        lowered = LoweredPlan(plan, self.rank, bases, self.base)
        readers = {p: len(plan.notifiers_of(p)) for p in needed}
        return RemoteEngine(engine_id, layout, plan, lowered, agents, readers, endpoints, first.metadata_sha256)

    def forget(self, engine_id: str) -> None:
        """Drop a remote engine (dead or gone): remove its agents; a later handshake starts fresh."""
        remote = self.remotes.pop(engine_id, None)
        if remote is not None:
            for agent in remote.agents.values():
                self.transport.remove_peer(agent)

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
        descs = {d.prefill: d for d in remote.lowered.descriptors(req.num_tokens, req.prefill_blocks,
                                                                    req.decode_blocks)}
        xfers, nbytes, ndescs = [], 0, 0
        for prank, agent in remote.agents.items():
            d = descs.get(prank)
            notif = encode_notif(Done(req.req_id, self.engine_id, self.rank, remote.readers[prank]))
            if d is None or d.count == 0:  # nothing to read here (prefix hit, unread replica): just notify
                self._notify(agent, notif)
                continue
            xfers.append(self.transport.read(agent, d.src, d.dst, d.nbytes, notif))
            nbytes += d.total_bytes
            ndescs += d.count
        self.metrics.post_seconds_sum += time.perf_counter() - t0
        if not xfers:
            self.finished.append(req.req_id)
            self.metrics.finished_requests += 1
            return
        self.metrics.transfers += len(xfers)
        self.inflight[req.req_id] = _InFlight(req, remote, xfers, time.perf_counter(), nbytes, ndescs)

    def _notify(self, agent: str, msg: bytes) -> None:
        try:
            self.transport.send_notif(agent, msg)
        except TransferError:
            self.metrics.failed_notifications += 1

    def abort(self, req_id: str, engine_id: str | None = None, readers_of: ReadRequest | None = None) -> None:
        """Abort a request: tell its prefill ranks to free the blocks (waits for posted copies to end).

        In flight: a read that completed already carried its notification, so only the prefill ranks
        whose read did not complete are told. Not started (``readers_of`` given): every rank is told.
        """
        f = self.inflight.pop(req_id, None)
        remote = f.remote if f else (self.remotes.get(readers_of.engine_id) if readers_of else None)
        if remote is None:
            self.metrics.aborted_requests += 1
            return
        to_notify = set(remote.agents.values())
        if f:
            # a completed read carried its notification; ranks with nothing to read were told at start
            to_notify = set()
            for x in f.xfers:
                if not self.transport.settle(x):
                    to_notify.add(x.peer)
                self.transport.release(x)
        for p, agent in remote.agents.items():
            if agent in to_notify:
                self._notify(agent, encode_notif(Done(req_id, self.engine_id, self.rank, remote.readers[p], ok=False)))
        self.metrics.aborted_requests += 1

    def poll(self) -> tuple[list[str], dict[str, str]]:
        """Advance in-flight requests; return (finished ids, {failed id: reason}) since the last call."""
        dead_engines = set()
        for rid, f in list(self.inflight.items()):
            try:
                states = [self.transport.check(x) for x in f.xfers]
            except TransferError as e:
                self._fail(rid, f, str(e))
                if "disconnect" in str(e).lower():
                    dead_engines.add(f.remote.engine_id)
                continue
            if all(s == "DONE" for s in states):
                for x in f.xfers:
                    self.transport.release(x)
                del self.inflight[rid]
                self.metrics.observe_transfer(time.perf_counter() - f.started)
                self.metrics.transfer_bytes += f.nbytes
                self.metrics.descriptors += f.ndescs
                self.metrics.finished_requests += 1
                self.finished.append(rid)
        for eid in dead_engines:
            # every other request in flight to the dead engine fails too, then its agents go
            for rid, f in list(self.inflight.items()):
                if f.remote.engine_id == eid:
                    self._fail(rid, f, f"prefill engine {eid!r} disconnected")
            self.forget(eid)
        out, failed = self.finished, self.failed
        self.finished, self.failed = [], {}
        return out, failed

    def _fail(self, rid: str, f: _InFlight, reason: str) -> None:
        for x in f.xfers:
            self.transport.release(x)
        self.inflight.pop(rid, None)
        self.failed[rid] = reason
        self.metrics.failed_transfers += max(1, len(f.xfers))
        self.metrics.failed_requests += 1

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
        for rid, f in list(self.inflight.items()):
            self._fail(rid, f, "decode rank closing")
        self.transport.close()

    # ---- benchmarks: timed direct and staged reads (appended) ----------------------------------
    def timed_read(self, req: ReadRequest, timeout_s: float = 120.0) -> dict:
        """Post ``req`` and wait for it here (no RPC in the timing); returns seconds, bytes, descriptors."""
        t0 = time.perf_counter()
        self.start(req)
        f = self.inflight.get(req.req_id)
        nbytes, ndescs = (f.nbytes, f.ndescs) if f else (0, 0)
        done, failed = self.wait(timeout_s, sleep_s=2e-5)
        if req.req_id in failed or req.req_id not in done:
            raise TransferError(f"request {req.req_id} failed: {failed.get(req.req_id, 'timeout')}")
        return {"seconds": time.perf_counter() - t0, "bytes": nbytes, "descriptors": ndescs}

    def staged_read(self, req: ReadRequest, sources: dict, split_bytes: int = 0) -> dict:
        """Read bytes a prefill packed with ``PrefillRank.stage`` (``sources``: prefill rank -> (address,
        bytes)) into a local staging buffer, then scatter them to the request's ``dst`` runs."""
        from ..staging import scatter
        remote = self.remotes[req.engine_id]
        t0 = time.perf_counter()
        descs = remote.lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks)
        total = sum(d.total_bytes for d in descs)
        if getattr(self, "staging", None) is None or self.staging.size < total:
            if getattr(self, "staging", None) is not None:
                self.transport.deregister(self.staging)
            self.staging = np.zeros(max(total, 4096), dtype=np.uint8)
            self.staging_addr = self.transport.register(self.staging)
        t1 = time.perf_counter()
        xfers, off, ndescs = [], 0, 0
        for d in descs:
            if d.total_bytes == 0:
                continue
            addr, n = sources[tuple(d.prefill)]
            assert n == d.total_bytes, (n, d.total_bytes)
            step = split_bytes or max(n, 1)
            starts = np.arange(0, n, step, dtype=np.int64)
            lens = np.minimum(step, n - starts)
            xfers.append(self.transport.read(remote.agents[d.prefill], addr + starts, self.staging_addr + off + starts,
                                             lens))
            off += n
            ndescs += int(lens.size)
        for x in xfers:
            while self.transport.check(x) != "DONE":
                time.sleep(2e-5)
            self.transport.release(x)
        t2 = time.perf_counter()
        off = 0
        for d in descs:
            scatter(self.staging, self.buf, d.dst - self.base, d.nbytes, off)
            off += d.total_bytes
        t3 = time.perf_counter()
        return {"lower_s": t1 - t0, "read_s": t2 - t1, "scatter_s": t3 - t2, "bytes": total, "descriptors": ndescs}

    def runs_digest(self, req: ReadRequest) -> str:
        """sha256 of the request's destination runs in this rank's buffer (to compare direct and staged)."""
        import hashlib
        from ..staging import pack
        descs = self.remotes[req.engine_id].lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks)
        h = hashlib.sha256()
        for d in descs:
            out = np.empty(d.total_bytes, dtype=np.uint8)
            pack(self.buf, d.dst - self.base, d.nbytes, out)
            h.update(out.tobytes())
        return h.hexdigest()

    def clear(self, value: int = 0xA5) -> None:
        self.buf.fill(value)
