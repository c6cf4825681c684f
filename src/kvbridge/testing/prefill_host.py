"""Many prefill engines in one process: a simulated cluster for burst and scale checks.

:class:`PrefillHost` starts one process that serves every rank of ``len(engine_ids)`` prefill engines of
one layout, each rank a real :class:`~kvbridge.runtime.prefill.PrefillRank` (its own NIXL agent, KV
memory and side-channel port), all served by one loop (a ZMQ poller over their sockets, so an idle host
costs nothing). The decode side under test runs elsewhere (the test's process) and connects to
:attr:`PrefillHost.endpoints` as it would to real engines.

A NIXL agent costs about 0.3 s to start, 18 file descriptors and 7 MiB here: a host of 128 TP1
engines starts in about 40 s; size the engines (tiny models, few blocks) to what the machine holds.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

from ..layout import EngineLayout, engine_from_dict, engine_to_dict

Rank = tuple[int, int]


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; returns the new soft limit."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _host_main(conn: Any, layout: dict[str, Any], engine_ids: list[str], host: str, progress_delay_us: int) -> None:
    if progress_delay_us:  # each idle agent's progress thread wakes this often (many agents share the cores)
        os.environ["KVBRIDGE_NIXL_PROGRESS_DELAY_US"] = str(progress_delay_us)
    import zmq

    from ..runtime.prefill import PrefillRank
    from .engine import default_memory
    raise_fd_limit()
    zmq.Context.instance().set(zmq.MAX_SOCKETS, 65536)
    eng = engine_from_dict(layout)
    ranks: dict[tuple[str, Rank], Any] = {}
    try:
        t0 = time.monotonic()
        for eid in engine_ids:
            for r in eng.ranks():
                ranks[(eid, r)] = PrefillRank(eng, r, eid, memory=default_memory(eng, r), staging_bytes=0, host=host)
        conn.send(({eid: {r: f"{host}:{ranks[(eid, r)].port}" for r in eng.ranks()} for eid in engine_ids},
                   time.monotonic() - t0))
        poller = zmq.Poller()
        by_sock = {}
        for pr in ranks.values():
            poller.register(pr.sock, zmq.POLLIN)
            by_sock[pr.sock] = pr
        while True:
            if conn.poll(0):
                cmd = conn.recv()
                if cmd == "stop":
                    break
                if cmd == "stats":
                    conn.send({f"{eid}/{r}": pr.stats() for (eid, r), pr in ranks.items()})
            for sock, _ in poller.poll(5):
                by_sock[sock].serve_once()
            for pr in ranks.values():  # notifications (Done) and lease expiry: cheap when idle
                pr.serve_once()
    finally:
        for pr in ranks.values():
            pr.close()
        conn.close()


class PrefillHost:
    """``engine_ids`` prefill engines of layout ``layout`` served by one process (see the module doc).
    ``progress_delay_us``: the NIXL progress threads' sleep there (0: kvbridge's default)."""

    def __init__(
        self,
        layout: EngineLayout,
        engine_ids: list[str],
        host: str = "127.0.0.1",
        start_timeout_s: float = 600.0,
        progress_delay_us: int = 0,
    ):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_host_main,
            args=(child, engine_to_dict(layout), list(engine_ids), host, progress_delay_us),
            daemon=True,
        )
        self.proc.start()
        child.close()
        if not self.conn.poll(start_timeout_s):
            self.kill()
            raise TimeoutError(f"the prefill host did not start {len(engine_ids)} engines within {start_timeout_s} s")
        self.endpoints: dict[str, dict[Rank, str]]
        self.endpoints, self.start_s = self.conn.recv()

    def stats(self) -> dict[str, Any]:
        self.conn.send("stats")
        return self.conn.recv()  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send("stop")
            except OSError:
                pass
            self.proc.join(30)
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def __enter__(self) -> PrefillHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_fds() -> int:
    """File descriptors open in this process (Linux)."""
    return len(os.listdir("/proc/self/fd"))
