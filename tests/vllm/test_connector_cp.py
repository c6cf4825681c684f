"""The connector with context parallelism (issue 21 point 4): CP sizes, ranks and interleave from vLLM's
config, cross-checked against the KV-cache specs and the registered tensors; byte-exact pairs on vLLM 0.33's
own KV-cache tensors (its planner and allocator, DCP-sharded specs), one process per rank over NIXL, checked
through vLLM's slot mapping (the oracle's copy of its kernel), never kvbridge's layout code; and the
scheduler's block counting under DCP on vLLM's real Scheduler.

What the CPU build cannot run: attention with DCP / PCP (vLLM's CPU backend has no context-parallel
attention), so no whole engine runs here with CP; the rank processes hold what a GPU worker's
``register_kv_caches`` gets."""
from __future__ import annotations

import tempfile

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("vllm.v1.core.kv_cache_planning")

from worker_harness import Side, deepseek_like, llama  # noqa: E402

from kvbridge.integrations.vllm import ConnectorConfig  # noqa: E402
from kvbridge.integrations.vllm_cp import VLLMContextParallelError  # noqa: E402


def _pair(model, P, D, **kw):
    pytest.importorskip("nixl._api")
    from worker_harness import run_pair
    r = run_pair(model, P, D, **kw)
    assert r.failed == [] and r.sent == sorted(f"req-{i + 1}" for i in range(len(r.sent))) and r.sent
    assert r.done == [f"dec-{x}" for x in r.sent]
    assert r.checked > 0 and r.bad == 0 and r.untouched_bad == 0, r
    return r


def test_mla_prefill_tp2_to_decode_tp2_dcp2_byte_exact():
    """DeepSeek-style MLA: the prefill's TP ranks each hold every token's latent; the decode's two DCP ranks
    each keep every other token (interleave 1) in the same block ids, one block id spanning 32 tokens; a
    prefix hit of one scheduler block (32 tokens) reads only the tail."""
    _pair(deepseek_like(2), Side(2, 1, 16), Side(2, 1, 16, dcp=2, cp_interleave=1),
          requests=((130, 0), (37, 1), (300, 2)))


def test_mla_prefill_tp1_to_decode_tp2_dcp2_interleave_block_size():
    """vLLM's NixlConnector default for P/D (interleave = block size): a TP1 prefill with block size 32 feeds
    a TP2 x DCP2 decode with block size 16 (chunks of 16 tokens dealt round robin)."""
    _pair(deepseek_like(2), Side(1, 1, 32), Side(2, 1, 16, dcp=2, cp_interleave=16), requests=((130, 0), (77, 1)))


def test_gqa_prefill_tp1_to_decode_tp2_dcp2_byte_exact():
    """GQA with DCP (vLLM: tp > KV heads, dcp <= tp // heads): 1 KV head replicated on the decode's TP2 ranks,
    which are its 2 DCP ranks (interleave 8); the prefill has block size 32, the decode 16."""
    _pair(llama(1), Side(1, 1, 32), Side(2, 1, 16, dcp=2, cp_interleave=8), requests=((130, 0), (41, 1), (200, 3)))


# ---------------------------------------------------------------------- config and ports
def _cfg(model, role="kv_both", **parallel):
    from sched_utils import make_vllm_config
    cfg = make_vllm_config(tempfile.mkdtemp(), model.hf, block_size=16, kv_transfer_config=dict(
        kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.integrations.vllm", kv_role=role,
        engine_id="e", kv_connector_extra_config={"side_channel_port": 7000}))
    for k, v in parallel.items():
        setattr(cfg.parallel_config, k, v)
    return cfg


def test_connector_config_reads_cp_sizes_and_interleave():
    c = ConnectorConfig.from_vllm(_cfg(deepseek_like(2), tensor_parallel_size=4, decode_context_parallel_size=2,
                                       cp_kv_cache_interleave_size=16), environ={})
    assert (c.tp, c.pcp, c.dcp, c.cp_interleave) == (4, 1, 2, 16)
    c = ConnectorConfig.from_vllm(_cfg(deepseek_like(2), tensor_parallel_size=2, prefill_context_parallel_size=2,
                                       data_parallel_size=2, data_parallel_index=1), environ={})
    assert (c.tp, c.pcp, c.dcp, c.cp_interleave) == (2, 2, 1, 1)
    assert c.port == 7000 + 1 * 2 * 2  # DP rank 1's range starts after DP rank 0's tp * pcp workers
    assert c.endpoint((0, 3)) == ("127.0.0.1", 7000 + 4 + 3)


def test_cp_sizes_vllm_cannot_form_are_a_typed_error_naming_the_setting():
    for parallel in (dict(tensor_parallel_size=4, decode_context_parallel_size=3),
                     dict(tensor_parallel_size=2, prefill_context_parallel_size=2, decode_context_parallel_size=3)):
        with pytest.raises(VLLMContextParallelError, match="decode_context_parallel_size=3"):
            ConnectorConfig.from_vllm(_cfg(deepseek_like(2), **parallel), environ={})


