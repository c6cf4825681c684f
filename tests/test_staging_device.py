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
