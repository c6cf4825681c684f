"""Benchmarks: descriptors, direct vs staged transfers over NIXL, hot path, start-up.

``kvbridge bench`` (or ``python benchmarks/run.py``) runs every scenario with real model geometry and
prints a table; JSON goes to ``benchmarks/out/results.json`` and a copy to ``benchmarks/results.json``.
``--quick`` runs a tiny smoke subset; ``--calibrate`` measures the cost-model constants and saves them.

Per scenario one decode rank (0, 0) runs in its own process and reads from the prefill rank processes
it needs (plus prefill rank (0, 0), which answers the handshake). Buffers hold one request of a few
thousand tokens (the model geometry is real; only the number of blocks is small). Each scenario is
measured in both modes:

* direct: ``DecodeRank.start`` + wait: one NIXL READ per prefill rank with the lowered descriptors;
* staged: the runtime's staged mode: the decode sends a stage request to each prefill rank, which
  packs its runs into its registered staging buffer; the decode reads each with one descriptor into
  its staging buffer and scatters. Timed end to end (request, packs, reads, scatters).

Times are measured inside the worker processes (no RPC in them); best and median of ``reps`` runs
after one warm-up run. numpy memcpy of the same byte count is measured in the decode process in the
same run. The machine this was written on has 2 shared cores: expect noise (see benchmarks/RESULTS.md).
"""
from __future__ import annotations

import gc
import json
import mmap
import os
import platform
import statistics
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvbridge.layout import EngineLayout, MemoryLayout, ceil_div
from kvbridge.lower import LoweredPlan
from kvbridge.models import load_model
from kvbridge.plan import plan_transfer

DECODE_RANK = (0, 0)


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    p_tp: int
    d_tp: int
    p_pp: int = 1
    d_pp: int = 1
    tokens: int = 4096
    block_size: int = 16
    note: str = ""


SCENARIOS = [
    Scenario("dense-gqa-p8d4", "llama-3.1-70b", 8, 4, note="prefill tp8 -> decode tp4"),
    Scenario("dense-gqa-p2d8", "llama-3.1-70b", 2, 8, note="prefill tp2 -> decode tp8"),
    Scenario("mla-p8d4", "deepseek-v3", 8, 4, note="latent replicated on every rank"),
    Scenario("swa-fa-p8d4", "gemma-4-31b", 8, 4, note="sliding window 1024 + full layers"),
    Scenario("mamba-hybrid-p8d4", "nemotron-h-56b", 8, 4, block_size=1024,
             note="54 Mamba-2 + 10 attention layers; block size 1024 keeps the state slots few"),
    Scenario("pp-p4pp2d4", "llama-3.1-70b", 4, 4, p_pp=2, note="prefill tp4 pp2 -> decode tp4 pp1"),
    Scenario("dense-equal-p4d4", "llama-3.1-70b", 4, 4, note="equal TP: whole blocks, no head slicing"),
]
QUICK = [Scenario("tiny-dense-p2d1", "tiny-dense", 2, 1, tokens=256)]
LAYOUTS = ("flash_attn_hnd", "cross_layer", "universal")
ALLOCS = ("contiguous", "shuffled")


def engines(sc: Scenario, layout: str, num_blocks: int):
    model = load_model(sc.model)
    mk = lambda side, tp, pp: EngineLayout(model, tp=tp, pp=pp, block_size=sc.block_size,  # noqa: E731
                                           memory=MemoryLayout.parse(layout), num_blocks=num_blocks, role=side)
    return mk("prefill", sc.p_tp, sc.p_pp), mk("decode", sc.d_tp, sc.d_pp)


def vllm_descriptor_count(plan, decode_rank, decode_blocks) -> int:
    """vLLM's scheme: one descriptor per (layer, K/V component, block) of every read."""
    n = 0
    for r in plan.reads_for(decode_rank):
        g = plan.prefill.model.group(r.group)
        comps = sum(1 for a, b in r.units if b > a)
        blocks = decode_blocks[r.group].block_ids.size if g.per_token else 1
        n += len(plan.group_layers(r)) * comps * blocks
    return n


def _stats(xs):
    return {"best": min(xs), "median": statistics.median(xs), "n": len(xs)}


