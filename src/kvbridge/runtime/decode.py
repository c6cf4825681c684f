"""A decode rank: handshakes with prefill engines, reads requests' KV, reports finished/failed ids.

The public facade of the decode side. Its parts:

* ``peer.py``: one :class:`~kvbridge.runtime.peer.Peer` per prefill engine owns what its handshake made
  (agents, prepared lists, sockets, outbox), with a lifecycle table of its own;
* ``handshake.py``: the handshake (metadata, checks, plan, agents, prepared lists);
* ``readstate.py`` / ``readmachine.py``: each (request, prefill rank) read is a sans-IO
  :class:`~kvbridge.runtime.readmachine.RankRead` that owns its state (``handle(event, now) -> actions``);
* this module: the public API, the peers' lifecycle driven by events (connect in the background,
  install, lose, re-handshake, reap) and the read loop, which turns ZMQ frames and NIXL states into
  the read machines' events and runs the actions they return;
* ``request.py``: :class:`ReadRequest` and the read in flight.

Per request the hot path is one validation (or
lowering) per prefill rank, one side-channel round trip (a batched ``Acquire`` that pins the lease for
direct reads, or the ``Stage`` request itself) and one posted READ, off this thread; failures are typed
(:class:`~kvbridge.errors.ReadFailure`).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from functools import partial

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import (
    Aborted,
    HandshakeError,
    HandshakeFailed,
    IncompatibleLayoutsError,
    KVBridgeError,
    LeaseExpired,
    PeerDisconnected,
    PeerGoneError,
    PeerRestarted,
    ReadFailure,
    RequestError,
    TransferError,
)
from ..layout import EngineLayout, engine_to_dict
from ..memory import KVMemory
from ..plan import Rank
from ..tensors import host_view
from ..transport.nixl import NixlTransport
from . import prepped_hook as _prepped_hook
from .handshake import Handshaker, RemoteEngine, fetch_meta
from .memhost import KVBytes, check_memory, register_memory, staging_nbytes, to_host, transport_device
from .metrics import Metrics
from .peer import Peer, PeerEvent, PeerState
from .peers import PeerTable, Ready
from .protocol import (
    STAGE_SEGMENT_BYTES,
    Acquire,
    Acquired,
    Done,
    Stage,
    Staged,
    StageError,
    blocks_to_wire,
    encode_notif,
    pack,
    unpack,
)
from .readmachine import REFUSALS, RankRead, ReadContext
from .readstate import (
    Abort,
    AlignRetry,
    Ask,
    Count,
    Fail,
    Failed,
    Granted,
    Heartbeat,
    LetGo,
    Notify,
    PinsReleased,
    Post,
    PostSegment,
    ReadEvent,
    ReadState,
    Refreshed,
    Refused,
    Restarted,
    Retry,
    Scatter,
    ScatterDone,
    ScatterFailed,
    Segment,
    Sent,
    StageFailed,
    Tick,
    Transfer,
    XferDone,
    XferFailed,
)
from .request import InFlight, ReadRequest
from .slots import SlotAllocator

__all__ = ["DecodeRank", "ReadRequest", "RemoteEngine", "Peer", "PeerState", "fetch_meta"]

log = logging.getLogger(__name__)


class DecodeRank:
    """Decode side of one rank: reads requests' KV from prefill engines into the engine's KV memory
    (``memory``, a :class:`KVMemory` describing tensors the engine allocated)."""

    def __init__(self, engine: EngineLayout, rank: Rank, engine_id: str, memory: KVMemory | None = None, transport=None,
                 handshake_timeout_s: float = 5.0,
                 transfer_mode: str = "auto", staging_bytes: int = 64 << 20, cost_model=None,
                 stage_timeout_s: float = 10.0, transfer_timeout_s: float = 120.0,
                 stage_segment_bytes: int = STAGE_SEGMENT_BYTES, post_threads: int = 1,
                 register_grace_s: float = 2.0, connect_timeout_s: float | None = None,
                 rehandshake_timeout_s: float = 1.0):
        if transfer_mode not in ("auto", "direct", "staged"):
            raise ValueError(f"transfer_mode must be auto, direct or staged, not {transfer_mode!r}")
        self.engine, self.rank, self.engine_id = engine, tuple(rank), engine_id
        self.mem = check_memory(memory, engine, rank)
        self._mem_wire = self.mem.to_wire()  # sent with stage requests
        self.transport = transport or NixlTransport(f"{engine_id}-d{rank[0]}t{rank[1]}", post_threads=post_threads,
                                                    **transport_device(self.mem))
        register_memory(self.transport, self.mem)
        # staged reads scatter on the KV memory's own device (torch ops for torch tensors, CPU or CUDA)
        self._kv = KVBytes(self.mem)
        if not self._kv.usable and transfer_mode != "direct":
            log.warning("decode rank %s: KV memory on %s given by address and torch is not loaded: no staged "
                        "reads (direct only); describe the memory with torch tensors to stage on the device",
                        self.rank, self.mem.device)
            transfer_mode = "direct"
        from ..cost import CostModel
        self.transfer_mode, self.stage_timeout_s = transfer_mode, stage_timeout_s
        self.stage_segment_bytes = int(stage_segment_bytes)
        self.transfer_timeout_s = transfer_timeout_s
        # an acquire/stage request that finds no lease yet ("not registered": the prefill engine registers
        # a request when its step ends, the router may be faster) is asked again for this long
        self.register_grace_s = float(register_grace_s)
        self._requeued: set = set()  # read keys already re-queued once after a restart
        self.ctx = zmq.Context.instance()
        self.metrics = Metrics()
        self.handshake_timeout_s = handshake_timeout_s
        # the prefill peers and their lifecycle; a background handshake is bounded as a whole by
        # connect_timeout_s (default: 2 x handshake_timeout_s + 5 s); reads re-queued after their engine
        # restarted or disconnected wait at most rehandshake_timeout_s for it
        self.peers = PeerTable(self.ctx, self.transport, self.metrics, self._handshaker, engine_id,
                               float(connect_timeout_s if connect_timeout_s is not None
                                     else 2 * handshake_timeout_s + 5.0), float(rehandshake_timeout_s))
        self._released: OrderedDict = OrderedDict()  # (read key, prefill rank, attempt): pins of ended reads let go
        self._failed_keys: OrderedDict = OrderedDict()  # reads that failed (a retry failing again counts once)
        self._linger_until = 0.0  # failed reads' requests may still be answered: drain replies until then
        self._layout_dict = engine_to_dict(engine)  # sent with stage requests
        self._zombies: list = []  # (req_id, staged ranks, reads still in progress after a failure)
        self.cost_model = cost_model or CostModel.load()
        # the staging buffer lives on the KV memory's device (registered as VRAM there when on a GPU)
        self.staging = self._kv.new_staging(staging_bytes if transfer_mode != "direct" else 0)
        self.staging_bytes = staging_nbytes(self.staging)
        self.staging_addr = self.transport.register(self.staging) if self.staging_bytes else 0
        self.slots = SlotAllocator(self.staging_bytes)
        self.inflight: dict[str, InFlight] = {}
        self.finished: list[str] = []
        self.failed: dict[str, ReadFailure] = {}

    # ---- peers: handshake, background connect, lifecycle (the table: peers.py) -----------------------
    @property
    def remotes(self) -> dict[str, Peer]:
        """{engine id: live :class:`~kvbridge.runtime.peer.Peer`} (each owns its handshake's result)."""
        return self.peers.remotes

    @property
    def _peers(self) -> dict[str, Peer]:
        """engine id -> its current peer (CONNECTING or LIVE)."""
        return self.peers.current

    @property
    def connect_timeout_s(self) -> float:
        return self.peers.connect_timeout_s

    @property
    def rehandshake_timeout_s(self) -> float:
        return self.peers.rehandshake_timeout_s

    def _handshaker(self) -> Handshaker:
        return Handshaker(self.ctx, self.transport, self.engine, self.rank, self.mem, self.engine_id,
                          self.handshake_timeout_s, self.staging_bytes, self.transfer_mode, self.cost_model)

    def handshake(self, engine_id: str, endpoints: dict[Rank, str]) -> Peer:
        """Contact the prefill engine's ranks this rank needs, on this thread; cached per engine id."""
        endpoints = {tuple(k): v for k, v in endpoints.items()}
        self.peers.endpoints[engine_id] = endpoints
        cur = self.peers.get(engine_id)
        pending: list = []
        if cur is not None and cur.live:
            # still the same engine? (same endpoints and the same NIXL agent behind every rank)
            if cur.endpoints == endpoints and self._handshaker().same_agents(cur.remote, endpoints):
                return cur
            self.forget(engine_id)
        elif cur is not None:  # connecting in the background: this handshake replaces it
            pending, cur.pending = cur.pending, []
            self.peers.abandon(cur)
        self._reap(engine_id=engine_id)  # its agents go before they are added again
        try:
            remote, prepped = self._handshaker().run(engine_id, endpoints)
        except (HandshakeError, IncompatibleLayoutsError):
            self.metrics.failed_handshakes += 1
            raise
        peer = Peer(engine_id, endpoints, started=time.monotonic(), pending=pending)
        self._start_queued(peer, self.peers.install(peer, remote, prepped))
        return peer

    def _start_queued(self, peer: Peer, pending: list[ReadRequest]) -> None:
        """Start the reads that waited for ``peer``'s handshake."""
        for req in pending:
            try:
                self.start(req)
            except KVBridgeError as e:
                self._count_failed(req)
                self.failed[req.key] = HandshakeFailed(str(e), req_id=req.req_id, engine_id=peer.engine_id)

    def connect(self, engine_id: str, endpoints: dict[Rank, str]) -> None:
        """Make sure prefill engine ``engine_id`` is (or becomes) live, without blocking: returns at once.

        Live with the same endpoints: nothing to do. Otherwise the handshake (metadata fetch from each
        prefill rank this rank needs, NIXL ``add_remote_agent``, prepared lists) runs on a background
        thread, bounded as a whole by ``connect_timeout_s``; :meth:`start` queues reads of a connecting
        engine and :meth:`poll` starts them once it is live, or fails them (:class:`HandshakeFailed`)
        if the handshake fails or runs past the bound. Idempotent: call it before every :meth:`start`
        (vLLM: when the scheduler first sees the request)."""
        endpoints = {tuple(k): v for k, v in endpoints.items()}
        self.peers.endpoints[engine_id] = endpoints
        cur = self.peers.get(engine_id)
        if cur is not None and cur.endpoints == endpoints:
            return  # live, or connecting to the same endpoints
        pending = []
        if cur is not None and cur.live:  # other endpoints: a new engine under this id
            self.forget(engine_id, "the prefill engine's endpoints changed (connect)")
        elif cur is not None:
            pending, cur.pending = cur.pending, []
            self.peers.abandon(cur)
        self._connect(engine_id, endpoints, pending)

    def _connect(self, engine_id: str, endpoints: dict, pending: list, bound_s: float | None = None) -> Peer:
        cur = self.peers.get(engine_id)
        if cur is not None and cur.live:
            self.forget(engine_id, "the prefill engine is handshaken again")
        elif cur is not None:
            self.peers.abandon(cur)
        self._reap(engine_id=engine_id)
        return self.peers.begin(engine_id, endpoints, pending, bound_s)

    def _advance_peers(self, now: float) -> None:
        """Install engines whose background handshake finished and start their queued reads; fail the
        queued reads of a handshake that failed or ran past its bound (``connect_timeout_s``)."""
        for r in self.peers.advance(now):
            if isinstance(r, Ready):
                self._start_queued(r.peer, r.pending)
                continue
            for req, failure in r.failures:
                self._count_failed(req)
                self.failed[req.key] = failure

    def _can_requeue(self, f: InFlight) -> bool:
        return not any(rr.pinned or rr.reads for rr in f.ranks.values()) and f.req.key not in self._requeued

    def _requeue_restarted(self, f: InFlight) -> bool:
        """A prefill rank answered "restarted" (same id and ports, a new process): if this read holds no
        pin anywhere yet, drop it quietly, re-handshake in the background and start it again there (the
        request that discovered the restart does not fail). True if requeued."""
        if not self._can_requeue(f):
            return False
        self._requeue(f, f"prefill engine {f.peer.engine_id!r} restarted", PeerEvent.RESTARTED)
        return True

    def _requeue(self, f: InFlight, why: str, event: PeerEvent) -> None:
        """Start ``f`` again behind a background re-handshake of its engine (once per read); it fails
        :class:`HandshakeFailed` (a :class:`PeerDisconnected`) if the engine cannot be reached. The
        engine's other reads that hold nothing yet go with it (the old peer is lost)."""
        old = f.peer
        eid = old.engine_id
        endpoints = self.peers.endpoints.get(eid, old.endpoints)
        cur = self.peers.get(eid)
        connecting = cur is not None and cur.connecting
        group = [f]
        if not connecting:
            group += [g for g in self.inflight.values() if g.peer is old and g is not f and self._can_requeue(g)]
        for g in group:
            self.inflight.pop(g.req.key, None)
            self._abort_ranks(g)
            self._release_reads(g)
            self._notify_failed(g)  # a request still out on a live rank may have pinned there: let it go
            self.metrics.restart_requeues += 1
            self._requeued.add(g.req.key)
        if len(self._requeued) > 4096:
            self._requeued.clear()
        if not connecting:
            for rid, g in list(self.inflight.items()):  # the old engine's reads that hold something: failed
                if g.peer is old:
                    self._fail(rid, g, self._failure(PeerDisconnected, g, None, f"{why}; its reads in progress "
                                                                               "cannot continue"))
            self.peers.retire(old, event)
            # reaps the old peer (its reads that held pins fail); a re-handshake is bounded by
            # rehandshake_timeout_s: a restarted engine answers at once, a dead one must fail fast
            cur = self._connect(eid, endpoints, [], min(self.connect_timeout_s, self.rehandshake_timeout_s))
            cur.why = why
        assert cur is not None
        cur.pending += [g.req for g in group]

    def forget(self, engine_id: str, reason: str = "the prefill engine was forgotten (re-handshake)",
               dead: bool = False) -> None:
        """Drop a remote engine (dead or gone): fail its requests in flight, close its peer (agents,
        sockets, prepared lists); a later handshake starts fresh."""
        for rid, f in list(self.inflight.items()):
            if f.peer.engine_id == engine_id:
                cls = PeerDisconnected if dead else Aborted
                self._fail(rid, f, cls(f"request {rid!r}: {reason}", req_id=rid, engine_id=engine_id), notify=not dead)
        self.peers.drop_live(engine_id)

    def _peer_died(self, peer: Peer, prank: Rank, detail: str) -> None:
        """NIXL reported the agent of ``prank`` disconnected: every request still reading it fails now (its
        queued reads are cancelled, never posted), the peer is lost (a later handshake starts fresh) and
        the dead agent is removed; the peer's live ranks keep their agents until the failed requests'
        Done notifications have gone out."""
        agent = peer.agent_gone(prank)
        requeue = []
        for _rid, f in list(self.inflight.items()):
            for p, rr in f.ranks.items():
                if not rr.terminal and f.peer.remote is not None and f.peer.agents.get(p) == agent:
                    if self._can_requeue(f):  # nothing pinned or read yet: the engine may be back (restart)
                        requeue.append(f)
                    else:
                        self._apply(f, rr, rr.handle(Failed(
                            ReadEvent.DISCONNECT, PeerDisconnected,
                            f"disconnected: prefill agent {agent!r} went away ({detail})"), time.monotonic()))
                    break
        self.peers.retire(peer, PeerEvent.DISCONNECTED)
        peer.remove_agent(prank, self.transport)
        for f in requeue:
            if self.inflight.get(f.req.key) is f:  # (an earlier one may have taken it along)
                self._requeue(f, f"prefill agent {agent!r} disconnected ({detail})", PeerEvent.DISCONNECTED)

    def _reap(self, engine_id: str | None = None) -> None:
        """Close lost peers once no read references them (or now, for ``engine_id``, which is about to be
        handshaken again: its reads fail), and release what abandoned handshakes made once they return."""
        self.peers.reap(engine_id, self._in_use, self._drop_reads)

    def _in_use(self, peer: Peer) -> bool:
        return any(f.peer is peer for f in self.inflight.values())

    def _drop_reads(self, peer: Peer, why: str = "the prefill engine is handshaken again") -> None:
        for rid, f in list(self.inflight.items()):
            if f.peer is peer:
                self._fail(rid, f, self._failure(Aborted, f, None, why), notify=False)

    # ---- requests ------------------------------------------------------------------------------
    def start(self, req: ReadRequest) -> None:
        """Validate ``req`` and ask its prefill ranks to pin the lease (direct reads are posted when the
        pin is granted; staged ranks pack on the stage request, which pins too; a rank with nothing to
        read is pinned and released at once). Raises RequestError/HandshakeError before anything moves."""
        key = req.key
        if key in self.inflight:
            raise RequestError(f"read {key!r} is already in flight on decode rank {self.rank}; give each read of "
                               "one prefill request its own ReadRequest.read_id")
        peer = self.peers.get(req.engine_id)
        if peer is None or not peer.live:
            if peer is not None and peer.connecting:  # started once the engine is live
                if any(p.key == key for p in peer.pending):
                    raise RequestError(f"read {key!r} is already queued on decode rank {self.rank}")
                peer.pending.append(req)
                return
            raise HandshakeError(f"no handshake with prefill engine {req.engine_id!r} yet; call connect() or "
                                 "handshake() first")
        t0 = time.perf_counter()
        modes = self._request_modes(peer, req) if self.transfer_mode == "auto" else peer.modes
        direct = [p for p, m in modes.items() if m == "direct"]
        staged = [p for p, m in modes.items() if m == "staged"]
        descs = _prepped_hook.direct_reads(peer.prepped, peer, req, direct)  # [i14]
        missing = [p for p in peer.agents if not req.attempt_for(p) and (
            p in staged or _prepped_hook.reads_something(descs.get(p)))]
        if missing:  # nothing to present to the prefill: it would refuse; do not even ask
            self._count_failed(req)
            self.failed[key] = LeaseExpired(
                f"request {req.req_id!r} carries no lease attempt for prefill ranks {sorted(missing)} of "
                f"{req.engine_id!r}; pass the attempt add_request returned (ReadRequest.attempt)",
                req_id=req.req_id, engine_id=req.engine_id, prefill_rank=missing[0])
            return
        f = InFlight(req, peer, {}, t0)
        now = time.monotonic()
        ctx = self._read_ctx()
        for prank in peer.agents:
            if prank in staged:
                continue
            d = descs.get(prank)
            if not _prepped_hook.reads_something(d):  # nothing to read here (prefix hit, unread replica)
                if not req.attempt_for(prank) or prank not in peer.socks:
                    continue  # nothing to present: the prefill's lease expires on its own
                d = None  # pinned, then released at once: only a pin holder's Done settles a read
            f.ranks[prank] = RankRead(prank, ReadState.ACQUIRING, now, ctx, work=d)
            self._queue(peer.outbox, peer, prank, req)
        if staged:
            wire_p, wire_d = blocks_to_wire(req.prefill_blocks), blocks_to_wire(req.decode_blocks)
            layout = self._layout_dict
            for prank in staged:
                msg = Stage(
                    req.req_id, self.engine_id, self.rank, layout, self._mem_wire, req.num_tokens, wire_p, wire_d,
                    self.stage_segment_bytes, req.attempt_for(prank), peer.readers[prank],
                    peer.digests.get(prank, ""), key, self.transport.agent_name)
                # lowered at most once, when the first segment is announced (or on a fallback to direct)
                f.ranks[prank] = RankRead(prank, ReadState.STAGE_REQUESTED, now, ctx, request=msg, slot_key=(key, prank),
                                          lower=partial(lower_one, peer.lowered, req, prank))
                peer.send(prank, pack(msg))
            f.stage_sent = time.perf_counter()
        self.metrics.post_seconds_sum += time.perf_counter() - t0
        if not f.ranks:
            self.finished.append(key)
            self.metrics.finished_requests += 1
            return
        self.inflight[key] = f

    def heartbeat(self, reqs: Iterable[ReadRequest]) -> None:
        """Tell the prefill ranks that these requests, queued or parked on this engine (not started), will
        still be read: each prefill rank this rank notifies extends their leases by its ``lease_s`` (never
        past its ``pin_s`` after registration), bound to the attempt and to this reader; nothing is
        pinned, and an unknown or ended request is left alone. Call it every ``lease_s / 6`` or so (vLLM
        0.33 does) for requests waiting longer than a fraction of the lease. Reads in flight need no
        call: :meth:`poll` refreshes their pins. Never blocks (sent on the next :meth:`poll`/:meth:`flush`)."""
        for req in reqs:
            if req.key in self.inflight:
                continue
            peer = self.peers.get(req.engine_id)
            if peer is None or not peer.live:
                continue
            for prank in peer.agents:
                if req.attempt_for(prank) and prank in peer.socks:
                    self._queue(peer.heartbeats, peer, prank, req)
        self.flush()

    def release(self, req: ReadRequest) -> None:
        """Give up ``req`` (the engine aborted or rejected the request): the prefill's blocks are freed as
        soon as no other reader needs them. Never blocks.

        In flight (``req.key`` started here): as :meth:`abort`: reads cancelled, and every pin this rank
        holds for it released (``Done``, failed); a pin still being granted is released when its grant
        arrives. Not started: every prefill rank this rank notifies gets a *decline* (``Done`` with
        ``decline=True``, failed) for ``req.key``: this rank's part of the read is settled without
        reading. A prefill rank frees the lease when that leaves no pin held by any reader (another
        decode engine's read, another read id of this engine, another rank of this engine still
        reading) and every read of it settled; otherwise the lease stays for the others (and expires on
        its own if they never come). A decline is ignored if this rank holds the pin (it releases
        instead) or already settled its part."""
        if req.key in self.inflight:
            self.abort(req.key)
            return
        self.metrics.aborted_requests += 1
        peer = self.peers.get(req.engine_id)
        if peer is None or not peer.live:
            return
        for p, agent in peer.agents.items():
            if req.attempt_for(p):
                self._notify(agent, self._done(req, peer, p, ok=False, decline=True))

    def _request_modes(self, remote: Peer, req: ReadRequest) -> dict:
        """Auto mode, per request: runs merge across consecutive block ids, so a request whose blocks are
        mostly consecutive (on both sides) may be cheaper direct than the handshake-time choice says."""
        from ..cost import request_chunks, request_modes
        chunks, frac = request_chunks(remote.layout.model.groups, req.decode_blocks, req.prefill_blocks,
                                      self.engine.block_size_of, remote.lowered.chunk_tokens)
        shapes = {p: remote.shapes.get(p) for p in remote.modes}
        staged = request_modes(self.cost_model, {p: s for p, s in shapes.items() if s is not None}, chunks, frac,
                               lambda p: p in remote.can_stage)
        return {p: staged.get(p, "direct") for p in remote.modes}

    def abort(self, req_id: str, engine_id: str | None = None, readers_of: ReadRequest | None = None) -> None:
        """Abort a request: tell its prefill ranks to free the blocks (never waits for a read).

        In flight (``req_id``: the read's key, :attr:`ReadRequest.key`): its reads are cancelled (one
        still in progress is parked with its memory until it ends) and every pin this rank holds for it
        is released. Not started (``readers_of`` given): as :meth:`release` (a decline to every prefill
        rank this rank notifies; the lease is freed only if no other reader holds a pin).
        """
        f = self.inflight.pop(req_id, None)
        if f is not None:
            self.metrics.aborted_requests += 1
            unpinned = [p for p, rr in f.ranks.items() if not rr.terminal and not rr.pinned]
            self._abort_ranks(f)
            self._release_reads(f)
            self._notify_failed(f)
            # ranks where we know of no pin (acquire not sent or not answered yet, refused): decline too.
            # If our request was answered meanwhile with a pin (a parked stage request), the release
            # above ends it and the prefill ignores the decline; if not, the release is ignored and the
            # decline settles our part (a pin granted after both is let go when its grant arrives)
            for p in unpinned:
                agent = f.peer.agent(p)
                if agent is not None and f.req.attempt_for(p):
                    self._notify(agent, self._done(f.req, f.peer, p, ok=False, decline=True))
            return
        if readers_of is not None:  # not started: decline (see release())
            self.release(readers_of)
        else:
            self.metrics.aborted_requests += 1

    @property
    def waiting(self) -> int:
        """Reads queued behind a background handshake (started while their engine was connecting, or
        re-queued after it restarted or disconnected); :meth:`poll` starts or fails them."""
        return self.peers.waiting

    @property
    def busy(self) -> bool:
        """Something needs polling: reads in flight, parked reads, retired engines, unsent messages."""
        return bool(self.inflight or self._zombies or self.peers.old or self.peers.connecting()
                    or any(p.outbox or p.unsent or p.heartbeats for p in self.peers.current.values())
                    or time.monotonic() < self._linger_until)

    def poll(self) -> tuple[list[str], dict[str, ReadFailure]]:
        """Advance in-flight requests; return (finished ids, {failed id: typed failure}) since the last call."""
        self.flush()
        self._drain_replies()
        now = time.monotonic()
        self._advance_peers(now)
        for rid, f in list(self.inflight.items()):
            if rid not in self.inflight:  # failed meanwhile (a dead peer fails all of its requests)
                continue
            failed = False
            for rr in f.ranks.values():
                if rr.terminal:
                    continue
                if self._advance(f, rr, now):
                    failed = True
                    break
            if failed or rid not in self.inflight:
                continue
            if all(rr.state is ReadState.DONE for rr in f.ranks.values()):
                self._complete(rid, f)
        self._reap_zombies()
        self._reap()
        self.flush()  # retries and heartbeats scheduled above
        out, failed = self.finished, self.failed
        self.finished, self.failed = [], {}
        return out, failed

    # ---- the read loop: ZMQ frames and NIXL states -> read events, actions -> I/O -----------------
    def _read_ctx(self) -> ReadContext:
        return ReadContext(self.stage_timeout_s, self.transfer_timeout_s, self.register_grace_s, self.slots,
                           self.staging_addr)

    @staticmethod
    def _queue(box: dict, peer: Peer, prank: Rank, req: ReadRequest) -> None:
        peer.queue(box, prank, (req.req_id, req.attempt_for(prank), req.key))

    def flush(self) -> None:
        """Send the batched acquire requests and heartbeats (one message per prefill rank) and retry the
        messages ZMQ could not take, of every peer with open sockets."""
        for peer in self.peers.active():
            if peer.unsent:
                peer.retry_unsent()
            if peer.outbox:
                out, peer.outbox = peer.outbox, {}
                for prank, reqs in out.items():
                    live = [(rid, a, k) for rid, a, k in reqs if k in self.inflight]
                    now = time.monotonic()
                    for _, _, k in live:
                        rr = self.inflight[k].ranks.get(prank)
                        if rr is not None:
                            rr.handle(Sent(), now)
                    if live and prank in peer.socks:
                        peer.send(prank, pack(Acquire(self.engine_id, self.rank, peer.readers[prank],
                                                      peer.digests.get(prank, ""), live, self.transport.agent_name)))
            if peer.heartbeats:
                out, peer.heartbeats = peer.heartbeats, {}
                for prank, reqs in out.items():
                    if prank in peer.socks:
                        self.metrics.heartbeats += len(reqs)
                        peer.send(prank, pack(Acquire(self.engine_id, self.rank, peer.readers[prank],
                                                      peer.digests.get(prank, ""), reqs, self.transport.agent_name,
                                                      heartbeat=True)))

    def _done(self, req: ReadRequest, remote: Peer, prank: Rank, ok: bool = True,
              decline: bool = False) -> bytes:
        return encode_notif(Done(req.req_id, self.engine_id, self.rank, remote.readers[prank], ok,
                                 req.attempt_for(prank), req.key, decline))

    def _let_go(self, remote: Peer, prank: Rank, rid: str, attempt: int, read_id: str) -> None:
        """The prefill granted a pin (or staged) for a read that is no longer live here (failed, aborted,
        or answered twice): release that pin once, so it does not hold the blocks until it times out."""
        key = (read_id, prank, attempt)
        if key in self._released or prank not in remote.agents:
            return
        self._released[key] = True
        while len(self._released) > 4096:
            self._released.popitem(last=False)
        agent = remote.agent(prank)
        if agent is not None:
            self._notify(agent, encode_notif(Done(rid, self.engine_id, self.rank, remote.readers[prank], False,
                                                  attempt, read_id)))

    def _apply(self, f: InFlight, rr: RankRead, actions: list, ids: tuple | None = None) -> bool:
        """Run what a read's machine asked for (the thin I/O half); True if the request failed."""
        prank, peer = rr.prefill, f.peer
        for a in actions:
            if isinstance(a, Post):
                a.transfer.xfer = self.transport.post(
                    peer.agents[prank], a.transfer.work, self._done(f.req, peer, prank), cancel=a.transfer,
                    remote_device=_device_of(peer, prank))
                # sizes of a direct read are worked out on the post thread: counted when the request completes
                self.metrics.transfers += 1
            elif isinstance(a, PostSegment):
                t, one = a.transfer, np.ones(1, dtype=np.int64)
                t.xfer = self.transport.read(peer.agents[prank], one * a.addr, one * a.local, one * t.nbytes, b"",
                                             remote_device=_device_of(peer, prank))
                f.nbytes += t.nbytes
                f.ndescs += 1
                self.metrics.transfers += 1
            elif isinstance(a, Scatter):
                a.transfer.scatter = self.transport.submit(self._scatter, a.transfer)
            elif isinstance(a, Ask):
                if not a.stage:
                    self._queue(peer.outbox, peer, prank, f.req)
                elif prank in peer.socks:
                    peer.send(prank, pack(rr.request))
                    rr.handle(Sent(), time.monotonic())
            elif isinstance(a, Heartbeat):
                self._queue(peer.heartbeats, peer, prank, f.req)
            elif isinstance(a, Notify):
                self._notify(peer.agents[prank], self._done(f.req, peer, prank))
            elif isinstance(a, LetGo):
                self._let_go(peer, prank, *(ids or (f.req.req_id, f.req.attempt_for(prank), f.req.key)))
            elif isinstance(a, Count):
                setattr(self.metrics, a.name, getattr(self.metrics, a.name) + 1)
            elif isinstance(a, Retry):
                # other reads of the same prefill request waiting to ask this rank again (vLLM n > 1: each
                # child is a reader) ask together, in one message: the prefill pins them all before any of
                # them can end and free the lease under the others (a refused acquire leaves no trace there)
                for g in self.inflight.values():
                    sib = g.ranks.get(prank) if g is not f else None
                    if (sib is not None and sib.retry_at is not None and g.peer is peer and g.req.req_id == f.req.req_id
                            and g.req.attempt_for(prank) == f.req.attempt_for(prank)):
                        at = min(a.at, sib.retry_at)
                        rr.handle(AlignRetry(at), 0.0)
                        sib.handle(AlignRetry(at), 0.0)
            elif isinstance(a, Restarted):
                if self._requeue_restarted(f):
                    return True
                failed = self._apply(f, rr, rr.handle(Failed(ReadEvent.REFUSED, PeerRestarted, a.text),
                                                      time.monotonic()))
                self.peers.retire(peer, PeerEvent.RESTARTED)  # a later handshake() reaches the new process
                return failed
            elif isinstance(a, Fail):
                self._fail(f.req.key, f, self._failure(a.kind, f, prank, a.text))  # the read key: what poll() reports
                return True
        return False

    def _failure(self, cls, f: InFlight, prank: Rank | None, text: str) -> ReadFailure:
        where = f"prefill engine {f.peer.engine_id!r} rank {prank}" if prank is not None else \
            f"prefill engine {f.peer.engine_id!r}"
        return cls(f"request {f.req.req_id!r} from {where}: {text}", req_id=f.req.req_id,
                   engine_id=f.peer.engine_id, prefill_rank=prank)

    def _on_acquired(self, peer: Peer, prank: Rank, msg: Acquired) -> None:
        """An ``Acquired`` frame -> one event per read it names."""
        now = time.monotonic()
        if msg.heartbeat:  # pins refreshed (reads in flight) or queued leases extended; refusals: no change
            for rid, attempt, read_id, ttl_s in msg.granted:
                f, rr = self._rank_read(peer, prank, rid, attempt, read_id)
                if rr is not None:
                    rr.handle(Refreshed(ttl_s), now)
            return
        for rid, attempt, read_id, ttl_s in msg.granted:
            f, rr = self._rank_read(peer, prank, rid, attempt, read_id)
            if rr is None:
                self._let_go(peer, prank, rid, attempt, read_id)  # a pin no live read of ours will use
                continue
            self._apply(f, rr, rr.handle(Granted(ttl_s), now), (rid, attempt, read_id))
        for rid, attempt, read_id, code, text in msg.refused:
            f, rr = self._rank_read(peer, prank, rid, attempt, read_id)
            if rr is not None:
                self._apply(f, rr, rr.handle(Refused(code, text), now))

    def _rank_read(self, remote: Peer, prank: Rank, rid: str, attempt: int | None = None,
                   read_id: str = ""):
        f = self.inflight.get(read_id or rid)
        if (f is None or f.peer is not remote or f.req.req_id != rid
                or (attempt is not None and attempt != f.req.attempt_for(prank))):
            return None, None
        return f, f.ranks.get(prank)

    def _on_stage_reply(self, peer: Peer, prank: Rank, msg: Staged | StageError) -> None:
        """A ``Staged``/``StageError`` frame -> one event for the read it names."""
        f, rr = self._rank_read(peer, prank, msg.req_id, msg.attempt or None, msg.read_id)
        ids = (msg.req_id, msg.attempt, msg.read_id or msg.req_id)
        if rr is None:  # the request failed or was aborted meanwhile: a pin made for it is released (once)
            if (isinstance(msg, Staged) or msg.code not in REFUSALS) and msg.attempt:
                self._let_go(peer, prank, *ids)
            return
        now = time.monotonic()
        if isinstance(msg, Staged):
            ev = Segment(msg.total, msg.offset, msg.nbytes, msg.addr, msg.last, msg.ttl_s)
        else:
            ev = StageFailed(msg.code, msg.message, msg.expired, msg.ttl_s)
        actions = rr.handle(ev, now)
        if not msg.attempt:
            actions = [a for a in actions if not isinstance(a, LetGo)]
        if isinstance(msg, Staged) and msg.last and any(isinstance(a, PostSegment) for a in actions):
            self.metrics.stage_wait_seconds_sum += time.perf_counter() - f.stage_sent
        self._apply(f, rr, actions, ids)

    def _scatter(self, r: Transfer) -> None:
        """Staging -> KV buffer for one staged segment (runs on a post thread)."""
        t0 = time.perf_counter()
        dst, nbytes = r.runs
        self._kv.scatter(self.staging, dst, nbytes, r.slot)
        self.metrics.scatter_seconds_sum += time.perf_counter() - t0

    def _notify(self, agent: str, msg: bytes) -> None:
        try:
            self.transport.send_notif(agent, msg)
        except TransferError:
            self.metrics.failed_notifications += 1

    def _drain_replies(self) -> None:
        for peer in self.peers.active():
            for prank, sock in list(peer.socks.items()):
                if peer.disconnected(prank, _monitor_event) and prank not in peer.gone and prank in peer.agents:
                    self._peer_died(peer, prank, "its side-channel connection closed")
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except (zmq.Again, zmq.ZMQError):
                        break
                    try:
                        msg = unpack(frames)
                    except HandshakeError:
                        continue
                    if isinstance(msg, Acquired):
                        self._on_acquired(peer, prank, msg)
                    elif isinstance(msg, (Staged, StageError)):
                        self._on_stage_reply(peer, prank, msg)

    def _advance(self, f: InFlight, rr: RankRead, now: float) -> bool:
        """Drive one rank's read: NIXL states of its transfers and scatters become events (here, in one
        place), then a tick (retries, heartbeats, completion, deadlines). True if the request failed."""
        peer, prank = f.peer, rr.prefill
        try:
            for i, t in enumerate(rr.reads):
                if not t.done and self.transport.check(t.xfer) == "DONE":
                    peer.progress[prank] = now
                    self._apply(f, rr, rr.handle(XferDone(i), now))
                if t.scatter is not None and not t.scattered and t.scatter.done():
                    e = t.scatter.exception()
                    if e is not None:
                        return self._apply(f, rr, rr.handle(ScatterFailed(f"{type(e).__name__}: {e}"), now))
                    rr.handle(ScatterDone(i), now)
        except TransferError as e:
            # typed: the transport's PeerGoneError, or the side channel's ZMQ disconnect event (never text)
            if prank in peer.agents and (isinstance(e, PeerGoneError) or peer.disconnected(prank, _monitor_event)):
                self._peer_died(peer, prank, f"NIXL: {e}")
                return True
            return self._apply(f, rr, rr.handle(XferFailed(str(e)), now))
        except Exception as e:  # noqa: BLE001 - a scatter bug fails the request, not the engine
            return self._apply(f, rr, rr.handle(ScatterFailed(f"{type(e).__name__}: {e}"), now))
        if now < rr.wake_at:  # nothing can be due yet (the machine's own bound): skip the tick
            return False
        queued, latest = False, float("-inf")
        for t in rr.reads:
            if not t.done:
                posted = getattr(t.xfer, "posted_at", latest)  # set by the post thread when it posts
                if posted is None:
                    queued = True
                else:
                    latest = max(latest, posted)
        return self._apply(f, rr, rr.handle(Tick(peer.progress.get(prank, 0.0), queued, latest), now))

    def _complete(self, rid: str, f: InFlight) -> None:
        self._release_reads(f)
        del self.inflight[rid]
        now = time.monotonic()
        for prank, rr in f.ranks.items():  # staged reads carry no notification: tell the prefill now
            if rr.notify_at_end and rr.pinned:
                self._notify(f.peer.agents[prank], self._done(f.req, f.peer, prank))
            rr.handle(PinsReleased(), now)  # direct reads' Done rode on the read
        self.metrics.observe_transfer(time.perf_counter() - f.started)
        for rr in f.ranks.values():
            for t in rr.reads:
                if t.work is not None:
                    f.nbytes += t.work.total_bytes
                    f.ndescs += t.work.count
        self.metrics.transfer_bytes += f.nbytes
        self.metrics.descriptors += f.ndescs
        self.metrics.finished_requests += 1
        self.finished.append(rid)

    def _release_reads(self, f: InFlight) -> set:
        """Release a request's reads and staging slots without waiting (never blocks the loop).

        Returns the prefill ranks whose reads did not all complete. A read not yet posted is cancelled; one
        still in progress (or whose scatter runs) is parked with its slot until it settles, so a late
        write can never land in memory that was handed to someone else.
        """
        incomplete, parked = set(), []
        for prank, rr in f.ranks.items():
            if rr.state is not ReadState.DONE and (rr.reads or rr.state is ReadState.POSTED):
                incomplete.add(prank)
            for r in rr.reads:  # (unfinished direct reads were cancelled by their machine when it ended)
                state = self.transport.settle(r.xfer, 0)
                if state is None or (r.scatter is not None and not r.scatter.done()):
                    parked.append(r)
                    continue
                self.transport.release(r.xfer)
        slots = [(f.req.key, p) for p, rr in f.ranks.items() if rr.staging is not None]
        if parked:
            self._zombies.append((f.req.req_id, slots, parked))
        else:
            for key in slots:
                self.slots.free(key)
        return incomplete

    def _reap_zombies(self) -> None:
        for item in list(self._zombies):
            rid, slots, reads = item
            if all(self.transport.settle(r.xfer, 0) is not None and (r.scatter is None or r.scatter.done())
                   for r in reads):
                for r in reads:
                    self.transport.release(r.xfer)
                for key in slots:
                    self.slots.free(key)
                self._zombies.remove(item)

    def _count_failed(self, req: ReadRequest) -> None:
        """One failed request per read (key and attempt): an engine that starts the same read again after
        a failure (a retry) and fails again is counted in ``retried_failures``, not again."""
        k = (req.key, req.attempt if isinstance(req.attempt, int) else tuple(sorted(req.attempt.items())))
        if k in self._failed_keys:
            self.metrics.retried_failures += 1
            return
        self._failed_keys[k] = True
        while len(self._failed_keys) > 4096:
            self._failed_keys.popitem(last=False)
        self.metrics.failed_requests += 1

    def _fail(self, rid: str, f: InFlight, failure: ReadFailure, notify: bool = True) -> None:
        """Fail a request: cancel its other ranks' reads, release what has ended (park the rest), and
        tell every live prefill rank it notifies (Done, failed), so blocks and staging slots come back."""
        self._abort_ranks(f)
        incomplete = self._release_reads(f)
        self.inflight.pop(rid, None)
        self.failed[rid] = failure
        self.metrics.failed_transfers += max(1, len(incomplete))
        self._count_failed(f.req)
        if notify:
            self._notify_failed(f)

    def _abort_ranks(self, f: InFlight) -> None:
        now = time.monotonic()
        for rr in f.ranks.values():
            self._apply(f, rr, rr.handle(Abort(), now))  # (counts of cancelled reads only)

    def _notify_failed(self, f: InFlight) -> None:
        """Done(failed) to every prefill rank where this rank holds a pin for the read, whose agent is
        alive: it releases that pin (only the holder's Done can). Nothing is sent for a rank that refused
        the acquire or was never asked (it holds nothing of ours); a pin granted after this is released
        when its grant arrives (``_let_go``)."""
        peers, now = self.transport.peers, time.monotonic()
        for p, rr in f.ranks.items():
            agent = f.peer.agent(p)
            if (rr.pinned or rr.asked) and agent is not None and agent in peers:
                # asked, unanswered: a pin may exist already (the prefill ignores a release of none)
                self._notify(agent, self._done(f.req, f.peer, p, ok=False))
                if rr.asked:  # the answer may still come: keep draining replies a while to let it go
                    self._linger_until = max(self._linger_until, time.monotonic() + self.stage_timeout_s)
                else:
                    self._released[(f.req.key, p, f.req.attempt_for(p))] = True
            rr.handle(PinsReleased(), now)

    def wait(self, timeout_s: float = 60.0, sleep_s: float = 1e-4) -> tuple[list[str], dict[str, ReadFailure]]:
        """Poll until nothing is in flight or waiting for a handshake (or timeout); returns everything
        finished/failed meanwhile."""
        done, failed = [], {}
        deadline = time.monotonic() + timeout_s
        while True:
            d, f = self.poll()
            done += d
            failed |= f
            if not (self.inflight or self.peers.connecting()) or time.monotonic() > deadline:
                return done, failed
            time.sleep(sleep_s)

    def stats(self) -> dict:
        return {"metrics": self.metrics.to_json(), "inflight": len(self.inflight),
                "live_handles": self.transport.live_handles(), "peers": len(self.transport.peers),
                "remotes": sorted(self.remotes), "parked_reads": sum(len(z[2]) for z in self._zombies),
                "retired_engines": len(self.peers.old),
                "staging_used": self.slots.bytes_used,
                "nixl": vars(self.transport.stats).copy() if hasattr(self.transport, "stats") else {}}

    def close(self) -> None:
        for eid, peer in list(self.peers.current.items()):
            if peer.live:
                self.forget(eid, "decode rank closing")
            else:  # a background handshake: let it end (bounded), then release what it made
                self.peers.abandon(peer)
        self.peers.wait_abandoned()
        self._reap(engine_id=None)
        for peer in self.peers.old:
            self._drop_reads(peer, "decode rank closing")
        self.peers.close_old()
        self.transport.close()

    # ---- benchmarks: timed direct and staged reads (appended) ----------------------------------
    def timed_read(self, req: ReadRequest, timeout_s: float = 120.0) -> dict:
        """Post ``req`` and wait for it here (no RPC in the timing); returns seconds, bytes, descriptors."""
        t0 = time.perf_counter()
        self.start(req)
        f = self.inflight.get(req.key)
        # poll every 0.2 ms, like an engine loop between steps: a tighter loop steals a core from the
        # copies on a small machine (reads and scatters run on the post threads, packs in the prefill)
        done, failed = self.wait(timeout_s, sleep_s=2e-4)
        if req.req_id in failed or req.req_id not in done:
            raise TransferError(f"request {req.req_id} failed: {failed.get(req.req_id, 'timeout')}")
        dt = time.perf_counter() - t0
        nbytes, ndescs = (f.nbytes, f.ndescs) if f else (0, 0)  # counted at completion
        return {"seconds": dt, "bytes": nbytes, "descriptors": ndescs}

    def set_transfer_mode(self, mode: str) -> None:
        """Force direct/staged/auto for later handshakes (forgets cached engines so they re-handshake)."""
        if mode not in ("auto", "direct", "staged"):
            raise ValueError(f"transfer_mode must be auto, direct or staged, not {mode!r}")
        if mode != "direct" and not self.staging_bytes:
            raise ValueError("this decode rank was created without a staging buffer (transfer_mode='direct')")
        self.transfer_mode = mode
        for eid in list(self.remotes):
            self.forget(eid)

    def runs_digest(self, req: ReadRequest) -> str:
        """sha256 of the request's destination runs in this rank's buffer (to compare direct and staged)."""
        import hashlib
        descs = self.remotes[req.engine_id].lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks)
        h = hashlib.sha256()
        for d in descs:
            out = self._kv.new_staging(d.total_bytes)
            self._kv.pack(d.dst, d.nbytes, out, 0)
            h.update(to_host(out).tobytes())
        return h.hexdigest()

    def clear(self, value: int = 0xA5) -> None:
        """Benchmarks/tests: set every byte of the KV memory to ``value``."""
        if self._kv.torch is not None:  # torch memory (CPU or CUDA): one byte tensor per allocation
            for b in self._kv.bufs:
                b.fill_(value)
            return
        for a in self.mem.allocations:
            host_view(a.addr, a.nbytes).fill(value)


def _monitor_event(mon) -> int | None:
    """The next event on a ZMQ monitor socket, or None when there is none."""
    try:
        return int(recv_monitor_message(mon, zmq.NOBLOCK)["event"])
    except (zmq.Again, zmq.ZMQError):
        return None


def lower_one(lowered, req: ReadRequest, prank: Rank):
    """The lowered descriptors of ``req`` for one prefill rank (a staged rank's work item)."""
    (d,) = lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks, only=(prank,))
    return d


def _device_of(remote: Peer, prank: Rank) -> str:
    """The device of a prefill rank's KV memory and staging buffer ("cpu" or "cuda:N"), from its handshake."""
    return getattr(remote.lowered.p_mem(prank), "device", "cpu")
