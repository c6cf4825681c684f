"""A prefill engine as one decode rank sees it: one object with a lifecycle that owns what it holds.

A :class:`Peer` is made when the decode rank first connects to a prefill engine id and lives until it
is retired; a re-handshake (restart, changed endpoints, another transfer mode) makes a new one. It
owns, once the handshake is done:

* the handshake's result (:class:`~kvbridge.runtime.handshake.RemoteEngine`: layout, plan, lowered plan,
  NIXL agent per prefill rank) and the NIXL agents that handshake added to the transport;
* the prepared descriptor lists per prefill rank (:mod:`~kvbridge.runtime.prepped_hook`);
* its side channel (:class:`SideChannel`): one ZMQ ROUTER connected to every prefill rank this decode
  rank asks (acquire, stage and heartbeat requests; one TCP connection per rank, addressed by a routing
  id per rank) and one monitor socket (a TCP connection closing is the earliest sign of a dead prefill
  process): three ZMQ sockets per peer whatever its number of ranks;
* its outbox: batched acquires and heartbeats per prefill rank, and frames ZMQ could not take yet;
* while connecting: the background handshake's future and the reads waiting for it.

Every change of :attr:`Peer.state` goes through :data:`TRANSITIONS` (``state -> event -> next state``);
a missing entry raises :class:`~kvbridge.errors.IllegalTransition`. Disconnects arrive typed (a
:class:`~kvbridge.errors.PeerGoneError` from the transport or a ZMQ ``EVENT_DISCONNECTED``), never by
text. :meth:`Peer.close` releases everything the peer owns, exactly once.

::

    CONNECTING ──CONNECTED──▶ LIVE ──DISCONNECTED | RESTARTED──▶ LOST ──CLOSE──▶ RETIRED
    CONNECTING ──HANDSHAKE_FAILED | HANDSHAKE_TIMEOUT──▶ LOST
    CONNECTING | LIVE ──CLOSE──▶ RETIRED       (forgotten, replaced, decode rank closing)
    LOST ──DISCONNECTED | RESTARTED──▶ LOST    (another rank of the lost engine reports it too)

LOST: no new reads; kept until the reads that still reference it have ended (and, for an abandoned
handshake, until its thread returns, so what it added is released). RETIRED is terminal.
"""
from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import HandshakeError, IllegalTransition
from ..modes import TransferPath
from ..transport.base import Transport
from .machine import step

if TYPE_CHECKING:
    from ..cost import PairShape
    from ..prepped import Prepared
    from .handshake import RemoteEngine

log = logging.getLogger(__name__)

Rank = tuple[int, int]


class PeerState(enum.Enum):
    """Lifecycle of a prefill engine on this decode rank."""

    CONNECTING = "connecting"  # background handshake running; reads queue on the peer
    LIVE = "live"              # handshaken: reads start, sockets open, agents added
    LOST = "lost"              # dead, restarted, or its handshake failed: no new reads, reaped later
    RETIRED = "retired"        # everything it owned is released (terminal)


class PeerEvent(enum.Enum):
    CONNECTED = "connected"                  # the background handshake finished (agents, lists, sockets)
    HANDSHAKE_FAILED = "handshake_failed"    # it raised (unreachable, refused, incompatible layouts, bug)
    HANDSHAKE_TIMEOUT = "handshake_timeout"  # it ran past its bound: abandoned, its late result dropped
    DISCONNECTED = "disconnected"            # NIXL PeerGoneError, or the side channel's connection closed
    RESTARTED = "restarted"                  # a prefill rank answered "restarted": a new process
    CLOSE = "close"                          # release everything (forgotten, replaced, reaped, closing)


S, E = PeerState, PeerEvent
TRANSITIONS: dict[PeerState, dict[PeerEvent, PeerState]] = {
    S.CONNECTING: {E.CONNECTED: S.LIVE, E.HANDSHAKE_FAILED: S.LOST, E.HANDSHAKE_TIMEOUT: S.LOST,
                   E.CLOSE: S.RETIRED},
    S.LIVE: {E.DISCONNECTED: S.LOST, E.RESTARTED: S.LOST, E.CLOSE: S.RETIRED},
    S.LOST: {E.DISCONNECTED: S.LOST, E.RESTARTED: S.LOST, E.CLOSE: S.RETIRED},
    S.RETIRED: {},
}
TERMINAL = frozenset(s for s, t in TRANSITIONS.items() if not t)


def next_state(state: PeerState, event: PeerEvent) -> PeerState:
    return step(TRANSITIONS, state, event, "peer")