# ---- transfer scenarios ----------------------------------------------------------------------------
def run_scenario(sc: Scenario, layout: str, reps: int = 3, allocs=ALLOCS, seed: int = 0, log=print) -> list[dict]:
    """Start the needed prefill ranks and one decode rank; measure every allocation in both modes."""
    from kvbridge.cost import CostModel, choose_modes
    from kvbridge.runtime.decode import ReadRequest
    from kvbridge.testing.procs import Worker
    from kvbridge.testing.verify import BlockPool, make_request

    n_req = ceil_div(sc.tokens, sc.block_size)
    num_blocks = n_req + n_req // 4 + 4
    prefill, decode = engines(sc, layout, num_blocks)
    plan = plan_transfer(prefill, decode)
    lp0 = LoweredPlan(plan, DECODE_RANK)  # buffer-relative offsets (bases 0)
    needed = plan.prefill_ranks_for(DECODE_RANK)
    rng = np.random.default_rng(seed)
    reqs = {}
    for alloc in allocs:
        shuffled = alloc == "shuffled"
        req = make_request(
            0, sc.tokens, prefill, decode, BlockPool(prefill, rng, shuffled), BlockPool(decode, rng, shuffled)
        )
        descs = lp0.descriptors(sc.tokens, req.prefill_blocks, req.decode_blocks)
        reqs[alloc] = (req, descs)
    stage_bytes = {p: max(d.total_bytes for _, ds in reqs.values() for d in ds if d.prefill == p) for p in needed}
    cm = CostModel.load()
    modes = sorted({m.mode for m in choose_modes(plan, cm) if m.decode == DECODE_RANK})
    chosen = modes[0] if len(modes) == 1 else "mixed"
    from kvbridge.cost import pair_shapes, request_chunks, request_modes
    shapes = pair_shapes(lp0)

    def auto_choice(req) -> str:  # what the runtime's auto mode decides for this request (same code)
        chunks, frac = request_chunks(prefill.model.groups, req.decode_blocks, req.prefill_blocks,
                                      decode.block_size, lp0.chunk_tokens)
        picked = set(request_modes(cm, shapes, chunks, frac, lambda p: True).values())
        return picked.pop() if len(picked) == 1 else "mixed"

    workers = {}
    rows = []
    try:
        t0 = time.perf_counter()
        # the decode handshakes with rank (0, 0) and every rank it notifies (unread replicas included)
        notify = plan.ranks_to_notify(DECODE_RANK)
        for r in sorted(set(needed) | set(notify) | {(0, 0)}):
            workers[r] = Worker("prefill", prefill, r, "prefill-0", host="127.0.0.1",
                                staging_bytes=stage_bytes.get(r, 0) + (1 << 20), staging_peer_share=1.0)
        dw = Worker("decode", decode, DECODE_RANK, "decode-0", transfer_mode="auto",
                    staging_bytes=sum(stage_bytes.values()) + (1 << 20))
        for w in list(workers.values()) + [dw]:
            w.ready()
        for i, w in enumerate(workers.values()):
            w.call("fill_random", seed + i)
        endpoints = {r: f"127.0.0.1:{w.info['port']}" for r, w in workers.items()}
        log(f"  [{sc.name} {layout}] {len(workers)} prefill + 1 decode processes ready "
            f"in {time.perf_counter() - t0:.1f} s")
        k = 0
        for alloc in allocs:
            req, descs = reqs[alloc]
            nbytes = sum(d.total_bytes for d in descs)
            ours = sum(d.count for d in descs)

            def rr():
                nonlocal k
                k += 1
                return ReadRequest(f"{alloc}-{k}", "prefill-0", req.num_tokens, req.prefill_blocks, req.decode_blocks,
                                   k)  # the lease attempt: add_request below registers j with attempt j

            def timed(mode):
                dw.call("set_transfer_mode", mode)
                dw.call("handshake", "prefill-0", endpoints)
                for w in workers.values():  # leases for the requests about to be read
                    for j in range(k + 1, k + reps + 3):
                        w.call("add_request", f"{alloc}-{j}", req.prefill_blocks, 600.0, j)
                times = [dw.call("timed_read", rr())["seconds"] for _ in range(reps + 1)][1:]
                digest = dw.call("runs_digest", rr())
                dw.call("clear")
                return times, digest

            direct, digest_direct = timed("direct")
            staged, digest_staged = timed("staged")
            memcpy = [dw.call("memcpy_gbps", nbytes) for _ in range(reps)]
            ds, ss, ms = _stats(direct), _stats(staged), _stats(memcpy)
            gb = lambda s: nbytes / s / 1e9  # noqa: E731
            measured = "direct" if ds["best"] <= ss["best"] else "staged"
            best_gbps = gb(min(ds["best"], ss["best"]))
            row = {
                "scenario": sc.name, "model": sc.model, "layout": layout, "alloc": alloc,
                "prefill": f"tp{sc.p_tp} pp{sc.p_pp}", "decode": f"tp{sc.d_tp} pp{sc.d_pp}",
                "block_size": sc.block_size, "tokens": sc.tokens, "prefill_ranks_read": len(needed),
                "bytes": nbytes, "descriptors": ours,
                "descriptors_vllm": vllm_descriptor_count(plan, DECODE_RANK, req.decode_blocks),
                "direct_s": ds, "direct_gbps_best": gb(ds["best"]), "direct_gbps_median": gb(ds["median"]),
                "staged_s": ss, "staged_gbps_best": gb(ss["best"]), "staged_gbps_median": gb(ss["median"]),
                "memcpy_gbps": ms,
                "ratio_direct": gb(ds["best"]) / ms["best"], "ratio_staged": gb(ss["best"]) / ms["best"],
                "ratio_best_mode": best_gbps / ms["best"],
                "ratio_best_mode_median": nbytes / min(ds["median"], ss["median"]) / 1e9 / ms["median"],
                "cost_model_choice": chosen, "auto_choice": auto_choice(req), "measured_faster": measured,
                "staged_equals_direct": digest_direct == digest_staged,
            }
            row["descriptor_reduction"] = row["descriptors_vllm"] / max(ours, 1)
            rows.append(row)
            log(f"  [{sc.name} {layout} {alloc}] {nbytes / 2**20:.0f} MiB, {ours} descs "
                f"(vLLM {row['descriptors_vllm']}); "
                f"direct {gb(ds['best']):.2f} GB/s, staged {gb(ss['best']):.2f} GB/s, memcpy {ms['best']:.2f} GB/s; "
                f"model: {chosen}, measured: {measured}, staged==direct: {row['staged_equals_direct']}")
    finally:
        for w in list(workers.values()) + ([dw] if "dw" in locals() else []):
            w.stop()
    return rows


