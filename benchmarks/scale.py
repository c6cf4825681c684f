"""Scale: a decode rank among many prefill engines, a prefill rank under many leases, simulated on this machine.

Sections (``--only`` picks some; every number is measured here, in this run):

* ``handshake``: CPU per remote engine of the handshake's own work (layout, plan, memory descriptions,
  lowering, cost shapes, prepared lists; no network, no NIXL), decode rank (0, 0) of a TP8 decode
  against TP8 prefill engines, vLLM's per-layer layout (``flash_attn``: one allocation per layer, each
  engine's at other addresses), per preset and block size. Three ways, alternating engine by engine:
  ``first`` (the first engine of a layout pair: nothing shared yet), ``next`` (later engines: templates
  shared by layout pair) and ``eager`` (every partial-chunk template built at handshake and nothing shared
  across engines: what the handshake did before).
* ``e2e``: one real handshake through the public path (``DecodeRank.handshake``), real geometry, a TP8
  prefill engine served by another process over NIXL (``--e2e-blocks`` blocks per rank), first and second
  engine of one layout.
* ``burst``: ``--burst`` new prefill engines (tiny model, TP ``--burst-tp``, all served by one process:
  ``kvbridge.testing.prefill_host``) appear at once; one decode rank (TP1) ``connect``s to all of them:
  time until every one is live, failures; then all of them restart at once (new process, new ports, same
  ids) and it happens again. Also: file descriptors and RSS the decode process holds per peer, and the
  decode's ``poll()`` per step with no peer and with every peer live and idle.
* ``poll``: the decode's ``poll()`` per step against 0 ... 512 live idle peers (``--poll-peers`` with one
  rank each, ``--poll-peers-tp8`` with eight: stand-in prefill endpoints in another process, peers
  installed without a handshake: ``kvbridge.testing.standins``), µs per call (median of
  ``--poll-rounds`` batches) and, where the code counts it, side channels visited per call.
* ``fds``: side channels alone (no NIXL) to ``--fd-engines`` engines of 8 ranks (stand-in ROUTER sockets
  in another process): descriptors per engine, against the former per-rank DEALER + monitor.
* ``leases``: a prefill rank's serving turn (``serve_once``, nothing to answer) with 0 ... 10,000 live
  leases.

Run: ``PYTHONPATH=src python benchmarks/scale.py [--burst 128] [--json out.json]`` (needs nixl for e2e,
burst and leases). Prints a rich table per section and writes the numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np
import zmq

from kvbridge import lower
from kvbridge.layout import EngineLayout, MemoryLayout, engine_to_dict
from kvbridge.memory import Allocation, KVMemory, rank_memory
from kvbridge.models import load_model
from kvbridge.prepped import Prepared, PreparedGeometry
from kvbridge.runtime.handshake import Handshaker
from kvbridge.runtime.protocol import RankMeta
from kvbridge.testing.prefill_host import PrefillHost, open_fds, raise_fd_limit


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---- handshake CPU ---------------------------------------------------------------------------------
def vllm_memory(engine: EngineLayout, rank, base: int) -> KVMemory:
    """Rank ``rank``'s cache as vLLM allocates it with FlashAttention: one tensor per layer
    ``[2, num_blocks, block_size, heads, head_dim]`` (kvbridge's ``flash_attn`` layout, each layer its own
    allocation), placed from ``base`` on (addresses only: nothing is allocated)."""
    rm = rank_memory(engine, *rank)
    regions = {g: replace(r, components=tuple(c.shifted(base) for c in r.components)) for g, r in rm.regions.items()}
    allocs = {}
    for r in regions.values():
        c = r.components[0]
        size = c.layer_stride or r.block_stride * engine.num_blocks
        for off in c.layer_offsets:
            allocs[off] = Allocation(off, size, "cpu")
    return KVMemory(engine, rank, regions, list(allocs.values()))


class CpuTransport:
    """What the handshake asks of a transport, without NIXL: prepared lists are the geometry alone."""

    agent_name = "bench-decode"

    def add_peer(self, metadata: bytes, digest: str | None = None) -> str:
        return f"agent-{digest}"

    def remove_peer(self, name: str) -> None:
        pass

    def prepare(self, peer: str, lowered: Any, prank: Any) -> Prepared | None:
        geo = PreparedGeometry(lowered, prank)
        return Prepared(peer, geo) if len(geo.local_rows) else None

    def unprepare(self, prep: Any) -> None:
        pass


def handshake_cpu(preset: str, bs: int, tp: int, engines: int, blocks: int) -> dict[str, list[float]]:
    m = load_model(preset)
    P = EngineLayout(
        m, tp=tp, block_size=bs, memory=MemoryLayout.parse("flash_attn"), num_blocks=blocks, role="prefill"
    )
    D = EngineLayout(m, tp=tp, block_size=bs, memory=MemoryLayout.parse("flash_attn"), num_blocks=blocks, role="decode")
    drank = (0, 0)
    from kvbridge.cost import CostModel
    hs = Handshaker(None, CpuTransport(), D, drank, vllm_memory(D, drank, 1 << 46), "dBench", 1.0, 0, "direct",
                    CostModel.load())
    metas: dict[str, dict] = {}

    def get(engine_id, endpoints, prank, step=None, probe=False):
        return metas[engine_id][prank]
    hs._get = get  # type: ignore[method-assign]
    shared = getattr(
        lower, "TEMPLATES", None
    )  # None: a kvbridge without shared templates (--only handshake on old code)
    out: dict[str, list[float]] = {"first": [], "next": [], "eager": []}
    ways = ["first"] + [w for _ in range(engines) for w in ("next", "eager")]
    for i, way in enumerate(ways):
        eid = f"p{i}"
        base = (1 << 40) * (i + 1) + 4096 * i  # every engine's memory elsewhere
        metas[eid] = {r: RankMeta(eid, r, engine_to_dict(P), m.fingerprint, f"a{i}", b"", f"{eid}{r}",
                                  vllm_memory(P, r, base + (1 << 36) * k).to_wire())
                      for k, r in enumerate(P.ranks())}
        endpoints = {r: "-" for r in P.ranks()}
        if shared is not None:
            if way == "first":
                shared.clear()
            lower.TEMPLATES = shared if way != "eager" else lower.TemplateCache(shared.max_bytes)
        try:
            t0 = time.process_time()
            remote, _ = hs.run(eid, endpoints)
            if way == "eager":  # every partial-chunk template, at handshake
                for lows in remote.lowered.by_prefill.values():
                    for low in lows:
                        if low.per_token:
                            for n in range(1, low.chunk):
                                remote.lowered.template(low, n)
            out[way].append((time.process_time() - t0) * 1e3)
        finally:
            if shared is not None:
                lower.TEMPLATES = shared
    return out


# ---- end to end ------------------------------------------------------------------------------------
def e2e(preset: str, bs: int, tp: int, blocks: int) -> dict[str, float]:
    from kvbridge.runtime.decode import DecodeRank
    from kvbridge.testing.engine import default_memory
    m = load_model(preset)
    P = EngineLayout(
        m, tp=tp, block_size=bs, memory=MemoryLayout.parse("flash_attn"), num_blocks=blocks, role="prefill"
    )
    D = EngineLayout(m, tp=tp, block_size=bs, memory=MemoryLayout.parse("flash_attn"), num_blocks=blocks, role="decode")
    lower.TEMPLATES.clear()
    with PrefillHost(P, ["e0", "e1"]) as host:
        dec = DecodeRank(D, (0, 0), f"dE2E-{preset}", memory=default_memory(D, (0, 0)), transfer_mode="direct",
                         staging_bytes=0)
        try:
            out = {}
            for eid, name in (("e0", "first_ms"), ("e1", "next_ms")):
                rss0, fds0 = _rss_mb(), open_fds()
                c0, t0 = time.process_time(), time.perf_counter()
                dec.handshake(eid, host.endpoints[eid])
                out[name] = (time.perf_counter() - t0) * 1e3
                out[name.replace("_ms", "_cpu_ms")] = (time.process_time() - c0) * 1e3
                out[name.replace("_ms", "_rss_mb")] = _rss_mb() - rss0
                time.sleep(0.5)  # the side channel's TCP connections
                out[name.replace("_ms", "_fds")] = open_fds() - fds0
            return out
        finally:
            dec.close()


# ---- burst -----------------------------------------------------------------------------------------
def _poll_us(dec, n: int = 2000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        dec.poll()
    return (time.perf_counter() - t0) / n * 1e6


def burst(n: int, tp: int, connect_timeout_s: float, progress_delay_us: int) -> dict[str, Any]:
    from kvbridge.runtime.decode import DecodeRank
    from kvbridge.testing.engine import default_memory
    m = load_model("tiny-dense")
    pl = EngineLayout(m, tp=tp, block_size=16, num_blocks=64, role="prefill")
    dl = EngineLayout(m, tp=1, block_size=16, num_blocks=64, role="decode")
    ids = [f"burst{i}" for i in range(n)]
    dec = DecodeRank(dl, (0, 0), "dBurst", memory=default_memory(dl, (0, 0)), transfer_mode="direct", staging_bytes=0,
                     connect_timeout_s=connect_timeout_s)
    res: dict[str, Any] = {"engines": n, "prefill_tp": tp, "connect_timeout_s": connect_timeout_s,
                           "poll_us_no_peer": _poll_us(dec)}
    try:
        for gen in ("new", "restarted"):
            host = PrefillHost(pl, ids, progress_delay_us=progress_delay_us)
            res[f"{gen}_host_start_s"] = host.start_s
            fds0, rss0 = open_fds(), _rss_mb()
            live_at: dict[str, float] = {}
            t0 = time.monotonic()
            for eid in ids:
                dec.connect(eid, host.endpoints[eid])
            while dec.peers.connecting():
                dec.poll()
                now = time.monotonic() - t0
                for eid in ids:
                    if eid not in live_at and eid in dec.remotes:
                        live_at[eid] = now
                time.sleep(2e-4)
            failed = [e for e in ids if e not in dec.remotes]
            res[gen] = {"all_live_s": max(live_at.values()) if live_at else None, "failed": len(failed),
                        "median_live_s": statistics.median(live_at.values()) if live_at else None,
                        "failed_handshakes": dec.metrics.failed_handshakes}
            if gen == "new":
                res["fds_per_peer"] = (open_fds() - fds0) / n
                res["rss_mb_per_peer"] = (_rss_mb() - rss0) / n
                res["side_channels"] = dec.peers.channels
                res[f"poll_us_{n}_idle_peers"] = _poll_us(dec)
                host.kill()  # every engine restarts at once
                until = time.monotonic() + 10
                while any(e in dec.remotes for e in ids) and time.monotonic() < until:
                    dec.poll()
                    time.sleep(1e-3)
            else:
                host.close()
    finally:
        dec.close()
    return res


# ---- poll against idle peers -------------------------------------------------------------------------
def poll_sweep(counts: list[int], ranks: int, rounds: int) -> list[dict[str, Any]]:
    """µs per ``DecodeRank.poll()`` with ``counts`` live idle peers of ``ranks`` prefill ranks each (one
    decode rank; stand-in endpoints in another process; peers added between steps, the TCP connections
    left to settle before each measurement)."""
    from kvbridge.runtime.decode import DecodeRank
    from kvbridge.testing.engine import default_memory
    from kvbridge.testing.standins import StandIns, install_idle, wide_context
    m = load_model("tiny-dense")
    dl = EngineLayout(m, tp=1, block_size=16, num_blocks=64, role="decode")
    top = max(counts)
    out = []
    with StandIns(max(1, top * ranks)) as stand:
        dec = DecodeRank(dl, (0, 0), f"dPoll{ranks}", memory=default_memory(dl, (0, 0)), transfer_mode="direct",
                         staging_bytes=0)
        wide_context(dec, max(8192, 4 * top + 64))
        work = getattr(dec.peers, "work", None)  # None: a kvbridge without the poller's counters
        try:
            have = 0
            for n in sorted(counts):
                while have < n:
                    install_idle(dec, f"idle{have}", {(0, r): stand.endpoints[have * ranks + r] for r in range(ranks)})
                    have += 1
                time.sleep(0.5)  # the side channels' TCP connections
                for _ in range(200):
                    dec.poll()
                k = max(20, int(0.05 / max(_poll_us(dec, 20) * 1e-6, 1e-7)))  # ~50 ms per batch
                ch0 = work.channels if work is not None else 0
                us = statistics.median(_poll_us(dec, k) for _ in range(rounds))
                visited = (work.channels - ch0) / (k * rounds) if work is not None else None
                out.append({"ranks_per_peer": ranks, "peers": n, "prefill_ranks": n * ranks, "poll_us": us,
                            "polls_per_batch": k, "channels_per_poll": visited})
        finally:
            dec.close()
    return out


# ---- side channels alone ---------------------------------------------------------------------------
def _routers(n: int, conn) -> None:
    raise_fd_limit()
    ctx = zmq.Context.instance()
    ctx.set(zmq.MAX_SOCKETS, 65536)
    socks = [ctx.socket(zmq.ROUTER) for _ in range(n)]
    conn.send([s.bind_to_random_port("tcp://127.0.0.1") for s in socks])
    conn.recv()


def fds(engines: int, ranks: int = 8) -> dict[str, Any]:
    from kvbridge.runtime.peer import SideChannel
    raise_fd_limit()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_routers, args=(engines * ranks, child), daemon=True)
    proc.start()
    out: dict[str, Any] = {"engines": engines, "ranks": ranks}
    try:
        ports = parent.recv()
        zctx = zmq.Context()
        zctx.set(zmq.MAX_SOCKETS, 65536)
        SideChannel(zctx, {(0, 0): f"127.0.0.1:{ports[0]}"}).close()
        time.sleep(0.3)
        for way in ("channel", "dealer_per_rank"):
            before = open_fds()
            held: list = []
            for e in range(engines):
                eps = {(0, r): f"127.0.0.1:{ports[e * ranks + r]}" for r in range(ranks)}
                if way == "channel":
                    held.append(SideChannel(zctx, eps))
                else:  # the former side channel: a DEALER and its monitor per prefill rank
                    for ep in eps.values():
                        s = zctx.socket(zmq.DEALER)
                        s.setsockopt(zmq.LINGER, 0)
                        held.append((s, s.get_monitor_socket(zmq.EVENT_DISCONNECTED)))
                        s.connect(f"tcp://{ep}")
            time.sleep(1.0)  # TCP connections are made on ZMQ's I/O thread
            out[way] = {"fds_per_engine": (open_fds() - before) / engines,
                        "zmq_sockets_per_engine": 3 if way == "channel" else 3 * ranks}
            for h in held:
                if isinstance(h, tuple):
                    h[0].disable_monitor()
                    h[1].close(0)
                    h[0].close(0)
                else:
                    h.close()
            time.sleep(0.5)
        zctx.term()
    finally:
        parent.send("stop")
        proc.join(10)
        proc.kill()
    return out


# ---- serving turn against live leases ----------------------------------------------------------------
def leases(counts: list[int]) -> list[dict[str, float]]:
    from kvbridge.lower import GroupBlocks
    from kvbridge.runtime.prefill import PrefillRank
    from kvbridge.testing.engine import default_memory
    m = load_model("tiny-dense")
    pl = EngineLayout(m, tp=1, block_size=16, num_blocks=64, role="prefill")
    out = []
    for n in counts:
        pr = PrefillRank(pl, (0, 0), f"pL{n}", memory=default_memory(pl, (0, 0)), staging_bytes=0, lease_s=600.0)
        try:
            blocks = {g.name: GroupBlocks.of([1, 2]) for g in m.groups}
            for i in range(n):
                pr.add_request(f"r{i}", blocks)
            pr.serve_once()
            k = 300
            t0 = time.perf_counter()
            for _ in range(k):
                pr.serve_once()
            us = (time.perf_counter() - t0) / k * 1e6
            out.append({"leases": n, "turn_us": us, "core_pct_one_turn_per_2ms": us / 2000 * 100})
        finally:
            pr.close()
    return out


# ---- report ----------------------------------------------------------------------------------------
def _table(title: str, cols: list[str], rows: list[list[Any]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for r in [cols] + rows:
            print(" | ".join(str(x) for x in r))
        return
    t = Table(title=title)
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(*(f"{x:.2f}" if isinstance(x, float) else str(x) for x in r))
    Console().print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="handshake,e2e,burst,poll,fds,leases")
    ap.add_argument("--presets", default="deepseek-v3,llama-3.1-70b")
    ap.add_argument("--block-sizes", default="16,32,64")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--engines", type=int, default=4, help="engines per way in the handshake section")
    ap.add_argument("--blocks", type=int, default=4096, help="blocks per rank (handshake section: addresses only)")
    ap.add_argument("--e2e-blocks", type=int, default=16)
    ap.add_argument("--burst", type=int, default=128)
    ap.add_argument("--burst-tp", type=int, default=1)
    ap.add_argument("--connect-timeout", type=float, default=15.0)
    ap.add_argument("--progress-delay-us", type=int, default=20000, help="NIXL progress sleep in the burst's host")
    ap.add_argument("--fd-engines", type=int, default=128)
    ap.add_argument("--poll-peers", default="0,1,8,64,128,512", help="idle peers (one rank each) in the poll sweep")
    ap.add_argument("--poll-peers-tp8", default="8,64", help="idle peers of eight ranks each in the poll sweep")
    ap.add_argument("--poll-rounds", type=int, default=7)
    ap.add_argument("--leases", default="0,100,1000,10000")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    raise_fd_limit()
    only = set(a.only.split(","))
    res: dict[str, Any] = {"load": os.getloadavg(), "cpus": os.cpu_count()}
    if "handshake" in only:
        rows, res["handshake"] = [], []
        for preset in a.presets.split(","):
            for bs in (int(x) for x in a.block_sizes.split(",")):
                r = handshake_cpu(preset, bs, a.tp, a.engines, a.blocks)
                med = {k: float(np.median(v)) for k, v in r.items()}
                res["handshake"].append({"preset": preset, "block_size": bs, "tp": a.tp, "cpu_ms": r, "median_ms": med})
                rows.append([preset, bs, med["first"], med["next"], med["eager"]])
        _table(
            f"handshake CPU per remote engine, ms (TP{a.tp} <-> TP{a.tp}, decode rank (0, 0), vLLM per-layer layout)",
            ["preset", "block", "first engine", "next engines", "eager, unshared (before)"],
            rows,
        )
    if "e2e" in only:
        rows, res["e2e"] = [], []
        for preset in a.presets.split(","):
            r = e2e(preset, 64, a.tp, a.e2e_blocks)
            res["e2e"].append({"preset": preset, "block_size": 64, **r})
            rows.append([preset, 64, r["first_ms"], r["first_cpu_ms"], r["next_ms"], r["next_cpu_ms"], r["next_rss_mb"],
                         r["next_fds"]])
        _table(
            f"DecodeRank.handshake, decode rank (0, 0) of TP{a.tp}, against a TP{a.tp} engine in another process "
            "(NIXL)",
            ["preset", "block", "first ms", "first CPU ms", "next ms", "next CPU ms", "next RSS MB", "next fds"],
            rows,
        )
    if "burst" in only:
        r = res["burst"] = burst(a.burst, a.burst_tp, a.connect_timeout, a.progress_delay_us)
        _table(f"burst: {a.burst} new TP{a.burst_tp} prefill engines, one TP1 decode rank "
               f"(connect_timeout_s {a.connect_timeout:g})", ["", "all live s", "median live s", "failed"],
               [[g, r[g]["all_live_s"], r[g]["median_live_s"], r[g]["failed"]] for g in ("new", "restarted")])
        _table("decode process per live peer", ["fds", "RSS MB", "poll us, no peer", f"poll us, {a.burst} idle peers"],
               [[r["fds_per_peer"], r["rss_mb_per_peer"], r["poll_us_no_peer"], r[f"poll_us_{a.burst}_idle_peers"]]])
    if "poll" in only:
        r = res["poll"] = []
        for ranks, counts in ((1, a.poll_peers), (8, a.poll_peers_tp8)):
            if counts:
                r += poll_sweep([int(x) for x in counts.split(",")], ranks, a.poll_rounds)
        _table("decode poll() against live idle peers (stand-in prefill endpoints)",
               ["ranks per peer", "idle peers", "prefill ranks", "us per poll", "channels visited per poll"],
               [[x["ranks_per_peer"], x["peers"], x["prefill_ranks"], x["poll_us"],
                 "-" if x["channels_per_poll"] is None else x["channels_per_poll"]] for x in r])
    if "fds" in only:
        r = res["fds"] = fds(a.fd_engines)
        _table(f"side channels to {a.fd_engines} engines x 8 ranks", ["", "fds per engine", "ZMQ sockets per engine"],
               [[w, r[w]["fds_per_engine"], r[w]["zmq_sockets_per_engine"]] for w in ("channel", "dealer_per_rank")])
    if "leases" in only:
        r = res["leases"] = leases([int(x) for x in a.leases.split(",")])
        _table("prefill serving turn (serve_once, nothing to answer) against live leases",
               ["leases", "turn us", "% of a core at one turn per 2 ms"],
               [[x["leases"], x["turn_us"], x["core_pct_one_turn_per_2ms"]] for x in r])
    res["load_after"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
