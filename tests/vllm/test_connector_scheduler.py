"""kvbridge's vLLM connector (scheduler side) under vLLM's real v1 Scheduler, prefill P and decode D.

The connector is loaded the way ``--kv-transfer-config`` loads it
(``kv_connector_module_path="kvbridge.integrations.vllm"``). The workers are played by the test:
it feeds back ``KVConnectorOutput``s (finished_sending / finished_recving / failed_recving). The worker
side of the connector (kvbridge endpoints over NIXL) is not exercised here.

Needs vllm (``scripts/install_vllm.sh 033``); skipped where it is not importable.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler",
                    reason="vllm not installed (bash scripts/install_vllm.sh 033)")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvbridge.integrations.vllm import (  # noqa: E402
    KVBridgeConnector,
    KVBridgeConnectorMetadata,
    layer_index,
)
from sched_utils import (  # noqa: E402
    TINY_LLAMA,
    assert_scheduler_empty,
    block_ref_counts,
    engine_outputs,
    make_request,
    make_scheduler,
    make_vllm_config,
    step,
)

BLOCK = 16
PROMPT = list(range(3, 43))  # 40 tokens -> 3 blocks of 16
MODULE = "kvbridge.integrations.vllm"


def _engine(tmp_path, name, policy="fail", extra=None):
    cfg = make_vllm_config(
        tmp_path / name, TINY_LLAMA,
        kv_transfer_config=dict(
            kv_connector="KVBridgeConnector", kv_connector_module_path=MODULE, kv_role="kv_both",
            engine_id=f"engine-{name}", kv_load_failure_policy=policy,
            kv_connector_extra_config=extra or {}),
        block_size=BLOCK)
    sched = make_scheduler(cfg, num_blocks=64)
    assert isinstance(sched.connector, KVBridgeConnector)
    assert sched.connector.role == KVConnectorRole.SCHEDULER
    return sched


def _prefill(sched, rid="req-P", prompt=PROMPT):
    req = make_request(rid, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True},
                       block_size=BLOCK)
    sched.add_request(req)
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {rid: len(prompt)}
    (eco,) = engine_outputs(outs)
    assert eco.finish_reason is not None and eco.kv_transfer_params is not None
    return req, json.loads(json.dumps(eco.kv_transfer_params))


def _decode_add(D, params, rid="req-D", prompt=PROMPT, max_tokens=3):
    req = make_request(rid, prompt, max_tokens=max_tokens, kv_transfer_params=params, block_size=BLOCK)
    D.add_request(req)
    so, _ = step(D)
    return req, so


def _run_to_end(sched, rid, n=10):
    tokens = []
    for _ in range(n):
        if rid not in sched.requests:
            break
        _, outs = step(sched)
        tokens += [t for o in engine_outputs(outs) for t in o.new_token_ids]
    return tokens


def test_layer_index():
    assert layer_index("model.layers.3.self_attn.attn") == 3
    assert layer_index("language_model.model.layers.17.attn") == 17
    with pytest.raises(ValueError):
        layer_index("lm_head")


def test_params_and_prefill_holds_blocks_until_finished_sending(tmp_path):
    P = _engine(tmp_path, "p", extra={"side_channel_host": "10.1.2.3", "side_channel_port": 7000})
    req, params = _prefill(P)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "engine-p"
    assert (params["remote_host"], params["remote_port"]) == ("10.1.2.3", 7000)
    assert params["remote_request_id"] == "req-P"
    assert params["remote_num_tokens"] == len(PROMPT)
    assert params["remote_tp_size"] == 1 and params["remote_pp_size"] == 1
    assert isinstance(params["remote_layout"], str) and params["remote_layout"]
    (ids,) = params["remote_block_ids"]  # one group
    assert len(ids) == 3
    assert P.connector.held_requests() == ["req-P"]
    # the next step's metadata tells P's workers which blocks to serve
    so, _ = step(P)
    assert isinstance(so.kv_connector_metadata, KVBridgeConnectorMetadata)
    assert so.kv_connector_metadata.send == {"req-P": ([ids], params["remote_attempt"])}
    assert isinstance(params["remote_attempt"], int) and 0 < params["remote_attempt"] < 2 ** 53
    for _ in range(3):
        step(P)
        assert "req-P" in P.requests and block_ref_counts(P, ids) == [1, 1, 1]
    step(P, finished_sending={"req-P"})
    assert block_ref_counts(P, ids) == [0, 0, 0]
    assert P.connector.held_requests() == []
    assert_scheduler_empty(P)


def test_defaults_without_extra_config(tmp_path):
    P = _engine(tmp_path, "p")
    _, params = _prefill(P)
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 5600)
    step(P, finished_sending={"req-P"})
    assert_scheduler_empty(P)


def test_plain_request_is_not_held(tmp_path):
    P = _engine(tmp_path, "p")
    req = make_request("plain", PROMPT, max_tokens=1, block_size=BLOCK)
    P.add_request(req)
    _, outs = step(P)
    (eco,) = engine_outputs(outs)
    assert eco.finish_reason is not None and eco.kv_transfer_params is None
    assert_scheduler_empty(P)


def test_decode_parks_until_finished_recving(tmp_path):
    P, D = _engine(tmp_path, "p"), _engine(tmp_path, "d")
    _, params = _prefill(P)
    req, so = _decode_add(D, params)
    assert so.num_scheduled_tokens == {}
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = so.kv_connector_metadata
    assert isinstance(meta, KVBridgeConnectorMetadata) and list(meta.recv) == ["req-D"]
    r = meta.recv["req-D"]
    (local,) = r.local_block_ids
    assert len(local) == 3 and r.local_first_block == [0]
    assert r.remote["remote_block_ids"] == params["remote_block_ids"]
    assert r.remote["remote_engine_id"] == "engine-p" and r.remote["remote_request_id"] == "req-P"
    json.dumps(r.remote)  # what reaches the workers is still plain JSON
    for _ in range(3):
        so, _ = step(D)
        assert so.num_scheduled_tokens == {} and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert so.kv_connector_metadata.recv == {}  # one read per request
        assert block_ref_counts(D, local) == [1, 1, 1]
    step(D, finished_recving={"req-D"})
    so, outs = step(D)
    assert so.num_scheduled_tokens == {"req-D": 1}
    assert so.scheduled_new_reqs[0].block_ids[0] == local
    assert so.scheduled_new_reqs[0].num_computed_tokens == len(PROMPT) - 1
    tokens = [t for o in engine_outputs(outs) for t in o.new_token_ids] + _run_to_end(D, "req-D")
    assert len(tokens) == 3
    assert_scheduler_empty(D)
    step(P, finished_sending={"req-P"})
    assert_scheduler_empty(P)


def test_prefix_hit_reads_only_the_tail(tmp_path):
    P, D = _engine(tmp_path, "p"), _engine(tmp_path, "d")
    # D computed the first 2 blocks of the prompt locally (an earlier request sharing the prefix)
    warm = make_request("warm", PROMPT[:32] + [500, 501], max_tokens=1, block_size=BLOCK)
    D.add_request(warm)
    _run_to_end(D, "warm")
    step(D)
    assert_scheduler_empty(D)
    _, params = _prefill(P)
    req, so = _decode_add(D, params)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    r = so.kv_connector_metadata.recv["req-D"]
    assert r.local_first_block == [2]
    (tail,) = r.local_block_ids
    assert len(tail) == 1
    all_ids = D.kv_cache_manager.get_block_ids("req-D")[0]
    assert len(all_ids) == 3 and all_ids[2:] == tail
    step(D, finished_recving={"req-D"})
    so, _ = step(D)
    assert so.num_scheduled_tokens == {"req-D": 1}
    _run_to_end(D, "req-D")
    assert_scheduler_empty(D)
    step(P, finished_sending={"req-P"})
    assert_scheduler_empty(P)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_read_reports_failed_recving(tmp_path, policy):
    P, D = _engine(tmp_path, "p"), _engine(tmp_path, "d", policy=policy)
    _, params = _prefill(P)
    req, _ = _decode_add(D, params, max_tokens=2)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    so, outs = step(D, finished_recving={"req-D"}, failed_recving={"req-D"})
    if policy == "fail":
        (eco,) = engine_outputs(outs)
        assert eco.request_id == "req-D" and str(eco.finish_reason).lower().endswith("error")
    else:
        so, _ = step(D)
        assert so.num_scheduled_tokens == {"req-D": len(PROMPT)}  # recomputed locally
        assert so.kv_connector_metadata.recv == {}  # no second read
        _run_to_end(D, "req-D")
    # the scheduler keeps running: a new plain request goes through
    other = make_request("other", PROMPT[:20], max_tokens=1, block_size=BLOCK)
    D.add_request(other)
    _run_to_end(D, "other")
    step(D)
    assert_scheduler_empty(D)
    # prefill: the lease expiring on P's worker is reported as finished_sending too
    step(P, finished_sending={"req-P"})
    assert_scheduler_empty(P)


def test_bad_params_are_not_read(tmp_path):
    D = _engine(tmp_path, "d")
    # do_remote_prefill without remote block ids: nothing to pull, computed locally
    req = make_request("bad", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_prefill": True},
                       block_size=BLOCK)
    D.add_request(req)
    so, _ = step(D)
    assert so.num_scheduled_tokens == {"bad": len(PROMPT)}
    _run_to_end(D, "bad")
    step(D)
    assert_scheduler_empty(D)


def test_aborted_prefill_frees_at_once(tmp_path):
    P = _engine(tmp_path, "p")
    req = make_request("ab", PROMPT, max_tokens=4, kv_transfer_params={"do_remote_decode": True},
                       block_size=BLOCK)
    P.add_request(req)
    step(P)
    P.finish_requests("ab", RequestStatus.FINISHED_ABORTED)
    step(P)
    assert P.connector.held_requests() == []
    assert_scheduler_empty(P)


def test_request_finished_all_groups_two_groups(tmp_path):
    """Under the hybrid allocator (not reachable on this platform) every group's ids travel."""
    P = _engine(tmp_path, "p")

    class _Req:
        request_id = "hma"
        status = RequestStatus.FINISHED_LENGTH_CAPPED
        num_computed_tokens = 40
        kv_transfer_params = {"do_remote_decode": True}

    delay, params = P.connector.request_finished_all_groups(_Req(), ([1, 2, 3], [7]))
    assert delay is True and params["remote_block_ids"] == [[1, 2, 3], [7]]
    assert json.loads(json.dumps(params)) == params
    _Req.status = RequestStatus.FINISHED_ABORTED
    assert P.connector.request_finished_all_groups(_Req(), ([1], [2])) == (False, None)