# ---- hot path ---------------------------------------------------------------------------------------
def hot_path(model: str = "llama-3.1-70b", p_tp: int = 8, d_tp: int = 4, tokens: int = 32768,
             layouts=LAYOUTS, reps: int = 30, transport=None) -> list[dict]:
    """µs per request of ``LoweredPlan.descriptors`` (what ``DecodeRank.start`` does on the caller's
    thread for a direct read: validate, per-chunk bases; runs that cannot merge stay factored), of that
    plus what the post thread does before posting (NIXL's Nx3 arrays written from the factored form, and
    ``get_xfer_descs`` on both sides), and of the staged posting path (stage request encoding + one
    descriptor per prefill rank)."""
    from kvbridge.layout import engine_to_dict
    from kvbridge.runtime.protocol import Stage, blocks_to_wire
    from kvbridge.runtime.protocol import pack as pack_msg
    bs = 16
    n = ceil_div(tokens, bs)
    out = []
    for layout in layouts:
        prefill = EngineLayout(load_model(model), tp=p_tp, block_size=bs, memory=MemoryLayout.parse(layout),
                               num_blocks=2 * n, role="prefill")
        decode = EngineLayout(load_model(model), tp=d_tp, block_size=bs, memory=MemoryLayout.parse(layout),
                              num_blocks=2 * n, role="decode")
        plan = plan_transfer(prefill, decode)
        bases = {r: (1 << 40) * (i + 1) for i, r in enumerate(plan.prefill_ranks_for(DECODE_RANK))}
        lp = LoweredPlan(plan, DECODE_RANK, bases, 1 << 44)
        rng = np.random.default_rng(0)
        for alloc in ALLOCS:
            from kvbridge.lower import GroupBlocks
            ids = (lambda: rng.permutation(2 * n)[:n]) if alloc == "shuffled" else (lambda: np.arange(n))
            pb = {g.name: GroupBlocks(ids().astype(np.int64)) for g in prefill.model.groups}
            db = {g.name: GroupBlocks(ids().astype(np.int64)) for g in prefill.model.groups}
            t_low, t_all, t_staged = [], [], []
            count = 0
            layout_dict = engine_to_dict(decode)
            from kvbridge.memory import KVMemory, rank_memory

            mem_wire = KVMemory.from_buffer(
                decode, DECODE_RANK, np.empty(rank_memory(decode, *DECODE_RANK).size, np.uint8)
            ).to_wire()
            for _ in range(reps + 2):
                # staged posting path (what DecodeRank.start does for a staged prefill rank): encode the
                # stage request; when the reply comes, one descriptor per prefill rank
                t0 = time.perf_counter()
                wire_p, wire_d = blocks_to_wire(pb), blocks_to_wire(db)
                for _prank in plan.prefill_ranks_for(DECODE_RANK):
                    pack_msg(Stage("r", "d", DECODE_RANK, layout_dict, mem_wire, tokens, wire_p, wire_d))
                    one = np.ones(1, dtype=np.int64)
                    arr = np.empty((1, 3), dtype=np.uint64)
                    arr[:, 0], arr[:, 1], arr[:, 2] = one, one, 0
                t_staged.append((time.perf_counter() - t0) * 1e6)
                t0 = time.perf_counter()
                descs = lp.descriptors(tokens, pb, db)
                t1 = time.perf_counter()
                for d in descs:  # what the post thread does: NIXL's Nx3 arrays, then its descriptor lists
                    local, remote = d.nixl_arrays(0, 0)
                    if transport is not None:
                        transport.xfer_descs(local)
                        transport.xfer_descs(remote)
                t2 = time.perf_counter()
                t_low.append((t1 - t0) * 1e6)
                t_all.append((t2 - t0) * 1e6)
                count = sum(d.count for d in descs)
            t_low, t_all, t_staged = t_low[2:], t_all[2:], t_staged[2:]
            out.append({"model": model, "prefill_tp": p_tp, "decode_tp": d_tp, "tokens": tokens, "layout": layout,
                        "alloc": alloc, "descriptors": count, "prefill_ranks": len(descs),
                        "descriptors_us": _stats(t_low), "with_nixl_dlists_us": _stats(t_all),
                        "staged_post_us": _stats(t_staged),
                        "nixl_dlists": "get_xfer_descs (both sides)" if transport is not None else "numpy Nx3 only"})
    return out


