"""Single-request latency of kvbridge against NIXL's own READ of the same bytes, same processes.

What runs: one process per prefill rank, serving through :class:`kvbridge.PrefillServer` (its thread and
nothing else, as an engine embeds it), one process per decode rank with a :class:`kvbridge.DecodeEndpoint`.
Llama-3.1-8B geometry (32 layers, 8 KV heads x 128, bf16: 128 KiB per token on TP1), block 16,
FlashAttention layout (``LKBTHD``) on both sides, shuffled block ids.

Per row (request size, topology), alternating in one run, round after round:

* kvbridge ``direct``, ``staged`` and ``auto`` reads (``DecodeEndpoint.start`` -> ``wait``), timed inside
  the decode process (no RPC in the timing);
* ``nixl``: NIXL's own READ of the very descriptors kvbridge posts (``initialize_xfer`` + ``transfer`` +
  polling ``check_xfer_state``), from the decode process's NIXL agent to the prefill's, one READ per
  prefill rank at once; ``nixl-1`` the same bytes as one descriptor per prefill rank.

A mode may end in ``+optimistic`` or ``+pinned`` (``direct+optimistic``, ``auto+pinned``): that system's
direct reads are posted beside their acquire (``DecodeConfig.optimistic_reads``) or once granted; a bare
mode uses the config's default. ``+queued`` (``direct+queued``): every read goes through the post thread
(``DecodeConfig.inline_post_bytes=0``, the default); ``+tags`` / ``+notags``: lease-tag checks on / off
(``DecodeConfig.tag_checks``; off by default); ``+inline``: reads up to 4 MiB are posted on the
decode's own thread when the post thread is idle.
``BENCH_PREFILL_BUSY=0.5``: each prefill process also runs a Python thread
spinning half of every 4 ms (an engine's busy-waiting threads starving the serving thread of the GIL).
``BENCH_SWITCH_US=500``: the prefill processes' GIL switch interval (``sys.setswitchinterval``; Python's default
is 5,000 µs). ``BENCH_PROFILE=/tmp/prof``: each kvbridge batch in a decode process runs under cProfile and is dumped to
``/tmp/prof.<pid>.<ns>`` (read with ``pstats``); timings of a profiled run are not results.

With ``--inflight K`` K requests start at once: latency per request and throughput (requests/s, GB/s).
Each kvbridge row carries its phase breakdown (``metrics.DECODE_PHASES``: median per read, from the
per-read change of each phase's sum) and the prefill's mean time per acquire/stage answer.

    PYTHONPATH=src python benchmarks/latency.py                   # 2/32/256 MiB TP1->TP1, TP4->TP2
    PYTHONPATH=src python benchmarks/latency.py --sizes 2 --inflight 1 8 64 --json out.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback

import numpy as np

MIB = 1 << 20
TOKEN_BYTES = 32 * 2 * 8 * 128 * 2  # Llama-3.1-8B, TP1: 128 KiB per token


def _layout(tp: int, num_blocks: int):
    from kvbridge import EngineLayout, load_model
    return EngineLayout(load_model("llama-3.1-8b"), tp=tp, block_size=16, num_blocks=num_blocks)


# ---- processes ------------------------------------------------------------------------------------
def _busy_thread(share: float, period_s: float = 0.004) -> None:
    """BENCH_PREFILL_BUSY=share (0..1): a Python thread of the prefill process spins that share of every
    4 ms, holding the GIL as an engine's busy-waiting threads do (the serving thread's answers wait for it)."""
    if share <= 0:
        return
    import threading

    def spin() -> None:
        while True:
            end = time.perf_counter() + share * period_s
            while time.perf_counter() < end:
                pass
            time.sleep((1 - share) * period_s)
    threading.Thread(target=spin, daemon=True).start()


def _prefill_main(conn, tp: int, rank, num_blocks: int) -> None:
    import kvbridge
    from kvbridge.testing import rankbench
    from kvbridge.testing.engine import default_memory
    try:
        eng = _layout(tp, num_blocks)
        mem = default_memory(eng, rank)
        ep = kvbridge.PrefillEndpoint(eng, rank, "bench-p", memory=mem, lease_s=120.0,
                                      staging_bytes=int(os.environ.get("BENCH_STAGING_MIB", "320")) << 20)
        rankbench.fill_random(ep, rank[1])
        if os.environ.get("BENCH_SWITCH_US"):  # the prefill process's GIL switch interval (sys.setswitchinterval)
            sys.setswitchinterval(float(os.environ["BENCH_SWITCH_US"]) * 1e-6)
        server = kvbridge.PrefillServer(ep)
        _busy_thread(float(os.environ.get("BENCH_PREFILL_BUSY", "0")))
        conn.send(("ok", ep.port))
    except Exception:  # noqa: BLE001
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "stop":
                server.close()
                conn.send(("ok", None))
                return
            if cmd == "add":
                for rid, blocks, attempt in args[0]:
                    server.add(rid, blocks, attempt)
                res = None
            elif cmd == "stats":
                res = server.stats()
            elif cmd == "cpu":
                res = (time.process_time(), 0.0)  # every thread of this process, ns resolution
            else:
                raise ValueError(cmd)
            conn.send(("ok", res))
        except Exception:  # noqa: BLE001
            conn.send(("err", traceback.format_exc()))


def _phase_sums(dec) -> dict:
    return {k: (h.sum, h.count) for k, h in dec.metrics.phases.items()}


def _kvbridge_reads(dec, reqs: list) -> tuple[list[float], list[dict]]:
    """Start ``reqs`` at once; per request the seconds to its completion, and per request (one in flight)
    its phases."""
    before = _phase_sums(dec)
    t0 = time.perf_counter()
    for r in reqs:
        dec.start(r)
    out: dict = {}
    left = {r.key for r in reqs}
    deadline = time.monotonic() + 120
    while left:
        done, failed = dec.wait(max(0.0, deadline - time.monotonic()), **_WAIT_KW)
        now = time.perf_counter() - t0
        if failed:
            raise RuntimeError(f"reads failed: {failed}")
        for k in done:
            if k in left:
                out[k] = now
                left.discard(k)
        if time.monotonic() > deadline:
            states = {k: {str(p): (rr.state.name, [(t.done, getattr(t.xfer, "posted_ns", None) is not None and
                                                     bool(getattr(t.xfer, "returned_ns", 0))) for t in rr.reads])
                          for p, rr in dec.inflight[k].ranks.items()} for k in sorted(left)[:3] if k in dec.inflight}
            raise RuntimeError(f"reads did not finish: {len(left)} left, e.g. {states}; stats {dec.stats()}")
    after = _phase_sums(dec)
    phases = {}
    if len(reqs) == 1:
        phases = {k: (after[k][0] - before.get(k, (0.0, 0))[0]) for k in after
                  if after[k][1] > before.get(k, (0.0, 0))[1]}
    return [out[r.key] for r in reqs], [phases]


_WAIT_KW: dict = {}


def _decode_main(conn, p_tp: int, d_tp: int, rank, num_blocks: int, endpoints: dict) -> None:
    import kvbridge
    from kvbridge.testing import rankbench
    from kvbridge.testing.engine import default_memory
    try:
        eng = _layout(d_tp, num_blocks)
        mem = default_memory(eng, rank)
        dec = kvbridge.DecodeEndpoint(eng, rank, "bench-d", memory=mem, transfer_mode="auto",
                                      staging_bytes=int(os.environ.get("BENCH_STAGING_MIB", "320")) << 20,
                                      transfer_timeout_s=60.0, **_segment_kw())
        import inspect
        if "first" in inspect.signature(dec.wait).parameters:
            _WAIT_KW["first"] = True  # return as soon as any read ends (else: when all have)
        dec.metrics.observe_phase  # noqa: B018 - phases recorded (this benchmark's breakdown needs them)
        conn.send(("ok", None))
    except Exception:  # noqa: BLE001
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "stop":
                dec.close()
                conn.send(("ok", None))
                return
            if cmd == "mode":
                # +optimistic / +pinned: optimistic_reads on / off; +queued: every post on the post thread
                mode, *flags = args[0].split("+")
                dec.reads.optimistic = (False if "pinned" in flags else True if "optimistic" in flags
                                        else dec.config.optimistic_reads)
                # +tags / +notags: lease-tag checks (runtime/tags.py) on / off
                dec.reads.tag_checks = (True if "tags" in flags else False if "notags" in flags
                                        else dec.config.tag_checks)
                if hasattr(dec.transport, "inline_post_bytes"):
                    dec.transport.inline_post_bytes = (0 if "queued" in flags else 4 << 20 if "inline" in flags
                                                       else dec.config.inline_post_bytes)
                if mode != dec.transfer_mode:
                    dec.set_transfer_mode(mode)
                if "bench-p" not in dec.remotes:
                    dec.handshake("bench-p", endpoints)
                res = ({str(k): v for k, v in dec.remotes["bench-p"].modes.items()},
                       dec.stats().get("links", {}))
            elif cmd == "kvbridge":
                prof = os.environ.get("BENCH_PROFILE")
                if prof:
                    import cProfile
                    pr = cProfile.Profile()
                    res = pr.runcall(_kvbridge_reads, dec, args[0])
                    pr.dump_stats(f"{prof}.{os.getpid()}.{time.monotonic_ns()}")
                else:
                    res = _kvbridge_reads(dec, args[0])
            elif cmd == "nixl":
                res = rankbench.nixl_reads(dec, args[0], args[1])
            elif cmd == "cpu":
                res = (time.process_time(), 0.0)  # every thread of this process, ns resolution
            elif cmd == "stats":
                res = dec.stats()
            else:
                raise ValueError(cmd)
            conn.send(("ok", res))
        except Exception:  # noqa: BLE001
            conn.send(("err", traceback.format_exc()))


def _segment_kw() -> dict:
    """BENCH_SEGMENT_MIB: the decode's stage_segment_bytes (staged reads packed, read and scattered in
    segments of this size; default: the runtime's)."""
    mib = os.environ.get("BENCH_SEGMENT_MIB")
    return {"stage_segment_bytes": int(float(mib) * MIB)} if mib else {}


