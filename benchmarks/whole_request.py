"""Whole request, kvbridge vs vLLM 0.33, in one run (issue 14 point 4).

Times, per request of one decode rank (0, 0), everything from "start a direct read" to "NIXL holds a
posted-ready transfer handle" (``make_prepped_xfer`` / ``initialize_xfer`` returned), on real NIXL lists
over real registered memory (address space reserved with MAP_NORESERVE; in-process prefill agents).
``transfer()`` is not called: the bytes (GBs at 32k tokens) would not fit this machine, and the copy is
the same for both systems. The two systems alternate request by request; medians and minima.

* kvbridge prepped: ``runtime.prepped_hook.direct_reads`` (the caller's thread: validate + sizes), then
  ``request`` (index
  arrays) + ``make_prepped_xfer`` per prefill rank (the post thread), lists prepared once (strided), with
  span lists (``KVBRIDGE_PREPPED_SPANS``, default 64) where runs are whole blocks on both sides.
* kvbridge prepped, no spans: the same on lists prepared with span levels () (the path before span lists).
  The loop runs ``2 * reps`` rounds; each round runs vLLM, then the two kvbridge variants in alternating
  order. The prepped and no-span columns hold only the rounds where that variant ran right after vLLM
  (caches cold, as the post thread finds them after an engine step; ``reps`` samples each); the "warm"
  column the rounds where it ran second. vLLM, staged: every round.
* kvbridge merged: ``LoweredPlan.descriptors`` (merges in Python) + Nx3 + ``get_xfer_descs`` x2 +
  ``initialize_xfer`` (the old path), to decide which is faster.
* vLLM 0.33: its own ``NixlConnectorWorker._compute_desc_ids`` (called on a stub holding the attributes
  it reads for an all-attention model) for the remote and the local side of each read, then
  ``make_prepped_xfer`` on lists prepared like vLLM's (one strided row per region: K and V of every
  layer, per block; P>D: the local list split per source rank).

Run (needs the vLLM venv, which has nixl):
    PYTHONPATH=src /work/main/.venv-vllm/bin/python benchmarks/whole_request.py [--reps 15]
"""
from __future__ import annotations

import argparse
import mmap
import statistics
import time
from types import SimpleNamespace

import numpy as np

from kvbridge.layout import EngineLayout, MemoryLayout, ceil_div
from kvbridge.lower import GroupBlocks, LoweredPlan
from kvbridge.memory import rank_memory
from kvbridge.models import load_model
from kvbridge.plan import plan_transfer
from kvbridge.transport.nixl import NixlTransport

DR = (0, 0)
_maps = []


def vbuf(nbytes: int) -> np.ndarray:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000))
    _maps.append(m)
    return np.frombuffer(m, dtype=np.uint8)


def vllm_compute_desc_ids():
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlConnectorWorkerBase as W
    except Exception:  # noqa: BLE001
        import vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker as bw
        W = next(v for k, v in vars(bw).items() if isinstance(v, type) and hasattr(v, "_compute_desc_ids"))
    return W._compute_desc_ids


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE / 2**20


def stats(xs):
    xs = [x * 1e3 for x in xs]
    return f"{statistics.median(xs):.3f} / {min(xs):.3f}"