def _hot_path_fresh_process(kw: dict) -> list[dict]:
    """hot_path() in a fresh process with glibc's default malloc settings (run through a spawn pool)."""
    from kvbridge.transport.nixl import NixlTransport
    t = NixlTransport("kvbridge-bench-hot-default")
    try:
        return [{**h, "malloc": "default"} for h in hot_path(transport=t, **kw)]
    finally:
        t.close()


# ---- start-up ---------------------------------------------------------------------------------------
def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _virtual_buffer(nbytes: int):
    """Address space for ``nbytes`` without committing memory (MAP_NORESERVE): enough to register."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000))
    return m, np.frombuffer(m, dtype=np.uint8)


def startup(model: str = "llama-3.1-70b", p_tp: int = 8, d_tp: int = 4, num_blocks: int = 100_000,
            layouts=LAYOUTS, vllm_blocks: int | None = None, transport=None, log=print) -> list[dict]:
    """Plan + LoweredPlan + one NIXL registration vs vLLM's full per-(layer, K/V, block) table."""
    from kvbridge.memory import rank_memory
    out = []
    for layout in layouts:
        plan_transfer.cache_clear()
        rank_memory.cache_clear()
        gc.collect()
        rss0 = _rss_mb()
        tracemalloc.start()
        t0 = time.perf_counter()
        m = load_model(model)
        prefill = EngineLayout(
            m, tp=p_tp, block_size=16, memory=MemoryLayout.parse(layout), num_blocks=num_blocks, role="prefill"
        )
        decode = EngineLayout(
            m, tp=d_tp, block_size=16, memory=MemoryLayout.parse(layout), num_blocks=num_blocks, role="decode"
        )
        plan = plan_transfer(prefill, decode)
        t1 = time.perf_counter()
        lp = LoweredPlan(plan, DECODE_RANK)
        t2 = time.perf_counter()
        size = rank_memory(decode, *DECODE_RANK).size
        mm, buf = _virtual_buffer(size) if transport is not None else (None, None)
        t3 = time.perf_counter()
        if transport is not None:
            transport.register(buf)
        t4 = time.perf_counter()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        ours = {"plan_ms": (t1 - t0) * 1e3, "lowered_ms": (t2 - t1) * 1e3, "register_ms": (t4 - t3) * 1e3,
                "total_ms": (t4 - t0 - (t3 - t2)) * 1e3, "tracemalloc_peak_mb": peak / 2**20,
                "rss_delta_mb": _rss_mb() - rss0, "template_runs": lp.num_templates_runs, "registrations": 1,
                "buffer_gib": size / 2**30}
        if transport is not None:
            transport.deregister(buf)
            del buf
            mm.close()
        # vLLM's scheme: one descriptor per (layer, K/V, block) of every registered layer tensor
        nb = vllm_blocks or num_blocks
        L = m.num_layers
        comps = 2
        block_bytes = rank_memory(decode, *DECODE_RANK).regions[m.groups[0].name].block_stride
        gc.collect()
        rss0 = _rss_mb()
        tracemalloc.start()
        t0 = time.perf_counter()
        rows = L * comps * nb
        table = np.empty((rows, 3), dtype=np.uint64)
        base = np.uint64(1 << 40)
        region = (np.arange(L * comps, dtype=np.uint64) * np.uint64(nb * block_bytes) + base)[:, None]
        table[:, 0] = (region + np.arange(nb, dtype=np.uint64)[None, :] * np.uint64(block_bytes)).ravel()
        table[:, 1] = block_bytes
        table[:, 2] = 0
        t1 = time.perf_counter()
        prep_ms = None
        if transport is not None:
            mm, vbuf = _virtual_buffer(int(L * comps * nb * block_bytes))
            addr = int(vbuf.ctypes.data)
            table[:, 0] += np.uint64(addr) - base
            transport.register(vbuf)
            tp0 = time.perf_counter()
            h = transport.agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, "DRAM")
            prep_ms = (time.perf_counter() - tp0) * 1e3
        t2 = time.perf_counter()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss = _rss_mb() - rss0
        if transport is not None:
            transport.agent.release_dlist_handle(h)
            transport.deregister(vbuf)
            del vbuf
            mm.close()
        del table
        scale = num_blocks / nb
        vllm = {"blocks_measured": nb, "rows": rows, "table_build_ms": (t1 - t0) * 1e3, "prep_xfer_dlist_ms": prep_ms,
                "total_ms": (t2 - t0) * 1e3, "tracemalloc_peak_mb": peak / 2**20, "rss_delta_mb": rss,
                "extrapolated_to_blocks": num_blocks if scale != 1 else None,
                "total_ms_at_num_blocks": (t2 - t0) * 1e3 * scale, "rss_delta_mb_at_num_blocks": rss * scale}
        out.append({"model": model, "layers": L, "prefill_tp": p_tp, "decode_tp": d_tp, "num_blocks": num_blocks,
                    "layout": layout, "ours": ours, "vllm_per_layer_kv_block": vllm})
        log(f"  [startup {layout}] ours {ours['total_ms']:.1f} ms / {ours['tracemalloc_peak_mb']:.2f} MB; "
            f"vLLM table {vllm['total_ms']:.0f} ms / {vllm['rss_delta_mb']:.0f} MB RSS ({rows:,} rows)")
    return out