class Proc:
    def __init__(self, target, *args):
        self.conn, child = mp.get_context("spawn").Pipe()
        self.p = mp.get_context("spawn").Process(target=target, args=(child, *args), daemon=True)
        self.p.start()
        self.info = self.recv(180)

    def recv(self, timeout=600):
        if not self.conn.poll(timeout):
            raise RuntimeError("a benchmark process did not answer")
        st, res = self.conn.recv()
        if st == "err":
            raise RuntimeError(res)
        return res

    def send(self, cmd, *args):
        self.conn.send((cmd, args))

    def call(self, cmd, *args):
        self.send(cmd, *args)
        return self.recv()


def _all(procs, cmd, *args):
    for p in procs:
        p.send(cmd, *args)
    return [p.recv() for p in procs]


# ---- one topology ---------------------------------------------------------------------------------
def run_topology(p_tp: int, d_tp: int, sizes_mib: list[int], inflight: list[int], rounds: int, reps: int,
                 modes: list[str], no_nixl: bool = False) -> list[dict]:
    from kvbridge import GroupBlocks, ReadRequest
    from kvbridge.runtime.metrics import DECODE_PHASES
    from kvbridge.runtime.prefill import new_attempt
    max_tokens = max(s * MIB // TOKEN_BYTES for s in sizes_mib)
    max_inflight_tokens = max(k * s * MIB // TOKEN_BYTES for s in sizes_mib for k in inflight
                              if k * s <= 256)
    num_blocks = max(max_tokens, max_inflight_tokens) // 16 + 8
    prefill = [Proc(_prefill_main, p_tp, (0, r), num_blocks) for r in range(p_tp)]
    endpoints = {(0, r): f"127.0.0.1:{p.info}" for r, p in enumerate(prefill)}
    decode = [Proc(_decode_main, p_tp, d_tp, (0, r), num_blocks, endpoints) for r in range(d_tp)]
    rng = np.random.default_rng(0)
    counter = [0]
    rows = []

    def make(tokens: int, k: int, register: bool = True):
        """k requests of ``tokens`` tokens (distinct shuffled blocks per request), registered on every
        prefill rank (``register``)."""
        nb = -(-tokens // 16)
        p_ids = rng.permutation(num_blocks)[: nb * k]
        d_ids = rng.permutation(num_blocks)[: nb * k]
        reqs, adds = [], []
        for i in range(k):
            counter[0] += 1
            rid, att = f"r{counter[0]}", new_attempt()
            pb = {"full": GroupBlocks.of(p_ids[i * nb:(i + 1) * nb])}
            db = {"full": GroupBlocks.of(d_ids[i * nb:(i + 1) * nb])}
            reqs.append(ReadRequest(rid, "bench-p", tokens, pb, db, att))
            adds.append((rid, pb, att))
        if register:
            _all(prefill, "add", adds)
        return reqs

    try:
        for size in sizes_mib:
            tokens = size * MIB // TOKEN_BYTES
            for k in inflight:
                if k * size > 256:  # bounded by the KV memory the processes hold
                    continue
                systems = modes + ([] if no_nixl else ["nixl", "nixl-1"])
                res: dict = {s: {"lat": [], "wall": [], "phases": [], "pre": {}, "cpu_d": 0.0, "cpu_p": 0.0, "reqs": 0}
                             for s in systems}
                chosen: dict = {}
                links: dict = {}  # decode rank 0's link figures after the system's reads (what auto chose from)
                for _ in range(rounds):
                    for s in systems:
                        if s in modes:
                            chosen[s], links[s] = _all(decode, "mode", s)[0]
                            _all(decode, "kvbridge", make(tokens, 1))  # warm-up (untimed)
                            p0 = _all(prefill, "stats")
                            d0 = _all(decode, "stats")
                        for _ in range(reps):
                            reqs = make(tokens, k, register=s in modes)  # NIXL's READ needs no lease
                            c0d, c0p = _all(decode, "cpu"), _all(prefill, "cpu")
                            if s in modes:
                                out = _all(decode, "kvbridge", reqs)
                                lat = np.max([o[0] for o in out], axis=0)  # every decode rank done
                                res[s]["phases"] += [o[1][0] for o in out if o[1] and o[1][0]]
                            else:
                                out = _all(decode, "nixl", reqs, s == "nixl-1")
                                lat = np.max(out, axis=0)
                            c1d, c1p = _all(decode, "cpu"), _all(prefill, "cpu")
                            res[s]["cpu_d"] += sum(sum(b) - sum(a) for a, b in zip(c0d, c1d))
                            res[s]["cpu_p"] += sum(sum(b) - sum(a) for a, b in zip(c0p, c1p))
                            res[s]["reqs"] += k
                            res[s]["lat"] += [float(x) for x in lat]
                            res[s]["wall"].append(float(max(lat)))
                        if s in modes:
                            d1 = _all(decode, "stats")
                            links[s] = d1[0].get("links", {})  # as the reads left them
                            for a, b in zip(d0, d1):  # reads proven by the lease's tag (runtime/tags.py)
                                for c in ("checked_reads", "optimistic_reads", "tag_checks"):
                                    res[s][c] = res[s].get(c, 0) + b["metrics"].get(c, 0) - a["metrics"].get(c, 0)
                            p1 = _all(prefill, "stats")
                            for a, b in zip(p0, p1):
                                for ph, h in b["metrics"]["phase_seconds"].items():
                                    h0 = a["metrics"]["phase_seconds"].get(ph, {"sum": 0.0, "count": 0})
                                    acc = res[s]["pre"].setdefault(ph, [0.0, 0])
                                    acc[0] += h["sum"] - h0["sum"]
                                    acc[1] += h["count"] - h0["count"]
                for s in systems:
                    lat = np.array(res[s]["lat"])
                    wall = np.array(res[s]["wall"])
                    row = {
                        "topology": f"TP{p_tp}->TP{d_tp}",
                        "mib": size,
                        "tokens": tokens,
                        "inflight": k,
                        "system": s,
                        "n": int(lat.size),
                        "p50_ms": float(np.percentile(lat, 50) * 1e3),
                        "p90_ms": float(np.percentile(lat, 90) * 1e3),
                        "p99_ms": float(np.percentile(lat, 99) * 1e3),
                        "req_per_s": float(k / np.median(wall)),
                        "gbps": float(k * size * MIB * d_tp / d_tp / np.median(wall) / 1e9),
                    }
                    # CPU seconds of every decode / prefill process per request (user + system: a cma copy
                    # is the reading process's system time; NIXL rows give the copy's own share)
                    row["cpu_ms_per_req_decode"] = res[s]["cpu_d"] / max(1, res[s]["reqs"]) * 1e3
                    row["cpu_ms_per_req_prefill"] = res[s]["cpu_p"] / max(1, res[s]["reqs"]) * 1e3
                    if s in chosen:
                        row["modes"] = chosen[s]
                        row["links"] = links[s]
                    if res[s]["phases"]:
                        row["phases_p50_ms"] = {ph: float(np.median([p.get(ph, 0.0) for p in res[s]["phases"]]) * 1e3)
                                                for ph in DECODE_PHASES if any(ph in p for p in res[s]["phases"])}
                    if res[s].get("optimistic_reads"):
                        row["checked_of_optimistic"] = f"{res[s]['checked_reads']}/{res[s]['optimistic_reads']}"
                        row["tag_checks"] = res[s]["tag_checks"]  # posted (a check answered after the grant: none)
                    if res[s]["pre"]:
                        row["prefill_mean_ms"] = {ph: v[0] / v[1] * 1e3 for ph, v in res[s]["pre"].items() if v[1]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for p in decode + prefill:
            try:
                p.call("stop")
            except Exception:  # noqa: BLE001
                p.p.kill()
    return rows


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title="kvbridge vs NIXL's own READ of the same descriptors (latency per request)")
    for c in ("topology", "MiB", "in flight", "system", "p50 ms", "p90 ms", "p99 ms", "req/s", "CPU ms/req D / P",
              "phases p50 (ms)"):
        t.add_column(c, justify="right" if c not in ("system", "phases p50 (ms)", "topology") else "left")
    for r in rows:
        ph = " ".join(f"{k} {v:.2f}" for k, v in r.get("phases_p50_ms", {}).items())
        pre = r.get("prefill_mean_ms", {})
        if pre:
            ph += " | prefill " + " ".join(f"{k} {pre[k]:.2f}" for k in ("acquire", "stage", "pin_held") if k in pre)
        t.add_row(r["topology"], str(r["mib"]), str(r["inflight"]), r["system"], f"{r['p50_ms']:.2f}",
                  f"{r['p90_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['req_per_s']:.0f}",
                  f"{r.get('cpu_ms_per_req_decode', 0):.2f} / {r.get('cpu_ms_per_req_prefill', 0):.2f}", ph)
    Console(width=220).print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 32, 256], help="request sizes, MiB (TP1 bytes)")
    ap.add_argument("--topologies", nargs="+", default=["1:1", "4:2"], help="prefill TP:decode TP")
    ap.add_argument("--inflight", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=3, help="alternations of every system")
    ap.add_argument("--reps", type=int, default=5, help="timed requests (or batches) per system and round")
    ap.add_argument("--modes", nargs="+", default=["direct", "staged", "auto"])
    ap.add_argument("--no-nixl", action="store_true", help="kvbridge rows only (e.g. to time another kvbridge tree)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}, load {os.getloadavg()}, {' '.join(sys.argv)}", flush=True)
    rows = []
    for topo in a.topologies:
        p, d = (int(x) for x in topo.split(":"))
        rows += run_topology(p, d, a.sizes, a.inflight, a.rounds, a.reps, a.modes, a.no_nixl)
    print_table(rows)
    print(f"load after: {os.getloadavg()}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"commit": commit, "argv": sys.argv, "load": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
