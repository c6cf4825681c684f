"""Engine-owned memory: tensors allocated the way engines allocate them, described to kvbridge,
moved with kvbridge's lowering, checked through the tensors' own indexing (never kvbridge's layout code)."""
import itertools

import numpy as np
import pytest

import kvbridge
from kvbridge.errors import LayoutError
from kvbridge.lower import LoweredPlan
from kvbridge.memory import KVMemory
from kvbridge.plan import plan_transfer
from kvbridge.testing.engines import FORMS, allocate, write_request
from kvbridge.testing.verify import BlockPool, make_request
from kvbridge.transport.reference import ReferenceTransport


def _engine(model, tp, pp=1, bs=16, nb=24):
    return kvbridge.EngineLayout(kvbridge.load_model(model) if isinstance(model, str) else model, tp=tp, pp=pp,
                                 block_size=bs, num_blocks=nb)


def _move(p_eng, d_eng, p_form, d_form, n_requests=3, seed=0, tamper=None):
    """Fill prefill tensors per request, move every decode rank's reads, return mismatches and cells."""
    plan = plan_transfer(p_eng, d_eng)
    rng = np.random.default_rng(seed)
    p_caches = {r: allocate(p_eng, r, p_form, seed) for r in p_eng.ranks()}
    d_caches = {r: allocate(d_eng, r, d_form, seed + 1) for r in d_eng.ranks()}
    p_mems = {r: kvbridge.describe_memory(p_eng, r, c.layers) for r, c in p_caches.items()}
    d_mems = {r: kvbridge.describe_memory(d_eng, r, c.layers) for r, c in d_caches.items()}
    if tamper:
        d_mems = {r: tamper(m) for r, m in d_mems.items()}
    t = ReferenceTransport()
    for m in list(p_mems.values()) + list(d_mems.values()):
        for a in m.allocations:
            t.register_region(a.addr, a.nbytes, a.device)
    pp_pool, dd_pool = BlockPool(p_eng, rng), BlockPool(d_eng, rng)
    reqs = []
    for i in range(n_requests):
        n = int(rng.integers(1, 4 * min(p_eng.block_size, d_eng.block_size) + 40))
        req = make_request(i, n, p_eng, d_eng, pp_pool, dd_pool, prefix_tokens=int(rng.integers(0, n)) if i else 0)
        reqs.append(req)
        for r, c in p_caches.items():
            write_request(c, p_eng, r, i + 1, n, {g: b.block_ids for g, b in req.prefill_blocks.items()},
                          {g: b.first_block for g, b in req.prefill_blocks.items()})
    for d_rank in d_eng.ranks():
        lp = LoweredPlan(plan, d_rank, prefill_mems={p: p_mems[p] for p in plan.prefill_ranks_for(d_rank)},
                         decode_mem=d_mems[d_rank])
        for req in reqs:
            for d in lp.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks):
                t.read("p", d.src, d.dst, d.nbytes)
    bad = cells = 0
    for i, req in enumerate(reqs):
        for r, c in d_caches.items():
            bad += write_request(
                c,
                d_eng,
                r,
                i + 1,
                req.num_tokens,
                {g: b.block_ids for g, b in req.decode_blocks.items()},
                {g: b.first_block for g, b in req.decode_blocks.items()},
                check=True,
            )
            cells += 1
    return bad, cells


TOPOLOGIES = [
    ("tiny-dense", 2, 1, 16, 1, 1, 32),
    ("tiny-dense", 1, 1, 32, 4, 1, 16),
    ("tiny-dense", 4, 1, 16, 2, 2, 16),
    ("gemma-4-mini", 4, 1, 16, 2, 1, 32),
    ("gemma-4-mini", 2, 2, 16, 8, 1, 16),
]


