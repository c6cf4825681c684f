"""Helpers shared by the runtime's reliability tests (remote failures, protocol versions, handshake
metadata, bad input, request lifecycle, metrics, staging) and the fault, scale and geometry tests: layouts
of the small test model, requests against the oracle (:class:`Jobs`), engines of rank processes
(:class:`Cluster`), in-process ranks (:func:`served`, :func:`hold`, :func:`inproc_decode`), a fake prefill
(:func:`fake_prefill`) and bounded waits (:func:`until`).

Notes on the oracle: ``verify`` (``procs.verify_rank``) rebuilds a decode rank's *whole* expected buffer
from the requests it is given, so every request whose bytes reached that decode rank must be passed.
Reads that failed half-way leave partial data in their decode blocks; the death tests bound those
mismatches by the failed requests' bytes, then re-read the failed requests from a restarted engine and
require an exact match for everything.
"""
from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
import zlib
from dataclasses import dataclass, replace

import numpy as np
import zmq

from kvbridge.layout import EngineLayout, ModelSpec
from kvbridge.lower import LoweredPlan
from kvbridge.models import preset
from kvbridge.plan import plan_transfer
from kvbridge.runtime.decode import DecodeRank, ReadRequest
from kvbridge.runtime.prefill import PrefillRank
from kvbridge.testing.engine import buffer_of, default_memory
from kvbridge.testing.oracle import SENTINEL
from kvbridge.testing.procs import EngineProcs, Worker, fill_rank
from kvbridge.testing.verify import BlockPool, Request, make_request

MODEL = preset("tiny-dense")
BS = 4
INF = float("inf")


def layout(role: str, tp: int, num_blocks: int, model: ModelSpec = MODEL, **kw) -> EngineLayout:
    return EngineLayout(model, tp=tp, block_size=BS, num_blocks=num_blocks, role=role, **kw)


def until(pred, timeout: float, what: str, interval: float = 0.02):
    """Poll ``pred`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


@dataclass(frozen=True)
class Job:
    """One request: ``num`` is the oracle's request number (fill/verify), ``rid`` the runtime id."""

    num: int
    engine: str
    req: Request
    rid: str

    @property
    def attempt(self) -> int:
        """The lease attempt this job is published under (the same on every prefill rank; the engine's
        scheduler would draw it at random)."""
        return zlib.crc32(self.rid.encode()) | 1

    def read(self, attempt: int | None = None, rid: str | None = None) -> ReadRequest:
        r = self.req
        return ReadRequest(rid or self.rid, self.engine, r.num_tokens, r.prefill_blocks, r.decode_blocks,
                           self.attempt if attempt is None else attempt)

    def renamed(self, rid: str) -> "Job":
        return replace(self, rid=rid)


