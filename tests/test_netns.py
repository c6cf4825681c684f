"""Across hosts: a prefill engine and a decode engine in two network namespaces joined by a veth pair.

``ns_p`` holds 10.77.0.1/24, ``ns_d`` 10.77.0.2/24; nothing else connects them (each has only its own
loopback), so the side channel (ZMQ) and the KV bytes (NIXL/UCX) must cross the veth link as they would
cross a network. ``UCX_TLS=tcp`` is required for that: with UCX's default transports the two processes
still share one kernel, UCX picks ``cma`` (process_vm_readv) and the bytes never touch the veth (the
test checks the veth's tx counter). ``UCX_NET_DEVICES`` names the veth in each namespace; it is not
strictly needed (measured: ``all`` works too, UCX skips the other namespace's ``lo``), while ``lo``
alone fails the handshake with "tcp/lo - different pid namespaces" -> HandshakeError.

The two sides are plain scripts (written to a temp dir) run with ``ip netns exec``; both derive the same
requests from a seed, the prefill fills them from the oracle and serves until they are freed, the
decode handshakes, reads, checks every byte with the oracle and prints a JSON report.

Needs root and a working ``ip netns``; otherwise skipped with the reason.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvbridge.transport.nixl import nixl_available

pytestmark = [pytest.mark.netns, pytest.mark.nixl,
              pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")]

SRC = Path(__file__).resolve().parents[1] / "src"
P_ADDR, D_ADDR = "10.77.0.1", "10.77.0.2"
PORT = 47711

COMMON = textwrap.dedent('''
    import json, sys, time
    import numpy as np
    from kvbridge.layout import EngineLayout
    from kvbridge.models import preset
    from kvbridge.testing.verify import BlockPool, make_request

    CFG = json.loads(sys.argv[1])
    MODEL = preset(CFG["model"])
    PL = EngineLayout(MODEL, tp=1, block_size=4, num_blocks=CFG["num_blocks"], role="prefill")
    DL = EngineLayout(MODEL, tp=1, block_size=4, num_blocks=CFG["num_blocks"], role="decode")

    def jobs():
        rng = np.random.default_rng(CFG["seed"])
        pp, dp = BlockPool(PL, rng), BlockPool(DL, rng)
        out = []
        for i in range(CFG["requests"]):
            n = int(rng.integers(1, CFG["max_tokens"] + 1))
            prefix = int(rng.integers(0, n)) if i % 3 == 2 else 0
            out.append(make_request(i, n, PL, DL, pp, dp, prefix))
        return out

    def emit(**kw):
        print("KVB " + json.dumps(kw, default=str), flush=True)
''')

PREFILL = COMMON + textwrap.dedent('''
    from kvbridge.runtime.prefill import PrefillRank
    from kvbridge.testing.procs import fill_rank
    from kvbridge.testing.engine import default_memory
    p = PrefillRank(PL, (0, 0), "pn", memory=default_memory(PL, (0, 0)), host=CFG["p_addr"], port=CFG["port"],
                    lease_s=120.0)
    reqs = jobs()
    for r in reqs:
        fill_rank(p, r.req_id, r.num_tokens, r.prefill_blocks)
        p.add_request(f"n{r.req_id}", r.prefill_blocks, attempt=1000 + r.req_id)
    emit(ready=True, port=p.port, agent=p.transport.agent_name)
    freed, deadline = [], time.time() + CFG["timeout"]
    while time.time() < deadline and len(freed) < len(reqs):
        p.serve_once()
        freed += p.take_freed()["freed"]
        time.sleep(2e-4)
    emit(freed=sorted(freed), stats=p.stats())
    p.close()
''')

DECODE = COMMON + textwrap.dedent('''
    from kvbridge.testing.oracle import SENTINEL
    from kvbridge.runtime.decode import DecodeRank, ReadRequest
    from kvbridge.testing.procs import verify_rank, fill_rank
    from kvbridge.testing.engine import buffer_of, default_memory
    d = DecodeRank(DL, (0, 0), "dn", memory=default_memory(DL, (0, 0)), handshake_timeout_s=10.0)
    buffer_of(d.mem).fill(SENTINEL)
    t0 = time.perf_counter()
    d.handshake("pn", {(0, 0): f"{CFG['p_addr']}:{CFG['port']}"})
    t_hs = time.perf_counter() - t0
    reads = [(r.req_id, ReadRequest(f"n{r.req_id}", "pn", r.num_tokens, r.prefill_blocks, r.decode_blocks,
                                          1000 + r.req_id))
             for r in jobs()]
    t0 = time.perf_counter()
    for _, rr in reads:
        d.start(rr)
    done, failed = d.wait(CFG["timeout"])
    t_xfer = time.perf_counter() - t0
    ver = verify_rank(d, reads)
    emit(done=sorted(done), failed=failed, verify=ver, stats=d.stats(), handshake_s=t_hs, transfer_s=t_xfer)
    d.close()
''')


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=check)


def _netns_unavailable() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "iproute2 `ip` is not installed"
    probe = f"kvbprobe{os.getpid()}"
    r = sh("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return None


def read_report(proc: subprocess.Popen, deadline: float, log: list) -> dict:
    """Next ``KVB {json}`` line from ``proc``'s stdout before ``deadline`` (other lines go to ``log``)."""
    buf = b""
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.1)
        if not r:
            if proc.poll() is not None:
                break
            continue
        chunk = os.read(fd, 1)
        if not chunk:
            break
        buf += chunk
        if chunk == b"\n":
            line = buf.decode(errors="replace").rstrip("\n")
            buf = b""
            if line.startswith("KVB "):
                return json.loads(line[4:])
            log.append(line)
    raise AssertionError(f"no report from pid {proc.pid} (rc={proc.poll()}); output:\n" + "\n".join(log[-40:]))


