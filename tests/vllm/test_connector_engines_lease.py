"""Issue 20, point 5, through the connector: vLLM 0.33's real Scheduler driving the connector's worker side on
vLLM's own KV tensors, one process per engine (scheduler + worker in it, stepped as vLLM's engine core
does), over NIXL. A decode request aborted before its read, and one aborted during it, free the prefill's
blocks (its scheduler's ``finished_sending``) within 1 s, by the decode's message, not by lease expiry; a
request queued on the decode for 3 x ``lease_s`` (KV pool full) heartbeats its lease and still reads
byte-exact; every engine ends with no request and no held block."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("vllm.v1.core.kv_cache_planning")
pytest.importorskip("nixl._api")

import dataclasses  # noqa: E402
import multiprocessing as mp  # noqa: E402
import os  # noqa: E402
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
from vllm.v1.request import RequestStatus  # noqa: E402
from worker_harness import Side, _cells, _recv, build_worker, free_port_base, llama  # noqa: E402

MODEL, SIDE = llama(2), Side(1, 1, 16)
LEASE_S = 1.5


def _engine(role, engine_id, port, tmp, num_blocks=None):
    conn, kv, kvc, cfg = build_worker(MODEL, SIDE, (0, 0), role, engine_id, port, tmp, extra={"lease_s": LEASE_S})
    sched = make_scheduler(cfg, kv_cache_config=dataclasses.replace(kvc, num_blocks=num_blocks or kvc.num_blocks))
    return conn, kv, kvc, sched


def _step(sched, conn):
    """One engine step as vLLM runs it: schedule, the worker's connector calls, the model's output."""
    so = sched.schedule()
    conn.bind_connector_metadata(so.kv_connector_metadata)
    conn.start_load_kv(None)
    conn.clear_connector_metadata()
    res = conn.get_transfer_results(set())
    assert (res.failed_recving or set()) <= (res.finished_recving or set())
    outs = sched.update_from_output(so, make_model_runner_output(
        list(so.num_scheduled_tokens), finished_sending=res.finished_sending or None,
        finished_recving=res.finished_recving or None, failed_recving=res.failed_recving or None))
    return so, outs, res


def _prompt(no, n):
    return [3 + (no * 97 + i) % 400 for i in range(n)]


def prefill_engine(pipe, port, tmp):
    try:
        conn, kv, kvc, sched = _engine("kv_producer", "prefill-e", port, tmp)
        freed: dict = {}
        pipe.send(("ready",))
        while True:
            if pipe.poll(0):
                cmd, arg = pipe.recv()
                if cmd == "exit":
                    break
                # prefill: write each request's KV (the oracle's values) into the blocks vLLM gave it
                params = {}
                for rid, (no, n) in arg.items():
                    sched.add_request(make_request(rid, _prompt(no, n), max_tokens=1,
                                                  kv_transfer_params={"do_remote_decode": True},
                                                  block_size=SIDE.block_size))
                so = sched.schedule()
                for rid, (no, n) in arg.items():
                    (ids,) = sched.kv_cache_manager.get_block_ids(rid)
                    for lname, t in kv.items():
                        v, blk, off, want = _cells(MODEL, SIDE, kvc, int(lname.split(".")[2]), t, (0, 0), ids, 0,
                                                   0, n, no)
                        v[blk, :, off, :] = want
                outs = sched.update_from_output(so, make_model_runner_output(list(so.num_scheduled_tokens)))
                for o in engine_outputs(outs):
                    params[o.request_id] = o.kv_transfer_params
                pipe.send(("params", params))
            _, _, res = _step(sched, conn)
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
        # every READ of this decode takes >= 0.3 s (transport/delayed.py): the "aborted during its read" case
        # needs a read still under way after the step that started it, and reads now finish within a step
        os.environ["KVBRIDGE_DELAY_LINK"] = "*:read:300"
        # 10 blocks of 16 tokens: a local request of 100 tokens (7 blocks) leaves too few for a 40-token read
        conn, kv, kvc, sched = _engine("kv_consumer", "decode-e", 0, tmp, num_blocks=10)
        pipe.send(("ready",))
        out = {}
        read: dict = {}  # request id -> blocks (checked once finished_recving)

        def run(until, pause=0.003):
            while not until():
                _, _, res = _step(sched, conn)
                assert not res.failed_recving, res.failed_recving
                for rid in res.finished_recving or ():
                    if rid in sched.requests:
                        read[rid] = sched.kv_cache_manager.get_block_ids(rid)[0]
                        out.setdefault("bad", 0)
                        out["bad"] += _check(kv, kvc, rid, read[rid])
                time.sleep(pause)

        def _check(kv, kvc, rid, ids):
            no, n = REQS[rid]
            bad = 0
            for lname, t in kv.items():
                v, blk, off, want = _cells(MODEL, SIDE, kvc, int(lname.split(".")[2]), t, (0, 0), ids, 0, 0, n, no)
                bad += int((v[blk, :, off, :] != want).sum())
            out["checked"] = out.get("checked", 0) + 1
            return bad

        # 1. queued for 3 x lease_s: the pool is full (a local request holds it), the read waits
        cmd, params = pipe.recv()
        sched.add_request(make_request("hog", list(range(500, 600)), max_tokens=400, block_size=SIDE.block_size))
        _step(sched, conn)
        q = make_request("dec-q", _prompt(*REQS["dec-q"]), max_tokens=2, kv_transfer_params=params["p-q"],
                         block_size=SIDE.block_size)
        sched.add_request(q)
        t0 = time.monotonic()
        run(lambda: time.monotonic() - t0 > 3 * LEASE_S, pause=0.1)
        out["queued_status"] = q.status.name  # still WAITING: never allocated
        sched.finish_requests("hog", RequestStatus.FINISHED_ABORTED)
        run(lambda: "dec-q" in read or time.monotonic() - t0 > 3 * LEASE_S + 20)
        out["queued_s"] = time.monotonic() - t0
        run(lambda: "dec-q" not in sched.requests or time.monotonic() - t0 > 3 * LEASE_S + 30)
        pipe.send(("queued", out))

        # 2. aborted before its read (finished in the step it arrives) and during it (after the step that
        # started it)
        cmd, params = pipe.recv()
        sched.add_request(make_request("dec-before", _prompt(*REQS["dec-before"]), max_tokens=2,
                                       kv_transfer_params=params["p-before"], block_size=SIDE.block_size))
        sched.finish_requests("dec-before", RequestStatus.FINISHED_ABORTED)
        out["t_abort_before"] = time.monotonic()
        sched.add_request(make_request("dec-during", _prompt(*REQS["dec-during"]), max_tokens=2,
                                       kv_transfer_params=params["p-during"], block_size=SIDE.block_size))
        so, _, res = _step(sched, conn)
        assert "dec-during" in so.kv_connector_metadata.recv and not res.finished_recving  # the read is under way
        sched.finish_requests("dec-during", RequestStatus.FINISHED_ABORTED)
        out["t_abort_during"] = time.monotonic()
        t1 = time.monotonic()
        run(lambda: not sched.requests or time.monotonic() - t1 > 20)
        for _ in range(3):
            _step(sched, conn)
        assert_scheduler_empty(sched)  # the aborted read's blocks went back once the read ended
        stats = conn.get_kv_connector_stats()
        out["stats"] = stats.data if stats else {}
        pipe.send(("aborts", out))
        pipe.recv()
        conn.shutdown()
    except Exception:  # noqa: BLE001
        pipe.send(("error", traceback.format_exc()))


# decode request id -> (oracle request number, prompt tokens); the prefill's request is "p-" + suffix
REQS = {"dec-q": (1, 40), "dec-before": (2, 40), "dec-during": (3, 56)}


def test_heartbeats_and_aborts_through_real_schedulers():
    ctx = mp.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="kvb-lease-engines-")
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
        pp.send(("prefill", {"p-q": REQS["dec-q"]}))
        _, params = _recv(pp, "params")
        dp.send(("go", params))
        _, queued = _recv(dp, "queued", 60)
        print(f"queued: {queued}")
        assert queued["queued_status"] == "WAITING" and queued["queued_s"] > 3 * LEASE_S
        assert queued["checked"] == 1 and queued["bad"] == 0  # read byte-exact after 3 x lease_s

        pp.send(("prefill", {"p-before": REQS["dec-before"], "p-during": REQS["dec-during"]}))
        _, params = _recv(pp, "params")
        dp.send(("go", params))
        _, aborts = _recv(dp, "aborts", 60)
        pp.send(("exit", None))
        _, freed, pstats = _recv(pp, "freed", 60)
        dp.send(("exit",))
        print(f"aborts: {aborts}\nfreed: {freed}\nprefill stats {pstats}")
        assert set(freed) == {"p-q", "p-before", "p-during"}
        before = freed["p-before"] - aborts["t_abort_before"]
        during = freed["p-during"] - aborts["t_abort_during"]
        print(f"prefill blocks freed {before * 1e3:.0f} ms after the abort before the read, "
              f"{during * 1e3:.0f} ms after the abort during it")
        assert before < 1.0 and during < 1.0
        # freed by the decode's messages, never by expiry (heartbeats kept the queued lease)
        assert pstats.get("prefill_expired_requests", 0) == 0, pstats
        assert aborts["stats"].get("reads_released", 0) == 1, aborts["stats"]
        assert not any(k.startswith("reads_failed_") for k in aborts["stats"]), aborts["stats"]
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()


def frozen_prefill_decode(pipe, tmp, port):
    """A decode worker whose request names a prefill engine that accepts TCP connections and never answers
    (a frozen process): the engine keeps stepping while the handshake runs in the background; the read
    fails typed (HandshakeFailed) once the handshake's bound passes."""
    import socket

    from kvbridge.integrations.vllm import RecvReq

    try:
        frozen = socket.socket()
        frozen.bind(("127.0.0.1", port))
        frozen.listen(16)  # never accepted, never answered
        conn, kv, kvc, _ = build_worker(MODEL, SIDE, (0, 0), "kv_consumer", "decode-e", 0, tmp,
                                        extra={"handshake_timeout_s": 1.0})
        params = {"do_remote_prefill": True, "remote_engine_id": "frozen-e", "remote_host": "127.0.0.1",
                  "remote_port": port, "remote_block_ids": [[1, 2]], "remote_request_id": "p-1",
                  "remote_num_tokens": 20, "remote_tp_size": 1, "remote_pp_size": 1, "remote_attempt": 3,
                  "remote_speculative": None}
        from kvbridge.integrations.vllm import KVBridgeConnectorMetadata
        steps, longest, failed = 0, 0.0, set()
        t0 = time.monotonic()
        metas = [KVBridgeConnectorMetadata(connect={"frozen-e": params}),  # the scheduler's first sight
                 KVBridgeConnectorMetadata(recv={"d-1": RecvReq("d-1", [[5, 6, 7]], [0], params)})]
        while not failed and time.monotonic() - t0 < 60:
            t = time.perf_counter()
            conn.bind_connector_metadata(metas.pop(0) if metas else KVBridgeConnectorMetadata())
            conn.start_load_kv(None)
            conn.clear_connector_metadata()
            res = conn.get_transfer_results(set())
            longest = max(longest, time.perf_counter() - t)
            steps += 1
            assert (res.failed_recving or set()) <= (res.finished_recving or set())
            failed |= res.failed_recving or set()
            time.sleep(0.01)
        stats = conn.get_kv_connector_stats()
        pipe.send(("done", sorted(failed), steps, longest, time.monotonic() - t0, stats.data if stats else {}))
        conn.shutdown()
        frozen.close()
    except Exception:  # noqa: BLE001
        pipe.send(("error", traceback.format_exc()))


def test_a_frozen_prefill_never_holds_the_decode_step():
    """Issue 20, point 4, through the connector: the handshake with a frozen prefill runs in the background;
    the decode worker keeps stepping (dozens of steps while it runs), and the read ends in failed_recving typed
    HandshakeFailed within the handshake's bound (2 x handshake_timeout_s + 5 s)."""
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    pr = ctx.Process(target=frozen_prefill_decode, args=(b, tempfile.mkdtemp(prefix="kvb-frozen-"), free_port_base(1)),
                     daemon=True)
    pr.start()
    try:
        _, failed, steps, longest, seconds, stats = _recv(a, "done", 90)
        print(f"frozen prefill: read failed after {seconds:.1f} s and {steps} engine steps (longest step "
              f"{longest * 1e3:.1f} ms); stats {stats}")
        assert failed == ["d-1"] and stats.get("reads_failed_HandshakeFailed") == 1, stats
        # the fetch waited out handshake_timeout_s (1 s) in the background while the engine kept stepping, 10 ms
        # apart: a step blocked on the handshake would leave a handful of steps, not dozens
        assert seconds >= 1.0 and steps > 20
        assert seconds < 30
    finally:
        pr.join(timeout=20)
        if pr.is_alive():
            pr.kill()
