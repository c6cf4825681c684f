"""The main job: a prefill engine and a decode engine as separate processes, KV moved by NIXL, verified.

``kvbridge demo`` starts one process per rank on each side (default: Gemma-4-style model with
different KV head counts per group, prefill TP=4, decode TP=2), fills the prefill cache from global
coordinates, transfers a batch of requests of varied lengths through NIXL, checks every decode byte
and prints a summary with the memcpy bandwidth of the same bytes measured in the same run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

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
class DemoResult:
    requests: int
    finished: int
    failed: dict
    start_errors: dict
    bytes_moved: int
    bytes_needed: int
    descriptors: int
    transfer_seconds: float
    memcpy_gbps: float
    mismatched_bytes: int
    checked_bytes: int
    prefill_freed: int
    leaked_handles: int
    staged_transfers: int = 0
    direct_transfers: int = 0
    latency_p50_s: float = 0.0  # per request (start to all bytes in), decode ranks' medians, worst rank
    latency_p90_s: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.transfer_seconds / 1e9 if self.transfer_seconds else 0.0

    @property
    def ok(self) -> bool:
        return (self.finished == self.requests and not self.failed and not self.start_errors
                and self.mismatched_bytes == 0 and self.bytes_moved == self.bytes_needed
                and self.prefill_freed == self.requests and self.leaked_handles == 0)


def blocks_needed(prefill: EngineLayout, decode: EngineLayout, lengths) -> int:
    bs = min(prefill.block_size, decode.block_size)
    return int(sum(ceil_div(int(n), bs) + 1 for n in lengths)) + 4


def run_demo(prefill: EngineLayout, decode: EngineLayout, num_requests: int = 32, max_tokens: int = 2048,
             seed: int = 0, prefix_hits: bool = True, show_progress: bool = True,
             transfer_mode: str = "auto", metrics_dir: str | None = None) -> DemoResult:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_tokens + 1, size=num_requests)
    nb = blocks_needed(prefill, decode, lengths)
    prefill = EngineLayout(**{**{f: getattr(prefill, f) for f in prefill.__dataclass_fields__}, "num_blocks": nb})
    decode = EngineLayout(**{**{f: getattr(decode, f) for f in decode.__dataclass_fields__}, "num_blocks": nb})
    plan_transfer(prefill, decode)  # reject bad topologies before starting processes
    P = D = None
    with Progress(console=console, transient=True, disable=not show_progress) as prog:
        task = prog.add_task("starting engines", total=6)
        try:
            P = EngineProcs.start("prefill", prefill, "prefill-0")
            D = EngineProcs.start("decode", decode, "decode-0", transfer_mode=transfer_mode)
            prog.update(task, advance=1, description="handshake")
            D.call_all("handshake", "prefill-0", P.endpoints())
            prog.update(task, advance=1, description="filling prefill cache from global coordinates")
            p_pool, d_pool = BlockPool(prefill, rng), BlockPool(decode, rng)
            reqs = []
            for i, n in enumerate(lengths):
                prefix = int(rng.integers(0, n)) if prefix_hits and rng.random() < 0.3 else 0
                reqs.append(make_request(i, int(n), prefill, decode, p_pool, d_pool, prefix))
            P.call_all("fill_many", [(r.req_id, r.num_tokens, r.prefill_blocks) for r in reqs])
            from ..runtime.prefill import new_attempt
            attempts = {r.req_id: new_attempt() for r in reqs}  # one lease attempt per request, every rank
            for w in P.workers.values():
                for r in reqs:
                    w.call("add_request", f"req-{r.req_id}", r.prefill_blocks, None, attempts[r.req_id])
            reads = [ReadRequest(f"req-{r.req_id}", "prefill-0", r.num_tokens, r.prefill_blocks, r.decode_blocks,
                                 attempts[r.req_id]) for r in reqs]
            prog.update(task, advance=1, description=f"transferring {num_requests} requests through NIXL")
            t0 = time.perf_counter()
            start_errors = {}
            for rank_errs in D.call_all("start_many", reads).values():
                start_errors |= rank_errs
            finished: dict = {}
            failed: dict = {}
            for d, f in D.call_all("wait", 120.0).values():
                for rid in d:
                    finished[rid] = finished.get(rid, 0) + 1
                failed |= f
            elapsed = time.perf_counter() - t0
            prog.update(task, advance=1, description="verifying every decode byte")
            ver = D.call_all("verify", [(r.req_id, rr) for r, rr in zip(reqs, reads)])
            stats = D.call_all("stats")
            per_rank_bytes = max(s["metrics"]["transfer_bytes"] for s in stats.values())
            memcpy = next(iter(D.workers.values())).call("memcpy_gbps", per_rank_bytes)
            prog.update(task, advance=1, description="waiting for the prefill to free blocks")
            freed: dict = {}
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                for r, got in P.call_all("take_freed").items():
                    for rid in got["freed"]:
                        freed[rid] = freed.get(rid, 0) + 1
                if sum(1 for v in freed.values() if v == len(P.workers)) == num_requests:
                    break
                time.sleep(0.02)
            if metrics_dir:
                from pathlib import Path
                from ..runtime.metrics_export import write_metrics
                out = Path(metrics_dir)
                out.mkdir(parents=True, exist_ok=True)
                write_metrics({("decode-0", r): s for r, s in D.call_all("stats").items()},
                              out / "decode.json", out / "decode.prom")
                write_metrics({("prefill-0", r): s for r, s in P.call_all("stats").items()},
                              out / "prefill.json", out / "prefill.prom")
            prog.update(task, advance=1)
        finally:
            for e in (D, P):
                if e is not None:
                    e.stop()
    n_ranks = len(decode.ranks())
    return DemoResult(
        requests=num_requests,
        finished=sum(1 for v in finished.values() if v == n_ranks),
        failed=failed, start_errors=start_errors,
        bytes_moved=sum(s["metrics"]["transfer_bytes"] for s in stats.values()),
        bytes_needed=sum(v["needed_bytes"] for v in ver.values()),
        descriptors=sum(s["metrics"]["descriptors"] for s in stats.values()),
        transfer_seconds=elapsed, memcpy_gbps=memcpy,
        mismatched_bytes=sum(v["mismatched_bytes"] for v in ver.values()),
        checked_bytes=sum(v["checked_bytes"] for v in ver.values()),
        prefill_freed=sum(1 for v in freed.values() if v == len(P.workers)),
        leaked_handles=sum(s["live_handles"] for s in stats.values()),
        staged_transfers=sum(s["metrics"]["staged_transfers"] for s in stats.values()),
        direct_transfers=sum(s["metrics"]["transfers"] - s["metrics"]["staged_transfers"] for s in stats.values()),
        latency_p50_s=max((s["metrics"].get("transfer_seconds_p50", 0.0) for s in stats.values()), default=0.0),
        latency_p90_s=max((s["metrics"].get("transfer_seconds_p90", 0.0) for s in stats.values()), default=0.0),
    )


# a request moving at least this many bytes per decode rank is bandwidth-bound: its GB/s means something
LARGE_REQUEST_BYTES = 256 << 20


def headline(res: DemoResult, n_decode_ranks: int = 1) -> list[tuple[str, str]]:
    """What the run's speed figures mean: per-request latency for small requests; GB/s and its ratio to
    memcpy only when one large request was moved (small requests are bound by per-transfer latency, and
    their aggregate GB/s against memcpy reads as a slowdown that is not there)."""
    per_req = res.bytes_moved / max(res.requests, 1) / max(n_decode_ranks, 1)
    rows = [("per-request latency p50 / p90 (start to all bytes in; worst decode rank)",
             f"{res.latency_p50_s * 1e3:.2f} / {res.latency_p90_s * 1e3:.2f} ms"),
            ("bytes per request per decode rank", f"{per_req / 2**20:.2f} MiB")]
    if res.requests == 1 and per_req >= LARGE_REQUEST_BYTES:
        rows += [("NIXL GB/s (one large request)", f"{res.gbps:.2f}"),
                 ("vs numpy memcpy of the same bytes, same run", f"{res.gbps / res.memcpy_gbps:.2f}x of {res.memcpy_gbps:.2f} GB/s"
                  if res.memcpy_gbps else "-")]
    else:
        rows += [("bandwidth", "not reported: these requests are small (latency-bound); for GB/s vs memcpy run "
                               "one large request: `kvbridge demo --requests 1 --max-tokens 32768`, or `kvbridge bench`")]
    return rows


def print_result(res: DemoResult, prefill: EngineLayout, decode: EngineLayout) -> None:
    t = Table(title=f"kvbridge demo: {prefill.model.name}  prefill tp={prefill.tp} pp={prefill.pp} bs={prefill.block_size} "
                    f"{prefill.memory} -> decode tp={decode.tp} pp={decode.pp} bs={decode.block_size} {decode.memory}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("requests finished / sent", f"{res.finished} / {res.requests}"),
        ("failed", str(len(res.failed) + len(res.start_errors))),
        ("bytes moved", f"{res.bytes_moved:,}"),
        ("bytes needed (decode boxes)", f"{res.bytes_needed:,}"),
        ("read amplification", f"{res.bytes_moved / res.bytes_needed:.3f}" if res.bytes_needed else "-"),
        ("descriptors per request", f"{res.descriptors / max(res.requests, 1):.1f}"),
        ("transfers direct / staged", f"{res.direct_transfers} / {res.staged_transfers}"),
        ("wall time of the whole run (all requests at once, all ranks, incl. RPC)", f"{res.transfer_seconds * 1e3:.1f} ms"),
        *headline(res, len(decode.ranks())),
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
                   transfer_mode=args.mode, metrics_dir=args.metrics_dir)
    print_result(res, prefill, decode)
    return 0 if res.ok else 1


def add_demo_parser(sub, add_topology, engine_from_args) -> None:
    p = sub.add_parser("demo", help="the main job: prefill and decode processes, KV over NIXL, every byte verified")
    add_topology(p, "gemma-4-mini", 4, 2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prefix-hits", action="store_true", help="decode never has a prefix-cache hit")
    p.add_argument("--metrics-dir", help="write each side's counters there as JSON and Prometheus text")
    p.add_argument("--mode", choices=("auto", "direct", "staged"), default="auto",
                   help="direct head-sliced reads, staged (prefill packs, one read, decode scatters), or "
                        "auto: the cost model chooses per (decode rank, prefill rank)")
    p.set_defaults(fn=lambda args: cmd_demo(args, engine_from_args))


__all__ = ["run_demo", "DemoResult", "MemoryLayout"]