@pytest.mark.parametrize("p_form, d_form", [(f, g) for f, g in zip(FORMS, FORMS[3:] + FORMS[:3])])
@pytest.mark.parametrize("model, ptp, ppp, pbs, dtp, dpp, dbs", TOPOLOGIES)
def test_engine_forms_byte_exact(p_form, d_form, model, ptp, ppp, pbs, dtp, dpp, dbs):
    bad, cells = _move(_engine(model, ptp, ppp, pbs), _engine(model, dtp, dpp, dbs), p_form, d_form)
    assert cells > 0 and bad == 0


@pytest.mark.parametrize("model, ptp, dtp", [("tiny-mla", 2, 1), ("tiny-mla", 1, 4), ("tiny-hybrid", 2, 1),
                                             ("tiny-hybrid", 1, 2)])
@pytest.mark.parametrize("form", ["vllm-LBNHC", "split", "padded", "separate"])
def test_mla_and_mamba_byte_exact(model, ptp, dtp, form):
    if model == "tiny-mla" and form == "split":
        form = "scattered"
    bad, cells = _move(
        _engine(model, ptp), _engine(model, dtp, bs=32), form, "flash_attn" if form != "vllm-LBNHC" else "vllm-BLNHC"
    )
    assert cells > 0 and bad == 0


@pytest.mark.parametrize("p_bs, d_bs, p_form, d_form", [
    ({"sliding": 16, "full": 32}, {"sliding": 32, "full": 16}, "vllm-LBNHC", "vllm-LBHNC"),
    ({"sliding": 16, "full": 32}, {}, "flash_attn", "vllm-BLNHC"),
    ({}, {"sliding": 8, "full": 64}, "vllm-LBHNC", "split")])
@pytest.mark.parametrize("ptp, dtp", [(1, 2), (4, 1)])
def test_groups_with_their_own_block_sizes_byte_exact(p_bs, d_bs, p_form, d_form, ptp, dtp):
    """vLLM's hybrid allocator gives groups different block sizes (one page size, e.g. Gemma-4: full
    attention 32 tokens per block, sliding window 16): each group's own block size on each side."""
    model = kvbridge.load_model("gemma-4-mini")  # groups "sliding" (8 KV heads x 32) and "full" (2 x 64)
    p = kvbridge.EngineLayout(model, tp=ptp, block_size=16, num_blocks=40, group_block_sizes=p_bs)
    d = kvbridge.EngineLayout(model, tp=dtp, block_size=16, num_blocks=40, group_block_sizes=d_bs)
    assert {p.block_size_of(g) for g in model.groups} | {d.block_size_of(g) for g in model.groups} != {16}
    bad, cells = _move(p, d, p_form, d_form, n_requests=4)
    assert cells > 0 and bad == 0


def test_group_block_sizes_travel_in_the_handshake_form():
    from kvbridge.layout import engine_from_dict, engine_to_dict
    model = kvbridge.load_model("gemma-4-mini")
    e = kvbridge.EngineLayout(model, tp=2, block_size=16, group_block_sizes={model.groups[0].name: 32})
    back = engine_from_dict(engine_to_dict(e))
    assert back == e and back.block_size_of(model.groups[0]) == 32 and back.block_size_of(model.groups[1]) == 16
    with pytest.raises(LayoutError, match="group_block_sizes"):
        kvbridge.EngineLayout(model, group_block_sizes={"nope": 32})


def test_a_wrong_stride_in_the_description_is_caught_by_the_oracle():
    """The oracle reads the tensors, not kvbridge's view of them: a description with K and V swapped
    (still inside the memory, still non-overlapping, every check of kvbridge's passes) must fail it."""
    from dataclasses import replace

    def swap(m: KVMemory) -> KVMemory:
        regions = {}
        for g, r in m.regions.items():
            k, v = r.components
            comps = (replace(k, layer_offsets=v.layer_offsets), replace(v, layer_offsets=k.layer_offsets))
            regions[g] = replace(r, components=comps)
        return KVMemory(m.engine, m.rank, regions, m.allocations)

    eng_p, eng_d = _engine("tiny-dense", 1, bs=16), _engine("tiny-dense", 1, bs=16)
    assert _move(eng_p, eng_d, "flash_attn", "hnd")[0] == 0
    bad, _ = _move(eng_p, eng_d, "flash_attn", "hnd", tamper=swap)
    assert bad > 0


