"""A decode rank's prefill peers, by engine id, and the steps of their lifecycle.

:class:`PeerTable` owns the peers (the current one per engine id, CONNECTING or LIVE, and the old
ones: LOST peers not reaped yet, retired ones whose background handshake still runs), the endpoints
last given per engine id, and the background handshake pool. It moves peers through their lifecycle
(:mod:`~kvbridge.runtime.peer`: connect in the background, install, abandon, retire, reap, drop) and
never touches a read: where a step concerns reads it returns a typed result (:class:`Ready`,
:class:`Unreachable`) or asks the caller through an explicit callback (``in_use``, ``drop_reads``),
so the decode rank decides what happens to them.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from ..errors import HandshakeError, HandshakeFailed, IncompatibleLayoutsError, TransferError
from .metrics import Metrics
from .peer import Peer, PeerEvent, PeerState, Rank

if TYPE_CHECKING:
    from .handshake import Handshaker, RemoteEngine
    from .request import ReadRequest


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

    def __init__(self, ctx: zmq.Context[Any], transport: Any, metrics: Metrics, handshaker: Callable[[], Handshaker],
                 engine_id: str, connect_timeout_s: float, rehandshake_timeout_s: float):
        self.ctx, self.transport, self.metrics, self.handshaker = ctx, transport, metrics, handshaker
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

    # ---- views ---------------------------------------------------------------------------------
    def get(self, engine_id: str) -> Peer | None:
        return self.current.get(engine_id)

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

    def connecting(self) -> bool:
        return any(p.connecting for p in self.current.values())

    @property
    def waiting(self) -> int:
        """Reads queued behind a background handshake."""
        return sum(len(p.pending) for p in self.current.values() if p.connecting)

    # ---- lifecycle -----------------------------------------------------------------------------
    def open_sock(self, endpoint: str) -> tuple[Any, Any]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # the side channel's TCP connection closing is the earliest sign of a dead prefill process
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(f"tcp://{endpoint}")
        return sock, mon

    def install(self, peer: Peer, remote: RemoteEngine, prepped: dict[Rank, Any] | None) -> list[ReadRequest]:
        """CONNECTING -> LIVE: the peer owns the handshake's result and opens its sockets (on this thread).
        Returns its queued reads (the caller starts them)."""
        self.current[peer.engine_id] = peer
        peer.connected(remote, prepped, self.open_sock)
        self.metrics.handshakes += 1
        pending, peer.pending = peer.pending, []
        return pending

    def begin(self, engine_id: str, endpoints: dict[Rank, str], pending: list[ReadRequest],
              bound_s: float | None = None) -> Peer:
        """A new CONNECTING peer for ``engine_id`` whose handshake runs on a background thread (the caller
        has dropped or abandoned the previous one)."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(2, thread_name_prefix=f"kvbridge-handshake-{self.engine_id}")
        phase = ["queued behind another handshake"]
        fut = self.pool.submit(self.handshaker().background, engine_id, endpoints, phase)
        peer = self.current[engine_id] = Peer(
            engine_id, endpoints, started=time.monotonic(), future=fut, pending=pending,
            bound_s=self.connect_timeout_s if bound_s is None else bound_s, phase=phase)
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

    def retire(self, peer: Peer, event: PeerEvent, grace_s: float = 0.5) -> None:
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
        for peer in list(self.current.values()):
            if not peer.connecting:
                continue
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
                out.append(Ready(peer, self.install(peer, remote, prepped)))
            elif now - peer.started > peer.bound_s:
                out.append(self._failed(peer, PeerEvent.HANDSHAKE_TIMEOUT, f"no handshake within {peer.bound_s:g} s "
                                        "(prefill engine dead, frozen or unreachable; the handshake was at: "
                                        f"{peer.phase[0]})", now))
        return out

    def _failed(self, peer: Peer, event: PeerEvent, why: str, now: float) -> Unreachable:
        del self.current[peer.engine_id]
        peer.lose(event, now, why)
        self.metrics.failed_handshakes += 1
        before = f"{peer.why}; re-handshake failed: " if peer.why else ""
        pending, peer.pending = peer.pending, []
        failures = [(req, HandshakeFailed(
            f"request {req.req_id!r}: {before}cannot reach prefill engine {peer.engine_id!r}: {why}",
            req_id=req.req_id, engine_id=peer.engine_id)) for req in pending]
        self.old.append(peer)  # closed by reap (at once, or when an abandoned handshake returns)
        return Unreachable(peer, failures)

    def reap(self, engine_id: str | None, in_use: Callable[[Peer], bool], drop_reads: Callable[[Peer], None]) -> None:
        """Close lost peers once nothing references them (``in_use`` false; or now, for ``engine_id``,
        which is about to be handshaken again: ``drop_reads`` fails its reads first), and release what
        abandoned handshakes made once they return."""
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
        if self.pool is not None:
            self.pool.shutdown(wait=False)
