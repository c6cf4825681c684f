"""Does posting hold the GIL? Llama-70B-like P8->D4, flashinfer, 32k tokens, 100k blocks, shuffled.

A worker thread posts one request (prepped: index arrays + ``make_prepped_xfer``; merged: the old path,
descriptors + Nx3 + ``get_xfer_descs`` + ``initialize_xfer``) while the main thread ticks; prints the
longest gap between main-thread ticks. Run: ``PYTHONPATH=src python benchmarks/post_gil.py`` (needs nixl).
"""
from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

from kvbridge.layout import EngineLayout, MemoryLayout
from kvbridge.lower import GroupBlocks, LoweredPlan
from kvbridge.memory import rank_memory
from kvbridge.models import load_model
from kvbridge.plan import plan_transfer
from kvbridge.transport.nixl import NixlTransport

sys.path.insert(0, os.path.dirname(__file__))
from whole_request import vbuf  # noqa: E402

NB, TOKENS, DR = 100_000, 32768, (0, 0)


def main() -> None:
    m = load_model("llama-3.1-70b")
    mk = lambda tp, role: EngineLayout(m, tp=tp, block_size=16, memory=MemoryLayout.parse("flashinfer"),  # noqa: E731
                                       num_blocks=NB, role=role)
    P, D = mk(8, "prefill"), mk(4, "decode")
    plan = plan_transfer(P, D)
    dec = NixlTransport("gil-d")
    dbase = dec.register(vbuf(rank_memory(D, *DR).size))
    pre, bases, agents = {}, {}, {}
    for p in plan.prefill_ranks_for(DR):
        pre[p] = NixlTransport(f"gil-p{p[1]}", multi_threaded=False)
        bases[p] = pre[p].register(vbuf(rank_memory(P, *p).size))
        agents[p] = dec.add_peer(pre[p].metadata())
    lp = LoweredPlan(plan, DR, bases, dbase)
    preps = {p: dec.prepare(agents[p], lp, p) for p in agents}
    rng = np.random.default_rng(0)
    pb = {g.name: GroupBlocks(rng.permutation(NB)[:2048]) for g in m.groups}
    db = {g.name: GroupBlocks(rng.permutation(NB)[:2048]) for g in m.groups}
    api = dec.agent

    def prepped(phases):
        for prep in preps.values():
            t0 = time.perf_counter()
            req = prep.geometry.request(prep.geometry.validate(TOKENS, pb, db), pb, db)
            t1 = time.perf_counter()
            h = api.make_prepped_xfer("READ", prep.local, req.local_ids, prep.remote, req.remote_ids, b"")
            phases.setdefault("ids ms", []).append(round((t1 - t0) * 1e3, 1))
            phases.setdefault("make_prepped_xfer ms", []).append(round((time.perf_counter() - t1) * 1e3, 1))
            api.release_xfer_handle(h)

    def merged(phases):
        for d in lp.descriptors(TOKENS, pb, db):
            loc, rem = d.nixl_arrays(0, 0)
            h = api.initialize_xfer("READ", dec.xfer_descs(loc), dec.xfer_descs(rem), agents[d.prefill], b"")
            api.release_xfer_handle(h)

    for name, fn in (("prepped", prepped), ("merged", merged)):
        for _ in range(3):
            done, phases = threading.Event(), {}
            th = threading.Thread(target=lambda: (fn(phases), done.set()))
            last = t_start = time.perf_counter()
            gaps = []
            th.start()
            while not done.is_set():
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                time.sleep(0)
            th.join()
            print(f"{name}: total {(time.perf_counter() - t_start) * 1e3:.1f} ms, main-thread ticks {len(gaps)}, "
                  f"longest gap {max(gaps) * 1e3:.2f} ms {phases}")
    for p in preps.values():
        dec.unprepare(p)
    dec.close()
    for t in pre.values():
        t.close()


if __name__ == "__main__":
    main()