def test_hybrid_allocator_groups_overlay_the_same_bytes():
    """vLLM's hybrid allocator: layer i of every group at the same offset of one buffer, one block-id
    space shared by the groups (a block belongs to one group at a time)."""
    eng = _engine("gemma-4-mini", 1, nb=32)
    g_sw, g_full = eng.model.groups
    flat = np.zeros(64 << 20, np.uint8)
    layers, logical = {}, {}
    for g in (g_sw, g_full):
        H, D = g.num_heads, g.head_dim
        for i, layer in enumerate(g.layers):
            t = flat[i * (4 << 20):][: 32 * 16 * H * 2 * D * 2].view(np.float16).reshape(32, H, 16, 2 * D)
            layers[layer] = kvbridge.LayerKV(t, "BHNC")
            logical[layer] = t
    mem = kvbridge.describe_memory(eng, (0, 0), layers)
    assert len(mem.allocations) == 1
    # the two groups' layer 0 start at the same address
    assert (
        mem.region(g_sw.name).components[0].layer_offsets[0] == mem.region(g_full.name).components[0].layer_offsets[0]
    )


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda L, e: {**L, 0: kvbridge.LayerKV(L[0].tensor[:, :8], "KBTHD")}, r"layer 0 .*field 'shape'.*num_blocks"),
        (lambda L, e: {**L, 1: kvbridge.LayerKV(L[1].tensor.astype(np.float32), "KBTHD")}, r"layer 1 .*field 'dtype'"),
        (lambda L, e: {**L, 2: kvbridge.LayerKV(L[2].tensor, "KBHTD")}, r"layer 2 .*field 'shape'"),
        (lambda L, e: {**L, 3: kvbridge.LayerKV(L[3].tensor[..., ::2], "KBTHD")}, r"layer 3 .*field 'shape'"),
        (lambda L, e: {k: v for k, v in L.items() if k != 2}, r"no memory given for layer 2"),
        (
            lambda L, e: {
                **L,
                0: kvbridge.LayerKV(
                    np.zeros((2, 24, 16, 4, 16), np.int32)[..., :16].view(np.float16)[..., ::2], "KBTHD"
                ),
            },
            r"layer 0 .*field 'strides'",
        ),
        (lambda L, e: {**L, 0: kvbridge.LayerKV(k=L[0].tensor[0], v=L[0].tensor[0], axes="BTHD")}, r"overlap"),
        (lambda L, e: {**L, 0: kvbridge.LayerKV("not a tensor", "KBTHD")}, r"cannot use str"),
    ],
    ids=[
        "too-few-blocks",
        "dtype",
        "axes-vs-shape",
        "head-dim",
        "missing-layer",
        "strided-elements",
        "k-is-v",
        "not-a-tensor",
    ],
)
def test_bad_descriptions_name_layer_component_field(mutate, match):
    eng = _engine("tiny-dense", 1)
    layers = allocate(eng, (0, 0), "flash_attn").layers
    with pytest.raises(LayoutError, match=match):
        kvbridge.describe_memory(eng, (0, 0), mutate(layers, eng))