class SideChannel:
    """The side channel of one peer: one ZMQ ROUTER connected to each prefill rank's endpoint, the
    connection to rank ``(pp, tp)`` addressed by routing id ``b"pp.tp"`` (``CONNECT_ROUTING_ID``, so
    messages queue from the moment of ``connect``, as on a DEALER), and one monitor of TCP disconnects
    (``EVENT_DISCONNECTED`` names the endpoint, hence the rank). Replies of every rank arrive on the one
    socket; :meth:`recv` hands each rank its own (others wait in per-rank queues)."""

    SOCKETS = 3  # ZMQ sockets it holds: the ROUTER, its monitor pair
    FDS = 3      # file descriptors besides one TCP connection per rank: the three sockets' mailboxes
    open_in_process = 0  # channels open in this process (every decode rank in it shares ZMQ's context)

    def __init__(self, ctx: zmq.Context[Any], endpoints: dict[Rank, str]):
        self.sock = ctx.socket(zmq.ROUTER)
        SideChannel.open_in_process += 1
        self._open = True
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown routing id raises, never drops silently
        self.mon: Any = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.rid: dict[Rank, bytes] = {}
        self.rank_of: dict[bytes, Rank] = {}
        self.by_endpoint: dict[bytes, Rank] = {}
        self.inbox: dict[Rank, deque[list[bytes]]] = {}
        self.down: set[Rank] = set()
        # the poller's touched channels (runtime/poller.py), while registered: a send, or a disconnect not
        # handed out yet, puts this channel there (its descriptor may not announce what follows)
        self.watch: dict[SideChannel, None] | None = None
        for prank, ep in endpoints.items():
            rid = f"{prank[0]}.{prank[1]}".encode()
            self.rid[prank], self.rank_of[rid] = rid, prank
            self.by_endpoint[f"tcp://{ep}".encode()] = prank
            self.inbox[prank] = deque()
            self.sock.setsockopt(zmq.CONNECT_ROUTING_ID, rid)
            try:
                self.sock.connect(f"tcp://{ep}")
            except zmq.ZMQError as e:
                self.close()
                raise HandshakeError(f"cannot open the side channel to prefill rank {prank} at {ep!r} ({e}); "
                                     "give endpoints as host:port") from None

    def fds(self) -> tuple[int, int]:
        """The descriptors that announce its two sockets (``ZMQ_FD``: edge-style, see runtime/poller.py)."""
        return int(self.sock.get(zmq.FD)), int(self.mon.get(zmq.FD))

    def send(self, prank: Rank, frames: list[bytes], flags: int = 0) -> None:
        if self.watch is not None:  # sending may consume the socket's signal of a reply: look again
            self.watch[self] = None
        self.sock.send_multipart([self.rid[prank], *frames], flags)

    def recv(self, prank: Rank, flags: int = 0) -> list[bytes]:
        """The next message of ``prank``; ``zmq.Again`` when it has none now."""
        box = self.inbox[prank]
        while not box:
            rid, *frames = self.sock.recv_multipart(flags)
            other = self.rank_of.get(rid)
            if other is not None:
                self.inbox[other].append(frames)
        return box.popleft()

    def recv_any(self) -> tuple[Rank, list[bytes]] | None:
        """The next message of any rank, in arrival order (``None``: none now, and ``ZMQ_EVENTS`` says so,
        which leaves the socket's descriptor accurate). Raises ``zmq.ZMQError`` once closed."""
        for prank, box in self.inbox.items():
            if box:
                return prank, box.popleft()
        while int(self.sock.get(_EVENTS)) & _POLLIN:
            try:
                rid, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            other = self.rank_of.get(rid)
            if other is not None:
                return other, frames
        return None

    def poll_monitor(self) -> set[Rank]:
        """Drain the monitor: the ranks whose TCP connection closed and that :meth:`disconnected` has not
        reported yet."""
        while True:
            try:
                ev = _recv_monitor(self.mon)
            except zmq.ZMQError:
                break
            if ev is None:
                break
            event, endpoint = ev
            if event == zmq.EVENT_DISCONNECTED and endpoint in self.by_endpoint:
                self.down.add(self.by_endpoint[endpoint])
        return self.down

    def disconnected(self, prank: Rank) -> bool:
        """Whether ``prank``'s TCP connection closed since the last call (drains the monitor; other ranks
        found closed stay for their own call, and the channel is looked at on the next poll)."""
        down = self.poll_monitor()
        hit = prank in down
        down.discard(prank)
        if down and self.watch is not None:
            self.watch[self] = None
        return hit

    @property
    def buffered(self) -> bool:
        """Replies already taken off the socket for some rank, not handed out yet (no socket event will
        announce them: poll before waiting)."""
        return any(self.inbox.values())

    def close(self) -> None:
        if self._open:
            self._open = False
            SideChannel.open_in_process -= 1
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.mon.close(0)
        self.sock.close(0)


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: enum ops cost µs


