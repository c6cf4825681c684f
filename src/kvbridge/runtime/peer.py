"""A prefill engine as one decode rank sees it: one object with a lifecycle that owns what it holds.

A :class:`Peer` is made when the decode rank first connects to a prefill engine id and lives until it
is retired; a re-handshake (restart, changed endpoints, another transfer mode) makes a new one. It
owns, once the handshake is done:

* the handshake's result (:class:`~kvbridge.runtime.handshake.RemoteEngine`: layout, plan, lowered plan,
  NIXL agent per prefill rank) and the NIXL agents that handshake added to the transport;
* the prepared descriptor lists per prefill rank (:mod:`~kvbridge.runtime.prepped_hook`);
* one ZMQ DEALER per prefill rank (acquire, stage and heartbeat requests) and its monitor socket
  (the side channel's TCP connection closing is the earliest sign of a dead prefill process);
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
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import zmq

from ..errors import IllegalTransition
from .readstate import step

if TYPE_CHECKING:
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


class Peer:
    """One prefill engine id on this decode rank, from connect to retirement (see the module docstring).

    ``transport``: what adds and removes NIXL agents and prepared lists (``remove_peer``, ``unprepare``).
    ``monitor``: ``socket -> monitor socket or None`` (ZMQ ``get_monitor_socket``), injected so the
    lifecycle is testable without sockets."""

    def __init__(self, engine_id: str, endpoints: dict[Rank, str], *, started: float = 0.0,
                 bound_s: float = float("inf"), future: Future[Any] | None = None,
                 pending: Collection[Any] = (), why: str = "", phase: list[str] | None = None):
        self.engine_id, self.endpoints = engine_id, dict(endpoints)
        self.state = PeerState.CONNECTING
        self.started, self.bound_s, self.why = started, bound_s, why
        self.future = future            # background handshake -> (RemoteEngine, prepared lists)
        self.phase = phase if phase is not None else ["queued"]  # the step that handshake is at (its thread writes)
        self.pending: list[Any] = list(pending)  # ReadRequests started while connecting
        self.error = ""                 # why the handshake failed (LOST from CONNECTING)
        self.remote: RemoteEngine | None = None
        self.prepped: dict[Rank, Any] = {}
        self.socks: dict[Rank, Any] = {}      # prefill rank -> DEALER
        self.monitors: dict[Rank, Any] = {}   # prefill rank -> its monitor socket
        self.outbox: dict[Rank, list[tuple[str, int, str]]] = {}      # acquires (req_id, attempt, key)
        self.heartbeats: dict[Rank, list[tuple[str, int, str]]] = {}  # heartbeats, the same
        self.unsent: list[tuple[Rank, list[bytes]]] = []  # frames ZMQ could not queue yet
        self.gone: set[Rank] = set()          # prefill ranks whose agent was reported dead
        self._removed: set[Rank] = set()      # prefill ranks whose agent was removed from the transport
        self.progress: dict[Rank, float] = {}  # prefill rank -> last time a read from it completed
        self.not_before = 0.0                 # LOST: reaped no earlier than this (monotonic)
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

    def adopt(self, remote: RemoteEngine, prepped: dict[Rank, Any] | None) -> None:
        """Take ownership of a handshake's result (its agents were added to the transport, its lists
        prepared): from now on :meth:`close` releases them."""
        self.remote, self.prepped = remote, dict(prepped or {})

    def connected(self, remote: RemoteEngine, prepped: dict[Rank, Any] | None,
                  open_sock: Callable[[str], tuple[Any, Any]]) -> None:
        """CONNECTING -> LIVE: own the handshake's result and open one side-channel socket and its
        monitor (``open_sock(endpoint) -> (socket, monitor or None)``) per prefill rank this decode
        rank asks."""
        self.fire(PeerEvent.CONNECTED)
        self.adopt(remote, prepped)
        self.future = None
        for prank in remote.side_ranks:
            sock, mon = open_sock(self.endpoints[prank])
            self.socks[prank] = sock
            if mon is not None:
                self.monitors[prank] = mon

    def lose(self, event: PeerEvent, not_before: float, why: str = "") -> None:
        """LIVE/CONNECTING -> LOST (no new reads); reaped no earlier than ``not_before``."""
        self.fire(event)
        self.not_before = max(self.not_before, not_before)
        if why:
            self.error = why

    @property
    def settled(self) -> bool:
        """No background handshake is still running for it (a late result would need releasing)."""
        return self.future is None or self.future.done()

    def close(self, transport: Any, keep_agents: Collection[str] = ()) -> None:
        """-> RETIRED: close the sockets and monitors, release the prepared lists and remove the NIXL
        agents (except ``keep_agents``, used by another live peer), exactly once; a later call only
        releases the late result of a handshake that was still running (never anything twice)."""
        if self.state is not PeerState.RETIRED:
            self.fire(PeerEvent.CLOSE)
            self.closes += 1
            self._release(transport, keep_agents)
        self._drop_late_result(transport, keep_agents)

    def _release(self, transport: Any, keep_agents: Collection[str]) -> None:
        for prank, sock in self.socks.items():
            mon = self.monitors.get(prank)
            if mon is not None:
                try:
                    sock.disable_monitor()
                except Exception:  # noqa: BLE001 - ZMQError, or a socket that has no monitor API
                    pass
                mon.close(0)
            sock.close(0)
        self.socks, self.monitors = {}, {}
        prepped, self.prepped = self.prepped, {}
        for p in prepped.values():
            transport.unprepare(p)
        if self.remote is not None:
            left = {p: a for p, a in self.remote.agents.items() if p not in self._removed and a not in keep_agents}
            self._removed.update(left)
            for agent in sorted(set(left.values())):
                transport.remove_peer(agent)
        self.outbox, self.heartbeats, self.unsent, self.pending = {}, {}, [], []

    def _drop_late_result(self, transport: Any, keep_agents: Collection[str]) -> None:
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
    def modes(self) -> dict[Rank, str]:
        return self._r().modes

    @property
    def shapes(self) -> dict[Rank, Any]:
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
    def stage_socks(self) -> dict[Rank, Any]:
        """prefill rank -> DEALER (the sockets this peer owns)."""
        return self.socks

    def summary(self) -> dict[str, Any]:
        return self._r().summary()

    def agent_gone(self, prank: Rank) -> str | None:
        """The transport reported the agent of ``prank`` disconnected: it is not named any more (no
        notifications to it); :meth:`remove_agent` removes it from the transport. Returns its name."""
        self.gone.add(prank)
        return self.remote.agents.get(prank) if self.remote is not None else None

    def remove_agent(self, prank: Rank, transport: Any) -> None:
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
    def disconnected(self, prank: Rank, recv_event: Callable[[Any], int | None]) -> bool:
        """The side channel's TCP connection to ``prank`` closed: drains the monitor; ``recv_event``
        returns the next ZMQ event code, or None when there is none."""
        mon = self.monitors.get(prank)
        if mon is None:
            return False
        seen = False
        while True:
            ev = recv_event(mon)
            if ev is None:
                return seen
            seen = seen or ev == zmq.EVENT_DISCONNECTED

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
        except zmq.ZMQError:
            pass

    def retry_unsent(self) -> None:
        unsent, self.unsent = self.unsent, []
        for prank, frames in unsent:
            self.send(prank, frames)

    def queue(self, box: dict[Rank, list[tuple[str, int, str]]], prank: Rank, item: tuple[str, int, str]) -> None:
        box.setdefault(prank, []).append(item)

    def __repr__(self) -> str:
        return f"Peer({self.engine_id!r}, {self.state.name})"
