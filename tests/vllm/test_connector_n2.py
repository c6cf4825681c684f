"""vLLM ``n > 1`` through both sides of the connector (issue 20 point 8, issue 23 point 1): vLLM 0.33's real
Scheduler on the prefill and on the decode, each next to the connector's worker side on vLLM's own KV
tensors, one process per engine, over NIXL.

vLLM fans a request with ``n`` choices out into child requests ``"{i}_{parent id}"`` on *each* engine
(``vllm/v1/engine/parallel_sampling.py``), so the prefill runs ``n`` children of one prompt and the decode
``n`` children that all carry the one set of ``kv_transfer_params`` the prefill's API answer had (the last
child's). Checked:

* the prefill's children get params naming one lease (the first finished child's blocks); a later sibling's
  own blocks go back to vLLM in the step it finishes (its request is gone, its blocks are free; they are
  then overwritten, as a reuse would, and no decode child sees those bytes);
* decode children reading one after the other (the second added only after the first read and its Done
  reached the prefill): the first Done does not free the prefill's blocks, the second frees them; both
  children's KV byte-exact;
* three children on each side in one step, read at once: all byte-exact, freed after the last;
* by the decode's Done messages only (lease 30 s, nothing expired), every engine ends with no request and no
  held block, the decode counts no failed read.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("vllm.v1.core.kv_cache_planning")
pytest.importorskip("nixl._api")

import dataclasses  # noqa: E402
import multiprocessing as mp  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from sched_utils import (  # noqa: E402
    assert_scheduler_empty,
    engine_outputs,
    make_model_runner_output,
    make_request,
    make_scheduler,
)
from worker_harness import Side, _cells, _recv, build_worker, free_port_base, llama  # noqa: E402

MODEL, SIDE = llama(2), Side(1, 1, 16)
LEASE_S = 30.0  # far longer than the test: only the decode's Done messages can free the prefill's blocks
WAIT_S = 30.0   # bound on every wait for the other process (the machine is shared: generous, never a timing check)


def _engine(role, engine_id, port, tmp, num_blocks=None):
    conn, kv, kvc, cfg = build_worker(MODEL, SIDE, (0, 0), role, engine_id, port, tmp, extra={"lease_s": LEASE_S})
    sched = make_scheduler(cfg, kv_cache_config=dataclasses.replace(kvc, num_blocks=num_blocks or kvc.num_blocks))
    return conn, kv, kvc, sched


def _step(sched, conn, write=None):
    """One engine step as vLLM runs it: schedule, the worker's connector calls (``write`` fills the KV of the
    scheduled requests, as the forward pass would), the model's output. Returns (outputs, connector results)."""
    so = sched.schedule()
    conn.bind_connector_metadata(so.kv_connector_metadata)
    conn.start_load_kv(None)
    if write is not None:
        write(so)
    conn.clear_connector_metadata()
    res = conn.get_transfer_results(set())
    assert (res.failed_recving or set()) <= (res.finished_recving or set())
    outs = sched.update_from_output(so, make_model_runner_output(
        list(so.num_scheduled_tokens), finished_sending=res.finished_sending or None,
        finished_recving=res.finished_recving or None, failed_recving=res.failed_recving or None))
    return outs, res


def _prompt(no, n):
    return [3 + (no * 97 + i) % 400 for i in range(n)]


def _fill(kv, kvc, ids, no, n, garbage=False):
    """Write the oracle's KV of prompt ``no`` (n tokens) into blocks ``ids`` (or a pattern of another prompt)."""
    for lname, t in kv.items():
        v, blk, off, want = _cells(MODEL, SIDE, kvc, int(lname.split(".")[2]), t, (0, 0), ids, 0, 0, n, no)
        v[blk, :, off, :] = (want ^ 0x5A5A) if garbage else want


def _mismatches(kv, kvc, ids, no, n) -> int:
    bad = 0
    for lname, t in kv.items():
        v, blk, off, want = _cells(MODEL, SIDE, kvc, int(lname.split(".")[2]), t, (0, 0), ids, 0, 0, n, no)
        bad += int((v[blk, :, off, :] != want).sum())
    return bad


