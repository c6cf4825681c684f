"""Time on the caller's (engine's) thread per call while a prefill engine is new, dead or frozen (issue 20,
point 4; target <= 1 ms per call).

A decode rank in this process learns of a prefill engine (TP 2: two rank processes, NIXL/UCX over host
memory) from a request, as a vLLM decode does from ``kv_transfer_params``, and starts reading it. For each
state of that engine the "engine step" is timed call by call:

* ``new``: the engine is up and has never been seen;
* ``dead``: nothing listens at its address (killed);
* ``frozen``: its processes are stopped (SIGSTOP) before the first contact.

``sync`` is the old way (``handshake()`` then ``start()`` on the caller's thread, what the connector does
today); ``background`` is ``connect()`` + ``start()`` (handshake on a background thread) followed by
``poll()`` calls every 0.2 ms until the reads end (finished, or failed typed). Per state and way: the
first call (handshake + start), the p50 / max of the ``poll()`` calls while the engine is connecting,
and of those once it is live (these start and post the queued reads: per-request work, the same as a
``start()`` of a known engine). Each row is its own fresh set
of processes; one run prints one table (ratios within one run).

Run: ``PYTHONPATH=src python benchmarks/caller_thread.py [--requests 8] [--handshake-timeout 2]``.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import time

from kvbridge.errors import KVBridgeError
from kvbridge.layout import EngineLayout
from kvbridge.models import preset
from kvbridge.runtime.decode import DecodeRank, ReadRequest
from kvbridge.testing.engine import default_memory
from kvbridge.testing.procs import EngineProcs
from kvbridge.testing.verify import BlockPool, make_request

MODEL, BS, TOKENS = preset("tiny-dense"), 4, 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(state: str, way: str, n: int, hs_timeout: float) -> dict:
    import numpy as np
    blocks = n * (TOKENS // BS) + 16
    pl = EngineLayout(MODEL, tp=2, block_size=BS, num_blocks=blocks, role="prefill")
    dl = EngineLayout(MODEL, tp=1, block_size=BS, num_blocks=blocks, role="decode")
    rng = np.random.default_rng(7)
    pp, dp = BlockPool(pl, rng), BlockPool(dl, rng)
    reqs = [make_request(i, TOKENS, pl, dl, pp, dp, 0) for i in range(n)]
    P = None
    if state == "dead":
        endpoints = {r: f"127.0.0.1:{free_port()}" for r in pl.ranks()}
    else:
        P = EngineProcs.start("prefill", pl, "pX")
        endpoints = P.endpoints()
        for i, r in enumerate(reqs):
            for w in P.workers.values():
                w.call("fill", i, r.num_tokens, r.prefill_blocks)
                w.call("add_request", f"r{i}", r.prefill_blocks, 60.0, i + 1)
        if state == "frozen":
            for w in P.workers.values():
                os.kill(w.proc.pid, signal.SIGSTOP)
    dec = DecodeRank(dl, (0, 0), "dX", memory=default_memory(dl, (0, 0)), transfer_mode="direct",
                     handshake_timeout_s=hs_timeout, connect_timeout_s=2 * hs_timeout + 1)
    reads = [ReadRequest(f"r{i}", "pX", r.num_tokens, r.prefill_blocks, r.decode_blocks, attempt=i + 1)
             for i, r in enumerate(reqs)]
    polls: list[float] = []    # poll() calls once the engine is live (they start and post the reads)
    waiting: list[float] = []  # poll() calls while the engine is connecting (or unreachable)
    outcome = ""
    try:
        t0 = time.perf_counter()
        try:
            if way == "sync":
                dec.handshake("pX", endpoints)
            else:
                dec.connect("pX", endpoints)
            for rd in reads:
                dec.start(rd)
        except KVBridgeError as e:
            outcome = f"raised {type(e).__name__}"
        first = time.perf_counter() - t0
        if state == "frozen" and P is not None:  # thaw after a while: the reads then finish
            thaw_at = time.monotonic() + min(1.0, hs_timeout / 2)
        else:
            thaw_at = None
        done, failed = [], {}
        deadline = time.monotonic() + 4 * hs_timeout + 20
        while time.monotonic() < deadline and not outcome:
            if thaw_at is not None and time.monotonic() >= thaw_at:
                for w in P.workers.values():
                    os.kill(w.proc.pid, signal.SIGCONT)
                thaw_at = None
            connecting = "pX" not in dec.remotes
            t = time.perf_counter()
            d, f = dec.poll()
            (waiting if connecting else polls).append(time.perf_counter() - t)
            done += d
            failed |= f
            if len(done) + len(failed) >= n and thaw_at is None:
                break
            time.sleep(2e-4)
        if not outcome:
            kinds = sorted({type(x).__name__ for x in failed.values()})
            outcome = f"{len(done)} read" + (f", {len(failed)} {'/'.join(kinds)}" if failed else "")
    finally:
        if P is not None:
            for w in P.workers.values():
                try:
                    os.kill(w.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        dec.close()
        if P is not None:
            P.stop()
    polls.sort()
    waiting.sort()
    return {"state": state, "way": way, "first_ms": first * 1e3,
            "wait_p50_ms": statistics.median(waiting) * 1e3 if waiting else 0.0,
            "wait_max_ms": waiting[-1] * 1e3 if waiting else 0.0, "waits": len(waiting),
            "poll_p50_ms": statistics.median(polls) * 1e3 if polls else 0.0,
            "poll_max_ms": polls[-1] * 1e3 if polls else 0.0, "polls": len(polls), "outcome": outcome}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--handshake-timeout", type=float, default=2.0)
    a = ap.parse_args()
    rows = [run(state, way, a.requests, a.handshake_timeout)
            for state in ("new", "dead", "frozen") for way in ("sync", "background")]
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"time on the caller's thread: {a.requests} requests of {TOKENS} tokens, prefill TP 2 -> "
                    f"decode TP 1, handshake_timeout_s {a.handshake_timeout:g}")
    for col in ("prefill engine", "way", "connect/handshake + start (ms)", "polls while connecting",
                "p50 / max (ms)", "polls once live", "p50 / max (ms)", "outcome"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["state"], r["way"], f"{r['first_ms']:.2f}", str(r["waits"]),
                  f"{r['wait_p50_ms']:.3f} / {r['wait_max_ms']:.2f}", str(r["polls"]),
                  f"{r['poll_p50_ms']:.3f} / {r['poll_max_ms']:.2f}", r["outcome"])
    Console(width=160).print(t)


if __name__ == "__main__":
    main()
