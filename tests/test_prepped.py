"""Prepared descriptor lists (issue 14): index arrays expand to exactly the lowered descriptors, and a
read posted through NIXL's prepped lists (two agents in one process, DRAM) is byte-exact."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvbridge.layout import EngineLayout, MemoryLayout
from kvbridge.lower import GroupBlocks, LoweredPlan, merge_adjacent
from kvbridge.memory import rank_memory
from kvbridge.models import load_model
from kvbridge.plan import plan_transfer
from kvbridge.prepped import PreparedGeometry
from kvbridge.transport.nixl import nixl_available

CASES = [  # model, p_tp, d_tp, layout, p_bs, d_bs, tokens
    ("tiny-dense", 2, 1, "flash_attn_hnd", 16, 16, 256),
    ("tiny-dense", 1, 2, "flash_attn_hnd", 16, 16, 203),
    ("tiny-dense", 2, 1, "cross_layer", 16, 32, 203),
    ("tiny-dense", 1, 2, "universal", 48, 32, 190),
    ("tiny-mla", 2, 1, "flash_attn_hnd", 16, 16, 100),
    ("jamba-1.5-mini", 2, 1, "flash_attn_hnd", 16, 16, 64),
    # groups with their own block sizes (vLLM's hybrid allocator): (default, {group: block size})
    ("gemma-4-mini", 2, 1, "flash_attn_hnd", (16, (("full", 32),)), (16, (("sliding", 32),)), 150),
]


def _bs(bs):
    return (bs, ()) if isinstance(bs, int) else bs


def _setup(model, ptp, dtp, layout, pbs, dbs, nb=40):
    m = load_model(model)
    P = EngineLayout(m, tp=ptp, block_size=_bs(pbs)[0], group_block_sizes=_bs(pbs)[1],
                     memory=MemoryLayout.parse(layout), num_blocks=nb, role="prefill")
    D = EngineLayout(m, tp=dtp, block_size=_bs(dbs)[0], group_block_sizes=_bs(dbs)[1],
                     memory=MemoryLayout.parse(layout), num_blocks=nb, role="decode")
    return m, plan_transfer(P, D), nb


def _blocks(m, tokens, bs, nb, shuffled, rng, slot):
    out = {}
    for g in m.groups:
        n = -(-tokens // dict(_bs(bs)[1]).get(g.name, _bs(bs)[0]))
        ids = rng.permutation(nb)[:n] if shuffled else np.arange(n)
        out[g.name] = GroupBlocks(ids if g.per_token else [slot])
    return out


def _norm(s, d, n):
    o = np.lexsort((s, d))
    return merge_adjacent(s[o], d[o], n[o])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("shuffled", [False, True])
def test_prepped_indices_expand_to_the_lowered_descriptors(case, shuffled):
    model, ptp, dtp, layout, pbs, dbs, tokens = case
    m, plan, nb = _setup(model, ptp, dtp, layout, pbs, dbs)
    rng = np.random.default_rng(3)
    for drank in plan.decode.ranks():
        bases = {r: (1 << 40) * (i + 1) for i, r in enumerate(plan.prefill_ranks_for(drank))}
        lp = LoweredPlan(plan, drank, bases, 1 << 44)
        pb, db = _blocks(m, tokens, pbs, nb, shuffled, rng, 3), _blocks(m, tokens, dbs, nb, shuffled, rng, 5)
        for d in lp.descriptors(tokens, pb, db):
            geo = PreparedGeometry(lp, d.prefill)
            ranges = geo.validate(tokens, pb, db)
            req = geo.request(ranges, pb, db)
            la, ll = geo.addresses(geo.local_rows, req.local_ids)
            ra, rl = geo.addresses(geo.remote_rows, req.remote_ids)
            assert np.array_equal(ll, rl)
            if req.tail is not None:
                ra, la, ll = (np.concatenate([a, b]) for a, b in zip((ra, la, ll), req.tail))
            got, want = _norm(ra, la, ll), _norm(d.src.copy(), d.dst.copy(), d.nbytes.copy())
            assert all(np.array_equal(x, y) for x, y in zip(got, want))
            assert geo.size(ranges) == (req.count, d.total_bytes)
            assert req.local_ids.dtype == np.int32


def _run_nixl_read(case, shuffled):
    from kvbridge.testing.oracle import copy_runs_reference
    from kvbridge.transport.nixl import NixlTransport
    model, ptp, dtp, layout, pbs, dbs, tokens = case
    m, plan, nb = _setup(model, ptp, dtp, layout, pbs, dbs)
    drank = (0, 0)
    d_t = NixlTransport("i14-dec")
    p_ts, pbufs, bases, agents = {}, {}, {}, {}
    try:
        dbuf = np.zeros(rank_memory(plan.decode, *drank).size, np.uint8)
        dbase = d_t.register(dbuf)
        rng = np.random.default_rng(7)
        for prank in plan.prefill_ranks_for(drank):
            t = p_ts[prank] = NixlTransport(f"i14-pre{prank[0]}{prank[1]}", multi_threaded=False)
            buf = pbufs[prank] = rng.integers(0, 256, rank_memory(plan.prefill, *prank).size, dtype=np.uint8)
            bases[prank] = t.register(buf)
            agents[prank] = d_t.add_peer(t.metadata())
        lp = LoweredPlan(plan, drank, bases, dbase)
        pb, db = _blocks(m, tokens, pbs, nb, shuffled, rng, 3), _blocks(m, tokens, dbs, nb, shuffled, rng, 5)
        expect = np.zeros_like(dbuf)
        for d in lp.descriptors(tokens, pb, db):
            copy_runs_reference(expect, d.dst - dbase, pbufs[d.prefill], d.src - bases[d.prefill], d.nbytes)
        preps = {p: d_t.prepare(agents[p], lp, p) for p in agents}
        xs = []
        for p, prep in preps.items():
            if prep is None:
                continue
            ranges = prep.geometry.validate(tokens, pb, db)
            xs.append((p, d_t.read_prepped(prep, ranges, pb, db, notif=b"done")))
        for p, x in xs:
            deadline = time.monotonic() + 30
            while d_t.check(x) != "DONE":
                assert time.monotonic() < deadline
                time.sleep(1e-3)
            d_t.release(x)
        assert np.array_equal(dbuf, expect)
        assert d_t.live_handles() == 0
        deadline = time.monotonic() + 10  # every prefill rank read got its notification
        got = set()
        while len(got) < len(xs) and time.monotonic() < deadline:
            for p, t in p_ts.items():
                if any(b"done" in v for v in t.get_notifs().values()):
                    got.add(p)
            time.sleep(1e-3)
        assert got == {p for p, _ in xs}
        for prep in preps.values():
            d_t.unprepare(prep)
    finally:
        d_t.close()
        for t in p_ts.values():
            t.close()


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
@pytest.mark.parametrize("case", CASES[:4] + CASES[5:], ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("shuffled", [False, True])
def test_prepped_nixl_read_is_byte_exact(case, shuffled):
    _run_nixl_read(case, shuffled)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("shuffled", [False, True])
def test_loopback_transport_prepped_and_plain_reads_are_byte_exact(case, shuffled):
    from kvbridge.testing.oracle import copy_runs_reference
    from kvbridge.transport.base import Transport
    from kvbridge.transport.loopback import LoopbackRegistry, LoopbackTransport
    model, ptp, dtp, layout, pbs, dbs, tokens = case
    m, plan, nb = _setup(model, ptp, dtp, layout, pbs, dbs)
    reg = LoopbackRegistry()
    dec = LoopbackTransport("dec", reg)
    assert isinstance(dec, Transport)
    rng = np.random.default_rng(11)
    drank = (0, 0)
    bufs, bases, agents, pts = {}, {}, {}, {}
    for prank in plan.prefill_ranks_for(drank):
        t = pts[prank] = LoopbackTransport(f"pre{prank}", reg)
        bufs[prank] = rng.integers(0, 256, rank_memory(plan.prefill, *prank).size, dtype=np.uint8)
        bases[prank] = t.register(bufs[prank])
        agents[prank] = dec.add_peer(t.metadata())
    for use_prepped in (True, False):
        dbuf = np.zeros(rank_memory(plan.decode, *drank).size, np.uint8)
        dbase = dec.register(dbuf)
        lp = LoweredPlan(plan, drank, bases, dbase)
        pb, db = _blocks(m, tokens, pbs, nb, shuffled, rng, 3), _blocks(m, tokens, dbs, nb, shuffled, rng, 5)
        expect = np.zeros_like(dbuf)
        for d in lp.descriptors(tokens, pb, db):
            copy_runs_reference(expect, d.dst - dbase, bufs[d.prefill], d.src - bases[d.prefill], d.nbytes)
            if use_prepped:
                prep = dec.prepare(agents[d.prefill], lp, d.prefill)
                x = dec.read_prepped(prep, prep.geometry.validate(tokens, pb, db), pb, db, b"ok")
            else:
                x = dec.read_descs(agents[d.prefill], d, b"ok")
            assert dec.check(x) == "DONE"
            dec.release(x)
        assert np.array_equal(dbuf, expect)
        assert all(t.get_notifs() == {"dec": [b"ok"]} for t in pts.values())
        dec.deregister(dbuf)
    assert dec.live_handles() == 0


def test_loopback_refuses_reads_outside_registered_memory():
    from kvbridge.errors import TransferError
    from kvbridge.transport.loopback import LoopbackRegistry, LoopbackTransport
    reg = LoopbackRegistry()
    a, b = LoopbackTransport("a", reg), LoopbackTransport("b", reg)
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    sa, da = a.register(src), b.register(dst)
    peer = b.add_peer(a.metadata())
    with pytest.raises(TransferError, match="outside"):
        b.read(peer, np.array([sa + 60]), np.array([da]), np.array([8]))
    b.read(peer, np.array([sa + 8]), np.array([da]), np.array([8]))
    assert dst[:8].tolist() == list(range(8, 16))
