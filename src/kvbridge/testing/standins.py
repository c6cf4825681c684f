"""Many idle peers on one decode rank, cheaply: stand-in prefill endpoints and peers with no handshake.

:class:`StandIns` binds ``n`` ZMQ ROUTER sockets (one per stand-in prefill rank) in a child process;
:func:`install_idle` gives a decode rank a live peer whose side channel connects to some of them, with
no NIXL agent and nothing to read (the handshake's result is a stub), as an idle prefill engine looks
to the decode's poll. :func:`wide_context` lets one process hold more side channels than ZMQ's default
1,023 sockets. Used by ``tests/test_scale.py`` and ``benchmarks/scale.py`` (polls against idle peers).
"""
from __future__ import annotations

import multiprocessing as mp
import time
from types import SimpleNamespace
from typing import Any

import zmq

from ..runtime.peer import Peer, Rank
from .prefill_host import raise_fd_limit


def _routers(n: int, conn: Any) -> None:
    """Child process: ``n`` ROUTER sockets standing in for prefill ranks; sends their ports, waits."""
    raise_fd_limit()
    ctx = zmq.Context.instance()
    ctx.set(zmq.MAX_SOCKETS, max(1024, 2 * n + 64))
    socks = [ctx.socket(zmq.ROUTER) for _ in range(n)]
    conn.send([s.bind_to_random_port("tcp://127.0.0.1") for s in socks])
    conn.recv()


class StandIns:
    """``n`` stand-in prefill ranks (ROUTER sockets) in a child process: :attr:`endpoints` ("host:port")."""

    def __init__(self, n: int):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_routers, args=(n, child), daemon=True)
        self._proc.start()
        self.endpoints = [f"127.0.0.1:{p}" for p in self._conn.recv()]

    def close(self) -> None:
        try:
            self._conn.send("stop")
        except OSError:
            pass
        self._proc.join(10)
        self._proc.kill()

    def __enter__(self) -> StandIns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wide_context(dec: Any, max_sockets: int = 8192) -> zmq.Context[Any]:
    """Give ``dec``'s peer table a ZMQ context of its own with room for ``max_sockets`` sockets (side
    channels opened from now on go there; ZMQ's socket limit is fixed once a context has a socket)."""
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, max_sockets)
    dec.peers.ctx = ctx
    return ctx


def install_idle(dec: Any, engine_id: str, endpoints: dict[Rank, str]) -> Peer:
    """A live, idle peer ``engine_id`` on decode rank ``dec`` (a :class:`~kvbridge.runtime.decode.DecodeRank`):
    its side channel connects to ``endpoints``; no NIXL agent, nothing prepared (a read of it would fail)."""
    ranks = tuple(sorted(endpoints))
    remote = SimpleNamespace(agents={}, side_ranks=ranks, readers={p: 0 for p in ranks}, digests={}, modes={},
                             shapes={}, can_stage=frozenset(), lowered=None, layout=None, plan=None, links={},
                             summary=lambda: {"agents": {}})
    peer = Peer(engine_id, endpoints, started=time.monotonic())
    dec.peers.endpoints[engine_id] = dict(endpoints)
    dec.peers.install(peer, remote, {})
    return peer
