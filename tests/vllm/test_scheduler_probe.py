"""vLLM's real v1 Scheduler (prefill P and decode D) driving a trivial pull-model probe connector.

The probe connector is defined here and loaded the way ``--kv-transfer-config`` loads a third-party
connector (``kv_connector_module_path`` = this module). It moves no bytes: the test plays the workers
by feeding ``KVConnectorOutput``s back. What is asserted is the contract a real (kvbridge) connector
relies on: when each hook is called with what, that P holds its blocks until D's worker reports the
read, that D stays parked until its KV arrived, that the params survive a JSON round trip, that a
failed read ends as ``failed_recving`` (recompute or error, per ``kv_load_failure_policy``) with the
scheduler still running, and that both schedulers end empty.

Needs vllm (``scripts/install_vllm.sh 033`` makes ``.venv-vllm``); skipped where it is not importable.
"""
from __future__ import annotations

import json
from typing import Any

import pytest

# (Not importorskip("vllm") alone: without vllm installed, this directory, tests/vllm, is itself importable
# as a namespace package named vllm, since pytest puts tests/ on sys.path.)
pytest.importorskip("vllm.v1.core.sched.scheduler",
                    reason="vllm not installed (bash scripts/install_vllm.sh 033)")

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
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus  # noqa: E402

BLOCK = 16
PROMPT = list(range(3, 43))  # 40 tokens -> 3 blocks of 16


class ProbeMetadata(KVConnectorMetadata):
    def __init__(self, recv: dict[str, dict[str, Any]], send: list[str]):
        self.recv = recv  # D: req id -> {local_block_ids, remote params}
        self.send = send  # P: req ids whose blocks are held for a remote read


