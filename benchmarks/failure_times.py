"""Failure times (issue 13): how fast a fault becomes a typed failure or a freed lease, over real processes.

Scenarios (each repeated ``--reps`` times on a fresh set of processes; one OS process per rank, NIXL/UCX
over host memory; the victim is always a separate process, the observer runs in this process and
time-stamps what it sees with ``time.monotonic()``, polling every 0.2 ms like an engine loop):

* ``kill``: a prefill engine of TP 2 (two rank processes) serves a batch of requests to a decode rank in
  this process (decode TP 1 reads both ranks); prefill rank (0, 1) gets ``kill -9`` once reads are
  posted (direct: pins granted, reads handed to the post thread) or right after the stage requests
  went out (staged). Time from the kill to each failure (``PeerDisconnected``).
* ``stop``: the same, with ``SIGSTOP`` instead of the kill and ``transfer_timeout_s`` =
  ``stage_timeout_s`` = ``--timeout``. Time from the stop to each failure (``TransferTimeout``),
  compared with the timeout (a rank's deadline runs from its last progress, which was before the stop).
* ``other``: two prefill engines (TP 2 each) serve the decode rank (direct, pA's requests started
  first); once reads are posted, pA's ranks get SIGSTOP. Do pB's requests still finish, and how fast? (The decode's post
  thread is shared by every engine; a request whose last chunk is partial posts a "tail" read first and
  waits for it on that thread.)
* ``decode``: a prefill rank in this process (leases ``--lease`` s, pins ``--pin`` s) serves a decode
  rank process that freezes itself with reads in flight and then gets ``kill -9``. Time from the kill
  until the prefill frees each lease, and how late each is freed after its own deadline (requests the
  dead decode pinned: ``lease_s`` (the prefill's ``pin_idle_s``) after its last heartbeat, at most ``pin_s``
  after the pin; never started: ``lease_s`` after ``add_request``).

Run: ``PYTHONPATH=src python benchmarks/failure_times.py [--reps 3] [--requests 150]`` (needs nixl).
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time
import zlib

import numpy as np

from kvbridge.errors import PeerDisconnected, TransferTimeout
from kvbridge.layout import EngineLayout
from kvbridge.models import preset
from kvbridge.runtime.decode import DecodeRank, ReadRequest
from kvbridge.runtime.prefill import PrefillRank
from kvbridge.testing.engine import default_memory
from kvbridge.testing.procs import EngineProcs, Worker
from kvbridge.testing.verify import BlockPool, make_request

MODEL, BS, TOKENS = preset("tiny-dense"), 4, 64


def layouts(n: int) -> tuple[EngineLayout, EngineLayout]:
    blocks = n * (TOKENS // BS) + 64
    return (EngineLayout(MODEL, tp=2, block_size=BS, num_blocks=blocks, role="prefill"),
            EngineLayout(MODEL, tp=1, block_size=BS, num_blocks=blocks, role="decode"))


def requests(pl: EngineLayout, dl: EngineLayout, n: int, seed: int, tag: str, tokens: int = TOKENS) -> list:
    rng = np.random.default_rng(seed)
    pp, dp = BlockPool(pl, rng), BlockPool(dl, rng)
    out = []
    for i in range(n):
        r = make_request(i, tokens, pl, dl, pp, dp, 0)
        rid = f"{tag}{i}"
        out.append((rid, r, zlib.crc32(rid.encode()) | 1))
    return out


def publish_procs(P: EngineProcs, reqs: list, lease_s: float) -> None:
    for w in P.workers.values():
        for rid, r, attempt in reqs:
            w.conn.send(("add_request", (rid, r.prefill_blocks, lease_s, attempt), {}))
        for _ in reqs:
            w.recv(30)


def read_of(engine_id: str, rid: str, r, attempt: int) -> ReadRequest:
    return ReadRequest(rid, engine_id, r.num_tokens, r.prefill_blocks, r.decode_blocks, attempt)


def prefill_fault(mode: str, fault: str, n: int, timeout_s: float, seed: int) -> dict:
    """Kill -9 or SIGSTOP prefill rank (0, 1) once the first request of a batch finished."""
    pl, dl = layouts(n)
    P = EngineProcs.start("prefill", pl, "pF")
    dec = None
    victim = P.workers[(0, 1)]
    try:
        dec = DecodeRank(dl, (0, 0), "dF", memory=default_memory(dl, (0, 0)), transfer_mode=mode,
                         stage_timeout_s=timeout_s, transfer_timeout_s=timeout_s)
        dec.handshake("pF", P.endpoints())
        reqs = requests(pl, dl, n, seed, "r")
        publish_procs(P, reqs, 120.0)
        for rid, r, a in reqs:
            dec.start(read_of("pF", rid, r, a))
        finished, failed = set(), {}
        # direct: the fault comes once the pins are granted and reads are handed to the post thread
        # (mid-transfer); staged: right after the stage requests went out (the prefill packs a batch this
        # small in a few ms, and what is packed is read without the prefill process: a later fault would
        # find nothing left that needs it)
        while mode == "direct" and not failed and not any(
                r for f in dec.inflight.values() for rr in f.ranks.values() for r in rr.reads if not r.done):
            d, f = dec.poll()
            finished.update(d)
            failed |= f
            time.sleep(2e-4)
        t_fault = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        in_flight = len(dec.inflight)
        times, kinds, gap, prev = [], set(), 0.0, t_fault
        deadline = t_fault + timeout_s + 60
        while (dec.inflight or dec.waiting) and time.monotonic() < deadline:  # (or re-queued behind a re-handshake)
            d, f = dec.poll()
            now = time.monotonic()
            gap, prev = max(gap, now - prev), now
            finished.update(d)
            for rid, why in f.items():
                failed[rid] = why
                times.append(now - t_fault)
                kinds.add(type(why).__name__)
            time.sleep(2e-4)
        expected = PeerDisconnected if fault == "kill" else TransferTimeout
        assert not dec.inflight and not dec.waiting, f"{len(dec.inflight)} requests still in flight"
        assert all(isinstance(w, expected) for w in failed.values()), kinds
        return {"in_flight": in_flight, "failed": len(times), "first": min(times, default=float("nan")),
                "last": max(times, default=float("nan")), "median": statistics.median(times) if times else float("nan"),
                "kinds": ",".join(sorted(kinds)), "max_poll_gap": gap}
    finally:
        if fault == "stop" and victim.proc.is_alive():
            os.kill(victim.proc.pid, signal.SIGCONT)
        if dec is not None:
            dec.close()
        for w in P.workers.values():
            w.kill()


def other_engine(n: int, cap_s: float, seed: int, tokens: int) -> dict:
    """Two prefill engines (TP 2 each) serve one decode rank (direct reads, pA's queued first); once reads
    are posted, both ranks of pA get SIGSTOP. How long do pB's requests take meanwhile (the decode's post thread is
    shared by every engine)? Stops looking after ``cap_s``."""
    pl, dl = layouts(2 * n)
    engines = {e: EngineProcs.start("prefill", pl, e) for e in ("pA", "pB")}
    dec = None
    try:
        dec = DecodeRank(dl, (0, 0), "dO", memory=default_memory(dl, (0, 0)), transfer_mode="direct",
                         stage_timeout_s=cap_s + 30, transfer_timeout_s=cap_s + 30)
        reqs = {}
        for i, (e, P) in enumerate(engines.items()):
            dec.handshake(e, P.endpoints())
            reqs[e] = requests(pl, dl, n, seed * 2 + i, e, tokens)
            publish_procs(P, reqs[e], 120.0)
        for e in ("pA", "pB"):  # pA's reads are queued first
            for rid, r, att in reqs[e]:
                dec.start(read_of(e, rid, r, att))
        finished = set()
        while not any(r for f in dec.inflight.values() for rr in f.ranks.values() for r in rr.reads if not r.done):
            finished.update(dec.poll()[0])  # pA is frozen once reads are posted: mid-transfer
            time.sleep(2e-4)
        t_stop = time.monotonic()
        for w in engines["pA"].workers.values():
            os.kill(w.proc.pid, signal.SIGSTOP)
        b_ids = {rid for rid, _, _ in reqs["pB"]}
        b_left = len(b_ids - finished)
        while b_ids - finished and time.monotonic() < t_stop + cap_s:
            finished.update(dec.poll()[0])
            time.sleep(2e-4)
        took = time.monotonic() - t_stop
        return {"b_in_flight": b_left, "b_finished": b_left - len(b_ids - finished), "seconds": took}
    finally:
        for w in engines["pA"].workers.values():
            if w.proc.is_alive():
                os.kill(w.proc.pid, signal.SIGCONT)
        for P in engines.values():
            for w in P.workers.values():
                w.kill()
        if dec is not None:
            dec.close()


def decode_killed(mode: str, n: int, lease_s: float, pin_s: float, seed: int) -> dict:
    """The decode rank (a process) freezes itself with reads in flight, then gets kill -9; this process's
    prefill rank frees every lease on its own deadline."""
    pl, dl = layouts(n)
    pl = EngineLayout(MODEL, tp=1, block_size=BS, num_blocks=pl.num_blocks, role="prefill")
    pre = PrefillRank(pl, (0, 0), "pK", memory=default_memory(pl, (0, 0)), lease_s=lease_s, pin_s=pin_s)
    lock, stop = threading.Lock(), threading.Event()
    freed_at: dict[str, tuple[str, float]] = {}

    def serve():
        while not stop.is_set():
            with lock:
                pre.serve_once()
                got = pre.take_freed()
            now = time.monotonic()
            for k in ("freed", "expired"):
                for rid in got[k]:
                    freed_at[rid] = (k, now)
            time.sleep(2e-4)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    victim = Worker("decode", dl, (0, 0), "dK", transfer_mode=mode)
    try:
        victim.ready()
        victim.call("handshake", "pK", {(0, 0): f"127.0.0.1:{pre.port}"})
        reqs = requests(pl, dl, n + 4, seed, "k")
        batch = reqs[:n]  # the last 4 are published, never started
        with lock:
            for rid, r, a in reqs:
                pre.add_request(rid, r.prefill_blocks, attempt=a)
        state = victim.call("start_freeze", [read_of("pK", rid, r, a) for rid, r, a in batch])
        os.kill(victim.proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        victim.proc.join(5)
        with lock:  # each lease's own deadline (this process's monotonic clock), pinned or not
            # a pinned lease ends when its last pin does (pin_idle_s = lease_s after the dead decode's last
            # heartbeat, at most pin_s after the pin): its deadline is the latest pin's
            deadlines = {rid: (max((p.deadline for p in lease.pins.values()), default=lease.deadline),
                               bool(lease.pins)) for rid, lease in pre.leases.items()}
        end = t_kill + max(lease_s, pin_s) + 30
        while len(freed_at) < len(reqs) and time.monotonic() < end:
            time.sleep(1e-3)
        assert len(freed_at) == len(reqs), f"{len(reqs) - len(freed_at)} leases never freed"
        with lock:
            assert not pre.leases and pre.slots.bytes_used == 0
        expired = [rid for rid in deadlines if freed_at[rid][0] == "expired"]  # (not a late Done)
        pinned = [rid for rid in expired if deadlines[rid][1]]
        unpinned = [rid for rid in expired if not deadlines[rid][1]]
        late = [freed_at[rid][1] - deadlines[rid][0] for rid in expired]
        since_kill = [freed_at[rid][1] - t_kill for rid in expired]
        return {"in_flight": state["inflight"], "pinned": len(pinned), "unpinned": len(unpinned),
                "done_before": len(reqs) - len(deadlines), "last": max(since_kill, default=float("nan")),
                "late_median": statistics.median(late) if late else float("nan"),
                "late_max": max(late, default=float("nan")), "late_min": min(late, default=float("nan"))}
    finally:
        if victim.proc.is_alive():
            victim.kill()
        stop.set()
        t.join(5)
        pre.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--timeout", type=float, default=1.0, help="transfer_timeout_s = stage_timeout_s (stop)")
    ap.add_argument("--lease", type=float, default=1.0, help="lease_s (decode killed)")
    ap.add_argument("--pin", type=float, default=2.0, help="pin_s (decode killed)")
    ap.add_argument("--only", choices=("kill", "stop", "other", "decode"), action="append")
    a = ap.parse_args()
    from rich.console import Console
    from rich.table import Table
    con = Console(width=200)
    only = set(a.only or ("kill", "stop", "other", "decode"))
    t = Table(title=f"failure times: {a.reps} runs each, {a.requests} requests of {TOKENS} tokens "
                    f"(tiny-dense, prefill TP 2 -> decode TP 1; decode-killed: prefill TP 1), seconds")
    for c in ("fault", "mode", "in flight", "failed / freed", "first", "median", "last (max of runs)",
              "longest poll() gap", "reference"):
        t.add_column(c, justify="right" if c not in ("fault", "mode", "reference") else "left")
    for fault in ("kill", "stop"):
        if fault not in only:
            continue
        for mode in ("direct", "staged"):
            runs = [prefill_fault(mode, fault, a.requests, a.timeout if fault == "stop" else 30.0, seed=i)
                    for i in range(a.reps)]
            for r in runs:
                con.print(f"  {fault} {mode}: {r}")
            ref = "s after the kill -9" if fault == "kill" else f"s after SIGSTOP; timeouts {a.timeout:g} s"
            t.add_row("prefill rank " + ("kill -9" if fault == "kill" else "SIGSTOP"), mode,
                      "/".join(str(r["in_flight"]) for r in runs), "/".join(str(r["failed"]) for r in runs),
                      f"{statistics.median(r['first'] for r in runs):.3f}",
                      f"{statistics.median(r['median'] for r in runs):.3f}",
                      f"{max(r['last'] for r in runs):.3f}", f"{max(r['max_poll_gap'] for r in runs):.3f}",
                      f"{ref} ({runs[0]['kinds']})")
    if "other" in only:
        cap = 10.0
        for tokens in (TOKENS, TOKENS - 3):  # whole 64-token chunks; a partial last chunk (a "tail" read)
            runs = [other_engine(a.requests // 2, cap, seed=i, tokens=tokens) for i in range(a.reps)]
            for r in runs:
                con.print(f"  other engine while pA is frozen ({tokens} tokens): {r}")
            t.add_row(f"prefill engine pA SIGSTOP, {tokens}-token requests", "direct",
                      "/".join(str(r["b_in_flight"]) for r in runs), "/".join(str(r["b_finished"]) for r in runs),
                      "", "", f"{max(r['seconds'] for r in runs):.3f}", "",
                      f"healthy pB's requests in flight / finished while pA is frozen; s until all finished "
                      f"(looked for {cap:g} s)")
    if "decode" in only:
        for mode in ("direct", "staged"):
            runs = [decode_killed(mode, a.requests, a.lease, a.pin, seed=i) for i in range(a.reps)]
            for r in runs:
                con.print(f"  decode killed {mode}: {r}")
            t.add_row("decode rank kill -9", mode, "/".join(str(r["in_flight"]) for r in runs),
                      "/".join(f"{r['pinned']}+{r['unpinned']}" for r in runs),
                      f"{statistics.median(r['late_min'] for r in runs) * 1e3:.1f} ms late",
                      f"{statistics.median(r['late_median'] for r in runs) * 1e3:.1f} ms late",
                      f"{max(r['late_max'] for r in runs) * 1e3:.1f} ms late; all freed "
                      f"{max(r['last'] for r in runs):.2f} s after the kill", "",
                      f"after each lease's deadline (pinned: {a.lease:g} s after the last heartbeat, at most pin "
                      f"{a.pin:g} s; never started: lease {a.lease:g} s)")
    con.print(t)


if __name__ == "__main__":
    main()
