"""The main job: a prefill engine and a decode engine as separate processes, KV moved by NIXL, verified.

``kvbridge demo`` starts one process per rank on each side (default: Gemma-4-style model with
different KV head counts per group, prefill TP=4, decode TP=2), fills the prefill cache from global
coordinates, then times (1) single requests one at a time, warm (handshake excluded), (2) a burst of
requests of varied lengths started at once (wall time and throughput), (3) with ``--large``, one large
request against a memcpy of the same bytes in the same run; then checks every decode byte.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ..layout import EngineLayout, MemoryLayout, ceil_div
from ..plan import plan_transfer
from ..runtime.decode import ReadRequest
from .procs import EngineProcs
from .verify import BlockPool, make_request

console = Console()


@dataclass
class Phase:
    """One timed part of the run, as the harness sees it: the wall time from handing the reads to the
    decode rank processes (pipe RPC) to every decode rank reporting them done."""

    name: str
    requests: int
    tokens: int                 # prompt tokens of all its requests
    longest: int                # tokens of its longest request
    bytes_moved: int            # over every decode rank
    seconds: list[float]        # one entry per timed request (sequential) or one for the whole burst

    @property
    def median_s(self) -> float:
        return float(np.median(self.seconds)) if self.seconds else 0.0

    @property
    def min_s(self) -> float:
        return min(self.seconds, default=0.0)


@dataclass
class DemoResult:
    requests: int
    finished: int
    failed: dict
    start_errors: dict
    bytes_moved: int
    bytes_needed: int
    descriptors: int
    transfer_seconds: float     # wall time of the burst (all its requests started at once)
    memcpy_gbps: float          # numpy copy of the large request's bytes (else the burst's), one thread
    mismatched_bytes: int
    checked_bytes: int
    prefill_freed: int
    leaked_handles: int
    staged_transfers: int = 0
    direct_transfers: int = 0
    host_staged_transfers: int = 0  # of the staged transfers, those through host staging
    pushed_transfers: int = 0  # of the staged transfers, those pushed (the prefill WROTE; no READ)
    links: dict | None = None   # decode rank -> its stats()["links"] (the measured path figures per prefill rank)
    warm: Phase | None = None   # sequential single requests after a warm-up one (handshake excluded)
    # the warm requests read again, timed inside each decode process (no RPC): kvbridge's read, and NIXL's
    # own READ of the same descriptors between the same processes (seconds, slowest decode rank)
    inproc: list[float] = field(default_factory=list)
    nixl: list[float] = field(default_factory=list)
    large_phases: dict = field(default_factory=dict)  # phase -> ms of the large request (slowest decode rank)
    large_prefill: dict = field(default_factory=dict)  # prefill phase -> mean ms over prefill ranks
    # NIXL's own READ of the large request's bytes, same processes, right after it (seconds, slowest decode
    # rank): the same descriptors a direct read posts, and the same bytes as one descriptor per prefill rank
    large_nixl: float = 0.0
    large_nixl_1: float = 0.0
    burst: Phase | None = None
    large: Phase | None = None  # one large request (``--large``)
    decode_ranks: int = 1

    @property
    def gbps(self) -> float:
        """The burst's bytes (every decode rank) per second of its wall time."""
        return self.burst.bytes_moved / self.burst.seconds[0] / 1e9 if self.burst and self.burst.seconds[0] else 0.0

    @property
    def large_gbps(self) -> float:
        return self.large.bytes_moved / self.large.seconds[0] / 1e9 if self.large and self.large.seconds[0] else 0.0

    @property
    def ok(self) -> bool:
        return (self.finished == self.requests and not self.failed and not self.start_errors
                and self.mismatched_bytes == 0 and self.bytes_moved == self.bytes_needed
                and self.prefill_freed == self.requests and self.leaked_handles == 0)


def blocks_needed(prefill: EngineLayout, decode: EngineLayout, lengths) -> int:
    bs = min(prefill.block_size, decode.block_size)
    return int(sum(ceil_div(int(n), bs) + 1 for n in lengths)) + 4