# ---- driver -----------------------------------------------------------------------------------------
def repo_benchmarks_dir() -> Path:
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    return here if here.is_dir() else Path.cwd() / "benchmarks"


def run_all(quick: bool = False, reps: int = 3, only: str | None = None, layouts=LAYOUTS, tokens: int | None = None,
            do_hot: bool = True, do_startup: bool = True, log=print) -> dict:
    scenarios = QUICK if quick else SCENARIOS
    if only:
        scenarios = [s for s in scenarios if only in s.name or only in s.model]
    if tokens:
        scenarios = [Scenario(**{**asdict(s), "tokens": tokens}) for s in scenarios]
    from kvbridge.cost import CostModel
    t_start = time.time()
    res = {"meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "numpy": np.__version__, "quick": quick, "reps": reps,
                    "cost_model": asdict(CostModel.load())},
           "scenarios": [], "hot_path": [], "startup": []}
    res["errors"] = []
    for sc in scenarios:
        for layout in layouts:
            try:
                res["scenarios"] += run_scenario(sc, layout, reps=reps, log=log)
            except Exception as e:  # noqa: BLE001 - record it, run the other scenarios
                log(f"  [{sc.name} {layout}] FAILED: {type(e).__name__}: {e}")
                res["errors"].append({"scenario": sc.name, "layout": layout, "error": f"{type(e).__name__}: {e}"})
    transport = None
    try:
        from kvbridge.transport.nixl import NixlTransport
        transport = NixlTransport("kvbridge-bench-main")
    except Exception as e:  # noqa: BLE001
        log(f"no NIXL agent in the driver ({e}); hot path without get_xfer_descs, start-up without registration")
    try:
        if do_hot:
            if quick:
                res["hot_path"] = hot_path("tiny-dense", 2, 1, tokens=2048, reps=5, transport=transport)
            else:
                # the case once with glibc's default allocator settings (a fresh process), then
                # with kvbridge.malloc.tune_malloc() (what kvbridge's rank processes use)
                import multiprocessing as mp
                with mp.get_context("spawn").Pool(1) as pool:
                    untuned = pool.apply(_hot_path_fresh_process, ({"reps": reps * 10},))
                from kvbridge.malloc import tune_malloc
                tuned = tune_malloc()
                res["hot_path"] = untuned + [{**h, "malloc": "tuned" if tuned else "default"} for h in
                                             hot_path(reps=reps * 10, transport=transport)
                                             + hot_path(p_tp=4, d_tp=4, reps=reps * 10, transport=transport)]
            for h in res["hot_path"]:
                log(
                    f"  [hot path {h['layout']} {h['alloc']} malloc {h.get('malloc', 'default')}] "
                    f"{h['descriptors']} descs: descriptors() "
                    f"{h['descriptors_us']['median']:.0f} us, "
                    f"+ NIXL dlists {h['with_nixl_dlists_us']['median']:.0f} us (median)"
                )
        if do_startup:
            if quick:
                res["startup"] = startup("tiny-dense", 2, 1, num_blocks=1000, transport=transport, log=log)
            else:
                res["startup"] = startup(transport=transport, log=log)
    finally:
        if transport is not None:
            transport.close()
    res["meta"]["seconds"] = time.time() - t_start
    return res