def scenario(name, model, p_tp, d_tp, layout, tokens, num_blocks, shuffled, reps, cdi, log=print):
    m = load_model(model)
    bs = 16
    P = EngineLayout(
        m, tp=p_tp, block_size=bs, memory=MemoryLayout.parse(layout), num_blocks=num_blocks, role="prefill"
    )
    D = EngineLayout(m, tp=d_tp, block_size=bs, memory=MemoryLayout.parse(layout), num_blocks=num_blocks, role="decode")
    plan = plan_transfer(P, D)
    pranks = plan.prefill_ranks_for(DR)
    dec = NixlTransport(f"wr-d-{name}-{layout}-{shuffled}")
    pre = {p: NixlTransport(f"wr-p{p[1]}-{name}-{layout}-{shuffled}", multi_threaded=False) for p in pranks}
    dsize = rank_memory(D, *DR).size
    dbuf = vbuf(dsize)
    dbase = dec.register(dbuf)
    bases, agents, psize = {}, {}, {}
    for p, t in pre.items():
        psize[p] = rank_memory(P, *p).size
        bases[p] = t.register(vbuf(psize[p]))
        agents[p] = dec.add_peer(t.metadata())
    lp = LoweredPlan(plan, DR, bases, dbase)
    from kvbridge import prepped
    for p in pranks:  # build the partial-chunk templates once (cached in lp), so both timings below exclude it
        prepped.PreparedGeometry(lp, p, span_levels=())
    levels = prepped.SPAN_LEVELS
    prepped.SPAN_LEVELS = ()
    rss0, t0 = rss_mib(), time.perf_counter()
    preps_ns = {p: dec.prepare(agents[p], lp, p) for p in pranks}
    prep_ns_ms, rss_ns = (time.perf_counter() - t0) * 1e3, rss_mib() - rss0
    prepped.SPAN_LEVELS = levels
    rss0, t0 = rss_mib(), time.perf_counter()
    preps = {p: dec.prepare(agents[p], lp, p) for p in pranks}
    prep_ms, rss_sp = (time.perf_counter() - t0) * 1e3, rss_mib() - rss0
    span_rows = sum(0 if pr.geometry.local_span_rows is None else
                    len(pr.geometry.local_span_rows) + len(pr.geometry.remote_span_rows) for pr in preps.values())
    rows = sum(len(pr.geometry.local_rows) + len(pr.geometry.remote_rows) for pr in preps.values())
    rng = np.random.default_rng(0)
    n = ceil_div(tokens, bs)
    ids = lambda: (rng.permutation(num_blocks)[:n] if shuffled else np.arange(n)).astype(np.int64)  # noqa: E731
    pb = {g.name: GroupBlocks(ids()) for g in m.groups}
    db = {g.name: GroupBlocks(ids()) for g in m.groups}
    api = dec.agent

    # ---- vLLM: regions = (layer, K/V) of this rank's per-layer caches; lists prepared once ------------
    layers = plan.group_layers(plan.reads_for(DR)[0])
    is_mla = any(g.name.startswith("mla") or "mla" in g.name for g in m.groups) or model.startswith("deepseek")
    R = len(layers) * (1 if is_mla else 2)
    ratio = p_tp // d_tp if (p_tp > d_tp and not is_mla) else 1  # P>D: local list split per source rank
    v_reads = [pranks[0]] if is_mla else pranks                   # MLA: one read (others only notified)
    d_blk = dsize // (R * num_blocks)
    l_rows = np.array([[dbase + r * num_blocks * d_blk, d_blk // ratio, 0, d_blk, num_blocks] for r in range(R)],
                      dtype=np.uint64)
    v_local = api.prep_xfer_dlist("NIXL_INIT_AGENT", l_rows, "DRAM")
    v_remote = {}
    for p in v_reads:
        p_blk = psize[p] // (R * num_blocks)
        seg = d_blk // ratio if ratio > 1 else (p_blk if p_tp >= d_tp else d_blk)
        rr = np.array(
            [[bases[p] + r * num_blocks * p_blk, seg, 0, p_blk, num_blocks] for r in range(R)], dtype=np.uint64
        )
        v_remote[p] = api.prep_xfer_dlist(agents[p], rr, "DRAM")
    stub = SimpleNamespace(_has_mamba=False, _transfer_layer_group_ids=[], num_regions=R,
                           block_len_per_layer=[d_blk] * R, region_group_ids=[0] * R,
                           _uses_region_group_mapping=False)
    v_pb, v_db = [pb[m.groups[0].name].block_ids.tolist()], [db[m.groups[0].name].block_ids.tolist()]

    def run_vllm():
        t = time.perf_counter()
        hs, cnt = [], 0
        for p in v_reads:
            r_ids = cdi(stub, v_pb, num_blocks, None, 1)
            l_ids = cdi(stub, v_db, num_blocks, 1.0, 1)
            hs.append(api.make_prepped_xfer("READ", v_local, l_ids, v_remote[p], r_ids, b"req:4"))
            cnt += len(l_ids)
        dt = time.perf_counter() - t
        for h in hs:
            api.release_xfer_handle(h)
        return dt, cnt

    from kvbridge.runtime.prepped_hook import direct_reads
    remote_stub = SimpleNamespace(lowered=lp)
    req_stub = SimpleNamespace(num_tokens=tokens, prefill_blocks=pb, decode_blocks=db)

    def run_prepped(preps=preps):
        t = time.perf_counter()
        # caller's thread: the runtime's own hand-over (runtime/prepped_hook.direct_reads): validate once,
        # sizes by arithmetic, one DirectRead per prefill rank
        works = direct_reads(preps, remote_stub, req_stub, pranks)
        t_caller = time.perf_counter() - t
        hs, cnt = [], 0
        for _p, w in works.items():  # the post thread's part (run inline here, as NixlTransport.post)
            req = w.prep.geometry.request(w.ranges, w.prefill_blocks, w.decode_blocks)
            pr = w.prep
            local, remote = (pr.local_span, pr.remote_span) if req.spans else (pr.local, pr.remote)
            hs.append(api.make_prepped_xfer("READ", local, req.local_ids, remote, req.remote_ids, b"x"))
            cnt += req.local_ids.size
        dt = time.perf_counter() - t
        for h in hs:
            api.release_xfer_handle(h)
        return dt, cnt, t_caller

    def run_merged():
        t = time.perf_counter()
        descs = lp.descriptors(tokens, pb, db)
        hs, cnt = [], 0
        for d in descs:
            loc, rem = d.nixl_arrays(0, 0)
            hs.append(api.initialize_xfer("READ", dec.xfer_descs(loc), dec.xfer_descs(rem), agents[d.prefill], b"x"))
            cnt += d.count
        dt = time.perf_counter() - t
        for h in hs:
            api.release_xfer_handle(h)
        return dt, cnt

    from kvbridge.layout import engine_to_dict
    from kvbridge.runtime.protocol import Stage, blocks_to_wire
    from kvbridge.runtime.protocol import pack as pack_msg
    layout_dict = engine_to_dict(D)

    def run_staged_post():  # what DecodeRank.start does for staged ranks: encode one stage request per rank
        t = time.perf_counter()
        wire_p, wire_d = blocks_to_wire(pb), blocks_to_wire(db)
        for _p in pranks:
            pack_msg(Stage("r", "d", DR, layout_dict, {}, tokens, wire_p, wire_d))
        return time.perf_counter() - t

    tv, tp, tc, tm, ts, tn = [], [], [], [], [], []
    cv = cp = cm = cn = 0
    wp, wn = [], []  # "warm": the kvbridge variant that ran second (after the other one, not after vLLM)
    for i in range(2 * reps + 1):
        a, cv = run_vllm()
        if i % 2:  # with spans right after vLLM (cold caches), then without
            b, cp, c = run_prepped()
            nn, cn, _ = run_prepped(preps_ns)
        else:
            nn, cn, _ = run_prepped(preps_ns)
            b, cp, c = run_prepped()
        mm, cm = run_merged() if (reps <= 5 or i % 3 == 0) else (None, cm)
        st = run_staged_post()
        if i:
            tv.append(a), ts.append(st)
            if i % 2:
                tp.append(b), tc.append(c), wn.append(nn)
            else:
                tn.append(nn), wp.append(b)
            if mm is not None:
                tm.append(mm)
    best_kv = statistics.median(tp)  # the runtime posts prepped (see RESULTS.md: prepped vs merged)
    row = {
        "scenario": name,
        "layout": layout,
        "alloc": "shuffled" if shuffled else "contiguous",
        "vllm_descs": cv,
        "kvb_prepped_ids": cp,
        "kvb_merged_descs": cm,
        "vllm_ms": stats(tv),
        "kvb_prepped_ms": stats(tp),
        "kvb_caller_ms": stats(tc),
        "kvb_merged_ms": stats(tm),
        "staged_post_ms": stats(ts),
        "ratio": statistics.median(tv) / best_kv,
        "prep_ms": prep_ms,
        "nospan_ids": cn,
        "nospan_ms": stats(tn),
        "nospan_ratio": statistics.median(tv) / statistics.median(tn),
        "warm_ms": f"{statistics.median(wp) * 1e3:.3f} / {statistics.median(wn) * 1e3:.3f}",
        "prep_nospan_ms": prep_ns_ms,
        "rows": rows,
        "span_rows": span_rows,
        "rss_mib": rss_sp,
        "rss_nospan_mib": rss_ns,
    }
    log(row)
    for p in pranks:
        dec.unprepare(preps[p])
        dec.unprepare(preps_ns[p])
    dec.close()
    for t in pre.values():
        t.close()
    return row


SCEN = [("llama70b-p8d4", "llama-3.1-70b", 8, 4), ("llama70b-p2d8", "llama-3.1-70b", 2, 8),
        ("deepseekv3-mla-p8d4", "deepseek-v3", 8, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--layouts", default="flashinfer,cross_layer,universal")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    cdi = vllm_compute_desc_ids()
    rows = []
    for name, model, ptp, dtp in SCEN:
        if a.only and a.only not in name:
            continue
        for layout in a.layouts.split(","):
            for sh in (False, True):
                rows.append(scenario(name, model, ptp, dtp, layout, a.tokens, a.blocks, sh, a.reps, cdi))
    print("\n| scenario | layout | alloc | vLLM descs | vLLM ms med / min | kvbridge prepped ids "
          "| prepped ms med / min | caller's thread ms | kvbridge merged descs | merged (old path) ms "
          "| vLLM / kvbridge prepped (medians) | staged posting ms "
          "| no-span ids | no-span prepped ms med / min | vLLM / no-span (medians) "
          "| warm ms med: prepped / no-span |")
    print("|" + "---|" * 16)
    for r in rows:
        print(f"| {r['scenario']} | {r['layout']} | {r['alloc']} | {r['vllm_descs']:,} | {r['vllm_ms']} | "
              f"{r['kvb_prepped_ids']:,} | {r['kvb_prepped_ms']} | {r['kvb_caller_ms']} | {r['kvb_merged_descs']:,} | "
              f"{r['kvb_merged_ms']} | {r['ratio']:.1f}x | {r['staged_post_ms']} | {r['nospan_ids']:,} | "
              f"{r['nospan_ms']} | {r['nospan_ratio']:.1f}x | {r['warm_ms']} |")
    print("\n| scenario | layout | alloc | list rows (per-block, both sides) | span list rows (both sides) "
          "| prepare ms: no spans / with spans | RSS MiB after prepare: no spans / with spans |")
    print("|" + "---|" * 7)
    for r in rows:
        print(f"| {r['scenario']} | {r['layout']} | {r['alloc']} | {r['rows']:,} | {r['span_rows']:,} | "
              f"{r['prep_nospan_ms']:.1f} / {r['prep_ms']:.1f} | +{r['rss_nospan_mib']:.1f} / +{r['rss_mib']:.1f} |")


if __name__ == "__main__":
    main()
