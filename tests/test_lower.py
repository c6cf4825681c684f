"""Lowering (kvbridge.lower): merge, descriptor math, request validation, the oracle over a sweep."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import random_models, random_pp_layers

from kvbridge.errors import RequestError
from kvbridge.layout import LAYOUT_PRESETS, EngineLayout, MemoryLayout, valid_tps
from kvbridge.lower import GroupBlocks, LoweredPlan, merge_adjacent
from kvbridge.models import PRESETS, preset
from kvbridge.plan import plan_transfer
from kvbridge.testing.sweep import pad_mamba, shrink, sweep_cases
from kvbridge.testing.verify import verify


def engine(model, tp=1, pp=1, bs=16, layout="flash_attn", num_blocks=64, **kw):
    return EngineLayout(model, tp=tp, pp=pp, block_size=bs, memory=MemoryLayout.parse(layout),
                        num_blocks=num_blocks, **kw)


def triples(d) -> list[tuple[int, int, int]]:
    return list(zip(d.src.tolist(), d.dst.tolist(), d.nbytes.tolist()))


def gb(ids, first=0):
    return GroupBlocks.of(ids, first)


# --------------------------------------------------------------------------------------------------
# merge_adjacent
# --------------------------------------------------------------------------------------------------

def _arr(*x):
    return np.array(x, dtype=np.int64)


def test_merge_contiguous_on_both_sides():
    s, d, n = merge_adjacent(_arr(0, 10, 20), _arr(100, 110, 120), _arr(10, 10, 10))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0], [100], [30])


def test_merge_contiguous_on_one_side_only():
    # source contiguous, destination not
    s, d, n = merge_adjacent(_arr(0, 10, 20), _arr(100, 200, 300), _arr(10, 10, 10))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 10, 20], [100, 200, 300], [10, 10, 10])
    # destination contiguous, source not
    s, d, n = merge_adjacent(_arr(0, 50, 20), _arr(100, 110, 120), _arr(10, 10, 10))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 50, 20], [100, 110, 120], [10, 10, 10])


def test_merge_partial_runs_and_unequal_lengths():
    s, d, n = merge_adjacent(_arr(0, 4, 100, 108, 200), _arr(0, 4, 50, 58, 12), _arr(4, 8, 8, 2, 1))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 100, 200], [0, 50, 12], [12, 10, 1])


def test_merge_only_adjacent_in_order():
    # contiguous pairs that are not consecutive in the list do not merge (no sort)
    s, d, n = merge_adjacent(_arr(10, 0), _arr(10, 0), _arr(10, 10))
    assert s.tolist() == [10, 0] and n.tolist() == [10, 10]


def test_merge_trivial_sizes():
    for k in (0, 1):
        s, d, n = merge_adjacent(_arr(*range(k)), _arr(*range(k)), _arr(*[4] * k))
        assert s.size == d.size == n.size == k


# --------------------------------------------------------------------------------------------------
# Descriptor math by hand
# --------------------------------------------------------------------------------------------------

TD = preset("tiny-dense")  # 4 layers, 4 KV heads x 16 dims, bf16: 32-byte atoms


def _tiny_lowered(prefill_bases=None, decode_base=0, **kw):
    p = engine(TD, bs=4, num_blocks=4, role="prefill", **kw)
    d = engine(TD, bs=4, num_blocks=4, role="decode", **kw)
    return LoweredPlan(plan_transfer(p, d), (0, 0), prefill_bases, decode_base)


# flash_attn "LKBTHD" with 4 blocks of 4 tokens: strides D=1, H=32, T=128, B=512, K=2048, L=4096
def _expected(pb, db, ntok_last=4):
    out = []
    for layer in range(4):
        for kv in range(2):
            for i, (a, b) in enumerate(zip(pb, db)):
                n = 128 * (ntok_last if i == len(pb) - 1 else 4)
                out.append((layer * 4096 + kv * 2048 + a * 512, layer * 4096 + kv * 2048 + b * 512, n))
    return sorted(out)


def test_descriptors_by_hand_two_blocks():
    lp = _tiny_lowered()
    (desc,) = lp.descriptors(8, {"full": gb([1, 3])}, {"full": gb([2, 0])})
    assert desc.prefill == (0, 0)
    assert sorted(triples(desc)) == _expected([1, 3], [2, 0])
    assert desc.count == 16 and desc.total_bytes == 8 * 4 * 2 * 4 * 32


def test_descriptors_by_hand_partial_last_block_and_bases():
    lp = _tiny_lowered({(0, 0): 1 << 20}, 1 << 30)
    (desc,) = lp.descriptors(6, {"full": gb([1, 3])}, {"full": gb([2, 0])})
    assert sorted((s - (1 << 20), d - (1 << 30), n) for s, d, n in triples(desc)) == _expected([1, 3], [2, 0], 2)


def test_descriptors_consecutive_blocks_merge():
    lp = _tiny_lowered()
    (desc,) = lp.descriptors(8, {"full": gb([1, 2])}, {"full": gb([2, 3])})
    assert sorted(triples(desc)) == sorted(
        (l * 4096 + kv * 2048 + 512, l * 4096 + kv * 2048 + 1024, 1024) for l in range(4) for kv in range(2))


def test_descriptors_prefix_hit_skips_decode_cached_blocks():
    lp = _tiny_lowered()
    # decode already has block 0 (tokens 0..3): it sends only its second block, for tokens 4..7
    (desc,) = lp.descriptors(8, {"full": gb([1, 3])}, {"full": gb([0], first=1)})
    assert sorted(triples(desc)) == sorted(
        (l * 4096 + kv * 2048 + 3 * 512, l * 4096 + kv * 2048 + 0, 512) for l in range(4) for kv in range(2))
    assert lp.needed_bytes(8, {"full": gb([1, 3])}, {"full": gb([0], first=1)}) == 4 * 4 * 2 * 4 * 32


def test_descriptors_head_slice_hnd_to_nhd():
    # P tp=1 HND -> D tp=2 NHD: decode rank 1 reads heads 2,3 of every token; on the prefill side
    # heads are outside tokens, so each (layer, kv, head, block) is one 4-token run of 128 bytes that
    # lands on 4 separate 32-byte atoms on the decode side (NHD with 2 heads: token stride 64)
    p = engine(TD, bs=4, num_blocks=2, layout="flash_attn_hnd", role="prefill")
    d = engine(TD, tp=2, bs=4, num_blocks=2, layout="flash_attn", role="decode")
    lp = LoweredPlan(plan_transfer(p, d), (0, 1))
    (desc,) = lp.descriptors(4, {"full": gb([1])}, {"full": gb([0])})
    # prefill HND strides: D=1, T=32, H=128, B=512, K=1024, L=2048 ; decode NHD (2 heads): D=1, H=32,
    # T=64, B=256, K=512, L=1024
    want = sorted((l * 2048 + kv * 1024 + 512 + h * 128 + t * 32, l * 1024 + kv * 512 + (h - 2) * 32 + t * 64, 32)
                  for l in range(4) for kv in range(2) for h in (2, 3) for t in range(4))
    got = sorted(triples(desc))
    assert sum(n for *_, n in got) == sum(n for *_, n in want)
    # expand got into 32-byte atoms and compare with the atom list
    atoms = sorted((s + k, d_ + k, 32) for s, d_, n in got for k in range(0, n, 32))
    assert atoms == want


def test_cross_layer_contiguous_ids_fewer_descriptors():
    p = engine(TD, bs=16, num_blocks=32, layout="cross_layer", role="prefill")
    d = engine(TD, bs=16, num_blocks=32, layout="cross_layer", role="decode")
    lp = LoweredPlan(plan_transfer(p, d), (0, 0))
    n = 20
    contiguous = lp.descriptors(16 * n, {"full": gb(range(3, 3 + n))}, {"full": gb(range(10, 10 + n))})[0]
    shuffled = lp.descriptors(16 * n, {"full": gb(range(n - 1, -1, -1))}, {"full": gb(range(10, 10 + n))})[0]
    assert contiguous.count == 1  # a cross-layer block holds every layer: the request is one run
    assert shuffled.count == n
    assert contiguous.total_bytes == shuffled.total_bytes == 16 * n * 4 * 2 * 4 * 32
    # per-layer layouts cannot merge across layers even with contiguous ids
    p2, d2 = (engine(TD, bs=16, num_blocks=32, layout="flash_attn", role=r) for r in ("prefill", "decode"))
    lp2 = LoweredPlan(plan_transfer(p2, d2), (0, 0))
    per_layer = lp2.descriptors(16 * n, {"full": gb(range(3, 3 + n))}, {"full": gb(range(10, 10 + n))})[0]
    assert per_layer.count == 4 * 2 > contiguous.count


def test_universal_layout_reads_whole_head_blocks_across_tp():
    """Head-major cross-layer blocks ("universal"): a TP-mismatched read is one run per (block, prefill
    rank) -- every layer, K and V of that head in one piece -- where the per-layer HND layout needs one
    run per (layer, K/V, block, prefill rank)."""
    n = 12
    ids_p, ids_d = gb([7, 2, 9, 0, 5, 11, 3, 8, 1, 10, 4, 6]), gb([3, 0, 11, 6, 9, 1, 4, 10, 2, 8, 5, 7])
    counts = {}
    for layout in ("universal", "flash_attn_hnd"):
        p = engine(TD, tp=4, bs=16, num_blocks=16, layout=layout, role="prefill")  # 1 head per rank
        d = engine(TD, tp=2, bs=16, num_blocks=16, layout=layout, role="decode")   # 2 heads per rank
        lp = LoweredPlan(plan_transfer(p, d), (0, 0))
        descs = lp.descriptors(16 * n, {"full": ids_p}, {"full": ids_d})
        assert [x.prefill for x in descs] == [(0, 0), (0, 1)]
        counts[layout] = [x.count for x in descs]
        if layout == "universal":  # one whole prefill block (4 layers x K/V x 16 tokens x 32 B) per run
            assert set(descs[0].nbytes.tolist()) == {4 * 2 * 16 * 32}
    assert counts["universal"] == [n, n]
    assert counts["flash_attn_hnd"] == [4 * 2 * n, 4 * 2 * n]


def test_mamba_descriptors_one_slot():
    m = preset("tiny-hybrid")
    p = engine(m, tp=2, bs=4, num_blocks=4, role="prefill")
    d = engine(m, tp=1, bs=4, num_blocks=4, role="decode")
    lp = LoweredPlan(plan_transfer(p, d), (0, 0))
    blocks_p = {"mamba": gb([3]), "attn": gb([0, 1])}
    blocks_d = {"mamba": gb([1]), "attn": gb([2, 3])}
    descs = lp.descriptors(8, blocks_p, blocks_d)
    assert [x.prefill for x in descs] == [(0, 0), (0, 1)]
    # decode needs the whole state of 4 Mamba layers + 8 tokens of 2 attention layers
    state = 8 * 3 * 4 * 2 + 2 * 2 * 3 * 8 * 2 + 8 * 4 * 8 * 4  # conv_x + B,C + ssm (tp=1)
    attn = 8 * 2 * 2 * 2 * 16 * 2
    assert sum(x.total_bytes for x in descs) == 4 * state + attn
    assert lp.needed_bytes(8, blocks_p, blocks_d) == 4 * state + attn


def test_int32_block_ids_give_the_same_descriptors():
    m = preset("llama-3.1-8b")  # cross-layer block stride 32 layers x 2 x 8 heads x 128 x 2 B x 16 = 2 MiB
    p = engine(m, bs=16, num_blocks=20000, layout="cross_layer", role="prefill")
    d = engine(m, bs=16, num_blocks=20000, layout="flash_attn", role="decode")
    lp = LoweredPlan(plan_transfer(p, d), (0, 0))
    ids = [1000, 5000]  # 5000 x 2 MiB > 2**31
    want = lp.descriptors(32, {"full": gb(ids)}, {"full": gb(ids)})[0]
    i32 = np.array(ids, dtype=np.int32)
    got = lp.descriptors(32, {"full": GroupBlocks(i32)}, {"full": GroupBlocks(i32)})[0]
    assert np.array_equal(got.src, want.src) and np.array_equal(got.dst, want.dst)


# --------------------------------------------------------------------------------------------------
# Request errors (raised before anything is lowered or moved)
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def lowered_hybrid(monkeypatch):
    m = preset("tiny-hybrid")
    p = engine(m, tp=2, bs=4, num_blocks=8, role="prefill")
    d = engine(m, tp=1, bs=4, num_blocks=8, role="decode")
    lp = LoweredPlan(plan_transfer(p, d), (0, 0))
    calls = []
    orig = LoweredPlan._lower_read  # a spy: which reads are lowered (no public count of lowerings)

    def spy(self, *a):
        calls.append(a)
        return orig(self, *a)

    monkeypatch.setattr(LoweredPlan, "_lower_read", spy)
    return lp, calls


GOOD_P = {"mamba": [3], "attn": [0, 1]}
GOOD_D = {"mamba": [1], "attn": [2, 3]}


@pytest.mark.parametrize("case,pblocks,dblocks,ntok,match", [
    ("prefill id too large", {"attn": gb([0, 8])}, {}, 8, r"prefill block ids \[8\].*out of range \[0, 8\)"),
    ("decode id negative", {}, {"attn": gb([-1, 2])}, 8, r"decode block ids \[-1\].*out of range"),
    ("mamba slot out of range", {"mamba": gb([9])}, {}, 8, r"prefill block ids \[9\] of group 'mamba'"),
    ("decode more than prefill sent", {"attn": gb([0])}, {}, 8, "more blocks than the prefill sent"),
    ("prefill window starts late", {"attn": gb([1], first=1)}, {}, 8, "more blocks than the prefill sent"),
    ("decode more blocks than tokens", {}, {"attn": gb([2, 3, 4])}, 8, "allocate 2 blocks"),
    ("decode blocks start past the end", {}, {"attn": gb([2], first=3)}, 8, "has only 8 tokens"),
    ("mamba two slots on decode", {}, {"mamba": gb([1, 2])}, 8, "exactly one decode state slot"),
    ("mamba two slots on prefill", {"mamba": gb([1, 2])}, {}, 8, "exactly one prefill state slot"),
    ("mamba no slot", {"mamba": gb([])}, {}, 8, "exactly one prefill state slot"),
])
def test_request_errors(lowered_hybrid, case, pblocks, dblocks, ntok, match):
    lp, calls = lowered_hybrid
    pb = {k: gb(v) for k, v in GOOD_P.items()} | pblocks
    db = {k: gb(v) for k, v in GOOD_D.items()} | dblocks
    with pytest.raises(RequestError, match=match):
        lp.descriptors(ntok, pb, db)
    assert calls == [], "validation must happen before any read is lowered"
    # the lowered plan stays usable
    descs = lp.descriptors(8, {k: gb(v) for k, v in GOOD_P.items()}, {k: gb(v) for k, v in GOOD_D.items()})
    assert sum(x.total_bytes for x in descs) > 0


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_request_error_missing_group(lowered_hybrid, side):
    lp, calls = lowered_hybrid
    pb = {k: gb(v) for k, v in GOOD_P.items()}
    db = {k: gb(v) for k, v in GOOD_D.items()}
    (pb if side == "prefill" else db).pop("attn")
    with pytest.raises(RequestError, match=f"no {side} block ids for group 'attn'"):
        lp.descriptors(8, pb, db)
    assert calls == []


def test_request_error_leaves_decode_buffer_untouched():
    """End to end: a rejected request moves no byte (the transport is never called)."""
    from kvbridge.memory import rank_memory
    from kvbridge.testing.oracle import new_buffer
    from kvbridge.transport.reference import ReferenceTransport
    p = engine(TD, bs=4, num_blocks=4, role="prefill")
    d = engine(TD, bs=4, num_blocks=4, role="decode")
    t = ReferenceTransport()
    pbuf, dbuf = new_buffer(rank_memory(p, 0, 0)), new_buffer(rank_memory(d, 0, 0))
    pbuf[:] = 7
    before = dbuf.copy()
    lp = LoweredPlan(plan_transfer(p, d), (0, 0), {(0, 0): t.register(pbuf)}, t.register(dbuf))
    with pytest.raises(RequestError):
        for x in lp.descriptors(8, {"full": gb([0, 1])}, {"full": gb([0, 4])}):
            t.read("p", x.src, x.dst, x.nbytes)
    assert t.bytes_moved == 0 and np.array_equal(dbuf, before)


# --------------------------------------------------------------------------------------------------
# The per-request path has no Python loop over blocks
# --------------------------------------------------------------------------------------------------

def _python_calls(fn) -> int:
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        if event == "call":
            n += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def test_descriptors_python_call_count_independent_of_blocks():
    m = preset("tiny-hybrid")  # attention + Mamba; different block sizes and TP, so several reads
    p = engine(m, tp=2, bs=4, num_blocks=2048, layout="flash_attn_hnd", role="prefill")
    d = engine(m, tp=1, bs=8, num_blocks=2048, layout="flashinfer", role="decode")
    lp = LoweredPlan(plan_transfer(p, d), (0, 0))
    rng = np.random.default_rng(0)

    def request(nblocks):
        ntok = 4 * nblocks - 1  # a partial last chunk too
        pb = {"mamba": gb([5]), "attn": gb(rng.permutation(2048)[:nblocks])}
        db = {"mamba": gb([7]), "attn": gb(rng.permutation(2048)[:(nblocks + 1) // 2])}
        return lambda: lp.descriptors(ntok, pb, db)

    small, large = request(100), request(2000)
    small(), large()  # build the lazily created templates (full and tail chunks) first
    counts = [_python_calls(small), _python_calls(large)]
    assert counts[0] == counts[1], counts
    assert sum(x.count for x in large()) > 5 * sum(x.count for x in small())  # the work did scale


# --------------------------------------------------------------------------------------------------
# The oracle: every decode byte checked
# --------------------------------------------------------------------------------------------------

SWEEP = sweep_cases(quick=True)


def test_sweep_covers_every_preset_and_layout_pair():
    assert {p.model.name for p, _ in SWEEP} == {shrink(preset(n)).name for n in PRESETS}
    pairs = {(p.memory.name, d.memory.name) for p, d in SWEEP}
    assert all(a != b for a, b in pairs)
    # every layout (kvbridge's and vLLM 0.33's names) on both sides, every case a distinct pair
    assert {a for a, _ in pairs} == {b for _, b in pairs} == set(LAYOUT_PRESETS)
    assert len(pairs) == len(SWEEP)
    assert any(p.tp > d.tp for p, d in SWEEP) and any(p.tp < d.tp for p, d in SWEEP)
    assert any(p.mamba_blocks_per_request for p, _ in SWEEP)
    assert any(d.mamba_blocks_per_request for _, d in SWEEP)


def test_shrink_keeps_geometry():
    for name in PRESETS:
        m, s = preset(name), shrink(preset(name))
        assert s.name == m.name + "-small" and s.num_layers == m.num_layers
        for a, b in zip(m.groups, s.groups):
            assert (a.name, a.kind, a.layers, a.dtype, a.num_heads, a.sliding_window) == \
                   (b.name, b.kind, b.layers, b.dtype, b.num_heads, b.sliding_window)
            assert [c.num_units for c in a.components] == [c.num_units for c in b.components]
            assert b.head_dim == min(a.head_dim, 8)
            if a.mamba:
                assert (b.mamba.num_heads, b.mamba.n_groups, b.mamba.head_dim, b.mamba.d_state) == \
                       (a.mamba.num_heads, a.mamba.n_groups, min(a.mamba.head_dim, 2), min(a.mamba.d_state, 4))


@pytest.mark.parametrize("prefill,decode", SWEEP, ids=[f"{i}-{p}->{d}" for i, (p, d) in enumerate(SWEEP)])
def test_oracle_sweep(prefill, decode):
    res = verify(prefill, decode, num_requests=3, seed=1)
    assert res.errors == []
    assert res.mismatched_bytes == 0
    assert res.bytes_moved == res.bytes_needed > 0
    assert res.amplification == 1.0
    assert res.ok




def small_models():
    return random_models(max_layers=8, max_window=24)


@st.composite
def random_pairs(draw):
    if draw(st.booleans()):
        model = shrink(preset(draw(st.sampled_from(["tiny-dense", "tiny-mla", "tiny-hybrid", "gemma-4-mini",
                                                    "gpt-oss-120b", "nemotron-h-56b"]))))
    else:
        model = draw(small_models())
    tps = set(range(1, 9))
    for g in model.groups:
        for c in g.components:
            tps &= set(valid_tps(c.num_units, 8))
    sides = []
    for role in ("prefill", "decode"):
        pp = draw(st.integers(1, min(3, model.num_layers)))
        pp_layers = draw(random_pp_layers(model.num_layers, pp))
        e = EngineLayout(model, tp=draw(st.sampled_from(sorted(tps))), pp=pp, pp_layers=pp_layers,
                         block_size=draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
                         memory=MemoryLayout.parse(draw(st.sampled_from(list(LAYOUT_PRESETS)))),
                         num_blocks=draw(st.integers(6, 24)), role=role)
        pad = draw(st.sampled_from([None, 0, 2]))
        sides.append(e if pad is None else pad_mamba(e, pad))
    return tuple(sides)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_pairs(), st.integers(0, 2**16), st.booleans())
def test_oracle_random_topologies(pair, seed, shuffled):
    prefill, decode = pair
    res = verify(prefill, decode, num_requests=3, seed=seed, shuffled=shuffled)
    assert res.errors == [] and res.mismatched_bytes == 0, (str(prefill), str(decode))
    assert res.amplification == 1.0 and res.ok


@pytest.mark.parametrize("model,p_tp,d_tp,layout", [
    ("llama-3.1-70b", 8, 4, "flash_attn_hnd"),   # head slices: factored, nothing merges
    ("llama-3.1-70b", 4, 4, "flash_attn_hnd"),   # whole blocks: merged arrays
    ("gemma-4-mini", 4, 2, "flashinfer"),        # two groups (SWA + full), a partial last chunk
    ("tiny-hybrid", 1, 2, "cross_layer"),        # Mamba state + attention
    ("llama-3.1-70b", 8, 4, "universal"),
])
@pytest.mark.parametrize("shuffled", [False, True, "runs"])
def test_nixl_arrays_match_materialised_descriptors(model, p_tp, d_tp, layout, shuffled):
    """The Nx3 arrays written for NIXL from the factored form equal the materialised src/dst/nbytes, and
    the counts known before materialising are right."""
    m = preset(model)
    bs, n = 16, 37
    p = engine(m, tp=p_tp, bs=bs, num_blocks=64, layout=layout, role="prefill")
    d = engine(m, tp=d_tp, bs=bs, num_blocks=64, layout=layout, role="decode")
    lp = LoweredPlan(plan_transfer(p, d), (0, 0), {r: 1 << 40 for r in plan_transfer(p, d).prefill_ranks_for((0, 0))},
                     1 << 41)
    rng = np.random.default_rng(3)
    if shuffled == "runs":  # groups of 3 consecutive ids in random order: merges inside groups only
        ids = lambda: (rng.permutation(21)[:, None] * 3 + np.arange(3)).ravel()[:n]  # noqa: E731
    else:
        ids = (lambda: rng.permutation(64)[:n]) if shuffled else (lambda: np.arange(5, 5 + n))
    blocks = {g.name: (gb([7]) if not g.per_token else gb(ids())) for g in m.groups}
    dblocks = {g.name: (gb([3]) if not g.per_token else gb(ids())) for g in m.groups}
    ntok = bs * n - 5
    fresh = lp.descriptors(ntok, blocks, dblocks)
    for x, y in zip(fresh, lp.descriptors(ntok, blocks, dblocks)):
        count, total = x.count, x.total_bytes  # before anything is materialised
        local, remote = x.nixl_arrays(local_dev=1, remote_dev=2)
        assert count == y.nbytes.size and total == int(y.nbytes.sum())
        assert local.dtype == remote.dtype == np.uint64 and local.shape == remote.shape == (count, 3)
        assert (local[:, 0] == y.dst.astype(np.uint64)).all() and (remote[:, 0] == y.src.astype(np.uint64)).all()
        assert (local[:, 1] == y.nbytes.astype(np.uint64)).all() and (remote[:, 1] == local[:, 1]).all()
        assert (local[:, 2] == 1).all() and (remote[:, 2] == 2).all()
        # after materialising, nixl_arrays answers from the cached arrays: same result
        l2, r2 = y.nixl_arrays(1, 2)
        assert (l2 == local).all() and (r2 == remote).all()
        assert merge_adjacent(y.src, y.dst, y.nbytes)[0].size == count  # maximal runs: nothing left to merge
    if (model, p_tp, d_tp, layout) == ("llama-3.1-70b", 8, 4, "flash_attn_hnd"):
        assert all(x.factored for x in fresh)  # 4 KiB head slices never merge: nothing materialised
    if p_tp == d_tp and not shuffled:  # consecutive ids: runs merge across blocks
        assert all(x.count <= 3 * 80 * 2 < n * 80 * 2 for x in fresh)  # full chunks: 160; partial last: 320
    if p_tp == d_tp and shuffled is True:  # nothing merges: kept factored
        assert all(x.factored for x in fresh)


@pytest.mark.parametrize("layout", ["cross_layer", "universal", "flash_attn_hnd", "flashinfer"])
@pytest.mark.parametrize("bs_p,bs_d", [(16, 32), (32, 16), (16, 48)])
def test_block_size_mismatch_consecutive_ids_give_maximal_runs(layout, bs_p, bs_d):
    """Chunks smaller than a block cross block boundaries; with consecutive ids on both sides the runs
    across those boundaries merge too (a review found 8192 runs where 8185 were maximal)."""
    m = preset("llama-3.1-8b")
    p = engine(m, tp=1, bs=bs_p, num_blocks=96, layout=layout, role="prefill")
    d = engine(m, tp=1, bs=bs_d, num_blocks=96, layout=layout, role="decode")
    lp = LoweredPlan(plan_transfer(p, d), (0, 0))
    ntok = 16 * 48  # whole chunks and whole blocks on both sides
    pb = {"full": gb(range(10, 10 + ntok // bs_p))}
    db = {"full": gb(range(20, 20 + ntok // bs_d))}
    (x,) = lp.descriptors(ntok, pb, db)
    assert merge_adjacent(x.src, x.dst, x.nbytes)[0].size == x.count


# ---- templates shared across remote engines (canonical coordinates) --------------------------------
def _engine_owned(model, ptp, dtp, form, bs=16, nb=24):
    """A prefill and a decode engine of one layout pair, each rank's cache in its own allocations
    (engine-owned memory: numpy places them anywhere, in any order)."""
    import kvbridge
    from kvbridge.testing.engines import allocate
    m = kvbridge.load_model(model)
    P = EngineLayout(m, tp=ptp, block_size=bs, num_blocks=nb)
    D = EngineLayout(m, tp=dtp, block_size=bs, num_blocks=nb)
    caches = []  # keep the tensors alive
    mems = []
    for eng, seed in ((P, 1), (P, 2), (D, 3)):
        per_rank = {}
        for r in eng.ranks():
            c = allocate(eng, r, form, seed)
            caches.append(c)
            per_rank[r] = kvbridge.describe_memory(eng, r, c.layers)
        mems.append(per_rank)
    return plan_transfer(P, D), mems, caches


def _relocated(mem, shift):
    """``mem`` with allocation ``i`` (in address order) moved by ``shift + i * 2 MiB``: another engine
    of the same shape elsewhere in memory (nothing is read there)."""
    from dataclasses import replace

    from kvbridge.memory import Allocation, KVMemory
    starts = [a.addr for a in mem.allocations]
    delta = [shift + i * (2 << 20) for i in range(len(starts))]

    def move(x):
        return x + delta[max(i for i, s in enumerate(starts) if s <= x)]
    regions = {g: replace(r, components=tuple(replace(v, layer_offsets=tuple(move(o) for o in v.layer_offsets))
                                              for v in r.components)) for g, r in mem.regions.items()}
    return KVMemory(mem.engine, mem.rank, regions,
                    [Allocation(a.addr + d, a.nbytes, a.device) for a, d in zip(mem.allocations, delta)])


@pytest.mark.parametrize("model, ptp, dtp, form", [
    ("tiny-dense", 2, 1, "vllm-LBNHC"), ("tiny-dense", 1, 2, "flash_attn"), ("tiny-dense", 2, 2, "scattered"),
    ("tiny-mla", 2, 1, "flash_attn"), ("jamba-1.5-mini", 2, 1, "separate")])
def test_shared_templates_equal_templates_built_on_each_engines_memory(model, ptp, dtp, form):
    """Every template an engine gets from the shared cache (built on another engine's memory in
    canonical coordinates, moved to its own addresses) equals, array for array, the template built
    directly on its own memory; full chunks and every partial chunk. The engine relocated from the
    first one (same shape, other addresses) builds nothing."""
    from kvbridge.lower import TEMPLATES, build_template
    plan, (pa, pb, dm), _keep = _engine_owned(model, ptp, dtp, form)
    moved_a = {r: _relocated(m, 1 << 44) for r, m in pa.items()}
    TEMPLATES.clear()
    for d_rank in plan.decode.ranks():
        for p_mems in (pa, moved_a, pb):
            misses = TEMPLATES.misses
            lp = LoweredPlan(plan, d_rank, prefill_mems={p: p_mems[p] for p in plan.prefill_ranks_for(d_rank)},
                             decode_mem=dm[d_rank])
            for lows in lp.by_prefill.values():
                for low in lows:
                    for ntok in range(1, low.chunk + 1):
                        got = lp.template(low, ntok)
                        want = build_template(lp.p_mem(low.read.prefill), lp.d_mem, low.read, low.layers, ntok)
                        for f in ("src_rel", "dst_rel", "nbytes", "src_bs", "dst_bs"):
                            a, b = getattr(got, f), getattr(want, f)
                            assert (a is None) == (b is None), f
                            if a is not None:
                                np.testing.assert_array_equal(a, b, err_msg=f"{f} ntok={ntok}")
                        assert (got.run_major, got.mergeable, got.runs_two_chunks, got.uniform) == \
                               (want.run_major, want.mergeable, want.runs_two_chunks, want.uniform)
            if p_mems is moved_a:
                assert TEMPLATES.misses == misses  # every template came from the first engine's


def test_template_cache_is_bounded_least_recently_used_first():
    from kvbridge.lower import ChunkTemplate, TemplateCache
    cache = TemplateCache(max_bytes=3 * 3 * 80)  # three templates of 10 runs (3 arrays x 10 x 8 B)

    def tpl():
        z = np.zeros(10, np.int64)
        return ChunkTemplate(z.copy(), z.copy(), z.copy(), False, False, 10)
    for k in range(3):
        cache.get(k, tpl)
    cache.get(0, tpl)  # 0 used again: 1 is now the oldest
    cache.get(3, tpl)
    assert len(cache) == 3 and cache.bytes <= cache.max_bytes
    built = []
    cache.get(1, lambda: built.append(1) or tpl())  # 1 was evicted: rebuilt
    cache.get(0, lambda: built.append(0) or tpl())  # 0 was kept
    assert built == [1]
    with pytest.raises(ValueError):  # shared arrays are read-only
        cache.get(0, tpl).src_rel[0] = 1