def write_results(res: dict, out_dir: Path | None = None, commit_copy: bool = True) -> Path:
    d = out_dir or repo_benchmarks_dir()
    (d / "out").mkdir(parents=True, exist_ok=True)
    name = "results-quick.json" if res["meta"].get("quick") else "results.json"
    p = d / "out" / name
    text = json.dumps(res, indent=1, default=float)
    p.write_text(text)
    if commit_copy and not res["meta"].get("quick"):
        (d / "results.json").write_text(text)
    return p


def print_results(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    con = Console(width=max(Console().width, 180))
    t = Table(title="kvbridge bench: one decode rank (0,0) reading one request (best of N; GB/s = 1e9 B/s)")
    for c in ("scenario", "layout", "alloc", "MiB", "descs", "vLLM descs", "direct GB/s", "staged GB/s",
              "memcpy GB/s", "ratio", "model picks", "auto picks", "faster", "ok"):
        t.add_column(c, justify="left" if c in ("scenario", "layout", "alloc", "model picks", "auto picks", "faster")
                     else "right")
    for r in res["scenarios"]:
        t.add_row(
            r["scenario"],
            r["layout"],
            r["alloc"],
            f"{r['bytes'] / 2**20:.0f}",
            f"{r['descriptors']:,}",
            f"{r['descriptors_vllm']:,}",
            f"{r['direct_gbps_best']:.2f}",
            f"{r['staged_gbps_best']:.2f}",
            f"{r['memcpy_gbps']['best']:.2f}",
            f"{r['ratio_best_mode']:.2f}",
            r["cost_model_choice"],
            r.get("auto_choice", "-"),
            r["measured_faster"],
            "[green]yes" if r["staged_equals_direct"] else "[red]NO",
        )
    con.print(t)
    if res["hot_path"]:
        h = Table(title="hot path: LoweredPlan.descriptors (+ NIXL descriptor lists) per request, per decode rank")
        for c in ("model", "P->D", "tokens", "layout", "alloc", "malloc", "descs", "descriptors() us med/best",
                  "+ dlists us med/best", "staged post us med/best"):
            h.add_column(c)
        for r in res["hot_path"]:
            h.add_row(
                r["model"],
                f"tp{r['prefill_tp']}->tp{r['decode_tp']}",
                str(r["tokens"]),
                r["layout"],
                r["alloc"],
                r.get("malloc", "default"),
                f"{r['descriptors']:,}",
                f"{r['descriptors_us']['median']:.0f} / {r['descriptors_us']['best']:.0f}",
                f"{r['with_nixl_dlists_us']['median']:.0f} / {r['with_nixl_dlists_us']['best']:.0f}",
                f"{r['staged_post_us']['median']:.0f} / {r['staged_post_us']['best']:.0f}",
            )
        con.print(h)
    if res["startup"]:
        s = Table(title="start-up: plan + lowered plan + NIXL registration vs vLLM per-(layer,K/V,block) table")
        for c in (
            "layout",
            "blocks",
            "ours ms",
            "ours MB (tracemalloc)",
            "vLLM rows",
            "vLLM ms",
            "vLLM MB (RSS)",
            "note",
        ):
            s.add_column(c)
        for r in res["startup"]:
            o, v = r["ours"], r["vllm_per_layer_kv_block"]
            note = f"measured at {v['blocks_measured']:,} blocks, scaled" if v["extrapolated_to_blocks"] else "measured"
            s.add_row(
                r["layout"],
                f"{r['num_blocks']:,}",
                f"{o['total_ms']:.1f}",
                f"{o['tracemalloc_peak_mb']:.2f}",
                f"{v['rows'] * (r['num_blocks'] // v['blocks_measured']):,}",
                f"{v['total_ms_at_num_blocks']:.0f}",
                f"{v['rss_delta_mb_at_num_blocks']:.0f}",
                note,
            )
        con.print(s)


# ---- calibration ------------------------------------------------------------------------------------
def calibrate(reps: int = 3, log=print):
    """Measure the cost-model constants here: wire GB/s (one large descriptor: equal TP, cross-layer,
    contiguous blocks), memcpy GB/s (same run), and the per-descriptor cost (4 KiB head-sliced reads of
    a shuffled per-layer P8->D4 request, minus their wire time)."""
    from kvbridge.cost import CostModel
    big = run_scenario(Scenario("calibrate-wire", "llama-3.1-70b", 4, 4, tokens=2048), "cross_layer", reps=reps,
                       allocs=("contiguous",), log=log)[0]
    small = run_scenario(Scenario("calibrate-desc", "llama-3.1-70b", 8, 4, tokens=2048), "flash_attn_hnd", reps=reps,
                         allocs=("shuffled",), log=log)[0]
    wire = big["direct_gbps_best"]
    copy = big["memcpy_gbps"]["best"]
    per_desc = max((small["direct_s"]["best"] - small["bytes"] / (wire * 1e9)) / small["descriptors"] * 1e6, 0.0)
    cm = CostModel(per_desc_us=round(per_desc, 3), wire_gbps=round(wire, 3), copy_gbps=round(copy, 3),
                   source="kvbridge bench --calibrate")
    cm.save()
    return cm, small


def cmd_bench(args) -> int:
    from rich.console import Console
    con = Console()
    if args.calibrate:
        from kvbridge.cost import CALIBRATION_FILE
        cm, row = calibrate(reps=args.reps, log=con.print)
        con.print(f"per descriptor {cm.per_desc_us} us, wire {cm.wire_gbps} GB/s, copy {cm.copy_gbps} GB/s "
                  f"-> saved to {CALIBRATION_FILE}")
        return 0
    layouts = tuple(args.layout) if args.layout else LAYOUTS
    res = run_all(quick=args.quick, reps=args.reps, only=args.only, layouts=layouts, tokens=args.tokens,
                  do_hot=not args.no_hot_path, do_startup=not args.no_startup, log=con.print)
    print_results(res)
    out = Path(args.out) if args.out else None
    p = write_results(res, out, commit_copy=not (args.only or args.tokens or args.layout))
    con.print(f"JSON written to {p}")
    return 0 if all(r["staged_equals_direct"] for r in res["scenarios"]) and not res["errors"] else 1


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: descriptors, direct vs staged over NIXL, hot path, start-up")
    p.add_argument("--quick", action="store_true", help="one tiny scenario (smoke test)")
    p.add_argument("--calibrate", action="store_true", help="measure the cost-model constants and save them")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up (best and median)")
    p.add_argument("--only", help="only scenarios whose name or model contains this")
    p.add_argument(
        "--layout", action="append", help="memory layout(s) to run (default: flash_attn_hnd, cross_layer, universal)"
    )
    p.add_argument("--tokens", type=int, help="override tokens per request")
    p.add_argument("--no-hot-path", action="store_true")
    p.add_argument("--no-startup", action="store_true")
    p.add_argument("--out", help="benchmarks directory to write out/ into (default: the repo's benchmarks/)")
    p.set_defaults(fn=cmd_bench)


__all__ = ["Scenario", "SCENARIOS", "run_scenario", "hot_path", "startup", "run_all", "calibrate",
           "vllm_descriptor_count", "add_bench_parser"]


def results_markdown(res: dict) -> str:
    """Markdown tables of a results dict (for benchmarks/RESULTS.md)."""
    L = [
        "| scenario | layout | alloc | MiB | descs (ours) | descs (vLLM) | direct GB/s best/med | staged GB/s best/med "
        "| memcpy GB/s best/med | ratio best mode | cost model (handshake) | auto (this request) | faster "
        "| staged==direct |",
        "|" + "---|" * 14,
    ]
    for r in res["scenarios"]:
        L.append(
            f"| {r['scenario']} | {r['layout']} | {r['alloc']} | {r['bytes'] / 2**20:.0f} | {r['descriptors']:,} | "
            f"{r['descriptors_vllm']:,} | {r['direct_gbps_best']:.2f} / {r['direct_gbps_median']:.2f} | "
            f"{r['staged_gbps_best']:.2f} / {r['staged_gbps_median']:.2f} | "
            f"{r['memcpy_gbps']['best']:.2f} / {r['memcpy_gbps']['median']:.2f} | {r['ratio_best_mode']:.2f} | "
            f"{r['cost_model_choice']} | {r.get('auto_choice', '-')} | {r['measured_faster']} | "
            f"{'yes' if r['staged_equals_direct'] else 'NO'} |"
        )
    out = "\n".join(L) + "\n"
    if res.get("hot_path"):
        H = ["| model | P->D | tokens | layout | alloc | malloc | descriptors (direct) | descriptors() µs med / best "
             "| + NIXL dlists µs med / best | staged posting µs med / best |",
             "|" + "---|" * 10]
        for h in res["hot_path"]:
            H.append(
                f"| {h['model']} | tp{h['prefill_tp']}->tp{h['decode_tp']} | {h['tokens']} | {h['layout']} | "
                f"{h['alloc']} | "
                f"{h.get('malloc', 'default')} | "
                f"{h['descriptors']:,} | {h['descriptors_us']['median']:.0f} / {h['descriptors_us']['best']:.0f} | "
                f"{h['with_nixl_dlists_us']['median']:.0f} / {h['with_nixl_dlists_us']['best']:.0f} | "
                f"{h['staged_post_us']['median']:.0f} / {h['staged_post_us']['best']:.0f} |"
            )
        out += "\n" + "\n".join(H) + "\n"
    if res.get("startup"):
        S = [
            "| layout | blocks | ours: plan / lowered / register / total ms | ours tracemalloc peak MB | ours RSS Δ MB "
            "| vLLM rows | vLLM build / prep_xfer_dlist / total ms | vLLM tracemalloc MB | vLLM RSS Δ MB |",
            "|" + "---|" * 9,
        ]
        for r in res["startup"]:
            o, v = r["ours"], r["vllm_per_layer_kv_block"]
            prep = f"{v['prep_xfer_dlist_ms']:.0f}" if v["prep_xfer_dlist_ms"] is not None else "-"
            S.append(
                f"| {r['layout']} | {r['num_blocks']:,} | {o['plan_ms']:.1f} / {o['lowered_ms']:.1f} / "
                f"{o['register_ms']:.1f} / "
                f"{o['total_ms']:.1f} | {o['tracemalloc_peak_mb']:.2f} | {o['rss_delta_mb']:.1f} | {v['rows']:,} | "
                f"{v['table_build_ms']:.0f} / {prep} / {v['total_ms']:.0f} | {v['tracemalloc_peak_mb']:.0f} | "
                f"{v['rss_delta_mb']:.0f} |"
            )
        out += "\n" + "\n".join(S) + "\n"
    return out