class ProbeConnector(KVConnectorBase_V1):
    """Pull-model bookkeeping only (the shape of a real P/D connector's scheduler side)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.calls: list[tuple[str, Any]] = []
        self._pending_recv: dict[str, dict[str, Any]] = {}
        self._pending_send: list[str] = []

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("get_num_new_matched_tokens", (request.request_id, num_computed_tokens)))
        p = request.kv_transfer_params or {}
        if p.get("do_remote_prefill") and not p.get("_received"):
            n = len(request.prompt_token_ids) - num_computed_tokens
            if n > 0:
                return n, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        ids = blocks.get_block_ids()
        self.calls.append(("update_state_after_alloc", (request.request_id, ids, num_external_tokens)))
        p = request.kv_transfer_params or {}
        if p.get("do_remote_prefill") and num_external_tokens > 0:
            self._pending_recv[request.request_id] = {
                "local_block_ids": list(ids[0]),
                "remote_block_ids": list(p["remote_block_ids"]),
                "remote_engine_id": p["remote_engine_id"],
                "remote_request_id": p["remote_request_id"],
            }
            p["_received"] = True  # a later get_num_new_matched_tokens must not ask again

    def build_connector_meta(self, scheduler_output):
        meta = ProbeMetadata(self._pending_recv, self._pending_send)
        self._pending_recv, self._pending_send = {}, []
        self.calls.append(("build_connector_meta", (sorted(meta.recv), list(meta.send))))
        return meta

    def request_finished(self, request, block_ids):
        self.calls.append(("request_finished", (request.request_id, request.status, list(block_ids))))
        p = request.kv_transfer_params or {}
        if not p.get("do_remote_decode") or request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None
        self._pending_send.append(request.request_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "remote_num_tokens": request.num_computed_tokens,
        }

    def update_connector_output(self, connector_output):
        self.calls.append(("update_connector_output", (connector_output.finished_sending,
                                                       connector_output.finished_recving,
                                                       connector_output.failed_recving)))

    # ---- worker side (never called here: the test plays the worker) ----
    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


def _engine(tmp_path, name, role="kv_both", policy="fail", layout="LBNHC"):
    cfg = make_vllm_config(
        tmp_path / name, TINY_LLAMA,
        kv_transfer_config=dict(
            kv_connector="ProbeConnector", kv_connector_module_path=__name__, kv_role=role,
            engine_id=f"engine-{name}", kv_load_failure_policy=policy),
        block_size=BLOCK, kv_cache_layout=layout)
    sched = make_scheduler(cfg, num_blocks=64)
    assert isinstance(sched.connector, ProbeConnector)
    assert sched.connector.role == KVConnectorRole.SCHEDULER
    return sched


def _names(conn):
    return [c[0] for c in conn.calls]


def _prefill(sched, rid="req-P"):
    """P: a 40-token request with max_tokens=1 finishes; returns its kv_transfer_params (JSON round trip)."""
    req = make_request(rid, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True},
                       block_size=BLOCK)
    sched.add_request(req)
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {rid: len(PROMPT)}
    (eco,) = engine_outputs(outs)
    assert eco.finish_reason is not None and eco.kv_transfer_params is not None
    return req, json.loads(json.dumps(eco.kv_transfer_params))


def test_prefill_holds_blocks_until_decode_reports(tmp_path):
    P = _engine(tmp_path, "p")
    req, params = _prefill(P)
    conn = P.connector
    # first hooks, in this order (add_request -> schedule)
    assert _names(conn)[:3] == ["get_num_new_matched_tokens", "update_state_after_alloc",
                                "build_connector_meta"]
    assert conn.calls[0][1] == ("req-P", 0)
    rid, ids, n_ext = conn.calls[1][1]
    assert rid == "req-P" and n_ext == 0 and len(ids[0]) == 3  # called even with 0 external tokens
    (fin,) = [c[1] for c in conn.calls if c[0] == "request_finished"]
    assert fin[1] == RequestStatus.FINISHED_LENGTH_CAPPED and fin[2] == ids[0]
    assert params["remote_block_ids"] == ids[0] and params["remote_num_tokens"] == len(PROMPT)
    # blocks held (delay_free) while the decode reads them; idle steps keep holding them; the next
    # build_connector_meta tells P's workers which requests to serve
    for _ in range(3):
        step(P)
        assert "req-P" in P.requests
        assert block_ref_counts(P, ids[0]) == [1, 1, 1]
    metas = [c[1] for c in conn.calls if c[0] == "build_connector_meta"]
    assert metas[:3] == [([], []), ([], ["req-P"]), ([], [])]
    # P's worker reports the read done -> blocks freed, scheduler empty
    step(P, finished_sending={"req-P"})
    assert ("update_connector_output", ({"req-P"}, None, set())) in conn.calls
    assert block_ref_counts(P, ids[0]) == [0, 0, 0]
    assert_scheduler_empty(P)


def test_decode_parks_until_kv_arrives(tmp_path):
    P, D = _engine(tmp_path, "p"), _engine(tmp_path, "d")
    _, params = _prefill(P)
    req = make_request("req-D", PROMPT, max_tokens=3, kv_transfer_params=params, block_size=BLOCK)
    D.add_request(req)
    so, _ = step(D)
    conn = D.connector
    assert so.num_scheduled_tokens == {}  # nothing runs: waiting for the remote KV
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert ("get_num_new_matched_tokens", ("req-D", 0)) in conn.calls
    (alloc,) = [c[1] for c in conn.calls if c[0] == "update_state_after_alloc"]
    assert alloc[0] == "req-D" and alloc[2] == len(PROMPT) and len(alloc[1][0]) == 3
    local_ids = alloc[1][0]
    # the request is not in the SchedulerOutput: the connector's metadata carries it to the workers
    assert so.scheduled_new_reqs == []
    meta = so.kv_connector_metadata
    assert isinstance(meta, ProbeMetadata)
    assert meta.recv == {"req-D": {"local_block_ids": local_ids,
                                   "remote_block_ids": params["remote_block_ids"],
                                   "remote_engine_id": "engine-p", "remote_request_id": "req-P"}}
    for _ in range(3):  # idle: still parked, blocks held
        so, _ = step(D)
        assert so.num_scheduled_tokens == {} and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert block_ref_counts(D, local_ids) == [1, 1, 1]
    # D's worker reports the read (on an otherwise empty step) -> runs next step on the same blocks,
    # recomputing only the last prompt token
    step(D, finished_recving={"req-D"})
    so, outs = step(D)
    assert so.num_scheduled_tokens == {"req-D": 1}
    assert so.scheduled_new_reqs[0].block_ids[0] == local_ids
    assert so.scheduled_new_reqs[0].num_computed_tokens == len(PROMPT) - 1
    tokens = []
    for _ in range(10):
        tokens += [t for o in engine_outputs(outs) for t in o.new_token_ids]
        if "req-D" not in D.requests:
            break
        so, outs = step(D)
    assert len(tokens) == 3
    fin = [c[1] for c in conn.calls if c[0] == "request_finished"]
    assert fin == [("req-D", RequestStatus.FINISHED_LENGTH_CAPPED, local_ids)]
    assert_scheduler_empty(D)
    step(P, finished_sending={"req-P"})
    assert_scheduler_empty(P)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_read_is_recomputed_or_errors(tmp_path, policy):
    P, D = _engine(tmp_path, "p"), _engine(tmp_path, "d", policy=policy)
    _, params = _prefill(P)
    req = make_request("req-D", PROMPT, max_tokens=2, kv_transfer_params=params, block_size=BLOCK)
    D.add_request(req)
    step(D)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # a failed receive is reported in failed_recving AND finished_recving (it must leave the wait state)
    so, outs = step(D, finished_recving={"req-D"}, failed_recving={"req-D"})
    if policy == "fail":
        (eco,) = engine_outputs(outs)
        assert eco.request_id == "req-D" and eco.finish_reason is not None
        assert str(eco.finish_reason).lower().endswith("error")
    else:
        so, outs = step(D)  # recomputed from scratch: the whole prompt is scheduled locally
        assert so.num_scheduled_tokens == {"req-D": len(PROMPT)}
        for _ in range(5):
            if "req-D" not in D.requests:
                break
            step(D)
    for _ in range(2):
        step(D)
    assert_scheduler_empty(D)
    step(P, finished_sending={"req-P"})
    assert_scheduler_empty(P)


def test_connector_loaded_by_module_path_gets_engine_config(tmp_path):
    D = _engine(tmp_path, "d", layout="LBHNC")
    conn = D.connector
    cfg = conn._vllm_config
    assert cfg.kv_transfer_config.kv_connector_module_path == __name__
    assert cfg.cache_config.block_size == BLOCK
    assert cfg.cache_config.get_resolved_kv_cache_layout().name == "LBHNC"
    assert cfg.parallel_config.tensor_parallel_size == 1
    assert cfg.parallel_config.pipeline_parallel_size == 1
    hf = cfg.model_config.hf_config
    assert (hf.num_key_value_heads, hf.head_dim, hf.num_hidden_layers) == (2, 64, 2)
    (group,) = conn._kv_cache_config.kv_cache_groups
    assert group.kv_cache_spec.num_kv_heads == 2 and group.kv_cache_spec.head_size == 64
    assert len(group.layer_names) == 2
    # no GPU platform: the hybrid allocator is off (and a non-SupportsHMA connector turns it off anyway)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager
