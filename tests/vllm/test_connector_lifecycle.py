"""Request lifecycle on the decode (issue 20's connector bullets): a decode request that finishes unread,
with any finished status, tells the prefill at once; requests queued on the decode heartbeat their
leases; two decode children of one prefill request (vLLM ``n > 1``) are not refused by the connector;
failures are counted once per failed request. vLLM 0.33's real Scheduler; the worker side over NIXL on
vLLM's own tensors."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from sched_utils import (  # noqa: E402
    TINY_LLAMA,
    assert_scheduler_empty,
    engine_outputs,
    make_request,
    make_scheduler,
    make_vllm_config,
    step,
)
from vllm.v1.request import RequestStatus  # noqa: E402

BLOCK = 16
PROMPT = list(range(3, 43))
FINISHED = [s for s in RequestStatus if RequestStatus.is_finished(s)]


def _engine(tmp_path, name, num_blocks=64):
    cfg = make_vllm_config(tmp_path / name, TINY_LLAMA, block_size=BLOCK, kv_transfer_config=dict(
        kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.integrations.vllm", kv_role="kv_both",
        engine_id=f"engine-{name}", kv_connector_extra_config={"lease_s": 30}))
    return make_scheduler(cfg, num_blocks=num_blocks)


def _params(tmp_path):
    P = _engine(tmp_path, "p")
    req = make_request("req-P", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True}, block_size=BLOCK)
    P.add_request(req)
    _, outs = step(P)
    (eco,) = engine_outputs(outs)
    return json.loads(json.dumps(eco.kv_transfer_params))


@pytest.mark.parametrize("status", FINISHED, ids=[s.name for s in FINISHED])
def test_a_decode_request_finished_before_its_read_releases_the_prefill_at_once(tmp_path, status):
    """Whatever the finished status (aborted, rejected/ignored, error, stopped, ...), a decode request that
    ends before its read is set up hands the prefill's params to the workers as a release, once."""
    params = _params(tmp_path)
    D = _engine(tmp_path, "d")
    req = make_request("req-D", PROMPT, max_tokens=2, kv_transfer_params=params, block_size=BLOCK)
    D.add_request(req)
    D.finish_requests("req-D", status)
    so, _ = step(D)
    assert so.kv_connector_metadata.recv == {}
    rel = so.kv_connector_metadata.release
    assert list(rel) == ["req-D"]
    assert rel["req-D"]["remote_request_id"] == "req-P" and rel["req-D"]["remote_attempt"] == params["remote_attempt"]
    so, _ = step(D)
    assert so.kv_connector_metadata.release == {}  # once
    assert_scheduler_empty(D)


def test_a_read_request_is_not_released(tmp_path):
    """A request whose read is set up is not released when it finishes (its read's Done frees the lease)."""
    params = _params(tmp_path)
    D = _engine(tmp_path, "d")
    req = make_request("req-D", PROMPT, max_tokens=1, kv_transfer_params=params, block_size=BLOCK)
    D.add_request(req)
    so, _ = step(D)
    assert list(so.kv_connector_metadata.recv) == ["req-D"] and so.kv_connector_metadata.release == {}
    D.finish_requests("req-D", RequestStatus.FINISHED_ABORTED)  # aborted mid-read
    so, _ = step(D, finished_recving={"req-D"})
    assert so.kv_connector_metadata.release == {}
    step(D)
    assert_scheduler_empty(D)


def test_requests_queued_on_the_decode_heartbeat_their_leases(tmp_path):
    """A request the decode cannot allocate yet (KV pool full) is named in the workers' heartbeat, at most
    every lease_s / 6; once allocated it is read, not heartbeated."""
    params = _params(tmp_path)
    D = _engine(tmp_path, "d", num_blocks=5)
    hog = make_request("hog", list(range(100, 160)), max_tokens=50, block_size=BLOCK)  # holds 4 of the 5 blocks
    D.add_request(hog)
    step(D)
    req = make_request("req-D", PROMPT, max_tokens=2, kv_transfer_params=params, block_size=BLOCK)
    D.add_request(req)
    so, _ = step(D)
    assert req.status == RequestStatus.WAITING and so.kv_connector_metadata.recv == {}
    assert list(so.kv_connector_metadata.heartbeat) == ["req-D"]
    assert so.kv_connector_metadata.heartbeat["req-D"]["remote_request_id"] == "req-P"
    so, _ = step(D)
    assert so.kv_connector_metadata.heartbeat == {}  # not before lease_s / 6 (5 s)
    D.finish_requests("hog", RequestStatus.FINISHED_ABORTED)
    so, _ = step(D)
    assert list(so.kv_connector_metadata.recv) == ["req-D"] and so.kv_connector_metadata.heartbeat == {}