def prefill_engine(pipe, port, tmp):
    try:
        conn, kv, kvc, sched = _engine("kv_producer", "prefill-e", port, tmp)
        ep = conn.worker.server  # the connector's PrefillServer (its endpoint's lease table, read under its lock)
        freed: dict = {}
        pipe.send(("ready",))
        while True:
            if pipe.poll(0):
                cmd, arg = pipe.recv()
                if cmd == "exit":
                    break
                if cmd == "prefill":  # add children (one step), write their KV as the forward pass would
                    prompts = {rid: (no, n) for rid, no, n in arg}
                    for rid, (no, n) in prompts.items():
                        sched.add_request(make_request(rid, _prompt(no, n), max_tokens=1,
                                                       kv_transfer_params={"do_remote_decode": True},
                                                       block_size=SIDE.block_size))
                    blocks = {}

                    def write(so, prompts=prompts, blocks=blocks):
                        for rid in so.num_scheduled_tokens:
                            if rid in prompts:
                                (blocks[rid],) = sched.kv_cache_manager.get_block_ids(rid)
                                _fill(kv, kvc, blocks[rid], *prompts[rid])
                    outs, res = _step(sched, conn, write)
                    for rid in res.finished_sending or ():
                        freed[rid] = time.monotonic()
                    params = {o.request_id: o.kv_transfer_params for o in engine_outputs(outs)}
                    held = {rid: rid in sched.requests for rid in prompts}
                    # a child whose blocks went back: overwrite them (as the next request using them would), so a
                    # decode reading them instead of the lease's would see other bytes
                    lease_blocks = {b for rid in sched.requests for b in sched.kv_cache_manager.get_block_ids(rid)[0]}
                    for rid in prompts:
                        if not held[rid]:
                            mine = [b for b in blocks[rid] if b not in lease_blocks]
                            if mine:
                                _fill(kv, kvc, mine, 999, len(mine) * SIDE.block_size, garbage=True)
                    free = sched.kv_cache_manager.block_pool.free_block_queue.num_free_blocks
                    pipe.send(("params", params, held, blocks, free))
                elif cmd == "lease":  # the lease of request ``arg``: reads expected, claims settled, pins
                    with ep._serve:
                        lease = ep.ep.table.get(arg)
                        got = None if lease is None else (lease.reads, sorted(
                            (k[1], lease.claim_settled(k)) for k in lease.claims), len(lease.pins))
                    pipe.send(("lease", got, arg in sched.requests, dict(freed)))
            _, res = _step(sched, conn)
            for rid in res.finished_sending or ():
                freed[rid] = time.monotonic()
            time.sleep(0.003)
        for _ in range(5):
            _step(sched, conn)
        assert_scheduler_empty(sched)
        stats = conn.get_kv_connector_stats()
        pipe.send(("freed", freed, stats.data if stats else {}))
        conn.shutdown()
    except Exception:  # noqa: BLE001
        pipe.send(("error", traceback.format_exc()))


def decode_engine(pipe, tmp):
    try:
        conn, kv, kvc, sched = _engine("kv_consumer", "decode-e", 0, tmp)
        pipe.send(("ready",))
        while True:
            cmd, arg = pipe.recv()
            if cmd == "exit":
                break
            # read: children (rid, (no, n), params) added in one step; step until every one has read and finished
            prompts = {rid: (no, n) for rid, (no, n), _ in arg}
            for rid, (no, n), params in arg:
                sched.add_request(make_request(rid, _prompt(no, n), max_tokens=2, kv_transfer_params=dict(params),
                                               block_size=SIDE.block_size))
            out = {"bad": {}, "first_block": {}, "failed": []}
            t0 = time.monotonic()
            while any(r in sched.requests for r in prompts) and time.monotonic() - t0 < WAIT_S:
                _, res = _step(sched, conn)
                out["failed"] += sorted(res.failed_recving or ())
                for rid in res.finished_recving or ():
                    if rid in prompts and rid in sched.requests:
                        (ids,) = sched.kv_cache_manager.get_block_ids(rid)
                        out["bad"][rid] = _mismatches(kv, kvc, ids, *prompts[rid])
                time.sleep(0.003)
            out["left"] = [r for r in prompts if r in sched.requests]
            for _ in range(3):
                _step(sched, conn)
            stats = conn.get_kv_connector_stats()
            out["stats"] = stats.data if stats else {}
            pipe.send(("read", out))
        assert_scheduler_empty(sched)
        conn.shutdown()
        pipe.send(("bye",))
    except Exception:  # noqa: BLE001
        pipe.send(("error", traceback.format_exc()))


