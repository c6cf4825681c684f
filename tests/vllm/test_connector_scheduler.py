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

from sched_utils import (  # noqa: E402
    TINY_LLAMA,
    assert_scheduler_empty,
    block_ref_counts,
    engine_outputs,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
    step,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvbridge.integrations.vllm import (  # noqa: E402
    KVBridgeConnector,
    KVBridgeConnectorMetadata,
    layer_index,
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


# ---------------------------------------------------------------------- attention + Mamba-2 hybrid
NEMOTRON_H = {  # Nemotron-H pattern M*M*: Mamba-2 layers 0 and 2 (8 heads x 32, 2 groups, state 16), attention 1, 3
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 4, "hybrid_override_pattern": "M*M*",
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "attention_head_dim": 64,
    "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
    "mamba_hidden_act": "silu", "use_conv_bias": True, "use_bias": False, "chunk_size": 128, "vocab_size": 512,
    "max_position_embeddings": 4096, "layer_norm_epsilon": 1e-5, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "mlp_hidden_act": "relu2"}


def _hybrid_engine(tmp_path, name, prefix_caching):
    """A scheduler for the Nemotron-H-like hybrid under the hybrid allocator: one attention group, one
    MambaSpec group (its state shapes by vLLM's own calculator), block sizes as vLLM sets them on a GPU (the
    attention block raised until its page holds a Mamba page, the Mamba page padded to it; Mamba block =
    max_model_len in mode "none", the attention block in mode "align" (prefix caching on))."""
    import math

    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    cfg = make_vllm_config(
        tmp_path / name, NEMOTRON_H, block_size=BLOCK, max_model_len=512, enable_prefix_caching=prefix_caching,
        kv_transfer_config=dict(kv_connector="KVBridgeConnector", kv_connector_module_path=MODULE,
                                kv_role="kv_both", engine_id=f"engine-{name}"))
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False  # as on a GPU with a SupportsHMA connector
    cc = cfg.cache_config
    shapes = MambaStateShapeCalculator.mamba2_state_shape(tp_world_size=1, intermediate_size=256, n_groups=2,
                                                         num_heads=8, head_dim=32, state_size=16, conv_kernel=4)
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(cfg.model_config.dtype, cc.mamba_cache_dtype,
                                                          cc.mamba_ssm_cache_dtype)
    mamba_page = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))
    per_token = 2 * 2 * 64 * torch.bfloat16.itemsize
    cc.block_size = BLOCK * -(-mamba_page // (BLOCK * per_token))
    cc.mamba_block_size = cc.block_size if cc.mamba_cache_mode == "align" else 512
    attn = FullAttentionSpec(block_size=cc.block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=cc.mamba_block_size, shapes=shapes, dtypes=dtypes,
                      page_size_padded=cc.block_size * per_token, mamba_type=MambaAttentionBackendEnum.MAMBA2,
                      mamba_cache_mode=cc.mamba_cache_mode,
                      num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)  # as MambaMixer2's
    kvc = make_kv_cache_config(cfg, 64, [(["model.layers.1.mixer.attn", "model.layers.3.mixer.attn"], attn),
                                         (["model.layers.0.mixer", "model.layers.2.mixer"], mamba)])
    sched = make_scheduler(cfg, kv_cache_config=kvc, block_sizes=resolve_kv_cache_block_sizes(kvc, cfg))
    return sched, cc.block_size


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["mamba-mode-none", "mamba-mode-align"])
def test_mamba_hybrid_prefill_stops_one_token_short_and_state_slots_travel(tmp_path, prefix_caching):
    """vLLM's decode recomputes the last prompt token after a load. For attention that rewrites equal K/V,
    but a Mamba state would take the token twice, so the prefill computes all but the last prompt token
    (as vLLM's NixlConnector) and the decode loads that state and computes the last token itself. Each
    Mamba group's block list (mode "none": the state slot; "align": positional, null blocks first) is cut
    to the one slot holding the request's state, on both sides."""
    P, bs = _hybrid_engine(tmp_path, "p", prefix_caching)
    D, _ = _hybrid_engine(tmp_path, "d", prefix_caching)
    assert P.connector.scheduler.backoff == 1
    prompt = list(range(3, 3 + 2 * bs + 5))  # 2 blocks and a bit
    n = len(prompt)
    req = make_request("req-P", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}, block_size=bs)
    P.add_request(req)
    scheduled, ecos = 0, []
    while not ecos:  # mode "align" may split the prefill at a block boundary
        so, outs = step(P)
        scheduled += so.num_scheduled_tokens.get("req-P", 0)
        ecos = [e for e in engine_outputs(outs) if e.finish_reason is not None]
        p_ids = P.kv_cache_manager.get_block_ids("req-P")
    assert scheduled == n - 1  # the last prompt token is left to the decode
    (eco,) = ecos
    params = json.loads(json.dumps(eco.kv_transfer_params))
    assert params["remote_num_tokens"] == n - 1
    attn_ids, mamba_ids = params["remote_block_ids"]
    assert attn_ids == list(p_ids[0]) and len(attn_ids) == -(-(n - 1) // bs)
    # the state slot: the request's last Mamba block (mode "align": after null blocks)
    assert len(mamba_ids) == 1 and mamba_ids[0] != 0 and mamba_ids == [p_ids[1][-1]]
    if prefix_caching:
        assert p_ids[1][0] == 0 and len(p_ids[1]) == len(attn_ids)
    so, _ = step(P)
    assert so.kv_connector_metadata.send == {"req-P": ([attn_ids, mamba_ids], params["remote_attempt"])}
    # decode: loads n - 1 tokens (attention) and the state, then computes the last prompt token
    dreq, so = _decode_add(D, params, prompt=prompt)
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    r = so.kv_connector_metadata.recv["req-D"]
    d_ids = D.kv_cache_manager.get_block_ids("req-D")
    assert r.local_block_ids == [list(d_ids[0]), [d_ids[1][-1]]] and r.local_first_block == [0, 0]
    assert d_ids[1][-1] != 0
    step(D, finished_recving={"req-D"})
    so, _ = step(D)
    assert so.num_scheduled_tokens == {"req-D": 1}
    assert so.scheduled_new_reqs[0].num_computed_tokens == n - 1
    _run_to_end(D, "req-D")
    step(D)
    assert_scheduler_empty(D)
    step(P, finished_sending={"req-P"})
    assert_scheduler_empty(P)


def test_mamba_hybrid_decode_refuses_a_state_after_the_whole_prompt(tmp_path):
    """A prefill that computed every prompt token (not stopping one short) holds a state the decode's
    recompute of the last token would corrupt: the decode computes the prompt itself instead."""
    D, bs = _hybrid_engine(tmp_path, "d", False)
    prompt = list(range(3, 3 + bs + 7))
    params = {"do_remote_prefill": True, "remote_engine_id": "engine-p", "remote_host": "127.0.0.1",
              "remote_port": 5600, "remote_block_ids": [[1, 2], [3]], "remote_request_id": "req-P",
              "remote_num_tokens": len(prompt), "remote_tp_size": 1, "remote_pp_size": 1}
    req, so = _decode_add(D, params, prompt=prompt, max_tokens=1)
    assert so.num_scheduled_tokens == {"req-D": len(prompt)} and so.kv_connector_metadata.recv == {}
    # the prefill's blocks are not needed: released at once (not held for the lease)
    assert list(so.kv_connector_metadata.release) == ["req-D"]
    _run_to_end(D, "req-D")
    step(D)
    assert_scheduler_empty(D)


def test_n_gt_1_siblings_share_a_lease_only_with_the_same_prompt(tmp_path):
    """vLLM ``n > 1``: children ``"{i}_{parent}"`` of one prompt share the first finished child's lease (its
    blocks held; each later sibling's blocks freed in its own step, its params naming that lease, and the lease
    told to wait for one more read). Not linked: a request whose id only looks like a sibling's but whose
    prompt differs, a second finish of the same index, an id that is no child's, and a sibling after the
    lease was freed (it gets a lease of its own)."""
    P = _engine(tmp_path, "P")

    def _finish(sched, rid, prompt=PROMPT):  # (a sibling may hit the prefix cache on the lease's blocks)
        sched.add_request(make_request(rid, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True},
                                       block_size=BLOCK))
        _, outs = step(sched)
        (eco,) = engine_outputs(outs)
        assert eco.finish_reason is not None and eco.kv_transfer_params is not None
        return None, json.loads(json.dumps(eco.kv_transfer_params))

    a0, pa0 = _finish(P, "0_par-1")
    so, _ = step(P)
    assert so.kv_connector_metadata.send.keys() == {"0_par-1"} and not so.kv_connector_metadata.expect
    a1, pa1 = _finish(P, "1_par-1")
    assert "1_par-1" not in P.requests and "0_par-1" in P.requests  # the sibling's blocks went back at once
    assert pa1["remote_request_id"] == "0_par-1" and pa1["remote_attempt"] == pa0["remote_attempt"]
    assert pa1["remote_block_ids"] == pa0["remote_block_ids"]
    so, _ = step(P)
    assert not so.kv_connector_metadata.send
    assert so.kv_connector_metadata.expect == {"0_par-1": (pa0["remote_attempt"], 2)}
    # a second finish of an index already linked (the child id submitted again): not linked again (the
    # lease would wait for a read that never comes), a lease of its own
    _, pa1b = _finish(P, "1_par-1")
    assert pa1b["remote_request_id"] == "1_par-1" and "1_par-1" in P.requests
    assert pa1b["remote_attempt"] != pa0["remote_attempt"]
    so, _ = step(P)
    assert set(so.kv_connector_metadata.send) == {"1_par-1"} and not so.kv_connector_metadata.expect
    # same parent id, another prompt (ids are only a hint): a lease of its own
    _, pb = _finish(P, "2_par-1", prompt=list(range(100, 140)))
    assert pb["remote_request_id"] == "2_par-1" and "2_par-1" in P.requests
    so, _ = step(P)
    assert set(so.kv_connector_metadata.send) == {"2_par-1"} and not so.kv_connector_metadata.expect
    # not a child id: a lease of its own
    _, pc = _finish(P, "par-1")
    assert pc["remote_request_id"] == "par-1" and "par-1" in P.requests
    # the shared lease ends (the worker reports it): a later sibling holds its own blocks
    step(P, finished_sending={"0_par-1", "1_par-1", "2_par-1", "par-1"})
    _, p3 = _finish(P, "3_par-1")
    assert p3["remote_request_id"] == "3_par-1" and "3_par-1" in P.requests
    step(P, finished_sending={"3_par-1"})
    step(P)
    assert_scheduler_empty(P)
    assert not P.connector.scheduler._siblings
