"""One NIXL READ between two processes on this machine's device memory, to see which UCX transports carry it.

    UCX_PROTO_INFO=y python benchmarks/gpu/ucx_probe.py --device cuda --mib 64

A child process registers a buffer (VRAM on a GPU, DRAM on CPU) with a plain NIXL agent (UCX backend); the
parent reads it: one READ of ``--mib`` MiB in one descriptor, and one in ``--descs`` descriptors (per
descriptor cost). With ``UCX_PROTO_INFO=y`` UCX prints the protocol and lanes it chose for each (cuda_ipc,
cuda_copy, tcp, rc/dc over InfiniBand, sm/cma); this prints the times and a JSON line. Both processes use
device 0 (the single-GPU case of the suite: prefill and decode ranks sharing a GPU).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _target(conn, nbytes: int, device: str) -> None:
    import driver
    import torch
    p = driver.Peak(torch, "probe-target", nbytes, device)
    conn.send(p.info())
    conn.recv()  # until the reader is done
    os._exit(0)  # a probe: no agent teardown (it can take seconds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--descs", type=int, default=1024)
    args = ap.parse_args(argv)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    nbytes = args.mib << 20
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_target, args=(theirs, nbytes, device), daemon=True)
    child.start()
    try:
        import driver
        import torch
        reader = driver.Peak(torch, "probe-reader", nbytes, device)
        if not mine.poll(60):
            raise RuntimeError("the target process did not start within 60 s")
        reader.add(0, mine.recv())
        t_first = reader.read(0, nbytes)  # connects
        one = min(reader.read(0, nbytes) for _ in range(3))
        many = min(reader.read(0, nbytes, args.descs) for _ in range(2))
        res = {"device": device, "mem": reader.mem, "bytes": nbytes, "first_read_s": t_first, "one_desc_s": one,
               "gbps": nbytes / one / 1e9, "descs": args.descs, "many_desc_s": many,
               "per_desc_us": max(many - one, 0.0) / args.descs * 1e6}
        print(
            f"ucx_probe: {reader.mem} -> {reader.mem} READ between two processes: {res['gbps']:.3g} GB/s "
            f"({args.mib} MiB, one descriptor), {res['per_desc_us']:.3g} us per descriptor ({args.descs})",
            flush=True,
        )
        print("UCX_PROBE_JSON " + json.dumps(res), flush=True)
        return 0
    finally:
        mine.send("stop")
        child.join(5)
        if child.is_alive():
            child.kill()


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # a probe: no agent teardown (it can take seconds)
