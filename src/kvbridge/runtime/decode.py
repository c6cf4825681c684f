"""A decode rank: handshakes with prefill engines, reads requests' KV, reports finished/failed ids.

One :class:`RemoteEngine` per prefill engine holds everything learned at handshake (layout, plan,
lowered plan, agent names): no parallel per-engine dicts. Per request the hot path is
``LoweredPlan.descriptors`` (vectorised), one side-channel round trip per prefill rank (a batched
``Acquire`` that pins the lease for direct reads, or the ``Stage`` request itself) and one posted READ
per prefill rank, off this thread. Each (request, prefill rank) read is a :class:`ReadMachine`
(``readstate.py``) with its own deadline; failures are typed (:class:`~kvbridge.errors.ReadFailure`).
"""
from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import zmq

from ..errors import (
    Aborted,
    HandshakeError,
    HandshakeFailed,
    IncompatibleLayoutsError,
    KVBridgeError,
    LayoutError,
    LeaseExpired,
    NotRegistered,
    PeerDisconnected,
    PeerGoneError,
    PeerRestarted,
    ReadFailure,
    RemoteError,
    RequestError,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from ..layout import EngineLayout, engine_from_dict, engine_to_dict
from ..lower import GroupBlocks, LoweredPlan
from ..memory import KVMemory
from ..plan import Rank, TransferPlan, plan_transfer
from ..tensors import host_view
from ..transport.nixl import NixlTransport
from . import prepped_hook as _prepped_hook
from .memhost import KVBytes, check_memory, register_memory, staging_nbytes, to_host, transport_device
from .metrics import Metrics
from .protocol import (
    STAGE_SEGMENT_BYTES,
    Acquire,
    Acquired,
    Done,
    ErrorReply,
    GetMeta,
    RankMeta,
    Stage,
    Staged,
    StageError,
    blocks_to_wire,
    encode_notif,
    pack,
    unpack,
)
from .readstate import AWAITING_REPLY, ReadEvent, ReadMachine, ReadState
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
    stage_socks: dict     # prefill rank -> DEALER socket (acquire and stage requests) of each rank read
    shapes: dict          # prefill rank -> cost.PairShape (auto mode re-decides per request from it)
    digests: dict = field(default_factory=dict)  # prefill rank -> sha256 of its NIXL metadata (restart check)
    can_stage: frozenset = frozenset()           # prefill ranks that can stage (stage_socks: every rank read)


    def summary(self) -> dict:
        """Plain-data view (what a handshake RPC returns)."""
        return {"engine_id": self.engine_id, "prefill": str(self.layout),
                "modes": {str(p): m for p, m in self.modes.items()}, "agents": {str(p): a for p, a in self.agents.items()}}



@dataclass(frozen=True)
class ReadRequest:
    """What the decode side knows of a request (vLLM's kv_transfer_params).

    ``attempt``: the lease's attempt id that ``PrefillRank.add_request`` returned (the same on every
    prefill rank when the engine passes one; or a mapping prefill rank -> attempt). The decode never
    sees a lease time: the prefill alone decides, on its own clock, whether the attempt is still live.
    ``read_id``: see :attr:`key`.
    """

    req_id: str
    engine_id: str
    num_tokens: int
    prefill_blocks: dict[str, GroupBlocks]
    decode_blocks: dict[str, GroupBlocks]
    attempt: int | dict = 0
    read_id: str = ""

    @property
    def key(self) -> str:
        """This read's id on the decode side and the prefill's pin: ``read_id`` (the decode engine's own
        request id, the same on all of its ranks), or ``req_id`` when none is given. Several reads of one
        prefill request (vLLM ``n > 1``, retries, hedges) need distinct read ids; :meth:`DecodeRank.poll`,
        :meth:`~DecodeRank.abort` and :meth:`~DecodeRank.release` name a read by this key."""
        return self.read_id or self.req_id

    def attempt_for(self, prefill_rank: Rank) -> int:
        a = self.attempt
        if isinstance(a, dict):
            return int(a.get(tuple(prefill_rank), 0))
        return int(a or 0)


class PeerState(enum.Enum):
    """Lifecycle of a prefill engine on this decode rank: CONNECTING (background handshake) -> LIVE (in
    ``remotes``) -> LOST (handshake failed or ran past its bound) / RETIRED (dead, restarted, forgotten)."""

    CONNECTING = "connecting"
    LIVE = "live"
    LOST = "lost"
    RETIRED = "retired"


@dataclass
class _Peer:
    """A prefill engine being connected in the background, with the reads waiting for it."""

    engine_id: str
    endpoints: dict
    state: PeerState
    future: Future
    started: float
    pending: list = field(default_factory=list)  # ReadRequests started while connecting
    why: str = ""  # set when reads were re-queued behind this handshake (a restart or disconnect)
    bound_s: float = 0.0  # the handshake fails its reads if not live this long after ``started``
    phase: list = field(default_factory=lambda: ["queued"])  # what the handshake thread is doing (its last step)


class _ReadCancelled(Exception):
    """Raised on the post thread for a read that was cancelled before NIXL saw it."""


class _Cancellable:
    """A lowered :class:`~kvbridge.lower.Descriptors` handed to the post thread; once ``cancelled`` its
    NIXL arrays are never written, so a read queued behind others to a dead peer is never posted."""

    __slots__ = ("d", "cancelled", "prefill")

    def __init__(self, d):
        self.d, self.cancelled, self.prefill = d, False, d.prefill

    # read through, not copied: a prepped read's sizes are worked out on the post thread (PreppedWork.size)
    @property
    def count(self) -> int:
        return self.d.count

    @property
    def total_bytes(self) -> int:
        return self.d.total_bytes

    def nixl_arrays(self, *args):
        if self.cancelled:
            raise _ReadCancelled("read cancelled before it was posted")
        return self.d.nixl_arrays(*args)


@dataclass
class _Read:
    """One posted READ of a request from one prefill rank (staged: into ``slot`` of our staging buffer)."""

    prefill: Rank
    xfer: object
    nbytes: int | None         # None: a direct read sized at completion (work)
    slot: int | None = None    # staged: our staging offset of the segment
    runs: tuple | None = None  # staged: (dst, nbytes) of the runs this segment scatters to
    scatter: object = None     # Future of the scatter from staging into the KV buffer
    cancel: _Cancellable | None = None
    done: bool = False         # the transfer completed (seen by poll)
    work: object = None        # direct: what was posted (its sizes, once known, count at completion)


@dataclass
class _Staging:
    """A staged prefill rank of one request: our staging slot and the runs the packed stream feeds."""

    slot: int
    dst: np.ndarray      # run destinations (absolute), in packed order
    nbytes: np.ndarray
    starts: np.ndarray   # offset of each run in the packed stream


@dataclass
class _RankRead:
    """The read of one request from one prefill rank: its state machine, deadlines (this process's
    monotonic clock) and transfers."""

    prefill: Rank
    sm: ReadMachine
    sent_at: float                 # when the acquire/stage request was made: the pin counts from here
    progress_at: float             # last progress from this rank (its own deadline re-arms only on it)
    descs: object = None           # direct: lowered descriptors, posted once the pin is granted
    pin_deadline: float = float("inf")
    reads: list = field(default_factory=list)
    staging: _Staging | None = None
    notify_at_end: bool = False    # no read carries this rank's Done: send it when the request completes
    pinned: bool = False           # the prefill granted this rank's pin (only then is a Done sent for it)
    asked: bool = False            # an acquire/stage request is out, unanswered (a pin may exist by now)
    first_sent: float = 0.0        # the first acquire/stage request (not-registered retries count from here)
    retry_at: float | None = None  # not registered yet: ask again at this time
    stage_msg: object = None       # staged: the Stage request (re-sent on a not-registered refusal)
    refresh_at: float = float("inf")  # pinned: send a heartbeat (re-arms the pin) at this time
    refresh_sent: float = 0.0      # when the last heartbeat went out (its answer counts from here)

    @property
    def state(self) -> ReadState:
        return self.sm.state


@dataclass
class _InFlight:
    req: ReadRequest
    remote: RemoteEngine
    ranks: dict          # prefill rank -> _RankRead
    started: float
    nbytes: int = 0
    ndescs: int = 0
    stage_sent: float = 0.0

    @property
    def xfers(self) -> list:
        return [r.xfer for rr in self.ranks.values() for r in rr.reads]


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
        # background handshakes (connect): engine id -> _Peer while connecting; the whole handshake is
        # bounded by connect_timeout_s (default: 2 x handshake_timeout_s + 5 s)
        self._peers: dict[str, _Peer] = {}
        self._endpoints: dict[str, dict] = {}  # engine id -> the endpoints last given (re-handshake on restart)
        self._hs_pool = None
        self._abandoned: list = []
        self._requeued: set = set()  # read keys already re-queued once after a restart
        self.connect_timeout_s = float(connect_timeout_s if connect_timeout_s is not None
                                       else 2 * handshake_timeout_s + 5.0)
        # reads re-queued after their engine restarted or disconnected wait at most this long for it
        self.rehandshake_timeout_s = float(rehandshake_timeout_s)
        self._released: OrderedDict = OrderedDict()  # (read key, prefill rank, attempt): pins of ended reads let go
        self._failed_keys: OrderedDict = OrderedDict()  # reads that failed (a retry failing again counts once)
        self._linger_until = 0.0  # failed reads' requests may still be answered: drain replies until then
        self._peer_progress: dict = {}  # prefill agent -> last time a read from it completed
        self._layout_dict = engine_to_dict(engine)  # sent with stage requests
        self._zombies: list = []  # (req_id, staged ranks, reads still in progress after a failure)
        self.cost_model = cost_model or CostModel.load()
        # the staging buffer lives on the KV memory's device (registered as VRAM there when on a GPU)
        self.staging = self._kv.new_staging(staging_bytes if transfer_mode != "direct" else 0)
        self.staging_bytes = staging_nbytes(self.staging)
        self.staging_addr = self.transport.register(self.staging) if self.staging_bytes else 0
        self.slots = SlotAllocator(self.staging_bytes)
        self.ctx = zmq.Context.instance()
        self.remotes: dict[str, RemoteEngine] = {}
        self._prepped: dict[str, dict] = {}  # [i14] engine id -> {prefill rank: prepared lists}
        self.inflight: dict[str, _InFlight] = {}
        self.finished: list[str] = []
        self.failed: dict[str, ReadFailure] = {}
        self.metrics = Metrics()
        self.handshake_timeout_s = handshake_timeout_s
        self._outbox: dict = {}     # (id(remote), prefill rank) -> (remote, rank, [(req_id, attempt, key)]): acquires
        self._heartbeats: dict = {}  # the same, heartbeats (queued requests, and pins of reads in flight)
        self._unsent: list = []     # (socket, frames): side-channel messages ZMQ could not queue yet
        self._dead_agents: set = set()
        self._retired: list = []    # (RemoteEngine, not before): engines dropped after a peer died
        self._monitors: dict = {}   # id(side-channel socket) -> its ZMQ monitor socket (disconnect events)

    # ---- handshake -----------------------------------------------------------------------------
    def handshake(self, engine_id: str, endpoints: dict[Rank, str]) -> RemoteEngine:
        """Contact the prefill engine's ranks this rank needs; cached per engine id."""
        endpoints = {tuple(k): v for k, v in endpoints.items()}
        self._endpoints[engine_id] = endpoints
        cached = self.remotes.get(engine_id)
        if cached is not None:
            # still the same engine? (same endpoints and the same NIXL agent behind every rank)
            if cached.endpoints == endpoints and self._same_agent(cached, endpoints):
                return cached
            self.forget(engine_id)
        self._reap_retired(engine_id=engine_id)  # its agents go before they are added again
        try:
            remote = self._handshake(engine_id, endpoints)
        except (HandshakeError, IncompatibleLayoutsError):
            self.metrics.failed_handshakes += 1
            raise
        self.remotes[engine_id] = remote
        self._prepped[engine_id] = _prepped_hook.prepare(self.transport, remote, self._prepped.pop(engine_id, None))  # [i14]
        self.metrics.handshakes += 1
        return remote

    def _same_agent(self, cached: "RemoteEngine", endpoints: dict) -> bool:
        """Every rank this rank handshook with still has the NIXL agent (metadata) it had then."""
        digests = cached.digests or {(0, 0): cached.digest0}
        for prank, digest in digests.items():
            try:
                meta = fetch_meta(self.ctx, endpoints[prank], self._get_meta(prank), self.handshake_timeout_s)
            except (HandshakeError, KeyError):
                return False
            if meta.metadata_sha256 != digest:
                return False
        return True

    def _get_meta(self, prank: Rank) -> GetMeta:
        return GetMeta(self.engine_id, self.rank, prank, self.transport.agent_name)

    def _get(self, engine_id: str, endpoints: dict, prank: Rank) -> RankMeta:
        if prank not in endpoints:
            raise HandshakeError(f"no endpoint given for prefill rank {prank} of engine {engine_id!r}; "
                                 f"give one per rank, got {sorted(endpoints)}")
        meta = fetch_meta(self.ctx, endpoints[prank], self._get_meta(prank), self.handshake_timeout_s)
        if meta.engine_id != engine_id:
            raise HandshakeError(f"endpoint {endpoints[prank]} is engine {meta.engine_id!r}, expected {engine_id!r}")
        if tuple(meta.rank) != prank:
            raise HandshakeError(f"endpoint {endpoints[prank]} is rank {tuple(meta.rank)}, expected {prank}")
        return meta

    def _handshake(self, engine_id: str, endpoints: dict[Rank, str], step=None) -> RemoteEngine:
        step = step or (lambda what: None)
        step("metadata from rank (0, 0)")
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
        step("planning")
        plan = plan_transfer(layout, self.engine)
        metas = {(0, 0): first}
        needed = plan.ranks_to_notify(self.rank)
        for prank in needed:
            if prank not in metas:
                step(f"metadata from rank {prank}")
                metas[prank] = self._get(engine_id, endpoints, prank)
        agents, bases = {}, {}
        step("NIXL add_remote_agent")
        try:
            self._add_peers(engine_id, layout, first, metas, needed, agents, bases)
        except BaseException:
            for agent in agents.values():  # no half-added engine
                self.transport.remove_peer(agent)
            raise
        step("lowering the plan")
        lowered = LoweredPlan(plan, self.rank, prefill_mems=bases, decode_mem=self.mem)
        readers = {p: len(plan.notifiers_of(p)) for p in needed}
        modes = self._modes(plan, {p: metas[p].staging_bytes for p in needed})
        can_stage = {p for p in plan.prefill_ranks_for(self.rank)
                     if metas[p].staging_bytes and self.staging_bytes and self.transfer_mode != "direct"}
        socks = {}
        # acquire (direct), stage and heartbeat requests: to every prefill rank this rank notifies (a rank
        # with nothing to read here is acquired and released too: only a pin holder's Done counts)
        for prank in sorted(set(needed) | set(plan.prefill_ranks_for(self.rank))):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # the side channel's TCP connection closing is the earliest sign of a dead prefill process
            self._monitors[id(sock)] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(f"tcp://{endpoints[prank]}")
            socks[prank] = sock
        from ..cost import pair_shapes
        return RemoteEngine(engine_id, layout, plan, lowered, agents, readers, endpoints, first.metadata_sha256,
                            modes, socks, pair_shapes(lowered),
                            digests={p: metas[p].metadata_sha256 for p in needed}, can_stage=frozenset(can_stage))

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
        if self.transfer_mode == "direct" or not self.staging_bytes:
            return {p: "direct" for p in reads}
        if self.transfer_mode == "staged":
            chosen = {p: "staged" for p in reads}
        else:
            from ..cost import choose_modes
            chosen = {m.prefill: m.mode for m in choose_modes(plan, self.cost_model, decode_ranks=[self.rank])}
        return {p: (chosen.get(p, "direct") if prefill_staging.get(p) else "direct") for p in reads}

    # ---- background handshakes (issue 20, point 4) -----------------------------------------------
    def connect(self, engine_id: str, endpoints: dict[Rank, str]) -> None:
        """Make sure prefill engine ``engine_id`` is (or becomes) live, without blocking: returns at once.

        Live with the same endpoints: nothing to do. Otherwise the handshake (metadata fetch from each
        prefill rank this rank needs, NIXL ``add_remote_agent``, prepared lists) runs on a background
        thread, bounded as a whole by ``connect_timeout_s``; :meth:`start` queues reads of a connecting
        engine and :meth:`poll` starts them once it is live, or fails them (:class:`HandshakeFailed`)
        if the handshake fails or runs past the bound. Idempotent: call it before every :meth:`start`
        (vLLM: when the scheduler first sees the request)."""
        endpoints = {tuple(k): v for k, v in endpoints.items()}
        self._endpoints[engine_id] = endpoints
        live = self.remotes.get(engine_id)
        if live is not None and live.endpoints == endpoints:
            return
        peer = self._peers.get(engine_id)
        if peer is not None and peer.state is PeerState.CONNECTING and peer.endpoints == endpoints:
            return
        if live is not None:  # other endpoints: a new engine under this id
            self.forget(engine_id, "the prefill engine's endpoints changed (connect)")
        self._connect(engine_id, endpoints, list(peer.pending) if peer is not None else [])

    def _connect(self, engine_id: str, endpoints: dict, pending: list, bound_s: float | None = None) -> None:
        if self._hs_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._hs_pool = ThreadPoolExecutor(2, thread_name_prefix=f"kvbridge-handshake-{self.engine_id}")
        self._reap_retired(engine_id=engine_id)
        phase = ["queued behind another handshake"]
        fut = self._hs_pool.submit(self._handshake_bg, engine_id, endpoints, phase)
        self._peers[engine_id] = _Peer(engine_id, endpoints, PeerState.CONNECTING, fut, time.monotonic(), pending,
                                       bound_s=self.connect_timeout_s if bound_s is None else bound_s, phase=phase)

    def _handshake_bg(self, engine_id: str, endpoints: dict, phase: list | None = None):
        """Background thread: the whole handshake; returns (remote, prepared lists). Each endpoint is
        probed with a plain TCP connect first: a dead process's closed port answers at once (refused),
        where ZMQ would wait out ``handshake_timeout_s``."""
        import socket
        phase = phase if phase is not None else ["started"]
        t0 = time.monotonic()
        times: list = []

        def step(what: str) -> None:
            times.append((phase[0], time.monotonic()))
            phase[0] = what

        for prank, ep in sorted(endpoints.items()):
            step(f"TCP connect to rank {prank} at {ep}")
            host, _, port = ep.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=self.handshake_timeout_s).close()
            except (OSError, ValueError) as e:
                raise HandshakeError(f"prefill rank {prank} of {engine_id!r} at {ep} does not accept connections "
                                     f"({type(e).__name__}: {e}); is the prefill engine running?") from None
        remote = self._handshake(engine_id, endpoints, step)
        step("NIXL prepared descriptor lists")
        try:
            prepped = _prepped_hook.prepare(self.transport, remote, None)  # [i14]
        except BaseException:
            self._drop_remote(remote)
            raise
        step("done")
        total = time.monotonic() - t0
        if total > 2.0:  # an operator's first clue when a prefill engine is slow to reach
            marks = [t0] + [t for _, t in times]
            log.warning("kvbridge: handshake with prefill engine %r took %.1f s: %s", engine_id, total, "; ".join(
                f"{what} {b - a:.2f} s" for (what, _), a, b in zip(times[1:], marks[1:], marks[2:])))
        return remote, prepped

    def _drop_remote(self, remote: RemoteEngine) -> None:
        live = {a for r in self.remotes.values() for a in r.agents.values()}
        for agent in remote.agents.values():
            if agent not in live:
                self.transport.remove_peer(agent)
        for sock in remote.stage_socks.values():
            self._close_sock(sock)

    def _advance_peers(self, now: float) -> None:
        """Install engines whose background handshake finished and start their queued reads; fail the
        queued reads of a handshake that failed or ran past ``connect_timeout_s``."""
        for eid, peer in list(self._peers.items()):
            if peer.state is not PeerState.CONNECTING:
                continue
            if peer.future.done():
                del self._peers[eid]
                try:
                    remote, prepped = peer.future.result()
                except (HandshakeError, IncompatibleLayoutsError, TransferError) as e:
                    self.metrics.failed_handshakes += 1
                    self._fail_pending(peer, str(e))
                    continue
                except Exception as e:  # noqa: BLE001 - a bug in the handshake fails its reads, not the engine
                    self.metrics.failed_handshakes += 1
                    self._fail_pending(peer, f"internal error: {type(e).__name__}: {e}")
                    continue
                old = self.remotes.get(eid)
                if old is not None:
                    self.forget(eid)
                self.remotes[eid] = remote
                self._prepped[eid] = prepped
                self.metrics.handshakes += 1
                for req in peer.pending:
                    try:
                        self.start(req)
                    except KVBridgeError as e:
                        self._count_failed(req)
                        self.failed[req.key] = HandshakeFailed(str(e), req_id=req.req_id, engine_id=eid)
            elif now - peer.started > peer.bound_s:
                peer.state = PeerState.LOST
                del self._peers[eid]
                self._abandoned.append(peer.future)
                self.metrics.failed_handshakes += 1
                self._fail_pending(peer, f"no handshake within {peer.bound_s:g} s (prefill engine dead, frozen or "
                                         f"unreachable; the handshake was at: {peer.phase[0]})")
        for fut in [f for f in self._abandoned if f.done()]:  # late results of abandoned handshakes: drop
            self._abandoned.remove(fut)
            if fut.exception() is None:
                remote, prepped = fut.result()
                _prepped_hook.release(self.transport, prepped)
                self._drop_remote(remote)

    def _fail_pending(self, peer: "_Peer", why: str) -> None:
        before = f"{peer.why}; re-handshake failed: " if peer.why else ""
        for req in peer.pending:
            self._count_failed(req)
            self.failed[req.key] = HandshakeFailed(
                f"request {req.req_id!r}: {before}cannot reach prefill engine {peer.engine_id!r}: {why}",
                req_id=req.req_id, engine_id=peer.engine_id)
        peer.pending = []

    def _can_requeue(self, f: _InFlight) -> bool:
        return not any(rr.pinned or rr.reads for rr in f.ranks.values()) and f.req.key not in self._requeued

    def _requeue_restarted(self, f: _InFlight) -> bool:
        """A prefill rank answered "restarted" (same id and ports, a new process): if this read holds no
        pin anywhere yet, drop it quietly, re-handshake in the background and start it again there (the
        request that discovered the restart does not fail). True if requeued."""
        if not self._can_requeue(f):
            return False
        self._requeue(f, f"prefill engine {f.remote.engine_id!r} restarted")
        return True

    def _requeue(self, f: _InFlight, why: str) -> None:
        """Start ``f`` again behind a background re-handshake of its engine (once per read); it fails
        :class:`HandshakeFailed` (a :class:`PeerDisconnected`) if the engine cannot be reached. The
        engine's other reads that hold nothing yet go with it (the old engine is dropped)."""
        eid = f.remote.engine_id
        endpoints = self._endpoints.get(eid, f.remote.endpoints)
        peer = self._peers.get(eid)
        group = [f]
        if peer is None or peer.state is not PeerState.CONNECTING:
            group += [g for g in self.inflight.values() if g.remote is f.remote and g is not f and self._can_requeue(g)]
        for g in group:
            self.inflight.pop(g.req.key, None)
            for rr in g.ranks.values():
                if not rr.sm.terminal:
                    rr.sm.fire(ReadEvent.ABORT)
            self._release_reads(g)
            self._notify_failed(g)  # a request still out on a live rank may have pinned there: let it go
            self.metrics.restart_requeues += 1
            self._requeued.add(g.req.key)
        if len(self._requeued) > 4096:
            self._requeued.clear()
        if peer is None or peer.state is not PeerState.CONNECTING:
            for rid, g in list(self.inflight.items()):  # the old engine's reads that hold something: failed
                if g.remote is f.remote:
                    self._fail(rid, g, self._failure(PeerDisconnected, g, None, f"{why}; its reads in progress "
                                                                               "cannot continue"))
            self._retire(f.remote)
            # reaps the old engine (its reads that held pins fail); a re-handshake is bounded by
            # rehandshake_timeout_s: a restarted engine answers at once, a dead one must fail fast
            self._connect(eid, endpoints, [], min(self.connect_timeout_s, self.rehandshake_timeout_s))
            peer = self._peers[eid]
            peer.why = why
        peer.pending += [g.req for g in group]

    def forget(self, engine_id: str, reason: str = "the prefill engine was forgotten (re-handshake)",
               dead: bool = False) -> None:
        """Drop a remote engine (dead or gone): fail its requests in flight, remove its agents; a later
        handshake starts fresh."""
        for rid, f in list(self.inflight.items()):
            if f.remote.engine_id == engine_id:
                cls = PeerDisconnected if dead else Aborted
                self._fail(rid, f, cls(f"request {rid!r}: {reason}", req_id=rid, engine_id=engine_id), notify=not dead)
        remote = self.remotes.pop(engine_id, None)
        _prepped_hook.release(self.transport, self._prepped.pop(engine_id, None))  # [i14]
        if remote is not None:
            for agent in remote.agents.values():
                self.transport.remove_peer(agent)
            for sock in remote.stage_socks.values():
                self._close_sock(sock)

    # ---- requests ------------------------------------------------------------------------------
    def start(self, req: ReadRequest) -> None:
        """Validate ``req`` and ask its prefill ranks to pin the lease (direct reads are posted when the
        pin is granted; staged ranks pack on the stage request, which pins too; a rank with nothing to
        read is pinned and released at once). Raises RequestError/HandshakeError before anything moves."""
        key = req.key
        if key in self.inflight:
            raise RequestError(f"read {key!r} is already in flight on decode rank {self.rank}; give each read of "
                               "one prefill request its own ReadRequest.read_id")
        remote = self.remotes.get(req.engine_id)
        if remote is None:
            peer = self._peers.get(req.engine_id)
            if peer is not None and peer.state is PeerState.CONNECTING:  # started once the engine is live
                if any(p.key == key for p in peer.pending):
                    raise RequestError(f"read {key!r} is already queued on decode rank {self.rank}")
                peer.pending.append(req)
                return
            raise HandshakeError(f"no handshake with prefill engine {req.engine_id!r} yet; call connect() or "
                                 "handshake() first")
        t0 = time.perf_counter()
        modes = self._request_modes(remote, req) if self.transfer_mode == "auto" else remote.modes
        direct = [p for p, m in modes.items() if m == "direct"]
        staged = [p for p, m in modes.items() if m == "staged"]
        descs = _prepped_hook.direct_reads(self._prepped.get(req.engine_id), remote, req, direct)  # [i14]
        missing = [p for p in remote.agents if not req.attempt_for(p) and (
            p in staged or _prepped_hook.reads_something(descs.get(p)))]
        if missing:  # nothing to present to the prefill: it would refuse; do not even ask
            self._count_failed(req)
            self.failed[key] = LeaseExpired(
                f"request {req.req_id!r} carries no lease attempt for prefill ranks {sorted(missing)} of "
                f"{req.engine_id!r}; pass the attempt add_request returned (ReadRequest.attempt)",
                req_id=req.req_id, engine_id=req.engine_id, prefill_rank=missing[0])
            return
        f = _InFlight(req, remote, {}, t0)
        now = time.monotonic()
        for prank in remote.agents:
            if prank in staged:
                continue
            d = descs.get(prank)
            if not _prepped_hook.reads_something(d):  # nothing to read here (prefix hit, unread replica)
                if not req.attempt_for(prank) or prank not in remote.stage_socks:
                    continue  # nothing to present: the prefill's lease expires on its own
                d = None  # pinned, then released at once: only a pin holder's Done settles a read
            f.ranks[prank] = _RankRead(prank, ReadMachine(ReadState.ACQUIRING), now, now, descs=d, first_sent=now)
            self._queue(self._outbox, remote, prank, req)
        if staged:
            wire_p, wire_d = blocks_to_wire(req.prefill_blocks), blocks_to_wire(req.decode_blocks)
            layout = self._layout_dict
            for prank in staged:
                rr = f.ranks[prank] = _RankRead(prank, ReadMachine(ReadState.STAGE_REQUESTED), now, now, first_sent=now)
                rr.stage_msg = Stage(
                    req.req_id, self.engine_id, self.rank, layout, self._mem_wire, req.num_tokens, wire_p, wire_d,
                    self.stage_segment_bytes, req.attempt_for(prank), remote.readers[prank],
                    remote.digests.get(prank, ""), key, self.transport.agent_name)
                self._send(remote.stage_socks[prank], pack(rr.stage_msg))
                rr.asked = True
            f.stage_sent = time.perf_counter()
        self.metrics.post_seconds_sum += time.perf_counter() - t0
        if not f.ranks:
            self.finished.append(key)
            self.metrics.finished_requests += 1
            return
        self.inflight[key] = f

    @staticmethod
    def _queue(box: dict, remote: RemoteEngine, prank: Rank, req: ReadRequest) -> None:
        box.setdefault((id(remote), prank), (remote, prank, []))[2].append(
            (req.req_id, req.attempt_for(prank), req.key))

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
            remote = self.remotes.get(req.engine_id)
            if remote is None:
                continue
            for prank in remote.agents:
                if req.attempt_for(prank) and prank in remote.stage_socks:
                    self._queue(self._heartbeats, remote, prank, req)
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
        remote = self.remotes.get(req.engine_id)
        if remote is None:
            return
        for p, agent in remote.agents.items():
            if req.attempt_for(p):
                self._notify(agent, self._done(req, remote, p, ok=False, decline=True))

    def _send(self, sock, frames: list) -> None:
        """Queue a side-channel message without blocking; what ZMQ cannot take now is retried on poll
        (the rank's deadline bounds the wait)."""
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self._unsent.append((sock, frames))
        except zmq.ZMQError:  # socket closed (engine forgotten): the request fails on its deadline
            pass

    def flush(self) -> None:
        """Send the batched acquire requests (one message per prefill rank) and retry unsent ones."""
        if self._unsent:
            unsent, self._unsent = self._unsent, []
            for sock, frames in unsent:
                self._send(sock, frames)
        if self._outbox:
            out, self._outbox = self._outbox, {}
            for remote, prank, reqs in out.values():
                live = [(rid, a, k) for rid, a, k in reqs if k in self.inflight]
                for _, _, k in live:
                    rr = self.inflight[k].ranks.get(prank)
                    if rr is not None:
                        rr.asked = True
                if live and prank in remote.stage_socks:
                    self._send(remote.stage_socks[prank], pack(Acquire(
                        self.engine_id, self.rank, remote.readers[prank], remote.digests.get(prank, ""), live,
                        self.transport.agent_name)))
        if self._heartbeats:
            out, self._heartbeats = self._heartbeats, {}
            for remote, prank, reqs in out.values():
                if prank in remote.stage_socks:
                    self.metrics.heartbeats += len(reqs)
                    self._send(remote.stage_socks[prank], pack(Acquire(
                        self.engine_id, self.rank, remote.readers[prank], remote.digests.get(prank, ""), reqs,
                        self.transport.agent_name, heartbeat=True)))

    def _request_modes(self, remote: RemoteEngine, req: ReadRequest) -> dict:
        """Auto mode, per request: runs merge across consecutive block ids, so a request whose blocks are
        mostly consecutive (on both sides) may be cheaper direct than the handshake-time choice says."""
        from ..cost import request_chunks, request_modes
        chunks, frac = request_chunks(remote.layout.model.groups, req.decode_blocks, req.prefill_blocks,
                                      self.engine.block_size_of, remote.lowered.chunk_tokens)
        shapes = {p: remote.shapes.get(p) for p in remote.modes}
        staged = request_modes(self.cost_model, {p: s for p, s in shapes.items() if s is not None}, chunks, frac,
                               lambda p: p in remote.can_stage)
        return {p: staged.get(p, "direct") for p in remote.modes}


    def _done(self, req: ReadRequest, remote: RemoteEngine, prank: Rank, ok: bool = True,
              decline: bool = False) -> bytes:
        return encode_notif(Done(req.req_id, self.engine_id, self.rank, remote.readers[prank], ok,
                                 req.attempt_for(prank), req.key, decline))

    def _let_go(self, remote: RemoteEngine, prank: Rank, rid: str, attempt: int, read_id: str) -> None:
        """The prefill granted a pin (or staged) for a read that is no longer live here (failed, aborted,
        or answered twice): release that pin once, so it does not hold the blocks until it times out."""
        key = (read_id, prank, attempt)
        if key in self._released or prank not in remote.agents:
            return
        self._released[key] = True
        while len(self._released) > 4096:
            self._released.popitem(last=False)
        agent = remote.agents[prank]
        if agent not in self._dead_agents:
            self._notify(agent, encode_notif(Done(rid, self.engine_id, self.rank, remote.readers[prank], False,
                                                  attempt, read_id)))

    def _post_direct(self, f: _InFlight, rr: _RankRead, d) -> None:
        """Direct read of a lowered :class:`~kvbridge.lower.Descriptors` (handed over factored, cancellable
        until the post thread reaches it); its Done rides on the read."""
        c = _Cancellable(d)
        x = _prepped_hook.post(self.transport, f.remote.agents[rr.prefill], c, self._done(f.req, f.remote, rr.prefill),
                               remote_device=_device_of(f.remote, rr.prefill))
        # sizes of a prepped read are worked out on the post thread: counted when the request completes
        self._track(f, rr, _Read(rr.prefill, x, None, cancel=c, work=d))

    def _track(self, f: _InFlight, rr: _RankRead, r: _Read, ndescs: int = 0) -> None:
        rr.reads.append(r)
        if r.work is None:
            f.nbytes += r.nbytes
            f.ndescs += ndescs
        self.metrics.transfers += 1

    def _failure(self, cls, f: _InFlight, prank: Rank | None, text: str) -> ReadFailure:
        where = f"prefill engine {f.remote.engine_id!r} rank {prank}" if prank is not None else \
            f"prefill engine {f.remote.engine_id!r}"
        return cls(f"request {f.req.req_id!r} from {where}: {text}", req_id=f.req.req_id,
                   engine_id=f.remote.engine_id, prefill_rank=prank)

    def _fire_fail(self, f: _InFlight, rr: _RankRead, event: ReadEvent, failure: ReadFailure) -> None:
        """One rank's read failed: its machine takes ``event``, the request fails (the others cancel)."""
        rr.sm.fire(event)
        self._fail(f.req.key, f, failure)  # the read key (read_id): what poll() reports

    def _refused(self, f: _InFlight, rr: _RankRead, code: str, text: str) -> None:
        if code == "restarted":
            if self._requeue_restarted(f):
                return
            self._fire_fail(f, rr, ReadEvent.REFUSED, self._failure(PeerRestarted, f, rr.prefill, text))
            self._retire(f.remote)  # a later handshake() reaches the new process
        elif code == "not_registered":
            self._fire_fail(f, rr, ReadEvent.REFUSED, self._failure(
                NotRegistered, f, rr.prefill, f"{text} (asked for {self.register_grace_s:g} s: register_grace_s)"))
        elif code in ("lease_expired", "done"):
            self._fire_fail(f, rr, ReadEvent.REFUSED, self._failure(LeaseExpired, f, rr.prefill, text))
        else:
            self._fire_fail(f, rr, ReadEvent.REFUSED, self._failure(RemoteError, f, rr.prefill, f"[{code}] {text}"))

    def _not_registered(self, f: _InFlight, rr: _RankRead, code: str, text: str, now: float) -> bool:
        """A refusal "not registered yet": ask again shortly, within ``register_grace_s`` of the first try.
        No pin exists and nothing is sent meanwhile. True if a retry was scheduled."""
        if code != "not_registered" or now - rr.first_sent >= self.register_grace_s:
            return False
        tries = self.metrics.register_retries
        self.metrics.register_retries = tries + 1
        rr.retry_at = now + min(0.1, 0.005 * 2 ** min(5, int((now - rr.first_sent) / 0.02)))
        # other reads of the same prefill request waiting to ask this rank again (vLLM n > 1: each child is
        # a reader) ask together, in one message: the prefill pins them all before any of them can end and
        # free the lease under the others (a refused acquire leaves no trace there)
        for g in self.inflight.values():
            sib = g.ranks.get(rr.prefill) if g is not f else None
            if (sib is not None and sib.retry_at is not None and g.remote is f.remote
                    and g.req.req_id == f.req.req_id and g.req.attempt_for(rr.prefill) == f.req.attempt_for(rr.prefill)):
                rr.retry_at = sib.retry_at = min(rr.retry_at, sib.retry_at)
        rr.progress_at = now
        return True

    def _on_acquired(self, remote: RemoteEngine, prank: Rank, msg: Acquired) -> None:
        now = time.monotonic()
        if msg.heartbeat:  # pins refreshed (reads in flight) or queued leases extended; refusals: no change
            for rid, attempt, read_id, ttl_s in msg.granted:
                f, rr = self._rank_read(remote, prank, rid, attempt, read_id)
                if rr is not None and rr.pinned and not rr.sm.terminal:
                    rr.pin_deadline = max(rr.pin_deadline, rr.refresh_sent + ttl_s)
                    rr.refresh_at = rr.refresh_sent + ttl_s / 3
            return
        for rid, attempt, read_id, ttl_s in msg.granted:
            f, rr = self._rank_read(remote, prank, rid, attempt, read_id)
            if rr is None or rr.state is not ReadState.ACQUIRING or rr.retry_at is not None:
                self._let_go(remote, prank, rid, attempt, read_id)  # a pin no live read of ours will use
                continue
            rr.pinned, rr.asked = True, False
            if ttl_s <= 0:
                self._fire_fail(f, rr, ReadEvent.REFUSED, self._failure(LeaseExpired, f, prank, "the pin was granted "
                                                                        "with no time left"))
                continue
            rr.sm.fire(ReadEvent.GRANTED)
            rr.pin_deadline, rr.progress_at = rr.sent_at + ttl_s, now
            rr.refresh_sent, rr.refresh_at = rr.sent_at, rr.sent_at + ttl_s / 3
            if rr.descs is None:  # nothing to read from this rank: release the pin at once
                self._notify(remote.agents[prank], self._done(f.req, remote, prank))
                rr.pinned = False
                rr.sm.fire(ReadEvent.COMPLETED)
                continue
            self._post_direct(f, rr, rr.descs)
            rr.descs = None
        for rid, attempt, read_id, code, text in msg.refused:
            f, rr = self._rank_read(remote, prank, rid, attempt, read_id)
            if rr is not None and rr.state is ReadState.ACQUIRING and rr.retry_at is None:
                rr.asked = False
                if not self._not_registered(f, rr, code, text, now):
                    self._refused(f, rr, code, text)

    def _rank_read(self, remote: RemoteEngine, prank: Rank, rid: str, attempt: int | None = None,
                   read_id: str = ""):
        f = self.inflight.get(read_id or rid)
        if (f is None or f.remote is not remote or f.req.req_id != rid
                or (attempt is not None and attempt != f.req.attempt_for(prank))):
            return None, None
        return f, f.ranks.get(prank)

    def _on_stage_reply(self, remote: RemoteEngine, prank: Rank, msg: Staged | StageError) -> None:
        from ..staging import offsets
        f, rr = self._rank_read(remote, prank, msg.req_id, msg.attempt or None, msg.read_id)
        pinned = isinstance(msg, Staged) or msg.code not in _REFUSALS
        if rr is None or rr.state not in (ReadState.STAGE_REQUESTED, ReadState.STAGING) or rr.retry_at is not None:
            # the request failed or was aborted meanwhile, or we fell back to direct reads: a pin the
            # prefill made for a read no longer live here is released (once)
            if pinned and (rr is None or rr.sm.terminal) and msg.attempt:
                self._let_go(remote, prank, msg.req_id, msg.attempt, msg.read_id or msg.req_id)
            return
        now = rr.progress_at = time.monotonic()
        req = f.req
        rr.pinned, rr.asked = rr.pinned or pinned, False
        if isinstance(msg, StageError):
            if rr.state is ReadState.STAGE_REQUESTED and self._not_registered(f, rr, msg.code, msg.message, now):
                return
            if msg.expired or msg.code in _REFUSALS:
                self._refused(f, rr, msg.code or "lease_expired", msg.message)
            elif rr.state is ReadState.STAGE_REQUESTED and msg.ttl_s > 0:  # no room: read directly, pinned
                rr.pin_deadline = rr.sent_at + msg.ttl_s
                rr.refresh_sent, rr.refresh_at = rr.sent_at, rr.sent_at + msg.ttl_s / 3
                self._direct_fallback(f, rr)
            else:
                self._fire_fail(f, rr, ReadEvent.REFUSED, self._failure(RemoteError, f, prank, msg.message))
            return
        if rr.staging is None and rr.state is ReadState.STAGE_REQUESTED:  # first segment
            rr.refresh_sent, rr.refresh_at = rr.sent_at, rr.sent_at + max(msg.ttl_s, 0.0) / 3
            if msg.total == 0:
                rr.notify_at_end = True  # nothing to read: Done goes out when the request completes
                rr.pin_deadline = now + 1e9  # nothing read: nothing to trust
                rr.sm.fire(ReadEvent.STAGE_LAST)
                return
            (d,) = f.remote.lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks, only=(prank,))
            if d.total_bytes != msg.total:
                self._fire_fail(f, rr, ReadEvent.PROTOCOL_ERROR, self._failure(
                    RemoteError, f, prank, f"the prefill packed {msg.total} B but this rank expects {d.total_bytes} B: "
                                           "the two sides lower differently (same kvbridge release?)"))
                return
            if msg.ttl_s <= 0:
                self._fire_fail(f, rr, ReadEvent.REFUSED, self._failure(LeaseExpired, f, prank,
                                                                        "staged with no pin time left"))
                return
            rr.pin_deadline = rr.sent_at + msg.ttl_s
            off = self.slots.alloc((req.key, prank), msg.total)
            if off is None:  # our staging is full: read directly (under the pin), ignore the rest
                self._direct_fallback(f, rr)
                return
            rr.staging = _Staging(off, d.dst, d.nbytes, offsets(d.nbytes))
            rr.notify_at_end = True
            self.metrics.staged_transfers += 1
        st = rr.staging
        if st is None:
            return
        a, b = np.searchsorted(st.starts, [msg.offset, msg.offset + msg.nbytes])
        if (msg.offset + msg.nbytes > msg.total or a >= st.starts.size or st.starts[a] != msg.offset
                or int(st.nbytes[a:b].sum()) != msg.nbytes):
            self._fire_fail(f, rr, ReadEvent.PROTOCOL_ERROR, self._failure(
                RemoteError, f, prank, f"the prefill sent a segment [{msg.offset}, +{msg.nbytes}) that does not "
                                       "start and end on run boundaries of this rank's lowering"))
            return
        if msg.last:
            self.metrics.stage_wait_seconds_sum += time.perf_counter() - f.stage_sent
        rr.sm.fire(ReadEvent.STAGE_LAST if msg.last else ReadEvent.STAGE_SEGMENT)
        one = np.ones(1, dtype=np.int64)
        # no notification on segment reads: Done is sent once every segment is read (the prefill frees
        # its staging slot on Done, and segments may complete out of order)
        x = self.transport.read(f.remote.agents[prank], one * msg.addr, one * (self.staging_addr + st.slot + msg.offset),
                                one * msg.nbytes, b"", remote_device=_device_of(f.remote, prank))
        self._track(f, rr, _Read(prank, x, int(msg.nbytes), st.slot + msg.offset, (st.dst[a:b], st.nbytes[a:b])), 1)

    def _direct_fallback(self, f: _InFlight, rr: _RankRead) -> None:
        self.metrics.staging_fallbacks += 1
        rr.sm.fire(ReadEvent.STAGE_FULL)
        req = f.req
        for d in f.remote.lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks, only=(rr.prefill,)):
            if d.count:
                self._post_direct(f, rr, d)
            else:
                rr.notify_at_end = True

    def _scatter(self, r: _Read) -> None:
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
            unpinned = [p for p, rr in f.ranks.items() if not rr.sm.terminal and not rr.pinned]
            for rr in f.ranks.values():
                if not rr.sm.terminal:
                    rr.sm.fire(ReadEvent.ABORT)
            self._release_reads(f)
            self._notify_failed(f)
            # ranks where we know of no pin (acquire not sent or not answered yet, refused): decline too.
            # If our request was answered meanwhile with a pin (a parked stage request), the release
            # above ends it and the prefill ignores the decline; if not, the release is ignored and the
            # decline settles our part (a pin granted after both is let go when its grant arrives)
            for p in unpinned:
                agent = f.remote.agents.get(p)
                if agent is not None and agent not in self._dead_agents and f.req.attempt_for(p):
                    self._notify(agent, self._done(f.req, f.remote, p, ok=False, decline=True))
            return
        if readers_of is not None:  # not started: decline (see release())
            self.release(readers_of)
        else:
            self.metrics.aborted_requests += 1

    @property
    def waiting(self) -> int:
        """Reads queued behind a background handshake (started while their engine was connecting, or
        re-queued after it restarted or disconnected); :meth:`poll` starts or fails them."""
        return sum(len(p.pending) for p in self._peers.values())

    @property
    def busy(self) -> bool:
        """Something needs polling: reads in flight, parked reads, retired engines, unsent messages."""
        return bool(self.inflight or self._zombies or self._retired or self._outbox or self._unsent
                    or self._heartbeats or self._peers or self._abandoned or time.monotonic() < self._linger_until)

    def poll(self) -> tuple[list[str], dict[str, ReadFailure]]:
        """Advance in-flight requests; return (finished ids, {failed id: typed failure}) since the last call."""
        self.flush()
        self._drain_replies()
        now = time.monotonic()
        if self._peers or self._abandoned:
            self._advance_peers(now)
        for rid, f in list(self.inflight.items()):
            if rid not in self.inflight:  # failed meanwhile (a dead peer fails all of its requests)
                continue
            failed = False
            for rr in f.ranks.values():
                if rr.sm.terminal:
                    continue
                if self._advance(f, rr, now):
                    failed = True
                    break
            if failed or rid not in self.inflight:
                continue
            if all(rr.state is ReadState.DONE for rr in f.ranks.values()):
                self._complete(rid, f)
        self._reap_zombies()
        self._reap_retired()
        self.flush()  # retries and heartbeats scheduled above
        out, failed = self.finished, self.failed
        self.finished, self.failed = [], {}
        return out, failed

    def _advance(self, f: _InFlight, rr: _RankRead, now: float) -> bool:
        """Drive one rank's read: not-registered retries, pin heartbeats, completions, scatters, its
        deadlines. True if the request failed."""
        prank = rr.prefill
        if rr.retry_at is not None:  # refused "not registered yet": nothing is held, nothing is sent
            if now < rr.retry_at:
                return False
            rr.retry_at, rr.sent_at = None, now
            if rr.state is ReadState.ACQUIRING:
                self._queue(self._outbox, f.remote, prank, f.req)
            elif rr.stage_msg is not None and prank in f.remote.stage_socks:
                self._send(f.remote.stage_socks[prank], pack(rr.stage_msg))
                rr.asked = True
        if rr.pinned and now >= rr.refresh_at:  # keep our pin alive on the prefill (its idle timeout)
            rr.refresh_sent = now
            rr.refresh_at = now + max(0.05, (rr.pin_deadline - now) / 2)  # again then if nobody answers
            self._queue(self._heartbeats, f.remote, prank, f.req)
        try:
            for r in rr.reads:
                if not r.done and self.transport.check(r.xfer) == "DONE":
                    r.done, rr.progress_at = True, now
                    self._peer_progress[f.remote.agents.get(prank)] = now
                    if r.runs is not None:  # staged segment: scatter it as soon as it is read
                        r.scatter = self.transport.submit(self._scatter, r)
                if r.scatter is not None and r.scatter.done():
                    r.scatter.result()  # raises what the scatter raised
        except TransferError as e:
            agent = f.remote.agents.get(prank)
            sock = f.remote.stage_socks.get(prank)
            if agent is not None and (isinstance(e, PeerGoneError) or (sock is not None and self._disconnected(sock))):
                self._peer_died(f.remote, agent, f"NIXL: {e}")
            else:
                self._fire_fail(f, rr, ReadEvent.NIXL_ERROR, self._failure(TransferFailed, f, prank, str(e)))
            return True
        except Exception as e:  # noqa: BLE001 - a scatter bug fails the request, not the engine
            self._fire_fail(f, rr, ReadEvent.PROTOCOL_ERROR, self._failure(
                ReadFailure, f, prank, f"scatter failed: {type(e).__name__}: {e}"))
            return True
        finished = all(r.done and (r.runs is None or (r.scatter is not None and r.scatter.done())) for r in rr.reads)
        if finished and rr.state in (ReadState.POSTED, ReadState.SCATTERING):
            if now > rr.pin_deadline:  # the read ended after the pin the prefill granted: not trusted
                self._fire_fail(f, rr, ReadEvent.TIMEOUT, self._failure(
                    LeaseExpired, f, prank, "the read ended after the lease pin the prefill granted ran out; its "
                                            "blocks may have been reused, the data is not trusted"))
                return True
            rr.sm.fire(ReadEvent.COMPLETED)
            return False
        waiting = rr.state in AWAITING_REPLY and not (rr.state is ReadState.STAGING and not finished)
        limit = self.stage_timeout_s if waiting else self.transfer_timeout_s
        if now - self._progress_ref(f, rr, now, waiting) > limit:
            what = ("did not answer the acquire/stage request within stage_timeout_s" if waiting
                    else "made no progress within transfer_timeout_s")
            self._fire_fail(f, rr, ReadEvent.TIMEOUT, self._failure(
                TransferTimeout, f, prank, f"{what}={limit:g} s (state {rr.state.name}; frozen, overloaded or "
                                           "unreachable)"))
            return True
        if now > rr.pin_deadline:
            self._fire_fail(f, rr, ReadEvent.TIMEOUT, self._failure(
                LeaseExpired, f, prank, "the lease pin the prefill granted ran out before the read ended"))
            return True
        return False

    def _progress_ref(self, f: _InFlight, rr: _RankRead, now: float, waiting: bool) -> float:
        """When this rank's read last showed the peer alive: its deadline runs from there. Waiting for an
        answer: the request or the last answer. Reading: the latest of the last progress, the last read
        completed from the same prefill agent, and the time the post thread posted each unfinished read;
        a read still in our own post queue stops the clock (a long local queue is not the peer's fault)."""
        if waiting:
            return rr.progress_at
        ref = max(rr.progress_at, self._peer_progress.get(f.remote.agents.get(rr.prefill), 0.0))
        for r in rr.reads:
            if not r.done:
                posted = getattr(r.xfer, "posted_at", ref)
                if posted is None:
                    return now
                ref = max(ref, posted)
        return ref

    def _complete(self, rid: str, f: _InFlight) -> None:
        self._release_reads(f)
        del self.inflight[rid]
        for prank, rr in f.ranks.items():  # staged reads carry no notification: tell the prefill now
            if rr.notify_at_end and rr.pinned:
                self._notify(f.remote.agents[prank], self._done(f.req, f.remote, prank))
            rr.pinned = False  # direct reads' Done rode on the read
        self.metrics.observe_transfer(time.perf_counter() - f.started)
        for rr in f.ranks.values():
            for r in rr.reads:
                if r.work is not None:
                    f.nbytes += r.work.total_bytes
                    f.ndescs += r.work.count
        self.metrics.transfer_bytes += f.nbytes
        self.metrics.descriptors += f.ndescs
        self.metrics.finished_requests += 1
        self.finished.append(rid)

    def _peer_died(self, remote: RemoteEngine, agent: str, detail: str) -> None:
        """NIXL reported ``agent`` disconnected: every request still reading it fails now (its queued reads
        are cancelled, never posted), the engine is retired (a later handshake starts fresh) and the dead
        agent is removed; the engine's live ranks keep their agents until the failed requests' Done
        notifications have gone out."""
        self._dead_agents.add(agent)
        requeue = []
        for _rid, f in list(self.inflight.items()):
            for prank, rr in f.ranks.items():
                if not rr.sm.terminal and f.remote.agents.get(prank) == agent:
                    if self._can_requeue(f):  # nothing pinned or read yet: the engine may be back (restart)
                        requeue.append(f)
                    else:
                        self._fire_fail(f, rr, ReadEvent.DISCONNECT, self._failure(
                            PeerDisconnected, f, prank, f"disconnected: prefill agent {agent!r} went away ({detail})"))
                    break
        self._retire(remote)
        self.transport.remove_peer(agent)
        for f in requeue:
            if self.inflight.get(f.req.key) is f:  # (an earlier one may have taken it along)
                self._requeue(f, f"prefill agent {agent!r} disconnected ({detail})")

    def _retire(self, remote: RemoteEngine, grace_s: float = 0.5) -> None:
        if self.remotes.get(remote.engine_id) is remote:
            del self.remotes[remote.engine_id]
        if all(r is not remote for r, _ in self._retired):
            self._retired.append((remote, time.monotonic() + grace_s))

    def _reap_retired(self, engine_id: str | None = None) -> None:
        """Remove the agents and sockets of retired engines once nothing references them (or now, for
        ``engine_id``, which is about to be handshaken again)."""
        if not self._retired:
            return
        now, keep = time.monotonic(), []
        for remote, not_before in self._retired:
            forced = remote.engine_id == engine_id
            if not forced and (now < not_before or any(f.remote is remote for f in self.inflight.values())):
                keep.append((remote, not_before))
                continue
            for rid, f in list(self.inflight.items()):
                if f.remote is remote:
                    self._fail(rid, f, self._failure(Aborted, f, None, "the prefill engine is handshaken again"),
                               notify=False)
            live = {a for r in self.remotes.values() for a in r.agents.values()}
            for agent in remote.agents.values():
                if agent not in live:
                    self.transport.remove_peer(agent)
                self._dead_agents.discard(agent)
            for sock in remote.stage_socks.values():
                self._close_sock(sock)
        self._retired = keep

    def _close_sock(self, sock) -> None:
        mon = self._monitors.pop(id(sock), None)
        if mon is not None:
            try:
                sock.disable_monitor()
            except (zmq.ZMQError, AttributeError):
                pass
            mon.close(0)
        sock.close(0)

    def _disconnected(self, sock) -> bool:
        """The side channel's TCP connection to this prefill rank closed (ZMQ monitor event)."""
        mon = self._monitors.get(id(sock))
        if mon is None:
            return False
        from zmq.utils.monitor import recv_monitor_message
        seen = False
        while True:
            try:
                ev = recv_monitor_message(mon, zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                return seen
            seen = seen or ev["event"] == zmq.EVENT_DISCONNECTED

    def _drain_replies(self) -> None:
        remotes = {id(r): r for r in self.remotes.values()}
        for f in self.inflight.values():
            remotes.setdefault(id(f.remote), f.remote)
        for remote in remotes.values():
            for prank, sock in list(remote.stage_socks.items()):
                if self._disconnected(sock) and remote.agents.get(prank) not in self._dead_agents:
                    self._peer_died(remote, remote.agents[prank], "its side-channel connection closed")
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
                        self._on_acquired(remote, prank, msg)
                    elif isinstance(msg, (Staged, StageError)):
                        self._on_stage_reply(remote, prank, msg)

    def _release_reads(self, f: _InFlight) -> set:
        """Release a request's reads and staging slots without waiting (never blocks the loop).

        Returns the prefill ranks whose reads did not all complete. A read not yet posted is cancelled; one
        still in progress (or whose scatter runs) is parked with its slot until it settles, so a late
        write can never land in memory that was handed to someone else.
        """
        incomplete, parked = set(), []
        for prank, rr in f.ranks.items():
            if rr.state is not ReadState.DONE and (rr.reads or rr.state is ReadState.POSTED):
                incomplete.add(prank)
            for r in rr.reads:
                if r.cancel is not None and not r.done:
                    if not r.cancel.cancelled:
                        self.metrics.cancelled_reads += 1
                    r.cancel.cancelled = True
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

    def _fail(self, rid: str, f: _InFlight, failure: ReadFailure, notify: bool = True) -> None:
        """Fail a request: cancel its other ranks' reads, release what has ended (park the rest), and
        tell every live prefill rank it notifies (Done, failed), so blocks and staging slots come back."""
        for rr in f.ranks.values():
            if not rr.sm.terminal:
                rr.sm.fire(ReadEvent.ABORT)
        incomplete = self._release_reads(f)
        self.inflight.pop(rid, None)
        self.failed[rid] = failure
        self.metrics.failed_transfers += max(1, len(incomplete))
        self._count_failed(f.req)
        if notify:
            self._notify_failed(f)

    def _notify_failed(self, f: _InFlight) -> None:
        """Done(failed) to every prefill rank where this rank holds a pin for the read, whose agent is
        alive: it releases that pin (only the holder's Done can). Nothing is sent for a rank that refused
        the acquire or was never asked (it holds nothing of ours); a pin granted after this is released
        when its grant arrives (``_let_go``)."""
        peers = self.transport.peers
        for p, rr in f.ranks.items():
            agent = f.remote.agents.get(p)
            if (rr.pinned or rr.asked) and agent is not None and agent not in self._dead_agents and agent in peers:
                # asked, unanswered: a pin may exist already (the prefill ignores a release of none)
                self._notify(agent, self._done(f.req, f.remote, p, ok=False))
                if rr.asked:  # the answer may still come: keep draining replies a while to let it go
                    self._linger_until = max(self._linger_until, time.monotonic() + self.stage_timeout_s)
                else:
                    self._released[(f.req.key, p, f.req.attempt_for(p))] = True
            rr.pinned = rr.asked = False

    def wait(self, timeout_s: float = 60.0, sleep_s: float = 1e-4) -> tuple[list[str], dict[str, ReadFailure]]:
        """Poll until nothing is in flight or waiting for a handshake (or timeout); returns everything
        finished/failed meanwhile."""
        done, failed = [], {}
        deadline = time.monotonic() + timeout_s
        while True:
            d, f = self.poll()
            done += d
            failed |= f
            if not (self.inflight or self._peers) or time.monotonic() > deadline:  # (or reads waiting for a handshake)
                return done, failed
            time.sleep(sleep_s)

    def stats(self) -> dict:
        return {"metrics": self.metrics.to_json(), "inflight": len(self.inflight),
                "live_handles": self.transport.live_handles(), "peers": len(self.transport.peers),
                "remotes": sorted(self.remotes), "parked_reads": sum(len(z[2]) for z in self._zombies),
                "retired_engines": len(self._retired),
                "staging_used": self.slots.bytes_used,
                "nixl": vars(self.transport.stats).copy() if hasattr(self.transport, "stats") else {}}

    def close(self) -> None:
        for peer in list(self._peers.values()):  # background handshakes: let them end, then drop them
            self._abandoned.append(peer.future)
        self._peers.clear()
        for fut in self._abandoned:
            try:
                remote, prepped = fut.result(timeout=self.connect_timeout_s)
            except Exception:  # noqa: BLE001 - failed or stuck: nothing of it was kept
                continue
            _prepped_hook.release(self.transport, prepped)
            self._drop_remote(remote)
        self._abandoned.clear()
        if self._hs_pool is not None:
            self._hs_pool.shutdown(wait=False)
        for eid in list(self.remotes):
            self.forget(eid, "decode rank closing")
        for remote, _ in list(self._retired):
            self._reap_retired(engine_id=remote.engine_id)
        for mon in self._monitors.values():
            mon.close(0)
        self._monitors.clear()
        for eid in list(self._prepped):  # [i14] lists of retired engines
            _prepped_hook.release(self.transport, self._prepped.pop(eid))
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


# refusal codes of an acquire/stage request: no pin was made
_REFUSALS = frozenset({"not_registered", "lease_expired", "restarted", "unknown_reader", "done"})


def _device_of(remote: RemoteEngine, prank: Rank) -> str:
    """The device of a prefill rank's KV memory and staging buffer ("cpu" or "cuda:N"), from its handshake."""
    return getattr(remote.lowered.p_mem(prank), "device", "cpu")