def test_the_first_sight_of_a_decode_request_hints_its_prefill_engine_to_the_workers(tmp_path):
    """Handshakes never run on the step that reads: the step in which the scheduler first sees a decode request
    names its prefill engine (id, side-channel host/port, TP/PP) in the metadata's ``connect``, so the workers
    start the background handshake then; later steps do not repeat it; a request queued behind a full KV pool
    is hinted too (its read starts later, the handshake now)."""
    params = _params(tmp_path)
    D = _engine(tmp_path, "d", num_blocks=5)
    hog = make_request("hog", list(range(100, 160)), max_tokens=50, block_size=BLOCK)  # holds 4 of the 5 blocks
    D.add_request(hog)
    so, _ = step(D)
    assert so.kv_connector_metadata.connect == {}
    req = make_request("req-D", PROMPT, max_tokens=2, kv_transfer_params=params, block_size=BLOCK)
    D.add_request(req)
    so, _ = step(D)
    assert req.status == RequestStatus.WAITING and so.kv_connector_metadata.recv == {}  # queued: not read yet
    hint = so.kv_connector_metadata.connect
    assert list(hint) == [params["remote_engine_id"]]
    assert {k: hint[params["remote_engine_id"]][k] for k in ("remote_host", "remote_port", "remote_tp_size",
                                                             "remote_pp_size")} == \
        {k: params[k] for k in ("remote_host", "remote_port", "remote_tp_size", "remote_pp_size")}
    so, _ = step(D)
    assert so.kv_connector_metadata.connect == {}  # once
    D.finish_requests(["hog", "req-D"], RequestStatus.FINISHED_ABORTED)
    step(D)
    assert_scheduler_empty(D)


@pytest.mark.parametrize("status", [s for s in FINISHED if s not in (RequestStatus.FINISHED_STOPPED,
                                                                      RequestStatus.FINISHED_LENGTH_CAPPED)],
                         ids=lambda s: s.name)
def test_a_prefill_request_that_ends_abnormally_frees_its_blocks_at_once(tmp_path, status):
    """Prefill side: any finish other than a normal stop (aborted, ignored, error, repetition) hands no
    params out and holds nothing: the blocks go back to vLLM at once, no lease is registered."""
    P = _engine(tmp_path, "p")
    req = make_request("ab", PROMPT, max_tokens=4, kv_transfer_params={"do_remote_decode": True}, block_size=BLOCK)
    P.add_request(req)
    step(P)
    P.finish_requests("ab", status)
    so, _ = step(P)
    assert P.connector.held_requests() == [] and so.kv_connector_metadata.send == {}
    assert_scheduler_empty(P)


# ---------------------------------------------------------------------- worker side, over NIXL
def test_an_unread_request_released_frees_the_prefill_lease_without_expiry():
    """req-2 finishes on the decode before its read: the decode worker tells the prefill, which frees the
    blocks (finished_sending) by that message, not by lease expiry (lease_s 20 s)."""
    pytest.importorskip("nixl._api")
    pytest.importorskip("vllm.v1.core.kv_cache_planning")
    from worker_harness import Side, llama, run_pair

    r = run_pair(llama(2), Side(2, 1, 16), Side(1, 1, 16), requests=((60, 0), (33, 0), (50, 0)), unread=("req-2",))
    assert r.failed == [] and r.done == ["dec-req-1", "dec-req-3"] and r.bad == 0
    assert r.sent == ["req-1", "req-2", "req-3"]
    assert r.stats.get("prefill_expired_requests", 0) == 0 and r.stats["reads_released"] == 1


def test_two_decode_children_of_one_prefill_request_are_each_read_into_their_own_blocks():
    """vLLM ``n = 2``: two decode requests carry the same prefill params. Each child is its own reader of the
    lease (``ReadRequest.read_id`` = the decode's request id, pinned separately): both read byte-exact into
    their own blocks, started in the same step, and the prefill frees the blocks once, after both."""
    pytest.importorskip("nixl._api")
    pytest.importorskip("vllm.v1.core.kv_cache_planning")
    from worker_harness import Side, llama, run_pair

    r = run_pair(llama(2), Side(1, 1, 16), Side(1, 1, 16), requests=((60, 0),), children=2)
    print(f"n=2: done {r.done}, failed {r.failed}, stats {r.stats}")
    assert r.done == ["dec-req-1", "dec-req-1-c1"] and r.failed == []
    assert r.bad == 0 and r.untouched_bad == 0 and r.checked > 0
    assert r.sent == ["req-1"] and r.stats.get("prefill_expired_requests", 0) == 0
    assert not any(k.startswith("reads_failed_") for k in r.stats), r.stats
    assert r.stats["reads_done"] == 2