# tokens of the one large request of ``--large`` (enough for the copy, not per-request costs, to dominate)
LARGE_TOKENS = 131072
# ``--large``'s staging buffers (MiB): a staged read larger than a decode engine's share of the prefill's
# buffer is read directly, one descriptor per head-sliced run (1,700 a request here: NIXL's own READ of
# those runs moved 0.2-0.8 GB/s against 6-15 GB/s for the same bytes as one descriptor)
LARGE_STAGING_MIB = 192


@dataclass
class _Engines:
    """The two engines' rank processes (None until started) and what their reads reported so far."""

    P: EngineProcs | None = None
    D: EngineProcs | None = None
    start_errors: dict = field(default_factory=dict)
    finished: dict = field(default_factory=dict)   # req_id -> decode ranks that finished it
    failed: dict = field(default_factory=dict)

    def moved(self) -> int:
        return sum(s["metrics"]["transfer_bytes"] for s in self.D.call_all("stats").values())

    def add_to_prefill(self, rr: ReadRequest) -> None:
        for w in self.P.workers.values():
            w.call("add_request", rr.req_id, rr.prefill_blocks, None, rr.attempt)

    def run(self, batch) -> float:
        """Hand ``batch`` (reads) to the prefill and decode ranks, start them at once, wait; wall seconds."""
        for w in self.P.workers.values():
            for rr in batch:
                w.call("add_request", rr.req_id, rr.prefill_blocks, None, rr.attempt)
        t0 = time.perf_counter()
        for rank_errs in self.D.call_all("start_many", batch).values():
            self.start_errors.update(rank_errs)
        for d, f in self.D.call_all("wait", 120.0).values():
            for rid in d:
                self.finished[rid] = self.finished.get(rid, 0) + 1
            self.failed.update(f)
        return time.perf_counter() - t0

    def stop(self) -> None:
        for e in (self.D, self.P):
            if e is not None:
                e.stop()


@dataclass
class _Extras:
    """What the phases measured besides their wall times (see :class:`DemoResult`)."""

    inproc: list[float] = field(default_factory=list)
    nixl: list[float] = field(default_factory=list)
    large_phases: dict = field(default_factory=dict)
    large_prefill: dict = field(default_factory=dict)
    large_nixl: float = 0.0
    large_nixl_1: float = 0.0
    # counters moved by the warm requests' timed re-reads (not part of the bytes the requests needed)
    extra: dict = field(default_factory=lambda: {"transfer_bytes": 0, "descriptors": 0, "transfers": 0,
                                                 "staged_transfers": 0})


def _with_blocks(layout: EngineLayout, nb: int) -> EngineLayout:
    return EngineLayout(**{**{f: getattr(layout, f) for f in layout.__dataclass_fields__}, "num_blocks": nb})


def _start(eng: _Engines, prefill: EngineLayout, decode: EngineLayout, transfer_mode: str,
           staging_mib: int | None, segment_mib: float | None, decode_options: dict | None) -> None:
    staging = {} if staging_mib is None else {"staging_bytes": int(staging_mib) << 20}
    eng.P = EngineProcs.start("prefill", prefill, "prefill-0", **staging)
    seg = {} if segment_mib is None else {"stage_segment_bytes": int(segment_mib * (1 << 20))}
    eng.D = EngineProcs.start("decode", decode, "decode-0", transfer_mode=transfer_mode,
                              **{**staging, **seg, **(decode_options or {})})