class Jobs:
    """Allocates requests (blocks on both sides) against one decode engine and several prefill engines."""

    def __init__(self, dlayout: EngineLayout, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.dlayout = dlayout
        self.dpool = BlockPool(dlayout, self.rng)
        self.ppools: dict[str, tuple[EngineLayout, BlockPool]] = {}
        self.next_num = 0

    def engine(self, engine_id: str, playout: EngineLayout) -> None:
        self.ppools[engine_id] = (playout, BlockPool(playout, self.rng))

    def make(self, engine_id: str, n: int, max_tokens: int = 64, prefix_p: float = 0.3, tag: str = "r",
             lengths=None) -> list[Job]:
        pl, pool = self.ppools[engine_id]
        out = []
        for i in range(n):
            num_tokens = int(lengths[i]) if lengths is not None else int(self.rng.integers(1, max_tokens + 1))
            prefix = int(self.rng.integers(0, num_tokens)) if self.rng.random() < prefix_p else 0
            num = self.next_num
            self.next_num += 1
            req = make_request(num, num_tokens, pl, self.dlayout, pool, self.dpool, prefix)
            out.append(Job(num, engine_id, req, f"{tag}{num}"))
        return out


def blocks_for(lengths, slack: int = 16) -> int:
    return int(sum(-(-int(n) // BS) for n in lengths)) + slack


def publish(P: EngineProcs, jobs: list[Job], lease_s: float = 120.0) -> dict[str, int]:
    """Fill the prefill ranks from the oracle and register a lease per request (one attempt id on every
    rank); returns rid -> attempt."""
    P.call_all("fill_many", [(j.num, j.req.num_tokens, j.req.prefill_blocks) for j in jobs])
    attempts: dict[str, int] = {}
    for i in range(0, len(jobs), 100):  # pipelined RPCs (replies stay far below the pipe's buffer)
        chunk = jobs[i:i + 100]
        for w in P.workers.values():
            for j in chunk:
                w.conn.send(("add_request", (j.rid, j.req.prefill_blocks, lease_s, j.attempt), {}))
        for w in P.workers.values():
            for j in chunk:
                attempts[j.rid] = w.recv(30)
                assert attempts[j.rid] == j.attempt
    return attempts


def start(D: EngineProcs, reads: list[ReadRequest]) -> None:
    errs = {}
    for r in D.call_all("start_many", reads).values():
        errs |= r
    assert not errs, f"start errors: {list(errs.items())[:3]}"


def merge(results, n_ranks: int, counts: dict, failed: dict) -> None:
    for d, f in results:
        for rid in d:
            counts[rid] = counts.get(rid, 0) + 1
        failed |= f


def collect(D: EngineProcs, timeout: float = 60.0) -> tuple[set, dict]:
    """``wait`` on every decode rank; a request is finished when every decode rank finished it."""
    counts, failed = {}, {}
    merge(D.call_all("wait", timeout).values(), len(D.workers), counts, failed)
    return {r for r, c in counts.items() if c == len(D.workers)}, failed


def take_until(D: EngineProcs, rids: set, timeout: float, counts=None, failed=None) -> tuple[set, dict]:
    """Poll ``take`` until every id in ``rids`` is finished on all decode ranks or failed on one
    (``counts``/``failed``: what earlier ``take`` calls returned)."""
    counts, failed = dict(counts or {}), dict(failed or {})

    def settled():
        merge(D.call_all("take").values(), len(D.workers), counts, failed)
        return all(r in failed or counts.get(r, 0) == len(D.workers) for r in rids)

    until(settled, timeout, f"{len(rids)} requests to settle")
    return {r for r, c in counts.items() if c == len(D.workers)}, failed


def verify(D: EngineProcs, jobs: list[Job]) -> dict:
    ver = D.call_all("verify", [(j.num, j.read()) for j in jobs])
    return {k: sum(v[k] for v in ver.values()) for k in ("mismatched_bytes", "needed_bytes", "checked_bytes")}


def needed_bytes(pl: EngineLayout, dl: EngineLayout, jobs: list[Job]) -> int:
    """Bytes the decode engine needs for ``jobs`` (computed here, from the plan)."""
    plan = plan_transfer(pl, dl)
    total = 0
    for r in dl.ranks():
        lp = LoweredPlan(plan, r)
        total += sum(lp.needed_bytes(j.req.num_tokens, j.req.prefill_blocks, j.req.decode_blocks) for j in jobs)
    return total


def expected_traffic(pl: EngineLayout, dl: EngineLayout, jobs: list[Job]) -> dict:
    """Transfers, bytes and descriptors the decode ranks must post for ``jobs`` (from the lowering)."""
    plan = plan_transfer(pl, dl)
    out = {"transfers": 0, "transfer_bytes": 0, "descriptors": 0}
    for r in dl.ranks():
        lp = LoweredPlan(plan, r)
        for j in jobs:
            for d in lp.descriptors(j.req.num_tokens, j.req.prefill_blocks, j.req.decode_blocks):
                if d.count:
                    out["transfers"] += 1
                    out["transfer_bytes"] += d.total_bytes
                    out["descriptors"] += d.count
    return out


def wait_freed(P: EngineProcs, rids: set, timeout: float = 15.0, key: str = "freed") -> dict:
    """Poll ``take_freed`` until every prefill rank reported every id in ``rids`` under ``key``."""
    seen = {r: {"freed": set(), "expired": set()} for r in P.workers}

    def done():
        for r, got in P.call_all("take_freed").items():
            seen[r]["freed"] |= set(got["freed"])
            seen[r]["expired"] |= set(got["expired"])
        return all(rids <= s[key] for s in seen.values())

    until(done, timeout, f"prefill {P.engine_id!r} to report {len(rids)} requests {key}")
    return seen


class Cluster(contextlib.AbstractContextManager):
    """Starts engines (all their rank processes spawned at once, then awaited) and stops every one on
    exit, whatever happened (in parallel; a rank that does not stop in time is killed)."""

    def __init__(self):
        self.engines: list[EngineProcs] = []

    def start(self, role: str, lay: EngineLayout, engine_id: str, **kw) -> EngineProcs:
        return self.start_many([(role, lay, engine_id, kw)])[0]

    def start_many(self, specs) -> list[EngineProcs]:
        """``specs``: (role, layout, engine_id[, kwargs]) tuples; like ``EngineProcs.start`` for each."""
        out = []
        for role, lay, engine_id, *kw in specs:
            extra = dict(kw[0]) if kw else {}
            if role == "prefill":
                extra.setdefault("host", "127.0.0.1")
            else:  # NIXL-level behaviour is tested on direct reads; staged variants opt in
                extra.setdefault("transfer_mode", "direct")
            e = EngineProcs(role, engine_id, lay, {})
            self.engines.append(e)  # stopped on exit even if a later rank fails to start
            for r in lay.ranks():
                e.workers[r] = Worker(role, lay, r, engine_id, **extra)
            out.append(e)
        for e in out:
            for w in e.workers.values():
                w.ready(timeout=60)
        return out

    def __exit__(self, *exc):
        def stop(w):
            try:
                w.stop(timeout=10)
            except Exception:  # noqa: BLE001 - best effort, then kill
                w.kill()

        threads = [threading.Thread(target=stop, args=(w,)) for e in self.engines for w in e.workers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for e in self.engines:
            for w in e.workers.values():
                if w.proc.is_alive():
                    w.kill()
        return False


def kill(P: EngineProcs) -> None:
    for w in P.workers.values():
        w.kill()
    assert not any(w.proc.is_alive() for w in P.workers.values())


@contextlib.contextmanager
def served(prefill: PrefillRank):
    """Serve an in-process prefill rank from a thread; yields a lock to hold while touching it."""
    lock, stop = threading.Lock(), threading.Event()

    def loop():
        while not stop.is_set():
            with lock:
                prefill.serve_once()
            time.sleep(2e-4)

    t = threading.Thread(target=loop, daemon=True, name="prefill-server")
    t.start()
    try:
        yield lock
    finally:
        stop.set()
        t.join(5)


def hold(pre: PrefillRank, lock, j: "Job", lease_s: float | None = None) -> int:
    """In-process prefill: write request ``j``'s oracle KV and hold its blocks under a lease (returns the
    attempt, ``j.attempt``)."""
    with lock:
        fill_rank(pre, j.num, j.req.num_tokens, j.req.prefill_blocks)
        return pre.add_request(j.rid, j.req.prefill_blocks, lease_s, attempt=j.attempt)


@contextlib.contextmanager
def inproc_decode(lay: EngineLayout, engine_id: str, rank=(0, 0), **kw):
    kw.setdefault("transfer_mode", "direct")
    d = DecodeRank(lay, rank, engine_id, memory=default_memory(lay, rank), **kw)
    buffer_of(d.mem).fill(SENTINEL)  # the oracle's sentinel, as the worker processes do
    try:
        yield d
    finally:
        d.close()


_PORTS = random.SystemRandom()  # (not the seeded module generator: parallel workers must not draw the same ports)


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (32768+ here): a port the kernel hands out for
    port 0 can be taken, before the test binds it, by any outgoing connection (ZMQ's, UCX's) of the processes
    running beside it (a fresh-clone CI run: "Address already in use" on such a port)."""
    lo, hi = 20000, 32000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            hi = min(hi, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(200):
        port = _PORTS.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (no luck: any free port)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Pair:
    P: EngineProcs
    D: EngineProcs
    pl: EngineLayout
    dl: EngineLayout
    jobs: Jobs
    written: list  # every job whose bytes reached the decode buffer (all must be passed to verify)

    def roundtrip(self, jobs: list[Job], lease_s: float = 60.0, timeout: float = 30.0) -> None:
        exp = publish(self.P, jobs, lease_s)
        start(self.D, [j.read(exp[j.rid]) for j in jobs])
        finished, failed = collect(self.D, timeout)
        assert not failed and {j.rid for j in jobs} <= finished
        self.written += jobs

    def verify(self) -> dict:
        return verify(self.D, self.written)


@contextlib.contextmanager
def fake_prefill(reply_fn):
    """A ROUTER on a random port answering every request with ``reply_fn(frames) -> frames``."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def loop():
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(20):
                fr = sock.recv_multipart()
                sock.send_multipart([fr[0], b""] + reply_fn(fr[2:]))

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop.set()
        t.join(5)
        sock.close(0)


def parked_stage_requests(pre: PrefillRank, lock) -> int:
    """In-process prefill served by :func:`served`: its stage requests parked for staging space
    (``stats()["parked_stage_requests"]``), read under ``lock``."""
    with lock:
        return pre.stats()["parked_stage_requests"]