def _lease_params(p: dict) -> dict:
    return {k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"}


def _wait_lease(pp, lease_id, until):
    """Ask the prefill about lease ``lease_id`` until ``until((lease, held, freed))`` (bounded: WAIT_S);
    returns the last answer (the caller asserts on it)."""
    t0 = time.monotonic()
    while True:
        pp.send(("lease", lease_id))
        got = _recv(pp, "lease", WAIT_S)[1:]
        if until(got) or time.monotonic() - t0 > WAIT_S:
            return got
        time.sleep(0.05)


def test_n2_children_share_one_prefill_lease_through_real_schedulers():
    ctx = mp.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="kvb-n2-")
    port = free_port_base(1)
    pp, pc = ctx.Pipe()
    dp, dc = ctx.Pipe()
    procs = [ctx.Process(target=prefill_engine, args=(pc, port, tmp), daemon=True),
             ctx.Process(target=decode_engine, args=(dc, tmp), daemon=True)]
    for p in procs:
        p.start()
    try:
        _recv(pp, "ready")
        _recv(dp, "ready")
        # ---- 1. the prefill's children finish in separate steps (child 1 reached the engine core late)
        no, n = 5, 40  # 2 full blocks of 16 and a partial one
        pp.send(("prefill", [("0_pa-1234abcd", no, n)]))
        _, params0, held0, blocks0, _ = _recv(pp, "params")
        pp.send(("prefill", [("1_pa-1234abcd", no, n)]))
        _, params1, held1, blocks1, _ = _recv(pp, "params")
        p0, p1 = params0["0_pa-1234abcd"], params1["1_pa-1234abcd"]
        assert held0 == {"0_pa-1234abcd": True} and held1 == {"1_pa-1234abcd": False}  # the sibling's blocks back
        # (vLLM adds each child's own remote_prefill_cached_tokens, the sibling's prefix hit on the lease's blocks)
        assert _lease_params(p1) == _lease_params(p0) and p1["remote_request_id"] == "0_pa-1234abcd", (p0, p1)
        assert p1["remote_block_ids"] == [blocks0["0_pa-1234abcd"]]
        got = _wait_lease(pp, "0_pa-1234abcd", lambda g: g[0] is not None and g[0][0] == 2)
        assert got[0] == (2, [], 0), got  # one lease, waiting for two reads, none yet

        # the decode's children one after the other: child 0 reads (vLLM's API answer carries the last
        # prefill child's params: p1), its Done reaches the prefill; the blocks stay held
        dp.send(("read", [("0_da-99", (no, n), p1)]))
        _, r0 = _recv(dp, "read", WAIT_S + 30)
        assert r0["bad"] == {"0_da-99": 0} and not r0["failed"] and not r0["left"], r0
        got = _wait_lease(pp, "0_pa-1234abcd", lambda g: g[0] is None or ("0_da-99", True) in g[0][1])
        lease, still_held, freed = got
        assert lease == (2, [("0_da-99", True)], 0), got  # the first Done settled its read, freed nothing
        assert still_held and "0_pa-1234abcd" not in freed, got

        dp.send(("read", [("1_da-99", (no, n), p1)]))
        _, r1 = _recv(dp, "read", WAIT_S + 30)
        assert r1["bad"] == {"1_da-99": 0} and not r1["failed"] and not r1["left"], r1
        got = _wait_lease(pp, "0_pa-1234abcd", lambda g: "0_pa-1234abcd" in g[2])
        assert got[0] is None and not got[1] and "0_pa-1234abcd" in got[2], got  # freed after the second Done

        # ---- 2. three children in one step on each side, read at once
        no, n = 6, 53
        kids = [(f"{i}_pb-5678ef01", no, n) for i in range(3)]
        pp.send(("prefill", kids))
        _, params, held, blocks, _ = _recv(pp, "params")
        owner = [rid for rid, h in held.items() if h]
        assert len(owner) == 1 and len({str(sorted(_lease_params(p).items())) for p in params.values()}) == 1, params
        last = params[kids[-1][0]]
        assert last["remote_request_id"] == owner[0]
        got = _wait_lease(pp, owner[0], lambda g: g[0] is not None and g[0][0] == 3)
        assert got[0] == (3, [], 0), got
        dp.send(("read", [(f"{i}_db-77", (no, n), last) for i in range(3)]))
        _, rb = _recv(dp, "read", WAIT_S + 30)
        assert rb["bad"] == {f"{i}_db-77": 0 for i in range(3)} and not rb["failed"] and not rb["left"], rb
        got = _wait_lease(pp, owner[0], lambda g: owner[0] in g[2])
        assert owner[0] in got[2], got

        dp.send(("exit", None))
        _recv(dp, "bye", WAIT_S)
        pp.send(("exit", None))
        _, freed, pstats = _recv(pp, "freed", WAIT_S)
        print(f"decode stats {rb['stats']}\nprefill freed {sorted(freed)} stats {pstats}")
        assert set(freed) == {"0_pa-1234abcd", owner[0]}  # one lease per parent, each freed
        assert pstats.get("prefill_expired_requests", 0) == 0, pstats
        assert pstats.get("prefill_freed_requests", 0) == 2, pstats
        assert not any(k.startswith("reads_failed_") for s in (r0, r1, rb) for k in s["stats"]), (r0, r1, rb)
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