def test_memory_outside_registered_regions_is_refused():
    eng = _engine("tiny-dense", 1)
    mem = kvbridge.describe_memory(eng, (0, 0), allocate(eng, (0, 0), "separate").layers)
    wire = mem.to_wire()
    wire["allocations"] = [[a, n // 2, d] for a, n, d in wire["allocations"]]
    with pytest.raises(LayoutError, match="not inside one registered memory region"):
        KVMemory.from_wire(eng, wire)


def test_every_allocation_is_one_region_and_every_descriptor_lies_in_one():
    p, d = _engine("tiny-dense", 2), _engine("tiny-dense", 1, bs=32)
    pc = {r: allocate(p, r, "separate") for r in p.ranks()}
    dc = allocate(d, (0, 0), "scattered")
    pm = {r: kvbridge.describe_memory(p, r, c.layers) for r, c in pc.items()}
    dm = kvbridge.describe_memory(d, (0, 0), dc.layers)
    assert all(len(m.allocations) == 4 for m in pm.values()) and len(dm.allocations) == 1
    plan = plan_transfer(p, d)
    lp = LoweredPlan(plan, (0, 0), prefill_mems=pm, decode_mem=dm)
    rng = np.random.default_rng(1)
    req = make_request(0, 100, p, d, BlockPool(p, rng), BlockPool(d, rng))
    for desc in lp.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks):
        for addrs, mem in ((desc.src, pm[desc.prefill]), (desc.dst, dm)):
            starts = np.array([a.addr for a in mem.allocations])
            ends = np.array([a.end for a in mem.allocations])
            i = np.searchsorted(starts, addrs, side="right") - 1
            assert (i >= 0).all() and (addrs + desc.nbytes <= ends[i]).all()


@pytest.mark.parametrize("name", ["LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"])
def test_vllm_layout_names_are_accepted(name):
    lay = kvbridge.MemoryLayout.parse(name)
    assert sorted(lay.order) == sorted("LKBTHD")
    p = kvbridge.EngineLayout(kvbridge.load_model("tiny-dense"), tp=2, memory=lay)
    d = kvbridge.EngineLayout(kvbridge.load_model("tiny-dense"), tp=1, block_size=32)
    from kvbridge.testing.verify import verify
    assert verify(p, d, num_requests=2).ok


def test_core_never_needs_torch_or_rich():
    import subprocess
    import sys
    code = ("import sys, kvbridge, kvbridge.describe, kvbridge.runtime.prefill, kvbridge.runtime.decode;"
            "kvbridge.PrefillEndpoint; kvbridge.DecodeEndpoint;"
            "print(sorted(m for m in ('torch', 'rich') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


_ = itertools


@pytest.mark.parametrize("p_cp, d_cp, model", [
    (dict(tp=4, block_size=16), dict(tp=4, dcp=4, cp_interleave=16, block_size=16), "tiny-mla"),
    (dict(tp=2, dcp=2, cp_interleave=4, block_size=8), dict(tp=3, dcp=3, cp_interleave=1, block_size=4), "tiny-mla"),
    (dict(tp=1, pcp=2, dcp=2, cp_interleave=8, block_size=16), dict(tp=2, block_size=32), "tiny-mla"),
    (dict(tp=1, pcp=2, block_size=32), dict(tp=4, dcp=2, cp_interleave=8, block_size=16), "gqa1"),
])
@pytest.mark.parametrize("p_form, d_form", [("vllm-LBNHC", "vllm-BLHNC"), ("separate", "vllm-LBHNC")])
def test_context_parallel_engine_tensors_byte_exact(p_cp, d_cp, model, p_form, d_form):
    """Issue 21: vLLM-shaped tensors on DCP/PCP ranks (each rank keeps block_size tokens of its share per
    block), filled and checked through the oracle's own vLLM slot map."""
    if model == "gqa1":
        model = kvbridge.ModelSpec("gqa1", 4, (kvbridge.layout.CacheGroup(
            "full", "full_attention", (0, 1, 2, 3), "float16", num_heads=1, head_dim=16),))
        if p_form == "separate":
            p_form = "flash_attn"
    else:
        model = kvbridge.load_model(model)
        if p_form == "separate":
            p_form = "scattered"
    p = kvbridge.EngineLayout(model, num_blocks=24, **p_cp)
    d = kvbridge.EngineLayout(model, num_blocks=24, **d_cp)
    bad, cells = _move(p, d, p_form, d_form)
    assert cells > 0 and bad == 0
