"""Does posting hold the GIL? Llama-70B-like P8->D4, flashinfer, 32k tokens, 100k blocks, shuffled:
a worker thread posts one request (prepped: index arrays + make_prepped_xfer; merged: the old path,
descriptors + Nx3 + get_xfer_descs + initialize_xfer) while the main thread ticks; prints the longest gap
between main-thread ticks. Run: PYTHONPATH=src python benchmarks/post_gil.py (needs nixl)."""
import sys, threading, time, numpy as np
sys.path.insert(0, __import__("os").path.dirname(__file__))
import whole_request as wr
from kvbridge.layout import EngineLayout, MemoryLayout
from kvbridge.models import load_model
from kvbridge.plan import plan_transfer
from kvbridge.lower import LoweredPlan, GroupBlocks
from kvbridge.memory import rank_memory
from kvbridge.transport.nixl import NixlTransport
m = load_model("llama-3.1-70b"); NB = 100000
P = EngineLayout(m, tp=8, block_size=16, memory=MemoryLayout.parse("flashinfer"), num_blocks=NB, role="prefill")
D = EngineLayout(m, tp=4, block_size=16, memory=MemoryLayout.parse("flashinfer"), num_blocks=NB, role="decode")
plan = plan_transfer(P, D); DR = (0, 0)
dec = NixlTransport("gil-d"); dbase = dec.register(wr.vbuf(rank_memory(D, *DR).size))
pre, bases, agents = {}, {}, {}
for p in plan.prefill_ranks_for(DR):
    pre[p] = NixlTransport(f"gil-p{p[1]}", multi_threaded=False)
    bases[p] = pre[p].register(wr.vbuf(rank_memory(P, *p).size)); agents[p] = dec.add_peer(pre[p].metadata())
lp = LoweredPlan(plan, DR, bases, dbase)
preps = {p: dec.prepare(agents[p], lp, p) for p in agents}
rng = np.random.default_rng(0)
pb = {g.name: GroupBlocks(rng.permutation(NB)[:2048]) for g in m.groups}
db = {g.name: GroupBlocks(rng.permutation(NB)[:2048]) for g in m.groups}
for mode in ("prepped", "merged"):
  for rep in range(3):
    done = threading.Event(); phases = {}
    def work():
        t0 = time.perf_counter()
        if mode == "prepped":
            for p, prep in preps.items():
                r = prep.geometry.validate(32768, pb, db)
                req = prep.geometry.request(r, pb, db)
                t1 = time.perf_counter()
                h = dec.agent.make_prepped_xfer("READ", prep.local, req.local_ids, prep.remote, req.remote_ids, b"")
                phases.setdefault("ids", []).append(t1 - t0); phases.setdefault("make", []).append(time.perf_counter() - t1)
                dec.agent.release_xfer_handle(h); t0 = time.perf_counter()
        else:
            for d in lp.descriptors(32768, pb, db):
                l, r = d.nixl_arrays(0, 0)
                h = dec.agent.initialize_xfer("READ", dec._xfer_descs(l), dec._xfer_descs(r), agents[d.prefill], b"")
                dec.agent.release_xfer_handle(h)
        done.set()
    th = threading.Thread(target=work); last = time.perf_counter(); gaps = []; t_start = last
    th.start()
    while not done.is_set():
        now = time.perf_counter(); gaps.append(now - last); last = now
        time.sleep(0)
    th.join(); tot = time.perf_counter() - t_start
    print(mode, f"total {tot*1e3:.1f} ms, main-thread ticks {len(gaps)}, longest gap {max(gaps)*1e3:.2f} ms",
          {k: [round(x*1e3, 1) for x in v] for k, v in phases.items()})
