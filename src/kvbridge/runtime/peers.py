"""A decode rank's prefill peers, by engine id, and the steps of their lifecycle.

:class:`PeerTable` owns the peers (the current one per engine id, CONNECTING or LIVE, and the old
ones: LOST peers not reaped yet, retired ones whose background handshake still runs), the endpoints
last given per engine id, and the background handshake pool. It moves peers through their lifecycle
(:mod:`~kvbridge.runtime.peer`: connect in the background, install, abandon, mark lost, reap, drop,
evict) and never touches a read: where a step concerns reads it returns a typed result
(:class:`Ready`, :class:`Unreachable`) or asks the caller through an explicit callback (``in_use``,
``drop_reads``, ``forget``), so the decode rank decides what happens to them.

What happens to an engine id's current peer when a new one is wanted (a handshake, a connect to other
endpoints, a re-handshake after a restart or a disconnect) is decided in one place,
:meth:`PeerTable.replace`::

    current peer     replace(engine id)
    none             nothing
    LIVE             forget(engine id, why): the caller fails its reads, the peer is closed
    CONNECTING       abandoned (retired; what its thread still makes is released when it returns);
                     its queued reads are handed to the new peer
    (then)           the engine id's LOST peers are reaped now (their reads fail), so its agents go
                     before they are added again

:meth:`PeerTable.reconnect` is that step followed by a background handshake; :meth:`PeerTable.requeue`
decides where reads re-queued after a restart or a disconnect wait (the engine id's connecting peer, or
the old peer marked lost and a new one begun within ``rehandshake_timeout_s``). Which reads are re-queued
(those holding nothing yet, once per read) is the decode rank's call: it looks at the reads.

Idle peers (no read or connect asked for them for ``idle_s``; none of their reads in flight) are
released (sockets, NIXL agents, prepared lists) and handshaken again on their next read; past
``max_peers`` live peers the least recently used idle ones go first (both set by
:class:`~kvbridge.runtime.config.DecodeConfig`: ``peer_idle_s``, ``max_peers``). Each peer holds one side channel
(:class:`~kvbridge.runtime.peer.SideChannel`: three ZMQ sockets, one TCP connection per prefill rank);
opening one that would leave fewer than :data:`FD_RESERVE` of the process's file descriptors (or ZMQ's
socket limit) fails the handshake, typed, before anything runs out.

What a poll looks at grows with the work, not with the peers: every open side channel is registered in one
:class:`~kvbridge.runtime.poller.ChannelPoller` (from install until it closes) that gives the channels with
something to read; :attr:`PeerTable.todo` holds the peers with something to send (marked by
:meth:`Peer.queue <kvbridge.runtime.peer.Peer.queue>` and by frames ZMQ could not take);
:attr:`PeerTable.handshaking` the background handshakes. Only eviction looks at every live peer, at most
once a second.

Handshakes run on a pool of :data:`HANDSHAKE_THREADS` threads; a handshake's bound
(``connect_timeout_s``) counts from when its thread starts it, not while it waits in the queue (a
queued handshake waits at most :data:`QUEUE_BOUNDS` bounds).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

try:
    import resource
except ImportError:  # not on this platform: the budget is not checked
    resource = None  # type: ignore[assignment]

from ..errors import HandshakeError, HandshakeFailed, IncompatibleLayoutsError, TransferError
from ..transport.base import Transport
from .metrics import Metrics
from .peer import Peer, PeerEvent, PeerState, Rank, SideChannel
from .poller import ChannelPoller, PollWork

if TYPE_CHECKING:
    from ..prepped import Prepared
    from .handshake import Handshaker, RemoteEngine
    from .request import ReadRequest


HANDSHAKE_THREADS = 4  # background handshakes at once (the CPU part holds the GIL; the rest waits on the network)
QUEUE_BOUNDS = 4       # a queued handshake waits at most this many connect_timeout_s for a thread
FD_RESERVE = 256       # file descriptors left for everything else (NIXL, the engine) when opening a side channel
REHANDSHAKE = "the prefill engine is handshaken again"  # why a live peer is forgotten for a re-handshake


def fd_budget() -> tuple[int, int] | None:
    """(file descriptors open, the process's soft limit), or None where they cannot be read."""
    if resource is None:
        return None
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return len(os.listdir("/proc/self/fd")), soft
    except OSError:
        return None


@dataclass
class Ready:
    """A background handshake finished: ``peer`` is LIVE (sockets open); its queued reads may start."""

    peer: Peer
    pending: list[ReadRequest]


@dataclass
class Unreachable:
    """A background handshake failed or ran past its bound: ``peer`` is LOST; its queued reads fail
    with these failures."""

    peer: Peer
    failures: list[tuple[ReadRequest, HandshakeFailed]]


class PeerTable:
    """The prefill peers of one decode rank (see the module docstring)."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        transport: Transport,
        metrics: Metrics,
        handshaker: Callable[[], Handshaker],
        engine_id: str,
        connect_timeout_s: float,
        rehandshake_timeout_s: float,
        idle_s: float,
        max_peers: int,
        threads: int = HANDSHAKE_THREADS,
    ):
        if idle_s <= 0 or max_peers < 1 or threads < 1:
            raise ValueError(f"peer_idle_s must be > 0 (got {idle_s}), max_peers >= 1 (got {max_peers}) and "
                             f"handshake threads >= 1 (got {threads})")
        self.ctx, self.transport, self.metrics, self.handshaker = ctx, transport, metrics, handshaker
        self.idle_s, self.max_peers, self.threads = float(idle_s), int(max_peers), int(threads)
        self.evicted: set[str] = set()  # engine ids released idle: handshaken again on their next read
        self._next_evict = 0.0
        self.channels = 0  # side channels open (SideChannel.SOCKETS ZMQ sockets each)
        self.engine_id = engine_id
        # engine id -> its current Peer (CONNECTING or LIVE); a background handshake is bounded as a whole
        # by connect_timeout_s
        self.current: dict[str, Peer] = {}
        self.old: list[Peer] = []  # LOST peers not reaped yet, and retired ones whose handshake still runs
        self.endpoints: dict[str, dict[Rank, str]] = {}  # engine id -> the endpoints last given (re-handshake)
        self.connect_timeout_s = connect_timeout_s
        # reads re-queued after their engine restarted or disconnected wait at most this long for it
        self.rehandshake_timeout_s = rehandshake_timeout_s
        self.pool: ThreadPoolExecutor | None = None
        # what a poll looks at grows with the work, not with the peers: the side channels by their
        # descriptors (one poller), the peers with something to send, the handshakes in flight
        self.work = PollWork()
        self.poller = ChannelPoller(self.work)
        self.todo: dict[Peer, None] = {}         # peers with queued acquires, heartbeats or unsent frames
        self.handshaking: dict[Peer, None] = {}  # peers begun in the background (pruned once not connecting)

    # ---- views ---------------------------------------------------------------------------------
    def get(self, engine_id: str) -> Peer | None:
        """The current peer of ``engine_id`` (asking counts as a use: it is not idle)."""
        peer = self.current.get(engine_id)
        if peer is not None:
            peer.used = time.monotonic()
        return peer

    @property
    def remotes(self) -> dict[str, Peer]:
        """{engine id: live peer}."""
        return {eid: p for eid, p in self.current.items() if p.state is PeerState.LIVE}

    def live_agents(self) -> set[str]:
        return {a for p in self.current.values() if p.live for a in p.agents.values()}

    def active(self) -> list[Peer]:
        """Peers with open sockets: live ones, and lost ones not yet reaped (reads may still use them)."""
        out = [p for p in self.current.values() if p.live]
        return out + [p for p in self.old if p.state is PeerState.LOST and p.remote is not None] if self.old else out

    def _connecting(self) -> list[Peer]:
        """The current peers whose background handshake runs (O(handshakes), not O(peers))."""
        return [p for p in self.handshaking if p.connecting and self.current.get(p.engine_id) is p]

    def connecting(self) -> bool:
        return bool(self.handshaking) and bool(self._connecting())

    @property
    def waiting(self) -> int:
        """Reads queued behind a background handshake."""
        return sum(p.waiting for p in self._connecting())

    def take_todo(self) -> list[Peer]:
        """The peers with something to send (queued acquires or heartbeats, frames ZMQ could not take),
        in the order they had it; none are left marked (sending what stays unsent marks them again)."""
        out = list(self.todo)
        self.todo.clear()
        self.work.flushed += len(out)
        return out

    def sending(self, heartbeats: bool = True) -> bool:
        """Some peer has acquires (or heartbeats) queued, or frames ZMQ could not take yet."""
        return any(p.outbox or p.unsent or (heartbeats and p.heartbeats) for p in self.todo)

    # ---- lifecycle -----------------------------------------------------------------------------
    def check_budget(self, engine_id: str, ranks: int, fds: tuple[int, int] | None = None) -> None:
        """Raise :class:`HandshakeError` if a side channel to ``ranks`` prefill ranks would leave fewer
        than :data:`FD_RESERVE` file descriptors, or pass ZMQ's socket limit (``fds``: the count of
        :func:`fd_budget` made already, e.g. by the handshake's thread; else counted now)."""
        need = ranks + SideChannel.FDS
        fds = fds if fds is not None else fd_budget()
        if fds is not None and fds[0] + need > fds[1] - FD_RESERVE:
            raise HandshakeError(
                f"no file descriptors left for the side channel to prefill engine {engine_id!r} ({ranks} ranks: "
                f"{need} descriptors): {fds[0]} of the process's {fds[1]} are open and {FD_RESERVE} stay "
                f"reserved; raise the limit (ulimit -n), release idle peers sooner (peer_idle_s, max_peers, "
                f"now {self.idle_s:g} s and {self.max_peers}) or give this decode rank fewer prefill engines")
        max_sockets = int(self.ctx.get(zmq.MAX_SOCKETS))
        open_now = SideChannel.open_in_process
        if (open_now + 1) * SideChannel.SOCKETS > max_sockets - FD_RESERVE // 4:
            raise HandshakeError(
                f"ZMQ's socket limit ({max_sockets}, zmq.MAX_SOCKETS of the context) leaves no room for the side "
                f"channel to prefill engine {engine_id!r} ({open_now} open in this process, {SideChannel.SOCKETS} "
                f"sockets each); raise the context's MAX_SOCKETS or lower max_peers ({self.max_peers})")

    def open_channel(self, endpoints: dict[Rank, str]) -> SideChannel:
        ch = SideChannel(self.ctx, endpoints)
        self.channels += 1
        close = ch.close

        def closed() -> None:
            self.channels -= 1
            self.poller.remove(ch)  # before its sockets close (their descriptor numbers may be reused)
            close()
        ch.close = closed  # type: ignore[method-assign]
        return ch

    def install(self, peer: Peer, remote: RemoteEngine, prepped: dict[Rank, Prepared] | None) -> list[ReadRequest]:
        """CONNECTING -> LIVE: the peer owns the handshake's result and opens its side channel (on this
        thread). Returns its queued reads (the caller starts them). Raises :class:`HandshakeError`,
        before the peer changes and with the handshake's agents and lists released, if the channel does not
        fit the budget (:meth:`check_budget`) or cannot be opened."""
        try:
            self.check_budget(peer.engine_id, len(remote.side_ranks), peer.fds)
            peer.connected(remote, prepped, self.open_channel)
            peer.todo = self.todo
            if isinstance(peer.channel, SideChannel):
                self.poller.add(peer, peer.channel)
        except HandshakeError:  # release what the handshake made (agents another live peer uses stay)
            for prep in (prepped or {}).values():
                self.transport.unprepare(prep)
            for agent in set(remote.agents.values()) - self.live_agents():
                self.transport.remove_peer(agent)
            raise
        self.current[peer.engine_id] = peer
        peer.used = time.monotonic()
        self.evicted.discard(peer.engine_id)
        self.metrics.handshakes += 1
        return peer.take_pending()

    def replace(self, engine_id: str, why: str, forget: Callable[[str, str], None],
                in_use: Callable[[Peer], bool], drop_reads: Callable[[Peer], None]) -> list[ReadRequest]:
        """Make way for a new peer of ``engine_id`` (the table in the module docstring): a live one is
        forgotten (``forget(engine_id, why)``: the caller fails its reads and calls :meth:`drop_live`),
        a connecting one is abandoned and its queued reads are returned; then its lost peers are reaped."""
        cur = self.current.get(engine_id)
        pending: list[ReadRequest] = []
        if cur is not None and cur.live:
            forget(engine_id, why)
        elif cur is not None:
            pending = cur.take_pending()
            self.abandon(cur)
        self.reap(engine_id, in_use, drop_reads)
        return pending

    def reconnect(self, engine_id: str, endpoints: dict[Rank, str], why: str, forget: Callable[[str, str], None],
                  in_use: Callable[[Peer], bool], drop_reads: Callable[[Peer], None],
                  pending: Sequence[ReadRequest] = (), bound_s: float | None = None) -> Peer:
        """:meth:`replace` the current peer of ``engine_id`` (same callbacks), then :meth:`begin` a new one
        in the background: the reads a connecting one had queued wait on it first, then ``pending``."""
        handed = self.replace(engine_id, why, forget, in_use, drop_reads)
        return self.begin(engine_id, endpoints, handed + list(pending), bound_s)

    def requeue(self, old: Peer, reqs: Sequence[ReadRequest], event: PeerEvent, why: str,
                forget: Callable[[str, str], None], in_use: Callable[[Peer], bool],
                drop_reads: Callable[[Peer], None]) -> Peer:
        """Queue ``reqs`` (reads of ``old`` the caller took out of flight, none queued yet) behind a background
        re-handshake of ``old``'s engine after it restarted or disconnected (``event``), and return the peer
        they wait on: the engine id's connecting peer if there is one; otherwise ``old`` is lost now and a
        new peer begun (:meth:`reconnect`) to the endpoints last given, bounded by ``rehandshake_timeout_s``
        until the engine accepts a connection (a dead one must fail fast; :meth:`_bound`), ``why`` kept for
        its failures. The caller fails ``old``'s other reads first (``old``'s reaping would drop them)."""
        eid = old.engine_id
        endpoints = self.endpoints.get(eid, old.endpoints)
        cur = self.current.get(eid)
        if cur is None or not cur.connecting:
            self.mark_lost(old, event)
            # reaps the old peer; a re-handshake is bounded by rehandshake_timeout_s
            cur = self.reconnect(eid, endpoints, REHANDSHAKE, forget, in_use, drop_reads,
                                 bound_s=min(self.connect_timeout_s, self.rehandshake_timeout_s))
            cur.why = why
        for req in reqs:
            queued = cur.queue_pending(req)
            assert queued, f"read {req.key!r} queued twice"  # (keys in flight are never queued)
        return cur

    def begin(self, engine_id: str, endpoints: dict[Rank, str], pending: list[ReadRequest],
              bound_s: float | None = None) -> Peer:
        """A new CONNECTING peer for ``engine_id`` whose handshake runs on a background thread (the caller
        has dropped or abandoned the previous one)."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"kvbridge-handshake-{self.engine_id}")
        phase = ["queued behind other handshakes"]
        peer = Peer(engine_id, endpoints, started=time.monotonic(), pending=pending,
                    bound_s=self.connect_timeout_s if bound_s is None else bound_s, phase=phase)
        handshaker = self.handshaker()

        def reached() -> None:
            peer.reached = True
        handshaker.connected = reached
        handshaker.reached_timeout_s = self.connect_timeout_s  # (abandoned past _bound all the same)

        def run() -> tuple[RemoteEngine, dict[Rank, Prepared]]:
            peer.running = time.monotonic()  # the bound counts from here, not from the queue
            out = handshaker.background(engine_id, endpoints, phase)
            peer.fds = fd_budget()  # (counted here, off the caller's thread)
            return out
        peer.future = self.pool.submit(run)
        self.current[engine_id] = peer
        self.handshaking[peer] = None
        self.evicted.discard(engine_id)
        return peer

    def abandon(self, peer: Peer) -> None:
        """A connecting peer nobody waits for any more: retired now; what its handshake thread still
        adds is released when it returns (:meth:`reap`)."""
        if self.current.get(peer.engine_id) is peer:
            del self.current[peer.engine_id]
        peer.close(self.transport, self.live_agents())
        if not peer.settled and peer not in self.old:
            self.old.append(peer)

    def drop_live(self, engine_id: str) -> None:
        """Close the live peer of ``engine_id`` now (its reads have been failed by the caller)."""
        peer = self.current.get(engine_id)
        if peer is not None and peer.live:
            del self.current[engine_id]
            peer.close(self.transport, self.live_agents())

    def mark_lost(self, peer: Peer, event: PeerEvent, grace_s: float = 0.5) -> None:
        """LIVE/LOST -> LOST: no new reads; closed by :meth:`reap` once nothing references it."""
        if peer.state is PeerState.RETIRED:
            return
        peer.lose(event, time.monotonic() + grace_s)
        if self.current.get(peer.engine_id) is peer:
            del self.current[peer.engine_id]
        if peer not in self.old:
            self.old.append(peer)

    def advance(self, now: float) -> list[Ready | Unreachable]:
        """Install engines whose background handshake finished; lose those whose handshake failed or ran
        past its bound (``connect_timeout_s``). Returns what the caller must do with their queued reads."""
        out: list[Ready | Unreachable] = []
        for peer in list(self.handshaking):
            if not peer.connecting or self.current.get(peer.engine_id) is not peer:
                del self.handshaking[peer]  # installed, failed, abandoned or replaced
                continue
            self.work.connecting += 1
            assert peer.future is not None
            if peer.future.done():
                try:
                    remote, prepped = peer.future.result()
                except (HandshakeError, IncompatibleLayoutsError, TransferError) as e:
                    out.append(self._failed(peer, PeerEvent.HANDSHAKE_FAILED, str(e), now))
                    continue
                except Exception as e:  # noqa: BLE001 - a bug in the handshake fails its reads, not the engine
                    out.append(self._failed(peer, PeerEvent.HANDSHAKE_FAILED,
                                            f"internal error: {type(e).__name__}: {e}", now))
                    continue
                try:
                    out.append(Ready(peer, self.install(peer, remote, prepped)))
                except HandshakeError as e:  # no room for its side channel (what it made is released)
                    peer.future = None
                    out.append(self._failed(peer, PeerEvent.HANDSHAKE_FAILED, str(e), now))
            elif peer.running is not None and now - peer.running > (bound := self._bound(peer)):
                out.append(self._failed(peer, PeerEvent.HANDSHAKE_TIMEOUT, f"no handshake within {bound:g} s "
                                        "(prefill engine dead, frozen or unreachable; the handshake was at: "
                                        f"{peer.phase[0]})", now))
            elif peer.running is None and now - peer.started > QUEUE_BOUNDS * peer.bound_s:
                out.append(self._failed(peer, PeerEvent.HANDSHAKE_TIMEOUT, f"the handshake waited "
                                        f"{QUEUE_BOUNDS * peer.bound_s:g} s for a handshake thread (all "
                                        f"{self.threads} busy with other prefill engines)", now))
        return out

    def _bound(self, peer: Peer) -> float:
        """The running handshake's bound: its own (a re-handshake's short one fails a dead engine fast) until
        the engine accepted a connection; from then on at least a whole handshake's (``connect_timeout_s``):
        a restarted engine on a busy machine may take seconds to answer and probe, and its re-queued reads
        would otherwise fail on a live engine."""
        return max(peer.bound_s, self.connect_timeout_s) if peer.reached else peer.bound_s

    def _failed(self, peer: Peer, event: PeerEvent, why: str, now: float) -> Unreachable:
        del self.current[peer.engine_id]
        peer.lose(event, now, why)
        self.metrics.failed_handshakes += 1
        before = f"{peer.why}; re-handshake failed: " if peer.why else ""
        pending = peer.take_pending()
        failures = [(req, HandshakeFailed(
            f"request {req.req_id!r}: {before}cannot reach prefill engine {peer.engine_id!r}: {why}",
            req_id=req.req_id, engine_id=peer.engine_id)) for req in pending]
        self.old.append(peer)  # closed by reap (at once, or when an abandoned handshake returns)
        return Unreachable(peer, failures)

    def evict_idle(self, now: float, in_use: Callable[[Peer], bool]) -> list[str]:
        """Release live peers unused for ``idle_s`` (and, past ``max_peers``, the least recently used
        idle ones) that no read references and that have nothing queued to send; returns their engine
        ids (remembered: handshaken again on their next read). Looks at most every ``idle_s / 8``
        (and at least every second)."""
        if now < self._next_evict:
            return []
        self._next_evict = now + min(1.0, self.idle_s / 8)
        live = [p for p in self.current.values() if p.live]
        over = len(live) - self.max_peers
        if over <= 0 and not any(now - p.used > self.idle_s for p in live):
            return []
        out = []
        for peer in sorted(live, key=lambda p: p.used):
            if now - peer.used <= self.idle_s and over <= 0:
                break
            if in_use(peer) or peer.outbox or peer.unsent or peer.heartbeats:
                continue
            del self.current[peer.engine_id]
            peer.close(self.transport, self.live_agents())
            self.evicted.add(peer.engine_id)
            self.metrics.evicted_peers += 1
            out.append(peer.engine_id)
            over -= 1
        return out

    def reap(self, engine_id: str | None, in_use: Callable[[Peer], bool], drop_reads: Callable[[Peer], None]) -> None:
        """Close lost peers once nothing references them (``in_use`` false; or now, for ``engine_id``,
        which is about to be handshaken again: ``drop_reads`` fails its reads first), and release what
        abandoned handshakes made once they return; release idle peers (:meth:`evict_idle`)."""
        if engine_id is None:
            self.evict_idle(time.monotonic(), in_use)
        if not self.old:
            return
        now, keep = time.monotonic(), []
        for peer in self.old:
            forced = peer.engine_id == engine_id
            if peer.state is PeerState.LOST:
                if not forced and (now < peer.not_before or not peer.settled or in_use(peer)):
                    keep.append(peer)
                    continue
                drop_reads(peer)
            peer.close(self.transport, self.live_agents())
            if not peer.settled:
                keep.append(peer)  # an abandoned handshake still running: released when it returns
        self.old = keep

    def wait_abandoned(self) -> None:
        """Closing: let the old peers' background handshakes end (bounded by ``connect_timeout_s``)."""
        for peer in list(self.old):
            if peer.future is not None and not peer.future.done():
                try:
                    peer.future.result(timeout=self.connect_timeout_s)
                except Exception:  # noqa: BLE001 - failed or stuck: nothing of it was kept
                    pass

    def close_old(self) -> None:
        for peer in self.old:
            peer.close(self.transport)
        self.old.clear()
        self.poller.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False)