def tx_bytes(ns: str, dev: str) -> int:
    return int(sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes").stdout)


def test_prefill_and_decode_in_two_network_namespaces(tmp_path):
    why = _netns_unavailable()
    if why:
        print(f"skipping: {why}")
        pytest.skip(why)
    tag = str(os.getpid())[-7:]
    ns_p, ns_d = f"kvbnsp{tag}", f"kvbnsd{tag}"
    veth_p, veth_d = f"kvbp{tag}", f"kvbd{tag}"
    procs: list[subprocess.Popen] = []
    try:
        sh("ip", "netns", "add", ns_p)
        sh("ip", "netns", "add", ns_d)
        sh("ip", "link", "add", veth_p, "type", "veth", "peer", "name", veth_d)
        sh("ip", "link", "set", veth_p, "netns", ns_p)
        sh("ip", "link", "set", veth_d, "netns", ns_d)
        for ns, dev, addr in ((ns_p, veth_p, P_ADDR), (ns_d, veth_d, D_ADDR)):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        ping = sh("ip", "netns", "exec", ns_d, "ping", "-c", "1", "-W", "2", P_ADDR, check=False)
        assert ping.returncode == 0 or shutil.which("ping") is None, ping.stdout + ping.stderr

        (tmp_path / "prefill.py").write_text(PREFILL)
        (tmp_path / "decode.py").write_text(DECODE)
        cfg = {"model": "tiny-dense", "num_blocks": 512, "seed": 3, "requests": 24, "max_tokens": 64,
               "p_addr": P_ADDR, "port": PORT, "timeout": 60}

        def launch(ns: str, dev: str, script: str) -> subprocess.Popen:
            env = dict(os.environ, PYTHONPATH=str(SRC), UCX_TLS="tcp", UCX_NET_DEVICES=dev,
                       UCX_WARN_UNUSED_ENV_VARS="n")
            p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(tmp_path / script), json.dumps(cfg)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
            procs.append(p)
            return p

        plog, dlog = [], []
        pre = launch(ns_p, veth_p, "prefill.py")
        ready = read_report(pre, time.monotonic() + 60, plog)
        assert ready["ready"] and ready["port"] == PORT
        tx0 = tx_bytes(ns_p, veth_p)
        dec = launch(ns_d, veth_d, "decode.py")
        rep = read_report(dec, time.monotonic() + 90, dlog)
        fin = read_report(pre, time.monotonic() + 30, plog)
        tx1 = tx_bytes(ns_p, veth_p)

        names = [f"n{i}" for i in range(cfg["requests"])]
        assert not rep["failed"], rep["failed"]
        assert sorted(rep["done"]) == sorted(names)
        ver = rep["verify"]
        assert ver["mismatched_bytes"] == 0 and ver["needed_bytes"] > 0
        m = rep["stats"]["metrics"]
        assert m["transfer_bytes"] == ver["needed_bytes"] and m["finished_requests"] == cfg["requests"]
        assert rep["stats"]["live_handles"] == 0
        assert sorted(fin["freed"]) == sorted(names) and fin["stats"]["leases"] == 0
        # the KV bytes really went over the veth link (plus protocol overhead)
        assert tx1 - tx0 >= ver["needed_bytes"], (tx1 - tx0, ver["needed_bytes"])
        print(f"netns: {cfg['requests']} requests, {ver['needed_bytes']:,} B over {veth_p} "
              f"(veth tx {tx1 - tx0:,} B), handshake {rep['handshake_s'] * 1e3:.0f} ms, "
              f"transfer {rep['transfer_s'] * 1e3:.0f} ms")
        for p in (dec, pre):
            p.wait(20)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for ns in (ns_p, ns_d):
            sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", veth_p, check=False)  # only if it never moved into a namespace
