"""Probe one benchmark scenario in one mode, many times: per-run GB/s and the decode rank's counters.

Used for the A/B measurements in benchmarks/RESULTS.md ("what changed"). Examples:

    .venv/bin/python benchmarks/probe.py dense-gqa-p8d4 flash_attn_hnd shuffled staged --reps 12
    .venv/bin/python benchmarks/probe.py dense-gqa-p8d4 flash_attn_hnd shuffled staged --segment-mib 16
    .venv/bin/python benchmarks/probe.py dense-gqa-p8d4 flash_attn_hnd shuffled staged --stage-wait 0
    .venv/bin/python benchmarks/probe.py pp-p4pp2d4 cross_layer contiguous direct --post-threads 2

Same setup as ``kvbridge bench`` (scenario geometry, one decode rank (0, 0) in its own process, the
prefill ranks it needs in theirs), but one mode and many repetitions, so distributions can be compared.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> int:
    import numpy as np
    from bench import DECODE_RANK, SCENARIOS, engines

    from kvbridge.layout import ceil_div
    from kvbridge.lower import LoweredPlan
    from kvbridge.plan import plan_transfer
    from kvbridge.runtime.decode import ReadRequest
    from kvbridge.testing.procs import Worker
    from kvbridge.testing.verify import BlockPool, make_request

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", choices=[s.name for s in SCENARIOS])
    ap.add_argument("layout")
    ap.add_argument("alloc", choices=["contiguous", "shuffled"])
    ap.add_argument("mode", choices=["direct", "staged", "auto"])
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--segment-mib", type=float, default=None, help="stage segment size (default: the protocol's)")
    ap.add_argument("--post-threads", type=int, default=1, help="decode threads posting NIXL reads")
    ap.add_argument("--staging-requests", type=int, default=1,
                    help="requests each prefill's staging buffer holds (1: the next waits for a slot)")
    ap.add_argument("--stage-wait", type=float, default=2.0,
                    help="seconds a stage request may wait for staging space (0: refuse at once, read directly)")
    a = ap.parse_args()
    sc = next(s for s in SCENARIOS if s.name == a.scenario)
    n_req = ceil_div(sc.tokens, sc.block_size)
    prefill, decode = engines(sc, a.layout, n_req + n_req // 4 + 4)
    plan = plan_transfer(prefill, decode)
    needed = plan.prefill_ranks_for(DECODE_RANK)
    rng = np.random.default_rng(0)
    shuffled = a.alloc == "shuffled"
    req = make_request(
        0, sc.tokens, prefill, decode, BlockPool(prefill, rng, shuffled), BlockPool(decode, rng, shuffled)
    )
    descs = LoweredPlan(plan, DECODE_RANK).descriptors(sc.tokens, req.prefill_blocks, req.decode_blocks)
    nbytes = sum(d.total_bytes for d in descs)
    per = {p: max([d.total_bytes for d in descs if d.prefill == p] or [0]) for p in needed}
    kw = {"post_threads": a.post_threads}
    if a.segment_mib:
        kw["stage_segment_bytes"] = int(a.segment_mib * 2**20)
    workers = {r: Worker("prefill", prefill, r, "prefill-0", host="127.0.0.1",
                         staging_bytes=a.staging_requests * per.get(r, 0) + (1 << 20), stage_wait_s=a.stage_wait,
                         staging_peer_share=1.0)  # one decode engine: the whole buffer is its
               for r in sorted(set(needed) | set(plan.ranks_to_notify(DECODE_RANK)) | {(0, 0)})}
    dw = Worker("decode", decode, DECODE_RANK, "decode-0", transfer_mode=a.mode,
                staging_bytes=sum(per.values()) + (1 << 20), **kw)
    try:
        for w in [*workers.values(), dw]:
            w.ready()
        for i, w in enumerate(workers.values()):
            w.call("fill_random", i)
        dw.call("handshake", "prefill-0", {r: f"127.0.0.1:{w.info['port']}" for r, w in workers.items()})
        for w in workers.values():
            for j in range(a.reps + 1):
                w.call("add_request", f"r{j}", req.prefill_blocks, 600.0, j + 1)
        gbps = [
            nbytes
            / dw.call(
                "timed_read",
                ReadRequest(f"r{j}", "prefill-0", req.num_tokens, req.prefill_blocks, req.decode_blocks, j + 1),
            )["seconds"]
            / 1e9
            for j in range(a.reps + 1)
        ][1:]
        memcpy = [dw.call("memcpy_gbps", nbytes) for _ in range(3)]
        m = dw.call("stats")["metrics"]
    finally:
        for w in [*workers.values(), dw]:
            w.stop()
    print(f"{a.scenario} {a.layout} {a.alloc} {a.mode} {nbytes / 2**20:.0f} MiB, {kw}: GB/s best {max(gbps):.2f} "
          f"median {statistics.median(gbps):.2f} min {min(gbps):.2f}; memcpy best {max(memcpy):.2f}")
    print("  runs:", " ".join(f"{x:.2f}" for x in gbps))
    print(
        "  decode counters:",
        {k: v for k, v in m.items() if k in ("transfers", "staged_transfers", "staging_fallbacks")},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
