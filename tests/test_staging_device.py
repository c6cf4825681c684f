"""Staging pack/scatter on the KV memory's own device: one code path for numpy arrays and torch tensors
(CPU here; CUDA tensors take the same torch index/copy operations). Skipped where torch is absent."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvbridge import staging
from kvbridge.testing.oracle import copy_runs_reference


def _runs(rng, size, n, align):
    starts = np.sort(rng.choice(size // (2 * align), n, replace=False)) * 2 * align
    lens = rng.integers(1, 3, n) * align
    return starts.astype(np.int64), lens.astype(np.int64)


@pytest.mark.parametrize("align", [1, 3, 8, 4096])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_pack_scatter_round_trip_on_the_tensors_device(kind, align):
    rng = np.random.default_rng(align)
    size = 64 * align * 4
    src, nbytes = _runs(rng, size, 40, align)
    host = rng.integers(0, 256, size, dtype=np.uint8)
    expect_packed = np.zeros(int(nbytes.sum()) + 16, np.uint8)
    copy_runs_reference(expect_packed, staging.offsets(nbytes) + 16, host, src, nbytes)
    perm = rng.permutation(src.size)  # scatter into shuffled places
    if kind == "torch":
        torch = pytest.importorskip("torch")
        buf = torch.from_numpy(host.copy())
        out = torch.zeros(expect_packed.size, dtype=torch.uint8)
        back = torch.zeros(size, dtype=torch.uint8)
        as_np = lambda t: t.numpy()  # noqa: E731
    else:
        buf, out, back = host.copy(), np.zeros(expect_packed.size, np.uint8), np.zeros(size, np.uint8)
        as_np = lambda a: a  # noqa: E731
    assert staging.pack(buf, src, nbytes, out, 16) == int(nbytes.sum())
    assert np.array_equal(as_np(out), expect_packed)
    staging.scatter(out, back, src, nbytes, 16)
    want = np.zeros(size, np.uint8)
    copy_runs_reference(want, src, host, src, nbytes)
    assert np.array_equal(as_np(back), want)
    # fancy on both sides: runs to other places in another order
    dst2 = src[perm]
    n2 = nbytes.copy()
    ok = np.all(n2 <= np.diff(np.append(np.sort(dst2), size))[np.argsort(np.argsort(dst2))])
    if ok:
        tgt = np.zeros(size, np.uint8)
        got = torch.zeros(size, dtype=torch.uint8) if kind == "torch" else np.zeros(size, np.uint8)
        staging.copy_runs(got, dst2, buf, src, n2)
        copy_runs_reference(tgt, dst2, host, src, n2)
        assert np.array_equal(as_np(got), tgt)


def test_torch_tensors_of_other_dtypes_are_byte_buffers():
    torch = pytest.importorskip("torch")
    t = torch.arange(64, dtype=torch.float32)
    out = torch.zeros(16, dtype=torch.float32)
    staging.pack(t, np.array([0, 128]), np.array([32, 32]), out)
    assert out.tolist() == [*range(8), *range(32, 40)]


def test_staging_does_not_import_torch():
    code = ("import sys, numpy as np; from kvbridge import staging; a = np.arange(16, dtype=np.uint8); "
            "o = np.zeros(8, np.uint8); staging.pack(a, np.array([0, 8]), np.array([4, 4]), o); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env=None)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_rank_kv_bytes_pack_and_scatter_across_many_allocations(kind):
    """The runtime's byte access to an engine's KV memory (``memhost.KVBytes``): one allocation per layer,
    runs of every allocation in shuffled order; pack then scatter reproduces the bytes, through numpy for
    numpy arrays and through torch (the CUDA code path) for torch tensors."""
    import kvbridge
    from kvbridge.runtime.memhost import KVBytes, to_host
    from kvbridge.tensors import host_view
    from kvbridge.testing.engines import allocate
    eng = kvbridge.EngineLayout(kvbridge.load_model("tiny-dense"), tp=1, block_size=16, num_blocks=8)
    layers = allocate(eng, (0, 0), "separate").layers
    if kind == "torch":
        torch = pytest.importorskip("torch")
        layers = {lay: kvbridge.LayerKV(torch.from_numpy(s.tensor), s.axes) for lay, s in layers.items()}
    mem = kvbridge.describe_memory(eng, (0, 0), layers)
    assert len(mem.allocations) > 1
    rng = np.random.default_rng(3)
    for a in mem.allocations:
        host_view(a.addr, a.nbytes)[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)
    src = np.concatenate([a.addr + rng.choice(a.nbytes // 256, 6, replace=False) * 256 for a in mem.allocations])
    src = rng.permutation(src).astype(np.int64)
    nbytes = rng.integers(1, 5, src.size).astype(np.int64) * 64
    want = np.concatenate([host_view(int(s), int(n)).copy() for s, n in zip(src, nbytes)])
    kv = KVBytes(mem)
    assert (kv.torch is not None) == (kind == "torch")
    stg = kv.new_staging(int(nbytes.sum()) + 128)
    assert kv.pack(src, nbytes, stg, 128) == int(nbytes.sum())
    assert np.array_equal(to_host(stg)[128:], want)
    for a in mem.allocations:
        host_view(a.addr, a.nbytes)[:] = 0
    kv.scatter(stg, src, nbytes, 128)
    assert np.array_equal(np.concatenate([host_view(int(s), int(n)) for s, n in zip(src, nbytes)]), want)


CASES = [  # (model, prefill tp, block, layout), (decode tp, block, layout), tokens, block ids in order
    ("tiny-dense", (2, 16, "flash_attn"), (1, 32, "LBNHC"), 200, False),
    ("tiny-dense", (2, 16, "flash_attn_hnd"), (1, 16, "cross_layer"), 197, True),
    ("tiny-mla", (2, 32, "LBNHC"), (1, 16, "LBNHC"), 200, True),
    ("tiny-mla", (1, 16, "LBNHC"), (1, 32, "LBNHC"), 150, False),
    ("gemma-4-mini", (2, 32, "flashinfer"), (1, 16, "flash_attn"), 230, False),
    ("tiny-hybrid", (1, 16, "LBNHC"), (1, 16, "flash_attn_hnd"), 100, False),
]


@pytest.mark.parametrize("gather,width,cpu", [("rows", 8, "numpy"), ("strided", 8, "numpy"), ("strided", 16, "numpy"),
                                               ("rows", 8, "torch"), ("strided", 16, "torch")])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1][2]}-{c[2][2]}-{c[3]}" for c in CASES])
def test_device_copies_of_lowered_requests_match_the_oracle(case, gather, width, cpu, monkeypatch):
    """A request's runs straight from the lowering's factored descriptors (per-chunk bases x template,
    merged arrays, partial-chunk tails, several groups), packed segment by segment from the prefill's
    memory and scattered into the decode's by :class:`staging.DeviceCopies` (torch, run starts computed
    on the tensors' device): the packed stream and the decode bytes equal the per-run reference copy."""
    torch = pytest.importorskip("torch")
    from kvbridge.layout import EngineLayout, MemoryLayout
    from kvbridge.lower import LoweredPlan
    from kvbridge.memory import rank_memory
    from kvbridge.models import load_model
    from kvbridge.plan import plan_transfer
    from kvbridge.testing.verify import BlockPool, make_request
    monkeypatch.setattr(staging, "GATHER_UNALIGNED", gather)
    monkeypatch.setattr(staging, "MAX_ELEMENT", width)
    monkeypatch.setattr(staging, "CPU_COPIES", cpu)  # torch's ops: the operations CUDA tensors take
    name, (ptp, pbs, play), (dtp, dbs, dlay), ntok, in_order = case
    m = load_model(name)
    p = EngineLayout(m, tp=ptp, block_size=pbs, memory=MemoryLayout.parse(play), num_blocks=24)
    d = EngineLayout(m, tp=dtp, block_size=dbs, memory=MemoryLayout.parse(dlay), num_blocks=24)
    rng = np.random.default_rng(ntok)
    req = make_request(
        0, ntok, p, d, BlockPool(p, rng, shuffled=not in_order), BlockPool(d, rng, shuffled=not in_order)
    )
    lp = LoweredPlan(plan_transfer(p, d), (0, 0))
    pbufs = {r: rng.integers(0, 256, rank_memory(p, *r).size, dtype=np.uint8) for r in p.ranks()}
    dsize = rank_memory(d, 0, 0).size
    want, got = np.zeros(dsize, np.uint8), torch.zeros(dsize, dtype=torch.uint8)
    dec = staging.DeviceCopies(torch, got, 0)
    kinds = set()
    for ds in lp.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks):
        kinds |= {type(part).__name__ for part in ds._parts}
        copy_runs_reference(want, ds.dst, pbufs[ds.prefill], ds.src, ds.nbytes)
        packed = np.zeros(ds.total_bytes + 64, np.uint8)
        copy_runs_reference(packed, staging.offsets(ds.nbytes) + 64, pbufs[ds.prefill], ds.src, ds.nbytes)
        lengths = staging.run_lengths(ds)
        assert np.array_equal(lengths, ds.nbytes)
        pre = staging.DeviceCopies(torch, torch.from_numpy(pbufs[ds.prefill]), 0)
        stg = torch.zeros(ds.total_bytes + 64, dtype=torch.uint8)
        pos = 64
        for a, b in staging.segment_bounds(lengths, max(1, ds.total_bytes // 5)):  # several segments
            n = pre.pack(staging.RunSlice(ds, "src", a, b), lengths[a:b], stg, pos)
            assert n == int(lengths[a:b].sum())
            dec.scatter(stg, staging.RunSlice(ds, "dst", a, b), lengths[a:b], pos)
            pos += n
        assert pos == 64 + ds.total_bytes
        assert np.array_equal(stg.numpy(), packed)
    assert want.any() and np.array_equal(got.numpy(), want)
    assert kinds  # the factored form and/or merged arrays, as the lowering chose


@pytest.mark.parametrize("cpu", ["numpy", "torch"])
@pytest.mark.parametrize("run_major", [False, True])
def test_device_copies_of_a_template_with_runs_of_several_lengths(run_major, cpu, monkeypatch):
    """A factored part whose template runs have different lengths (run-major and chunk-major order), in
    segments that cut through chunks: packed and scattered on the device like the reference."""
    torch = pytest.importorskip("torch")
    from kvbridge.lower import ChunkTemplate, Descriptors, _Outer
    monkeypatch.setattr(staging, "CPU_COPIES", cpu)
    rng = np.random.default_rng(int(run_major))
    tpl = ChunkTemplate(np.array([0, 96, 400, 1000], np.int64), np.array([0, 200, 260, 900], np.int64),
                        np.array([96, 48, 144, 24], np.int64), run_major, False, 0, uniform=False)
    s_chunk = rng.permutation(40)[:9].astype(np.int64) * 2048 + 8
    d_chunk = rng.permutation(40)[:9].astype(np.int64) * 1024 + 16
    ds = Descriptors(
        (0, 0), parts=[_Outer(s_chunk, d_chunk, tpl), (np.array([81920 - 40]), np.array([40000]), np.array([40]))]
    )
    src = rng.integers(0, 256, 81920, dtype=np.uint8)
    packed = np.zeros(ds.total_bytes, np.uint8)
    copy_runs_reference(packed, staging.offsets(ds.nbytes), src, ds.src, ds.nbytes)
    want = np.zeros(41000, np.uint8)
    copy_runs_reference(want, ds.dst, src, ds.src, ds.nbytes)
    lengths = staging.run_lengths(ds)
    assert np.array_equal(lengths, ds.nbytes)
    pre = staging.DeviceCopies(torch, torch.from_numpy(src), 0)
    got = torch.zeros(want.size, dtype=torch.uint8)
    dec = staging.DeviceCopies(torch, got, 0)
    stg = torch.zeros(ds.total_bytes, dtype=torch.uint8)
    pos = 0
    for a, b in staging.segment_bounds(lengths, 700):
        n = pre.pack(staging.RunSlice(ds, "src", a, b), lengths[a:b], stg, pos)
        dec.scatter(stg, staging.RunSlice(ds, "dst", a, b), lengths[a:b], pos)
        pos += n
    assert pos == ds.total_bytes
    assert np.array_equal(stg.numpy(), packed) and np.array_equal(got.numpy(), want)
