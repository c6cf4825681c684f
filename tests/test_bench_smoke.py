"""Staging pack/scatter round trips, and a tiny benchmark scenario end to end (no timing assertions)."""
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbridge import staging
from kvbridge.layout import EngineLayout, MemoryLayout
from kvbridge.lower import LoweredPlan
from kvbridge.models import load_model
from kvbridge.plan import plan_transfer
from kvbridge.testing.oracle import copy_runs_reference
from kvbridge.testing.verify import BlockPool, make_request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchmarks/bench.py


def _runs(rng, size, n, lengths):
    """n non-overlapping runs with lengths drawn from ``lengths``, in random order."""
    lens = rng.choice(lengths, n).astype(np.int64)
    gaps = rng.integers(0, 64, n)
    starts = np.cumsum(lens + gaps) - lens
    assert starts[-1] + lens[-1] <= size
    perm = rng.permutation(n)
    return starts[perm], lens[perm]


@pytest.mark.parametrize("lengths", [[4096], [256, 4096], [1, 3, 7, 64, 100], list(range(1, 40))])
def test_pack_scatter_round_trip(lengths):
    rng = np.random.default_rng(len(lengths))
    size = 1 << 20
    n = 150
    buf = rng.integers(0, 256, size, dtype=np.uint8)
    src, nbytes = _runs(rng, size, n, lengths)
    out = np.zeros(int(nbytes.sum()) + 16, dtype=np.uint8)
    assert staging.pack(buf, src, nbytes, out, out_offset=16) == nbytes.sum()
    ref = np.zeros_like(out)
    copy_runs_reference(ref, staging.offsets(nbytes) + 16, buf, src, nbytes)
    assert np.array_equal(out, ref)
    dst, _ = _runs(rng, size, n, [int(nbytes.max())])  # destinations big enough for any run
    back = np.full(size, 0xA5, dtype=np.uint8)
    staging.scatter(out, back, dst, nbytes, staging_offset=16)
    expect = np.full(size, 0xA5, dtype=np.uint8)
    copy_runs_reference(expect, dst, buf, src, nbytes)  # direct copies, run by run
    assert np.array_equal(back, expect)


def test_staged_equals_direct_on_lowered_descriptors():
    """Pack + scatter through a staging buffer gives the same decode bytes as direct per-run copies."""
    m = load_model("tiny-dense")
    mk = lambda tp, lay: EngineLayout(m, tp=tp, block_size=16, memory=MemoryLayout.parse(lay), num_blocks=24)  # noqa: E731
    for lay in ("flash_attn_hnd", "cross_layer"):
        p, d = mk(2, lay), mk(1, lay)
        plan = plan_transfer(p, d)
        lp = LoweredPlan(plan, (0, 0))
        rng = np.random.default_rng(1)
        req = make_request(0, 200, p, d, BlockPool(p, rng), BlockPool(d, rng))
        from kvbridge.memory import rank_memory
        pbufs = {r: rng.integers(0, 256, rank_memory(p, *r).size, dtype=np.uint8) for r in p.ranks()}
        dsize = rank_memory(d, 0, 0).size
        direct, staged = np.zeros(dsize, np.uint8), np.zeros(dsize, np.uint8)
        for ds in lp.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks):
            copy_runs_reference(direct, ds.dst, pbufs[ds.prefill], ds.src, ds.nbytes)
            st = np.empty(ds.total_bytes, np.uint8)
            staging.pack(pbufs[ds.prefill], ds.src, ds.nbytes, st)
            staging.scatter(st, staged, ds.dst, ds.nbytes)
        assert np.array_equal(direct, staged)
        assert direct.any()


def test_vllm_descriptor_count():
    from bench import vllm_descriptor_count
    m = load_model("tiny-dense")  # 4 layers, K and V
    p = EngineLayout(m, tp=2, num_blocks=16)
    d = EngineLayout(m, tp=1, num_blocks=16)
    rng = np.random.default_rng(0)
    req = make_request(0, 100, p, d, BlockPool(p, rng), BlockPool(d, rng))  # 7 blocks
    assert vllm_descriptor_count(plan_transfer(p, d), (0, 0), req.decode_blocks) == 2 * 4 * 2 * 7


@pytest.mark.nixl
def test_bench_quick_scenario(tmp_path):
    pytest.importorskip("zmq")
    from kvbridge.transport.nixl import nixl_available
    if not nixl_available():
        pytest.skip("nixl not installed")
    from bench import QUICK, run_scenario
    rows = run_scenario(QUICK[0], "flash_attn_hnd", reps=1, allocs=("shuffled",), log=lambda *a: None)
    assert len(rows) == 1
    r = rows[0]
    assert r["bytes"] > 0 and r["descriptors"] > 0 and r["descriptors_vllm"] >= r["descriptors"]
    assert r["direct_gbps_best"] > 0 and r["staged_gbps_best"] > 0 and r["memcpy_gbps"]["best"] > 0
    assert r["staged_equals_direct"]
    assert r["cost_model_choice"] in ("direct", "staged", "mixed")
