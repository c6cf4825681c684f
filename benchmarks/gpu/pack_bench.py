"""Staged pack and scatter against a device-to-device copy of the same bytes, for the GPU suite's shapes.

    python benchmarks/gpu/pack_bench.py --device cuda                 # the suite's full shapes
    python benchmarks/gpu/pack_bench.py --device cpu --tokens 1024    # CPU torch, smaller requests

Per pair of the GPU suite (``driver.pairs_config``: dense GQA head slices, MLA latents, SWA+FA), one
prefill rank's and one decode rank's KV caches are allocated with torch on the device in the suite's
engine layouts (``driver.allocate``) and described with the public API. The request's descriptors for
(decode rank 0, its first prefill rank) come from the lowering, as in the runtime. Then, alternating in
rounds (the order rotates every round), each implementation:

* ``pack``: the request's runs of the prefill memory -> one staging tensor on the device (what the
  prefill does for a staged read; the runtime's ``KVBytes.pack``);
* ``scatter``: that staging tensor -> the runs of the decode memory (``KVBytes.scatter``);
* ``d2d``: a torch copy of the same number of bytes between two device tensors.

Implementations: ``after`` (this tree: ``kvbridge.staging.DeviceCopies``, runs from the factored
descriptors, index tensors on the device), ``after-rows`` (the same, but a gather whose run starts are
not multiples of the run length indexes rows of their common divisor instead of overlapping row views),
``after-w16`` (the same with 16-byte elements where the alignment allows), ``after-torchcpu`` (CPU only:
torch's index_copy_ for the scatter instead of numpy's put on the same memory) and ``before`` (kvbridge at
2f72096, kept below:
host numpy indices per request and allocation, ``uint8`` rows of the largest power of two dividing every
offset). Every implementation's packed bytes are compared with ``before``'s, and the decode memory after
each scatter with the packed stream (its runs packed again by ``before``). Times are medians (CUDA: the device is
synchronised before a timer starts and stops). The rounds reuse one request's descriptors, so its chunk
bases (a few KB) are uploaded to the device in the untimed first round only; a new request uploads them
once. JSON is written to ``--out`` after every pair.
``--budget-s`` bounds the whole run: a pair or round that would start after it is skipped (and said so).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "src"))

import driver  # noqa: E402  (benchmarks/gpu/driver.py: the suite's pairs and engine layouts)

IMPLS = ("after", "after-rows", "after-w16", "after-torchcpu", "before")


# ---- kvbridge at 2f72096: the implementation this replaces, for the A/B comparison ------------------
def _before_copy_runs_torch(torch, dst_buf, dst, src_buf, src, nbytes) -> None:
    dev = dst_buf.device
    bits = int(np.bitwise_or.reduce(np.concatenate([src, dst, nbytes]).astype(np.int64)))
    u = min(int(bits & -bits) if bits else 4096, 4096)
    pieces = nbytes // u
    first = np.cumsum(pieces) - pieces
    k = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(first, pieces)
    si = np.repeat(src // u, pieces) + k
    di = np.repeat(dst // u, pieces) + k
    s2 = src_buf[:src_buf.numel() // u * u].view(-1, u)
    d2 = dst_buf[:dst_buf.numel() // u * u].view(-1, u)
    s_packed = si.size and si[-1] - si[0] == si.size - 1 and np.all(np.diff(si) == 1)
    d_packed = di.size and di[-1] - di[0] == di.size - 1 and np.all(np.diff(di) == 1)
    if s_packed and d_packed:
        d2[int(di[0]):int(di[0]) + di.size].copy_(s2[int(si[0]):int(si[0]) + si.size])
    elif s_packed:
        d2.index_copy_(0, torch.as_tensor(di, device=dev), s2[int(si[0]):int(si[0]) + si.size])
    elif d_packed:
        torch.index_select(s2, 0, torch.as_tensor(si, device=dev), out=d2[int(di[0]):int(di[0]) + di.size])
    else:
        d2.index_copy_(0, torch.as_tensor(di, device=dev), s2.index_select(0, torch.as_tensor(si, device=dev)))


def _before_groups(kv, addrs: np.ndarray):
    if len(kv.bufs) == 1:
        return [(kv.bufs[0], addrs - kv.bases[0], None)]
    which = np.searchsorted(kv.bases, addrs, side="right") - 1
    order = np.argsort(which, kind="stable")
    w = which[order]
    edges = [0, *(np.flatnonzero(np.diff(w)) + 1).tolist(), w.size]
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        idx = order[a:b]
        i = int(w[a])
        out.append((kv.bufs[i], addrs[idx] - kv.bases[i], idx))
    return out


def before_pack(torch, kv, src, nbytes, staging, offset: int) -> None:
    from kvbridge.staging import offsets
    pos = offsets(nbytes) + offset
    for buf, rel, m in _before_groups(kv, np.asarray(src, np.int64)):
        _before_copy_runs_torch(
            torch, staging, pos if m is None else pos[m], buf, rel, nbytes if m is None else nbytes[m]
        )


def before_scatter(torch, kv, staging, dst, nbytes, offset: int) -> None:
    from kvbridge.staging import offsets
    pos = offsets(nbytes) + offset
    for buf, rel, m in _before_groups(kv, np.asarray(dst, np.int64)):
        _before_copy_runs_torch(
            torch, buf, rel, staging, pos if m is None else pos[m], nbytes if m is None else nbytes[m]
        )


# ---- one pair -----------------------------------------------------------------------------------------
def setup(torch, name: str, pair: dict, device: str):
    """(prefill KVBytes, decode KVBytes, descriptors, decode owners) for decode rank 0 and its first prefill rank."""
    import kvbridge
    from kvbridge.lower import LoweredPlan
    from kvbridge.plan import plan_transfer
    from kvbridge.runtime.memhost import KVBytes
    pe, de = driver.engine_of(pair, "p"), driver.engine_of(pair, "d")
    plan = plan_transfer(pe, de)
    drank = (0, 0)
    prank = plan.prefill_ranks_for(drank)[0]
    players, _, powners = driver.allocate(torch, pe, prank, pair["p"][2], device)
    dlayers, _, downers = driver.allocate(torch, de, drank, pair["d"][2], device)
    g = torch.Generator(device=device).manual_seed(1)
    for t in powners:
        b = t.reshape(-1).view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=device, generator=g))
    pmem = kvbridge.describe_memory(pe, prank, players)
    dmem = kvbridge.describe_memory(de, drank, dlayers)
    lp = LoweredPlan(plan, drank, prefill_mems={prank: pmem}, decode_mem=dmem)
    pb = {k: kvbridge.GroupBlocks.of(v) for k, v in driver.request_blocks(pair, "p", 0).items()}
    db = {k: kvbridge.GroupBlocks.of(v) for k, v in driver.request_blocks(pair, "d", 1).items()}
    (ds,) = lp.descriptors(pair["tokens"], pb, db, only=(prank,))
    return KVBytes(pmem), KVBytes(dmem), ds, downers, (powners, players, dlayers)


def _sync(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(torch, device: str, fn) -> float:
    _sync(torch, device)
    t0 = time.perf_counter()
    fn()
    _sync(torch, device)
    return time.perf_counter() - t0


def bench_pair(torch, name: str, pair: dict, device: str, impls, reps: int, deadline: float) -> dict:
    from kvbridge import staging
    from kvbridge.staging import RunSlice, run_lengths
    t_setup = time.perf_counter()
    pkv, dkv, ds, downers, keep = setup(torch, name, pair, device)
    total = ds.total_bytes
    lengths = run_lengths(ds)
    src_h, dst_h = ds.src, ds.dst  # host addresses for ``before`` (materialised once, outside its timing)
    stg = {i: torch.zeros(total, dtype=torch.uint8, device=device) for i in impls}
    d2d_src = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device)
    d2d_dst = torch.empty_like(d2d_src)
    parts = [("arrays" if isinstance(p, tuple) else ("run-major" if p.run_major else "chunk-major")) for p in ds._parts]
    out = {"bytes": total, "runs": int(ds.count), "run_bytes": sorted({int(x) for x in np.unique(lengths)})[:6],
           "parts": parts, "prefill": {"tp": pair["p"][0], "block_size": pair["p"][1], "form": pair["p"][2]},
           "decode": {"tp": pair["d"][0], "block_size": pair["d"][1], "form": pair["d"][2]},
           "tokens": pair["tokens"], "setup_s": round(time.perf_counter() - t_setup, 3), "rounds": 0}

    def run(impl: str, what: str) -> None:
        if impl == "d2d":
            d2d_dst.copy_(d2d_src)
            return
        if impl == "before":
            if what == "pack":
                before_pack(torch, pkv, src_h, lengths, stg[impl], 0)
            else:
                before_scatter(torch, dkv, stg[impl], dst_h, lengths, 0)
            return
        default, width, cpu = staging.GATHER_UNALIGNED, staging.MAX_ELEMENT, staging.CPU_COPIES
        if impl == "after-rows":
            staging.GATHER_UNALIGNED = "rows"
        if impl == "after-w16":
            staging.MAX_ELEMENT = 16
        if impl == "after-torchcpu":
            staging.CPU_COPIES = "torch"
        try:
            if what == "pack":
                pkv.pack(RunSlice(ds, "src"), lengths, stg[impl], 0)
            else:
                dkv.scatter(stg[impl], RunSlice(ds, "dst"), lengths, 0)
        finally:
            staging.GATHER_UNALIGNED, staging.MAX_ELEMENT, staging.CPU_COPIES = default, width, cpu

    ref = torch.zeros(total, dtype=torch.uint8, device=device)  # the packed stream, by the old code
    before_pack(torch, pkv, src_h, lengths, ref, 0)
    times: dict = {i: {"pack": [], "scatter": []} for i in impls}
    times["d2d"] = {"copy": []}
    order = list(impls) + ["d2d"]
    checked = {}
    for r in range(reps + 1):  # round 0: warm-up (caches, allocator), checked, not timed
        if r and time.perf_counter() > deadline:
            out["stopped"] = f"time budget reached after {r - 1} timed rounds"
            break
        rot = order[r % len(order):] + order[:r % len(order)]
        for impl in rot:
            if impl == "d2d":
                dt = _timed(torch, device, lambda: run("d2d", "copy"))
                if r:
                    times["d2d"]["copy"].append(dt)
                continue
            for what in ("pack", "scatter"):
                if what == "scatter":
                    for t in downers:
                        t.reshape(-1).view(torch.uint8).fill_(0)
                dt = _timed(torch, device, lambda: run(impl, what))
                if r:
                    times[impl][what].append(dt)
                if not r:  # check every byte once per implementation
                    if what == "pack":
                        checked[f"{impl}.pack"] = bool(torch.equal(stg[impl], ref))
                    if what == "scatter":
                        back = torch.zeros(total, dtype=torch.uint8, device=device)
                        before_pack(torch, dkv, dst_h, lengths, back, 0)
                        checked[f"{impl}.scatter"] = bool(torch.equal(back, stg[impl]))
        out["rounds"] = r
    out["byte_exact"] = checked

    def med(x):
        return statistics.median(x) if x else None

    d2d = med(times["d2d"]["copy"])
    out["d2d_gbps"] = total / d2d / 1e9 if d2d else None
    for impl in impls:
        row = {}
        for what in ("pack", "scatter"):
            m = med(times[impl][what])
            row[f"{what}_s_median"] = m
            row[f"{what}_gbps"] = total / m / 1e9 if m else None
            row[f"{what}_vs_d2d"] = (d2d / m) if m and d2d else None
            row[f"{what}_s"] = times[impl][what]
        out[impl] = row
    out["d2d_s"] = times["d2d"]["copy"]
    return out


def environment(torch, device: str) -> dict:
    env = {"device": device, "python": platform.python_version(), "torch": torch.__version__,
           "numpy": np.__version__, "host": platform.node(), "cpus": os.cpu_count(),
           "torch_threads": torch.get_num_threads()}
    try:
        env["loadavg"] = os.getloadavg()
    except OSError:
        pass
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="the suite's tiny models")
    ap.add_argument("--pairs", default="", help="comma-separated subset of: dense-gqa, mla, swa-fa")
    ap.add_argument("--tokens", type=int, default=0, help="tokens per request for every pair (default: the suite's)")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per pair (each implementation once a round)")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS}")
    ap.add_argument("--budget-s", type=float, default=40.0, help="no new pair or round starts after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(HERE.parent / "out" / "gpu"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    import torch
    device = "cuda:0" if args.device == "cuda" else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("pack_bench: --device cuda but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    impls = tuple(i for i in args.impls.split(",") if i and not (i == "after-torchcpu" and args.device == "cuda"))
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        ap.error(f"--impls: unknown {bad}; choose from {IMPLS}")
    pairs = driver.pairs_config(args.small)
    if args.pairs:
        pairs = {k: pairs[k] for k in args.pairs.split(",")}
    if args.tokens:
        pairs = {k: dict(v, tokens=args.tokens) for k, v in pairs.items()}
    res = {"benchmark": "pack_bench", "environment": environment(torch, device), "args": vars(args), "pairs": {},
           "skipped": []}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"pack_bench_{args.device}.json"

    def save() -> None:
        res["elapsed_s"] = round(time.perf_counter() - t0, 2)
        path.write_text(json.dumps(res, indent=1))

    rc = 0
    last = 0.0  # wall seconds of the last pair: a pair starts only where as much time is left
    for name, pair in pairs.items():
        if time.perf_counter() + last > deadline:
            res["skipped"].append(name)
            print(f"pack_bench: {name}: skipped (the time budget of {args.budget_s:g} s would be passed: "
                  f"the last pair took {last:.1f} s)", flush=True)
            continue
        t_pair = time.perf_counter()
        try:
            r = bench_pair(torch, name, pair, device, impls, args.reps, deadline)
        except Exception as e:  # noqa: BLE001 - recorded, the next pair runs
            import traceback
            res.setdefault("errors", {})[name] = f"{e!r}\n{traceback.format_exc()}"
            print(f"pack_bench: {name}: FAILED {e!r}", flush=True)
            rc = 1
            save()
            continue
        res["pairs"][name] = r
        last = time.perf_counter() - t_pair
        if not all(r["byte_exact"].values()):
            rc = 1
        line = [
            f"{name}: {r['bytes'] / 1e6:.1f} MB, {r['runs']} runs of {r['run_bytes']} B, d2d {_f(r['d2d_gbps'])} GB/s"
        ]
        for impl in impls:
            x = r[impl]
            line.append(f"  {impl:13s} pack {_f(x['pack_gbps'])} GB/s ({_f(x['pack_vs_d2d'])}x d2d)"
                        f"  scatter {_f(x['scatter_gbps'])} GB/s ({_f(x['scatter_vs_d2d'])}x d2d)")
        line.append(
            f"  byte-exact: {r['byte_exact']}; timed rounds {r['rounds']}"
            + (f"; {r['stopped']}" if "stopped" in r else "")
        )
        print("\n".join(line), flush=True)
        save()
    save()
    print(f"pack_bench: wrote {path} ({res['elapsed_s']} s)", flush=True)
    return rc


def _f(x, nd=3):
    if x is None:
        return "-"
    return f"{x:.{nd}g}" if abs(x) < 1000 else f"{x:,.0f}"


if __name__ == "__main__":
    sys.exit(main())