def _fill(eng: _Engines, prefill: EngineLayout, decode: EngineLayout, rng, all_lengths, n_warm: int,
          num_requests: int, prefix_hits: bool) -> tuple[list, list[ReadRequest]]:
    """Fill the prefill cache from global coordinates (some burst requests with a prefix-cache hit on the
    decode); the requests and one read each (one lease attempt per request, every rank)."""
    from ..runtime.prefill import new_attempt
    p_pool, d_pool = BlockPool(prefill, rng), BlockPool(decode, rng)
    reqs = []
    for i, n in enumerate(all_lengths):
        in_burst = n_warm <= i < n_warm + num_requests
        prefix = int(rng.integers(0, n)) if in_burst and prefix_hits and rng.random() < 0.3 else 0
        reqs.append(make_request(i, int(n), prefill, decode, p_pool, d_pool, prefix))
    eng.P.call_all("fill_many", [(r.req_id, r.num_tokens, r.prefill_blocks) for r in reqs])
    reads = [ReadRequest(f"req-{r.req_id}", "prefill-0", r.num_tokens, r.prefill_blocks, r.decode_blocks,
                         new_attempt()) for r in reqs]
    return reqs, reads


def _warm_phase(eng: _Engines, warm_reads: list[ReadRequest], warm_requests: int, warm_len: int,
                ex: _Extras) -> Phase:
    """One untimed read, then the others one at a time; then the same requests again (same bytes, a new
    lease each), timed inside the decode processes, alternating with NIXL's own READ of the same
    descriptors."""
    from ..runtime.prefill import new_attempt
    eng.run(warm_reads[:1])  # untimed: the first read after the handshake
    b0 = eng.moved()
    secs = [eng.run([rr]) for rr in warm_reads[1:]]
    warm = Phase("warm", warm_requests, warm_len * warm_requests, warm_len, eng.moved() - b0, secs)
    s0 = eng.D.call_all("stats")
    for rr in warm_reads[1:]:
        again = replace(rr, req_id=rr.req_id + AGAIN, attempt=new_attempt())
        eng.add_to_prefill(again)
        ex.inproc.append(max(v["seconds"] for v in eng.D.call_all("timed_read", again).values()))
        ex.nixl.append(max(v[0] for v in eng.D.call_all("nixl_reads", [rr]).values()))
    for r, st in eng.D.call_all("stats").items():  # (not part of the bytes the requests needed)
        for k in ex.extra:
            ex.extra[k] += st["metrics"][k] - s0[r]["metrics"][k]
    return warm


def _burst_phase(eng: _Engines, burst_reads: list[ReadRequest], lengths) -> Phase:
    b0 = eng.moved()
    burst = Phase("burst", len(burst_reads), int(sum(lengths)), int(max(lengths)), 0, [eng.run(burst_reads)])
    burst.bytes_moved = eng.moved() - b0
    return burst


def _large_phase(eng: _Engines, large_reads: list[ReadRequest], large_tokens: int, ex: _Extras) -> Phase:
    """The large request, where its time went on each side, and NIXL's own READ of its bytes."""
    b0 = eng.moved()
    d0, p0 = eng.D.call_all("stats"), eng.P.call_all("stats")
    big = Phase("large", 1, large_tokens, large_tokens, 0, [eng.run(large_reads)])
    big.bytes_moved = eng.moved() - b0
    ex.large_phases.update(_phase_delta(d0, eng.D.call_all("stats"), slowest=True))
    ex.large_prefill.update(_phase_delta(p0, eng.P.call_all("stats"), slowest=False))
    ex.large_nixl = max(v[0] for v in eng.D.call_all("nixl_reads", large_reads).values())
    ex.large_nixl_1 = max(v[0] for v in eng.D.call_all("nixl_reads", large_reads, True).values())
    return big


def _wait_freed(P: EngineProcs, n_reqs: int, timeout_s: float = 10.0) -> dict:
    """req_id -> prefill ranks that freed it, once every rank freed every request (or after ``timeout_s``)."""
    freed: dict = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _r, got in P.call_all("take_freed").items():
            for rid in got["freed"]:
                if not rid.endswith(AGAIN):  # (the timed re-reads of the warm requests)
                    freed[rid] = freed.get(rid, 0) + 1
        if sum(1 for v in freed.values() if v == len(P.workers)) == n_reqs:
            break
        time.sleep(0.02)
    return freed