def _recv_monitor(mon: Any) -> tuple[int, bytes] | None:
    """(event, endpoint) of the next monitor message, None when there is none."""
    if not mon.get(_EVENTS) & _POLLIN:
        return None
    try:
        msg = recv_monitor_message(mon, zmq.NOBLOCK)
    except zmq.Again:
        return None
    return int(msg["event"]), bytes(msg["endpoint"])


class RankSocket:
    """One prefill rank's end of a :class:`SideChannel`, as a socket (``send_multipart``/``recv_multipart``)."""

    __slots__ = ("channel", "prank")

    def __init__(self, channel: Any, prank: Rank):
        self.channel, self.prank = channel, prank

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.channel.send(self.prank, frames, flags)

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        return self.channel.recv(self.prank, flags)  # type: ignore[no-any-return]


class Peer:
    """One prefill engine id on this decode rank, from connect to retirement (see the module docstring).

    ``transport``: what adds and removes NIXL agents and prepared lists (``remove_peer``, ``unprepare``).
    ``open_channel``: ``endpoints -> side channel`` (:class:`SideChannel`), injected so the lifecycle is
    testable without sockets."""

    def __init__(self, engine_id: str, endpoints: dict[Rank, str], *, started: float = 0.0,
                 bound_s: float = float("inf"), future: Future[Any] | None = None,
                 pending: Collection[Any] = (), why: str = "", phase: list[str] | None = None):
        self.engine_id, self.endpoints = engine_id, dict(endpoints)
        self.state = PeerState.CONNECTING
        self.started, self.bound_s, self.why = started, bound_s, why
        self.future = future            # background handshake -> (RemoteEngine, prepared lists)
        self.phase = phase if phase is not None else ["queued"]  # the step that handshake is at (its thread writes)
        # (file descriptors open, the soft limit) as the background handshake ended (its thread writes):
        # the side channel's budget is checked against it, not counted again on the caller's thread
        self.fds: tuple[int, int] | None = None
        self._pending: list[Any] = list(pending)  # ReadRequests started while connecting (only its methods change it)
        self.error = ""                 # why the handshake failed (LOST from CONNECTING)
        self.remote: RemoteEngine | None = None
        self.prepped: dict[Rank, Prepared] = {}
        self.channel: Any = None              # the side channel (SideChannel), while open
        self.socks: dict[Rank, RankSocket] = {}  # prefill rank -> its end of the side channel (RankSocket)
        self.outbox: dict[Rank, list[tuple[str, int, str]]] = {}      # acquires (req_id, attempt, key)
        self.heartbeats: dict[Rank, list[tuple[str, int, str]]] = {}  # heartbeats, the same
        self.unsent: list[tuple[Rank, list[bytes]]] = []  # frames ZMQ could not queue yet
        # the table's peers with something to send (outbox, heartbeats, unsent), once installed: a flush
        # looks only at those
        self.todo: dict[Peer, None] | None = None
        self.gone: set[Rank] = set()          # prefill ranks whose agent was reported dead
        self._removed: set[Rank] = set()      # prefill ranks whose agent was removed from the transport
        self.progress: dict[Rank, float] = {}  # prefill rank -> last time a read from it completed
        self.not_before = 0.0                 # LOST: reaped no earlier than this (monotonic)
        self.used = started                   # last time a read or a connect asked for it (idle eviction)
        self.running: float | None = None     # when its handshake thread started (None: queued or not background)
        # the prefill engine accepted the handshake's first connection (its thread writes): a re-handshake's
        # short bound (fail fast on a dead engine) no longer applies, the whole handshake's bound does
        self.reached = False
        self.closes = 0                       # how many times close() released anything (0 or 1)

    # ---- lifecycle --------------------------------------------------------------------------------
    def fire(self, event: PeerEvent) -> PeerState:
        self.state = next_state(self.state, event)
        return self.state

    @property
    def live(self) -> bool:
        return self.state is PeerState.LIVE

    @property
    def connecting(self) -> bool:
        return self.state is PeerState.CONNECTING

    def adopt(self, remote: RemoteEngine, prepped: dict[Rank, Prepared] | None) -> None:
        """Take ownership of a handshake's result (its agents were added to the transport, its lists
        prepared): from now on :meth:`close` releases them."""
        self.remote, self.prepped = remote, dict(prepped or {})

    def connected(self, remote: RemoteEngine, prepped: dict[Rank, Prepared] | None,
                  open_channel: Callable[[dict[Rank, str]], Any]) -> None:
        """CONNECTING -> LIVE: own the handshake's result and open the side channel
        (``open_channel({prefill rank: endpoint})``) to the prefill ranks this decode rank asks."""
        next_state(self.state, PeerEvent.CONNECTED)  # an illegal event raises before anything opens
        channel = open_channel({p: self.endpoints[p] for p in remote.side_ranks})  # may raise: still CONNECTING
        self.fire(PeerEvent.CONNECTED)
        self.adopt(remote, prepped)
        self.future = None
        self.channel = channel
        self.socks = {p: RankSocket(channel, p) for p in remote.side_ranks}

    def lose(self, event: PeerEvent, not_before: float, why: str = "") -> None:
        """LIVE/CONNECTING -> LOST (no new reads); reaped no earlier than ``not_before``."""
        self.fire(event)
        self.not_before = max(self.not_before, not_before)
        if why:
            self.error = why

    # ---- the reads waiting for its handshake (only these methods change them) ---------------------
    @property
    def pending(self) -> tuple[Any, ...]:
        """The reads queued behind its handshake, in order (read-only: :meth:`queue_pending`,
        :meth:`take_pending`)."""
        return tuple(self._pending)

    @property
    def waiting(self) -> int:
        """How many reads are queued behind its handshake."""
        return len(self._pending)

    def queue_pending(self, req: Any) -> bool:
        """Queue ``req`` (a :class:`~kvbridge.runtime.request.ReadRequest`) until the handshake is done;
        False, and nothing queued, if a read of the same key waits already."""
        if any(p.key == req.key for p in self._pending):
            return False
        self._pending.append(req)
        return True

    def take_pending(self) -> list[Any]:
        """The queued reads, in order, leaving none queued (the caller starts, hands over or fails them)."""
        out, self._pending = self._pending, []
        return out

    @property
    def settled(self) -> bool:
        """No background handshake is still running for it (a late result would need releasing)."""
        return self.future is None or self.future.done()

    def close(self, transport: Transport, keep_agents: Collection[str] = ()) -> None:
        """-> RETIRED: close the sockets and monitors, release the prepared lists and remove the NIXL
        agents (except ``keep_agents``, used by another live peer), exactly once; a later call only
        releases the late result of a handshake that was still running (never anything twice)."""
        if self.state is not PeerState.RETIRED:
            self.fire(PeerEvent.CLOSE)
            self.closes += 1
            self._release(transport, keep_agents)
        self._drop_late_result(transport, keep_agents)

    def _release(self, transport: Transport, keep_agents: Collection[str]) -> None:
        if self.channel is not None:
            self.channel.close()
        self.channel, self.socks = None, {}
        prepped, self.prepped = self.prepped, {}
        for p in prepped.values():
            transport.unprepare(p)
        if self.remote is not None:
            left = {p: a for p, a in self.remote.agents.items() if p not in self._removed and a not in keep_agents}
            self._removed.update(left)
            for agent in sorted(set(left.values())):
                transport.remove_peer(agent)
        self.outbox, self.heartbeats, self.unsent, self._pending = {}, {}, [], []
        if self.todo is not None:
            self.todo.pop(self, None)

    def _drop_late_result(self, transport: Transport, keep_agents: Collection[str]) -> None:
        """An abandoned (or closed-while-connecting) handshake's thread returned: release what it made."""
        fut = self.future
        if fut is None or not fut.done():
            return
        self.future = None
        if fut.cancelled() or fut.exception() is not None:
            return
        remote, prepped = fut.result()
        for p in (prepped or {}).values():
            transport.unprepare(p)
        for agent in set(remote.agents.values()) - set(keep_agents):
            transport.remove_peer(agent)

    # ---- what the handshake learned --------------------------------------------------------------
    def _r(self) -> RemoteEngine:
        if self.remote is None:
            raise IllegalTransition(f"peer {self.engine_id!r} is {self.state.name}: it has no handshake result")
        return self.remote

    @property
    def agents(self) -> dict[Rank, str]:
        return self._r().agents

    @property
    def readers(self) -> dict[Rank, int]:
        return self._r().readers

    @property
    def digests(self) -> dict[Rank, str]:
        return self._r().digests

    @property
    def modes(self) -> dict[Rank, TransferPath]:
        return self._r().modes

    @property
    def shapes(self) -> dict[Rank, PairShape]:
        return self._r().shapes

    @property
    def can_stage(self) -> frozenset[Rank]:
        return self._r().can_stage

    @property
    def lowered(self) -> Any:
        return self._r().lowered

    @property
    def layout(self) -> Any:
        return self._r().layout

    @property
    def plan(self) -> Any:
        return self._r().plan

    @property
    def stage_socks(self) -> dict[Rank, RankSocket]:
        """prefill rank -> DEALER (the sockets this peer owns)."""
        return self.socks

    def summary(self) -> dict[str, Any]:
        return self._r().summary()

    def agent_gone(self, prank: Rank) -> str | None:
        """The transport reported the agent of ``prank`` disconnected: it is not named any more (no
        notifications to it); :meth:`remove_agent` removes it from the transport. Returns its name."""
        self.gone.add(prank)
        return self.remote.agents.get(prank) if self.remote is not None else None

    def remove_agent(self, prank: Rank, transport: Transport) -> None:
        """Remove the agent of ``prank`` from the transport now (once; :meth:`close` removes the rest)."""
        if self.remote is not None and prank not in self._removed and prank in self.remote.agents:
            self._removed.add(prank)
            transport.remove_peer(self.remote.agents[prank])

    def agent(self, prank: Rank) -> str | None:
        """The NIXL agent of ``prank`` while it is usable: not reported dead, peer not retired (a lost
        peer's other agents stay until it is reaped, so failed reads can still release their pins)."""
        if self.remote is None or prank in self.gone or self.state is PeerState.RETIRED:
            return None
        return self.remote.agents.get(prank)

    # ---- side channel ----------------------------------------------------------------------------
    def wait_sockets(self) -> list[Any]:
        """The ZMQ sockets to wait on for this peer's side channel (its socket and monitor; none once
        closed). Check :attr:`buffered` first: a reply may already wait in the channel."""
        ch = self.channel
        return [ch.sock, ch.mon] if isinstance(ch, SideChannel) else []

    @property
    def buffered(self) -> bool:
        return self.channel is not None and bool(self.channel.buffered)

    def disconnected(self, prank: Rank) -> bool:
        """The side channel's TCP connection to ``prank`` closed (a ZMQ monitor event, never text)."""
        return self.channel is not None and prank in self.socks and bool(self.channel.disconnected(prank))

    def send(self, prank: Rank, frames: list[bytes]) -> None:
        """Queue a side-channel message without blocking; what ZMQ cannot take now is kept in the outbox
        and retried by :meth:`retry_unsent` (the read's deadline bounds the wait). A closed socket (or
        none: the peer was closed) drops it: the read fails on its deadline."""
        sock = self.socks.get(prank)
        if sock is None:
            return
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self.unsent.append((prank, frames))
            if self.todo is not None:
                self.todo[self] = None
        except zmq.ZMQError:
            pass

    def retry_unsent(self) -> None:
        unsent, self.unsent = self.unsent, []
        for prank, frames in unsent:
            self.send(prank, frames)

    def queue(self, box: dict[Rank, list[tuple[str, int, str]]], prank: Rank, item: tuple[str, int, str]) -> None:
        box.setdefault(prank, []).append(item)
        if self.todo is not None:
            self.todo[self] = None

    def take_outbox(self) -> dict[Rank, list[tuple[str, int, str]]]:
        """The batched acquires queued so far (per prefill rank), leaving the outbox empty."""
        out, self.outbox = self.outbox, {}
        return out

    def take_heartbeats(self) -> dict[Rank, list[tuple[str, int, str]]]:
        """The batched heartbeats queued so far (per prefill rank), leaving none queued."""
        out, self.heartbeats = self.heartbeats, {}
        return out

    def record_progress(self, prank: Rank, now: float) -> None:
        """A read from ``prank`` completed at ``now`` (the peer is alive: other reads' deadlines re-arm)."""
        if now > self.progress.get(prank, float("-inf")):
            self.progress[prank] = now

    def progress_of(self, prank: Rank) -> float:
        """When a read from ``prank`` last completed (-inf: never)."""
        return self.progress.get(prank, float("-inf"))

    def __repr__(self) -> str:
        return f"Peer({self.engine_id!r}, {self.state.name})"