def test_dcp_with_the_cpu_backend_form_is_refused_by_name():
    """vLLM's CPU attention backend form moves whole blocks; a DCP rank holds only its share of a block's
    tokens, so the worker refuses it (typed) instead of mixing ranks' tokens."""
    pytest.importorskip("nixl._api")
    from test_connector_refusals import _build_in_child
    kind, msg = _build_in_child({"kv_content": "kv_blocks"}, "kv_consumer", llama(1),
                                Side(2, 1, 16, content="kv_blocks", dcp=2))
    assert kind == "ContextParallelUnsupported" and "decode_context_parallel_size=2" in msg, (kind, msg)


# ---------------------------------------------------------------------- the scheduler side under DCP
def _mla_scheduler(name, role, tp, dcp=1, interleave=1):
    """vLLM's real Scheduler for an MLA model at TP ``tp`` x DCP ``dcp`` with the connector, given the block
    sizes the engine core resolves (``resolve_kv_cache_block_sizes``: one block id per block_size x dcp)."""
    import torch
    from sched_utils import attention_layer_names, make_kv_cache_config, make_scheduler, make_vllm_config
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    cfg = make_vllm_config(tempfile.mkdtemp(prefix=name), deepseek_like(2).hf, block_size=16, kv_transfer_config=dict(
        kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.integrations.vllm", kv_role=role,
        engine_id=f"engine-{name}"))
    pc = cfg.parallel_config
    pc.tensor_parallel_size, pc.decode_context_parallel_size, pc.cp_kv_cache_interleave_size = tp, dcp, interleave
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=96, dtype=torch.bfloat16)
    kv = make_kv_cache_config(cfg, 64, groups=[(attention_layer_names(2), spec)])
    sbs, hbs = resolve_kv_cache_block_sizes(kv, cfg)
    assert sbs == 16 * dcp
    return make_scheduler(cfg, num_blocks=64, kv_cache_config=kv, block_sizes=(sbs, hbs)), hbs


def test_prefix_hit_under_dcp_counts_scheduler_blocks_of_block_size_times_dcp():
    """Decode TP2 x DCP2 (block_size 16: one block id spans 32 tokens) that computed 64 prompt tokens locally:
    the read starts at scheduler block 2 (first_block = 64 // 32, not 64 // 16) into the tail's block ids;
    the prefill (TP2, no DCP) carries its CP sizes in kv_transfer_params."""
    import json

    from sched_utils import engine_outputs, make_request, step
    from vllm.v1.request import RequestStatus
    P, p_hbs = _mla_scheduler("p", "kv_producer", tp=2)
    D, d_hbs = _mla_scheduler("d", "kv_consumer", tp=2, dcp=2, interleave=16)
    prompt = list(range(3, 103))  # 100 tokens
    warm = make_request("warm", prompt[:64] + [500, 501], max_tokens=1, block_size=d_hbs)
    D.add_request(warm)
    for _ in range(4):
        if "warm" not in D.requests:
            break
        step(D)
    req = make_request("req-P", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True},
                       block_size=p_hbs)
    P.add_request(req)
    _, outs = step(P)
    (eco,) = engine_outputs(outs)
    params = json.loads(json.dumps(eco.kv_transfer_params))
    assert (params["remote_tp_size"], params["remote_pcp_size"], params["remote_dcp_size"],
            params["remote_cp_interleave"]) == (2, 1, 1, 1)
    assert len(params["remote_block_ids"][0]) == -(-100 // 16)
    dreq = make_request("req-D", prompt, max_tokens=2, kv_transfer_params=params, block_size=d_hbs)
    D.add_request(dreq)
    so, _ = step(D)
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    r = so.kv_connector_metadata.recv["req-D"]
    all_ids = D.kv_cache_manager.get_block_ids("req-D")[0]
    assert len(all_ids) == -(-100 // 32) == 4
    assert r.local_first_block == [64 // 32] and r.local_block_ids == [list(all_ids[2:])]


def test_mla_prefill_tp1_pcp2_to_decode_tp2_dcp2_byte_exact():
    """Prefill context parallelism on the prefill: its 2 PCP ranks each bind their own side-channel port
    (base + pcp_rank * tp + tp_rank) and hold the whole latent (PCP alone replicates the cache); the decode
    lists them from the params' ``remote_pcp_size`` and reads each token from one of them."""
    _pair(deepseek_like(2), Side(1, 1, 16, pcp=2), Side(2, 1, 16, dcp=2, cp_interleave=16),
          requests=((130, 0), (77, 1)))


def test_gqa_prefill_tp2_to_decode_tp4_dcp2_byte_exact():
    """GQA, 2 KV heads: decode TP4 x DCP2 (each head on 2 TP ranks, which are DCP ranks 0 and 1 of it,
    interleave 1) from a TP2 prefill (one head per rank)."""
    _pair(llama(2), Side(2, 1, 16), Side(4, 1, 16, dcp=2, cp_interleave=1), requests=((130, 0), (37, 1), (300, 2)))


def test_mla_prefill_tp2_dcp2_to_decode_tp1_byte_exact():
    """DCP on the prefill (a kv_both engine serving with DCP): each token lives on one prefill DCP rank; the
    TP1 decode (block size 32) gathers every token from the rank that holds it."""
    _pair(deepseek_like(2), Side(2, 1, 16, dcp=2, cp_interleave=1), Side(1, 1, 32), requests=((130, 0), (77, 1)))
