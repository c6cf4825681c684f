"""A decode rank: handshakes with prefill engines, reads requests' KV, reports finished/failed ids.

The public facade of the decode side (:class:`DecodeRank`), composing two objects with explicit
interfaces. Its parts:

* ``peer.py``: one :class:`~kvbridge.runtime.peer.Peer` per prefill engine owns what its handshake made
  (agents, prepared lists, sockets, outbox), with a lifecycle table of its own;
* ``peers.py``: :class:`~kvbridge.runtime.peers.PeerTable`, the peers by engine id and the steps of
  their lifecycle (connect in the background, install, abandon, mark lost, reap); it never touches a read
  and returns typed results (``Ready``/``Unreachable``) for the reads that waited;
* ``handshake.py``: the handshake (metadata, checks, plan, agents, prepared lists);
* ``readstate.py`` / ``readmachine.py``: each (request, prefill rank) read is a sans-IO
  :class:`~kvbridge.runtime.readmachine.RankRead` that owns its state (``handle(event, now) -> actions``);
* ``readloop.py``: :class:`~kvbridge.runtime.readloop.ReadLoop`, the reads in flight and the read
  loop, which turns ZMQ frames and NIXL states into the read machines' events and runs the actions
  they return; a restart or a dead prefill rank it sees is handed back here through callbacks;
* ``request.py``: :class:`ReadRequest` and the read in flight;
* this module: the public API, and what needs both halves: a read of a connecting engine queued on its
  peer, a read re-queued behind a re-handshake after its engine restarted or disconnected, an engine
  forgotten or dead (its reads fail, its peer goes).

Per request the hot path is one validation (or
lowering) per prefill rank, one side-channel round trip (a batched ``Acquire`` that pins the lease for
direct reads, or the ``Stage`` request itself) and one posted READ, off this thread; failures are typed
(:class:`~kvbridge.errors.ReadFailure`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import zmq

from ..cost import CostModel
from ..errors import (
    Aborted,
    HandshakeError,
    HandshakeFailed,
    IncompatibleLayoutsError,
    KVBridgeError,
    PeerDisconnected,
    ReadFailure,
    RequestError,
)
from ..layout import EngineLayout, engine_to_dict
from ..memory import KVMemory
from ..modes import AUTO, TransferMode, TransferPath, parse_mode
from ..plan import Rank
from ..transport.base import Transport
from ..transport.delayed import wrap_from_env
from ..transport.nixl import NixlTransport
from .config import DecodeConfig
from .handshake import Handshaker, RemoteEngine, fetch_meta
from .memhost import KVBytes, check_memory, register_memory, staging_nbytes, transport_device
from .metrics import Metrics
from .paths import new_host_buffer
from .peer import Peer, PeerEvent, PeerState
from .peers import REHANDSHAKE, PeerTable, Ready
from .probe import Prober
from .readloop import ReadLoop, queue_read
from .request import InFlight, ReadRequest
from .slots import SlotAllocator

# the longest sleep of wait() while a background handshake runs / while messages wait for ZMQ to take them
CONNECTING_POLL_S = 0.002
UNSENT_POLL_S = 0.001

__all__ = ["DecodeRank", "ReadRequest", "RemoteEngine", "Peer", "PeerState", "fetch_meta"]

log = logging.getLogger(__name__)


def _closed(*_args: Any) -> Any:
    raise RuntimeError("this decode rank is closed")


class DecodeRank:
    """Decode side of one rank: reads requests' KV from prefill engines into the engine's KV memory
    (``memory``, a :class:`KVMemory` describing tensors the engine allocated)."""

    def __init__(self, engine: EngineLayout, rank: Rank, engine_id: str, memory: KVMemory | None = None,
                 transport: Transport | None = None, config: DecodeConfig | None = None,
                 cost_model: CostModel | None = None, **options: Any) -> None:
        """``config``: the rank's options (:class:`~kvbridge.runtime.config.DecodeConfig`; keyword
        ``options`` replace its fields, e.g. ``transfer_mode="staged"``); ``transport``: a transport over
        this rank's memory (default: a NIXL agent); ``cost_model``: picks a path per read in ``auto`` mode
        (default: the measured one, :meth:`~kvbridge.cost.CostModel.load`)."""
        cfg = self.config = DecodeConfig.resolve(config, options)
        transfer_mode: TransferMode = cfg.transfer_mode
        self.engine, self.rank, self.engine_id = engine, (rank[0], rank[1]), engine_id
        self.mem = check_memory(memory, engine, rank)
        self.transport = wrap_from_env(transport or NixlTransport(f"{engine_id}-d{rank[0]}t{rank[1]}",
                                                                  post_threads=cfg.post_threads,
                                                                  inline_post_bytes=cfg.inline_post_bytes,
                                                                  **transport_device(self.mem)))
        register_memory(self.transport, self.mem)
        # staged reads scatter on the KV memory's own device (torch ops for torch tensors, CPU or CUDA)
        self._kv = KVBytes(self.mem)
        if not self._kv.usable and transfer_mode != TransferPath.DIRECT:
            log.warning("decode rank %s: KV memory on %s given by address and torch is not loaded: no staged "
                        "reads (direct only); describe the memory with torch tensors to stage on the device",
                        self.rank, self.mem.device)
            transfer_mode = TransferPath.DIRECT
        self.transfer_mode = transfer_mode
        self._requeued: set[str] = set()  # read keys already re-queued once after a restart
        # re-queued reads waiting for their earlier attempt's READ to settle: (request, engine id, until)
        self._held: list[tuple[ReadRequest, str, float]] = []
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.metrics = Metrics()
        self.handshake_timeout_s = cfg.handshake_timeout_s
        # the prefill peers and their lifecycle; a background handshake is bounded as a whole by
        # connect_timeout_s (default: 2 x handshake_timeout_s + 5 s); reads re-queued after their engine
        # restarted or disconnected wait at most rehandshake_timeout_s for it; peers unused for peer_idle_s
        # (or past max_peers) are released and handshaken again on their next read
        self.peers = PeerTable(self.ctx, self.transport, self.metrics, self._handshaker, engine_id,
                               cfg.connect_bound_s, cfg.rehandshake_timeout_s, cfg.peer_idle_s, cfg.max_peers)
        wake_fd = getattr(self.transport, "wake_fd", None)
        if wake_fd is not None:  # a post or a scatter ending wakes wait() beside the side channels
            self.peers.poller.add_fd(wake_fd)
        self.cost_model = cost_model or CostModel.load()
        # the staging buffer lives on the KV memory's device (registered as VRAM there when on a GPU)
        self.staging = self._kv.new_staging(cfg.staging_bytes if transfer_mode != TransferPath.DIRECT else 0)
        self.staging_bytes = staging_nbytes(self.staging)
        self.staging_addr = self.transport.register(self.staging) if self.staging_bytes else 0
        # host staging mirrors the staging buffer's slots (the host-staged path: READ host -> host, then
        # host -> device and scatter); pinned on a CUDA rank
        self.host_staging = new_host_buffer(self._kv, self.staging_bytes)
        self.host_staging_addr = self.transport.register(self.host_staging) if self.staging_bytes else 0
        # measures each link at handshake (off the engine's step); its probe buffers are allocated and the
        # local copies timed now, with the staging buffers
        self.prober = Prober(self.transport, self._kv, self.cost_model, cfg.probe_ms, cfg.probe_bytes,
                             metrics=self.metrics)
        self.prober.prepare()
        self.slots = SlotAllocator(self.staging_bytes)
        # the reads in flight and their I/O; an acquire/stage request that finds no lease yet ("not
        # registered": the prefill engine registers a request when its step ends, the router may be
        # faster) is asked again for register_grace_s
        self.reads = ReadLoop(
            engine_id=engine_id, rank=self.rank, transport=self.transport, metrics=self.metrics, kv=self._kv,
            staging=self.staging, staging_addr=self.staging_addr, slots=self.slots,
            layout_dict=engine_to_dict(engine), mem_wire=self.mem.to_wire(),
            stage_segment_bytes=cfg.stage_segment_bytes, stage_timeout_s=cfg.stage_timeout_s,
            transfer_timeout_s=cfg.transfer_timeout_s, register_grace_s=cfg.register_grace_s,
            restarted=self._requeue_restarted, mark_lost=self.peers.mark_lost, died=self._peer_died,
            host_staging=self.host_staging, host_staging_addr=self.host_staging_addr,
            staging_device=str(getattr(self._kv, "device", "cpu")), optimistic=cfg.optimistic_reads,
            tag_checks=cfg.tag_checks)

    # ---- the read loop's state and settings (readloop.py) -----------------------------------------
    @property
    def inflight(self) -> dict[str, InFlight]:
        """{read key: the read in flight}."""
        return self.reads.inflight

    @property
    def finished(self) -> list[str]:
        return self.reads.finished

    @property
    def failed(self) -> dict[str, ReadFailure]:
        return self.reads.failed

    @property
    def stage_timeout_s(self) -> float:
        return self.reads.stage_timeout_s

    @property
    def transfer_timeout_s(self) -> float:
        return self.reads.transfer_timeout_s

    @property
    def register_grace_s(self) -> float:
        return self.reads.register_grace_s

    @property
    def stage_segment_bytes(self) -> int:
        return self.reads.stage_segment_bytes

    # ---- peers: handshake, background connect, lifecycle (the table: peers.py) -----------------------
    @property
    def remotes(self) -> dict[str, Peer]:
        """{engine id: live :class:`~kvbridge.runtime.peer.Peer`} (each owns its handshake's result)."""
        return self.peers.remotes

    @property
    def connect_timeout_s(self) -> float:
        return self.peers.connect_timeout_s

    @property
    def rehandshake_timeout_s(self) -> float:
        return self.peers.rehandshake_timeout_s

    def _handshaker(self) -> Handshaker:
        return Handshaker(self.ctx, self.transport, self.engine, self.rank, self.mem, self.engine_id,
                          self.handshake_timeout_s, self.staging_bytes, self.transfer_mode, self.cost_model,
                          prober=self.prober if self.prober.enabled else None,
                          host_staging_bytes=staging_nbytes(self.host_staging),
                          push=bool(self.staging_bytes) and self.transfer_mode != TransferPath.DIRECT)

    def handshake(self, engine_id: str, endpoints: dict[Rank, str]) -> Peer:
        """Contact the prefill engine's ranks this rank needs, on this thread; cached per engine id."""
        endpoints = {(k[0], k[1]): v for k, v in endpoints.items()}
        self.peers.endpoints[engine_id] = endpoints
        cur = self.peers.get(engine_id)
        # still the same engine? (same endpoints and the same NIXL agent behind every rank)
        if cur is not None and cur.live and cur.remote is not None and cur.endpoints == endpoints and \
                self._handshaker().same_agents(cur.remote, endpoints):
            return cur
        pending = self.peers.replace(engine_id, "the prefill engine was forgotten (re-handshake)", self.forget,
                                     self._in_use, self._drop_reads)
        try:
            remote, prepped = self._handshaker().run(engine_id, endpoints)
        except (HandshakeError, IncompatibleLayoutsError):
            self.metrics.failed_handshakes += 1
            raise
        peer = Peer(engine_id, endpoints, started=time.monotonic(), pending=pending)
        self._start_queued(peer, self.peers.install(peer, remote, prepped))
        return peer

    def _start_queued(self, peer: Peer, pending: list[ReadRequest]) -> None:
        """Start the reads that waited for ``peer``'s handshake. One whose earlier attempt's READ (an
        optimistic one, withdrawn by a restart) may still write its blocks waits until that READ settled
        (:meth:`_start_held`), at most ``connect_timeout_s``."""
        for req in pending:
            if self._unsettled(req.req_id):
                self._held.append((req, peer.engine_id, time.monotonic() + self.peers.connect_timeout_s))
                continue
            self._start_one(req, peer.engine_id)

    def _start_one(self, req: ReadRequest, engine_id: str) -> None:
        try:
            self.start(req)
        except KVBridgeError as e:
            self.reads.fail_queued(req, HandshakeFailed(str(e), req_id=req.req_id, engine_id=engine_id))

    def _unsettled(self, req_id: str) -> bool:
        """A READ of request ``req_id`` that ended unfinished is still parked (it may still write)."""
        return any(z[0] == req_id for z in self.reads.zombies)

    def _start_held(self, now: float) -> None:
        """Start the held reads whose earlier READs have settled; fail those held past their bound."""
        held, self._held = self._held, []
        for req, engine_id, until in held:
            if not self._unsettled(req.req_id):
                self._start_one(req, engine_id)
            elif now > until:
                self.reads.fail_queued(req, PeerDisconnected(
                    f"request {req.req_id!r}: its READ from the restarted prefill engine {engine_id!r} did not "
                    f"settle within connect_timeout_s={self.peers.connect_timeout_s:g} s, so it is not read "
                    "again into the same blocks", req_id=req.req_id, engine_id=engine_id))
            else:
                self._held.append((req, engine_id, until))

    def connect(self, engine_id: str, endpoints: dict[Rank, str]) -> None:
        """Make sure prefill engine ``engine_id`` is (or becomes) live, without blocking: returns at once.

        Live with the same endpoints: nothing to do. Otherwise the handshake (metadata fetch from each
        prefill rank this rank needs, NIXL ``add_remote_agent``, prepared lists) runs on a background
        thread, bounded as a whole by ``connect_timeout_s``; :meth:`start` queues reads of a connecting
        engine and :meth:`poll` starts them once it is live, or fails them (:class:`HandshakeFailed`)
        if the handshake fails or runs past the bound. Idempotent: call it before every :meth:`start`
        (vLLM: when the scheduler first sees the request)."""
        endpoints = {(k[0], k[1]): v for k, v in endpoints.items()}
        self.peers.endpoints[engine_id] = endpoints
        cur = self.peers.get(engine_id)
        if cur is not None and cur.endpoints == endpoints:
            return  # live, or connecting to the same endpoints
        self._connect(engine_id, endpoints, why="the prefill engine's endpoints changed (connect)")

    def _connect(self, engine_id: str, endpoints: dict[Rank, str], why: str = REHANDSHAKE) -> Peer:
        return self.peers.reconnect(engine_id, endpoints, why, self.forget, self._in_use, self._drop_reads)

    def _advance_peers(self, now: float) -> None:
        """Install engines whose background handshake finished and start their queued reads; fail the
        queued reads of a handshake that failed or ran past its bound (``connect_timeout_s``)."""
        for r in self.peers.advance(now):
            if isinstance(r, Ready):
                self._start_queued(r.peer, r.pending)
                continue
            for req, failure in r.failures:
                self.reads.fail_queued(req, failure)

    def _can_requeue(self, f: InFlight) -> bool:
        return all(rr.holds_nothing for rr in f.ranks.values()) and f.req.key not in self._requeued

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
        cur = self.peers.get(old.engine_id)
        connecting = cur is not None and cur.connecting
        group = [f]
        if not connecting:
            group += [g for g in self.inflight.values() if g.peer is old and g is not f and self._can_requeue(g)]
        for g in group:
            self.reads.withdraw(g)
            self._requeued.add(g.req.key)
        if len(self._requeued) > 4096:
            self._requeued.clear()
        if not connecting:  # the old engine's reads that hold something: failed (the old peer is lost)
            text = f"{why}; its reads in progress cannot continue"
            self.reads.fail_all(lambda g: g.peer is old,
                                lambda _rid, g: self.reads.failure(PeerDisconnected, g, None, text))
        # where they wait (the engine id's connecting peer, or a new one) is the table's policy
        self.peers.requeue(old, [g.req for g in group], event, why, self.forget, self._in_use, self._drop_reads)

    def forget(self, engine_id: str, reason: str = "the prefill engine was forgotten (re-handshake)",
               dead: bool = False) -> None:
        """Drop a remote engine (dead or gone): fail its requests in flight, close its peer (agents,
        sockets, prepared lists); a later handshake starts fresh."""
        cls = PeerDisconnected if dead else Aborted
        self.reads.fail_all(lambda f: f.peer.engine_id == engine_id,
                            lambda rid, _f: cls(f"request {rid!r}: {reason}", req_id=rid, engine_id=engine_id),
                            notify=not dead)
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
                    else:  # (fails f, always: ReadLoop.disconnect)
                        self.reads.disconnect(f, rr, f"disconnected: prefill agent {agent!r} went away ({detail})")
                    break
        self.peers.mark_lost(peer, PeerEvent.DISCONNECTED)
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

    def _drop_reads(self, peer: Peer, why: str = REHANDSHAKE) -> None:
        self.reads.fail_all(lambda f: f.peer is peer, lambda _rid, f: self.reads.failure(Aborted, f, None, why),
                            notify=False)

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
        if peer is None and req.engine_id in self.peers.evicted:  # released idle: handshaken again
            peer = self._connect(req.engine_id, self.peers.endpoints[req.engine_id])
        if peer is None or not peer.live:
            if peer is not None and peer.connecting:  # started once the engine is live
                if not peer.queue_pending(req):
                    raise RequestError(f"read {key!r} is already queued on decode rank {self.rank}")
                return
            raise HandshakeError(f"no handshake with prefill engine {req.engine_id!r} yet; call connect() or "
                                 "handshake() first")
        t0 = time.perf_counter()
        modes = self._request_modes(peer, req) if self.transfer_mode == AUTO else peer.modes
        self.reads.start(peer, req, modes, t0)

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
                    queue_read(peer.heartbeats, peer, prank, req)
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
        self.reads.decline(peer, req)

    def _request_modes(self, remote: Peer, req: ReadRequest) -> dict[Rank, TransferPath]:
        """Auto mode, per request: runs merge across consecutive block ids, so a request whose blocks are
        mostly consecutive (on both sides) may be cheaper direct than the handshake-time choice says."""
        from ..cost import request_chunks, request_modes
        chunks, frac = request_chunks(remote.layout.model.groups, req.decode_blocks, req.prefill_blocks,
                                      self.engine.block_size_of, remote.lowered.chunk_tokens)
        shapes = {p: remote.shapes.get(p) for p in remote.modes}
        links = getattr(remote.remote, "links", None) or {}
        staged = request_modes(self.cost_model, {p: s for p, s in shapes.items() if s is not None}, chunks, frac,
                               lambda p: p in remote.can_stage, links)
        return {p: staged.get(p, TransferPath.DIRECT) for p in remote.modes}

    def abort(self, req_id: str, engine_id: str | None = None, readers_of: ReadRequest | None = None) -> None:
        """Abort a request: tell its prefill ranks to free the blocks (never waits for a read).

        In flight (``req_id``: the read's key, :attr:`ReadRequest.key`): its reads are cancelled (one
        still in progress is parked with its memory until it ends) and every pin this rank holds for it
        is released. Not started (``readers_of`` given): as :meth:`release` (a decline to every prefill
        rank this rank notifies; the lease is freed only if no other reader holds a pin).
        """
        if self.reads.abort(req_id):
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
        """Something needs polling: reads in flight, parked reads, retired engines, unsent messages, lease-tag
        checks in flight, answers awaited. Poll an idle rank too, about once a second (as :class:`DecodeDriver`
        and an engine's step do): a late answer, e.g. a prefill that was frozen granting a read that failed
        meanwhile, or the grant of a read completed on its lease's tag, is let go then instead of pinning that
        prefill's blocks until its pin bound."""
        return bool(self.inflight or self._held or self.reads.zombies or self.reads.push_holds or self.peers.old
                    or self.peers.connecting() or self.peers.sending() or self.reads.checks
                    or self.reads.awaiting or time.monotonic() < self.reads.linger_until)

    def poll(self) -> tuple[list[str], dict[str, ReadFailure]]:
        """Advance in-flight requests; return (finished ids, {failed id: typed failure}) since the last call.

        Costs the work there is, not the number of peers: it drains only the side channels the poller
        finds readable (or that were sent on), sends only for peers with something queued, and looks only
        at the reads in flight and the handshakes running (idle peers are looked at about once a second,
        for eviction); ``peers.work`` counts what it visited."""
        self.peers.work.polls += 1
        self.flush()
        self.reads.drain(self.peers.poller.ready())
        now = time.monotonic()
        self._advance_peers(now)
        self.reads.advance(now)
        if self._held:
            self._start_held(now)
        self._reap()
        self.flush()  # retries and heartbeats scheduled above
        return self.reads.take()

    def flush(self) -> None:
        """Send the batched acquire requests and heartbeats (one message per prefill rank) and retry the
        messages ZMQ could not take, of the peers that have some."""
        self.reads.flush(self.peers.take_todo())

    def wait(self, timeout_s: float = 60.0, sleep_s: float | None = None,
             first: bool = False) -> tuple[list[str], dict[str, ReadFailure]]:
        """Poll until nothing is in flight or waiting for a handshake (or timeout; with ``first``, until
        at least one read finished or failed); returns everything finished/failed meanwhile.

        Between polls it sleeps on the events themselves: a side-channel reply (ZMQ), the side channel's
        connection closing, a post or a staged scatter ending (the transport's wake-up fd), and otherwise
        only until the earliest deadline of a read in flight (a retry, a heartbeat, a timeout).
        ``sleep_s``: the longest sleep between polls (default: no bound but those)."""
        done: list[str] = []
        failed: dict[str, ReadFailure] = {}
        deadline = time.monotonic() + timeout_s
        clear = getattr(self.transport, "clear_wake", None)
        while True:
            if clear is not None:
                clear()  # before looking: a post that ends from here on makes the fd readable again
            d, f = self.poll()
            done += d
            failed |= f
            now = time.monotonic()
            if not (self.inflight or self._held or self.reads.held_failures or self.peers.connecting()) or \
                    now > deadline or \
                    (first and (done or failed)):
                return done, failed
            pause = min(deadline - now, self.next_wake(now))
            self._block(pause if sleep_s is None else min(pause, sleep_s))

    def next_wake(self, now: float) -> float:
        """Seconds until the read loop may have something to do with no event (see :meth:`wait`)."""
        pause = self.reads.next_wake(now, getattr(self.transport, "wake_fd", None) is not None)
        if self.peers.connecting():
            pause = min(pause, CONNECTING_POLL_S)  # a background handshake ends on its own thread
        if self.peers.sending(heartbeats=False):
            pause = min(pause, UNSENT_POLL_S)  # ZMQ could not take a message: try again soon
        return pause

    def _block(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s`` or until a side-channel socket, its monitor or the transport's
        wake-up fd is readable."""
        if timeout_s <= 0 or self.peers.poller.pending():  # a reply no descriptor announces: poll now
            return
        self.peers.poller.wait(timeout_s)  # the one poller: every side channel, its monitor, the wake-up fd

    def stats(self) -> dict[str, Any]:
        return {"metrics": self.metrics.to_json(), "inflight": len(self.inflight),
                "live_handles": self.transport.live_handles(), "peers": len(self.transport.peers),
                "remotes": sorted(self.remotes), "parked_reads": sum(len(z[2]) for z in self.reads.zombies),
                "held_failures": len(self.reads.held_failures), "held_requeues": len(self._held),
                "held_push_slots": len(self.reads.push_holds),
                "retired_engines": len(self.peers.old),
                "staging_used": self.slots.bytes_used, "links": self.links(),
                "nixl": vars(self.transport.stats).copy() if hasattr(self.transport, "stats") else {}}

    def links(self) -> dict[str, Any]:
        """Per prefill engine and rank: the path chosen at handshake and each path's measured GB/s, µs per
        descriptor and moving correction (``cost.LinkFigures.to_json``)."""
        out: dict[str, Any] = {}
        for eid, peer in self.remotes.items():
            remote = peer.remote
            if remote is None:
                continue
            for p, link in (getattr(remote, "links", None) or {}).items():
                out.setdefault(eid, {})[str(tuple(p))] = {"chosen": remote.modes.get(p, TransferPath.DIRECT).value,
                                                          **link.to_json()}
        return out

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
        self.reads.drain_checks()
        self.transport.close()
        # its tables hold this rank's bound methods (reference cycles): cut, so that the rank and its NIXL
        # agent go when their owner drops them, not inside a later garbage collection on whatever thread
        # triggers it (an engine's step: a 14 ms collection seen, the agent's teardown)
        self.peers.handshaker = _closed
        self.reads.restarted = self.reads.died = _closed

    def set_transfer_mode(self, mode: str) -> None:
        """Force direct/staged/auto for later handshakes (forgets cached engines so they re-handshake)."""
        mode = parse_mode(mode)
        if mode != TransferPath.DIRECT and not self.staging_bytes:
            raise ValueError("this decode rank was created without a staging buffer (transfer_mode='direct')")
        self.transfer_mode = mode
        for eid in list(self.remotes):
            self.forget(eid)