def _write_metrics(metrics_dir: str, eng: _Engines) -> None:
    from pathlib import Path

    from ..runtime.metrics_export import write_metrics
    out = Path(metrics_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_metrics({("decode-0", r): s for r, s in eng.D.call_all("stats").items()},
                  out / "decode.json", out / "decode.prom")
    write_metrics({("prefill-0", r): s for r, s in eng.P.call_all("stats").items()},
                  out / "prefill.json", out / "prefill.prom")


def _leaked_handles(D: EngineProcs, timeout_s: float = 10.0) -> int:
    """Transfer handles the decode ranks still hold once every transfer had ``timeout_s`` to settle: a probe
    transfer given up at its deadline is released when it ends (on a link slowed to seconds per READ, after
    the requests are done), which is no leak; a handle still held after that is one."""
    deadline = time.monotonic() + timeout_s
    while True:
        live = sum(s["live_handles"] for s in D.call_all("stats").values())
        if not live or time.monotonic() >= deadline:
            return live
        time.sleep(0.05)


def _sum(stats: dict, key: str) -> int:
    return sum(s["metrics"][key] for s in stats.values())


def _result(eng: _Engines, n_reqs: int, n_ranks: int, stats: dict, ver: dict, memcpy: float, freed: dict,
            warm: Phase | None, burst: Phase, big: Phase | None, ex: _Extras, leaked: int) -> DemoResult:
    extra = ex.extra
    return DemoResult(
        requests=n_reqs,
        finished=sum(1 for v in eng.finished.values() if v == n_ranks),
        failed=eng.failed, start_errors=eng.start_errors,
        bytes_moved=_sum(stats, "transfer_bytes") - extra["transfer_bytes"],
        bytes_needed=sum(v["needed_bytes"] for v in ver.values()),
        descriptors=_sum(stats, "descriptors") - extra["descriptors"],
        transfer_seconds=burst.seconds[0], memcpy_gbps=memcpy,
        mismatched_bytes=sum(v["mismatched_bytes"] for v in ver.values()),
        checked_bytes=sum(v["checked_bytes"] for v in ver.values()),
        prefill_freed=sum(1 for v in freed.values() if v == len(eng.P.workers)),
        leaked_handles=leaked,
        staged_transfers=_sum(stats, "staged_transfers") - extra["staged_transfers"],
        direct_transfers=sum(s["metrics"]["transfers"] - s["metrics"]["staged_transfers"] for s in stats.values())
        - extra["transfers"] + extra["staged_transfers"],
        host_staged_transfers=sum(s["metrics"].get("host_staged_transfers", 0) for s in stats.values())
        - extra.get("host_staged_transfers", 0),
        pushed_transfers=sum(s["metrics"].get("pushed_transfers", 0) for s in stats.values())
        - extra.get("pushed_transfers", 0),
        links={r: s.get("links", {}) for r, s in stats.items()},
        warm=warm, burst=burst, large=big, decode_ranks=n_ranks, inproc=ex.inproc, nixl=ex.nixl,
        large_phases=ex.large_phases, large_prefill=ex.large_prefill, large_nixl=ex.large_nixl,
        large_nixl_1=ex.large_nixl_1,
    )


def run_demo(prefill: EngineLayout, decode: EngineLayout, num_requests: int = 32, max_tokens: int = 2048,
             seed: int = 0, prefix_hits: bool = True, show_progress: bool = True,
             transfer_mode: str = "auto", metrics_dir: str | None = None, warm_requests: int = 0,
             large: bool = False, large_tokens: int = LARGE_TOKENS, staging_mib: int | None = None,
             segment_mib: float | None = None, decode_options: dict | None = None) -> DemoResult:
    """Three timed phases on one pair of engines, every byte verified at the end (``decode_options``: more
    options of the decode ranks, :class:`~kvbridge.runtime.config.DecodeConfig` fields; ``staging_mib``:
    every rank's staging buffer; ``segment_mib``: the decode's stage segment size):

    1. *warm single requests*: one untimed request (the first read from each prefill rank sets up what the
       handshake left), then ``warm_requests`` requests of ``max_tokens // 2`` tokens one at a time;
    2. *burst*: ``num_requests`` requests of 1..``max_tokens`` tokens started at once;
    3. with ``large``: one request of ``large_tokens`` tokens, for GB/s against a memcpy of the same bytes.

    ``requests``/``finished`` of the result count every phase (``kvbridge demo`` runs 5 warm requests; the
    default here is none, only the burst).
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_tokens + 1, size=num_requests)
    warm_len = max(1, max_tokens // 2)
    n_warm = 1 + warm_requests if warm_requests > 0 else 0
    all_lengths = [warm_len] * n_warm + list(lengths) + ([large_tokens] if large else [])
    nb = blocks_needed(prefill, decode, all_lengths)
    prefill, decode = _with_blocks(prefill, nb), _with_blocks(decode, nb)
    plan_transfer(prefill, decode)  # reject bad topologies before starting processes
    eng, ex = _Engines(), _Extras()
    with Progress(console=console, transient=True, disable=not show_progress) as prog:
        task = prog.add_task("starting engines", total=7)
        try:
            _start(eng, prefill, decode, transfer_mode, staging_mib, segment_mib, decode_options)
            prog.update(task, advance=1, description="handshake")
            eng.D.call_all("handshake", "prefill-0", eng.P.endpoints())
            prog.update(task, advance=1, description="filling prefill cache from global coordinates")
            reqs, reads = _fill(eng, prefill, decode, rng, all_lengths, n_warm, num_requests, prefix_hits)
            warm_reads, burst_reads = reads[:n_warm], reads[n_warm:n_warm + num_requests]
            large_reads = reads[n_warm + num_requests:]
            warm = big = None
            if warm_reads:
                prog.update(task, advance=1, description=f"{warm_requests} single requests, one at a time")
                warm = _warm_phase(eng, warm_reads, warm_requests, warm_len, ex)
            prog.update(task, advance=1, description=f"burst: {num_requests} requests at once")
            burst = _burst_phase(eng, burst_reads, lengths)
            if large_reads:
                prog.update(task, advance=1, description=f"one large request ({large_tokens} tokens)")
                big = _large_phase(eng, large_reads, large_tokens, ex)
            prog.update(task, advance=1, description="verifying every decode byte")
            ver = eng.D.call_all("verify", [(r.req_id, rr) for r, rr in zip(reqs, reads)])
            stats = eng.D.call_all("stats")
            # the same bytes as the large request (else the burst), copied by one thread of a decode process
            memcpy = next(iter(eng.D.workers.values())).call("memcpy_gbps", (big or burst).bytes_moved)
            prog.update(task, advance=1, description="waiting for the prefill to free blocks")
            freed = _wait_freed(eng.P, len(reqs))
            leaked = _leaked_handles(eng.D)
            if metrics_dir:
                _write_metrics(metrics_dir, eng)
            prog.update(task, advance=1)
        finally:
            eng.stop()
    return _result(eng, len(reqs), len(decode.ranks()), stats, ver, memcpy, freed, warm, burst, big, ex, leaked)


AGAIN = "-again"  # suffix of the warm requests' timed re-reads


def _phase_delta(before: dict, after: dict, slowest: bool) -> dict:
    """{phase: ms} spent between two ``stats()`` snapshots of every rank: the slowest rank's (decode) or
    the mean per observation over the ranks (prefill)."""
    out: dict = {}
    for r, st in after.items():
        b = before.get(r, {}).get("metrics", {}).get("phase_seconds", {})
        for ph, h in st["metrics"].get("phase_seconds", {}).items():
            h0 = b.get(ph, {"sum": 0.0, "count": 0})
            n, sec = h["count"] - h0["count"], h["sum"] - h0["sum"]
            if n <= 0:
                continue
            if slowest:
                out[ph] = max(out.get(ph, 0.0), sec * 1e3)
            else:
                acc = out.setdefault(ph, [0.0, 0])
                acc[0] += sec * 1e3
                acc[1] += n
    return out if slowest else {ph: v[0] / v[1] for ph, v in out.items()}


def headline(res: DemoResult) -> list[tuple[str, str]]:
    """The speed figures, each labelled with what it is. Every time is the harness's view: from handing the
    reads to the decode rank processes to every decode rank reporting them done (pipe RPC included)."""
    mib = 2 ** 20
    rows = []
    w = res.warm
    if w and w.requests:
        rows.append((f"single-request transfer latency, warm: median / min of {w.requests} requests of "
                     f"{w.longest} tokens ({w.bytes_moved / w.requests / res.decode_ranks / mib:.2f} MiB "
                     f"per decode rank), one at a time; handshake and first request excluded",
                     f"{w.median_s * 1e3:.2f} / {w.min_s * 1e3:.2f} ms"))
    if res.inproc and res.nixl:
        k, n = float(np.median(res.inproc)), float(np.median(res.nixl))
        rows.append((f"the same single requests timed inside the decode processes (no RPC; slowest decode rank), "
                     f"median of {len(res.inproc)}: kvbridge vs NIXL's own READ of the same descriptors between "
                     "the same processes", f"{k * 1e3:.2f} vs {n * 1e3:.2f} ms ({(k - n) * 1e3:+.2f} ms)"))
    b = res.burst
    if b:
        rows += [(f"burst wall time: {b.requests} requests of up to {b.longest} tokens started at once, "
                  f"until all are in (not a per-request latency)", f"{b.seconds[0] * 1e3:.1f} ms"),
                 ("burst throughput (requests and bytes over every decode rank, per second of wall time)",
                  f"{b.requests / b.seconds[0]:.0f} req/s, {res.gbps:.2f} GB/s" if b.seconds[0] else "-")]
    g = res.large
    if g:
        ratio = f"{res.large_gbps / res.memcpy_gbps:.2f}x of memcpy" if res.memcpy_gbps else "-"
        rows += [(f"large request: {g.tokens} tokens, {g.bytes_moved / mib:.1f} MiB over {res.decode_ranks} decode "
                  f"ranks, transfer wall time", f"{g.seconds[0] * 1e3:.1f} ms"),
                 ("large request GB/s vs one-thread numpy memcpy of the same bytes, same run",
                  f"{res.large_gbps:.2f} vs {res.memcpy_gbps:.2f} GB/s ({ratio})")]
        if res.large_nixl:
            per = g.bytes_moved / 1e9
            one = (f"{per / res.large_nixl_1:.2f}", f"{res.large_nixl_1 * 1e3:.0f}") if res.large_nixl_1 else ("-", "-")
            rows.append(("NIXL's own READ of the large request's bytes, same processes, right after: the "
                         "descriptors a direct read posts / the same bytes as one descriptor per prefill rank "
                         "(per staging buffer's worth)",
                         f"{per / res.large_nixl:.2f} / {one[0]} GB/s ({res.large_nixl * 1e3:.0f} / {one[1]} ms)"))
        if res.large_phases:
            rows.append(("large request: where the time went (ms, slowest decode rank; phases overlap across "
                         "segments and prefill ranks)", " ".join(f"{k} {v:.1f}" for k, v in res.large_phases.items())))
        if res.large_prefill:
            rows.append(("large request on the prefill ranks (mean ms per answer)",
                         " ".join(f"{k} {v:.1f}" for k, v in res.large_prefill.items() if k != "serve_turn")))
    else:
        rows.append(("GB/s vs memcpy", "not measured: small requests are bound by per-request latency; "
                                       "run `kvbridge demo --large` for one large request"))
    return rows


def print_result(res: DemoResult, prefill: EngineLayout, decode: EngineLayout) -> None:
    t = Table(
        title=f"kvbridge demo: {prefill.model.name}  prefill tp={prefill.tp} pp={prefill.pp} bs={prefill.block_size} "
        f"{prefill.memory} -> decode tp={decode.tp} pp={decode.pp} bs={decode.block_size} {decode.memory}"
    )
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("requests finished / sent (all phases)", f"{res.finished} / {res.requests}"),
        ("failed", str(len(res.failed) + len(res.start_errors))),
        ("bytes moved", f"{res.bytes_moved:,}"),
        ("bytes needed (decode boxes)", f"{res.bytes_needed:,}"),
        ("read amplification", f"{res.bytes_moved / res.bytes_needed:.3f}" if res.bytes_needed else "-"),
        ("descriptors per request", f"{res.descriptors / max(res.requests, 1):.1f}"),
        ("transfers direct / staged", f"{res.direct_transfers} / {res.staged_transfers}"),
        *headline(res),
        ("bytes checked on decode", f"{res.checked_bytes:,}"),
        ("mismatched bytes", str(res.mismatched_bytes)),
        ("requests freed by prefill", f"{res.prefill_freed} / {res.requests}"),
        ("leaked transfer handles", str(res.leaked_handles)),
        ("result", "[green]PASS" if res.ok else "[red]FAIL"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    for rid, why in list(res.failed.items())[:5] + list(res.start_errors.items())[:5]:
        console.print(f"[red]{rid}: {why}")


def cmd_demo(args, _engine) -> int:
    from ..models import load_model
    model = load_model(args.model)
    prefill, decode = _engine(args, "prefill", model), _engine(args, "decode", model)
    res = run_demo(prefill, decode, args.requests, args.max_tokens, args.seed, prefix_hits=not args.no_prefix_hits,
                   transfer_mode=args.mode, metrics_dir=args.metrics_dir, warm_requests=args.warm_requests,
                   large=args.large, large_tokens=args.large_tokens,
                   staging_mib=args.staging_mib if args.staging_mib or not args.large else LARGE_STAGING_MIB,
                   segment_mib=args.segment_mib)
    print_result(res, prefill, decode)
    return 0 if res.ok else 1


def add_demo_parser(sub, add_topology, engine_from_args) -> None:
    p = sub.add_parser("demo", help="the main job: prefill and decode processes, KV over NIXL, every byte verified")
    add_topology(p, "gemma-4-mini", 4, 2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prefix-hits", action="store_true", help="decode never has a prefix-cache hit")
    p.add_argument("--warm-requests", type=int, default=5,
                   help="single requests (max-tokens/2 tokens) timed one at a time after a warm-up one (0: none)")
    p.add_argument("--large", action="store_true",
                   help="also move one large request and report its GB/s against memcpy of the same bytes")
    p.add_argument("--large-tokens", type=int, default=LARGE_TOKENS, help="tokens of the --large request")
    p.add_argument(
        "--staging-mib",
        type=int,
        default=None,
        help="staging buffer of every prefill and decode rank, MiB (default: the endpoints' 64, with --large "
        f"{LARGE_STAGING_MIB}); a staged read larger than a decode engine's share of the prefill's "
        "buffer reads directly",
    )
    p.add_argument("--segment-mib", type=float, default=None,
                   help="staged reads are packed, read and scattered in segments of this size (MiB; default: "
                        "the decode endpoint's): smaller segments overlap the three")
    p.add_argument("--metrics-dir", help="write each side's counters there as JSON and Prometheus text")
    from ..modes import TRANSFER_MODES
    p.add_argument("--mode", choices=TRANSFER_MODES, default="auto",
                   help="direct head-sliced reads, staged (prefill packs, one read, decode scatters), host (staged "
                        "through host staging buffers), push (prefill packs and WRITEs into the decode's staging, "
                        "decode scatters), or auto: chosen per (decode rank, prefill rank) and request "
                        "from the links measured at handshake")
    p.set_defaults(fn=lambda args: cmd_demo(args, engine_from_args))


__all__ = ["run_demo", "DemoResult", "Phase", "MemoryLayout"]
