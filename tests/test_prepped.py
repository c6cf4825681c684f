"""Prepared descriptor lists (issue 14): index arrays expand to exactly the lowered descriptors, and a
read posted through NIXL's prepped lists (two agents in one process, DRAM) is byte-exact."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvbridge import prepped
from kvbridge.layout import EngineLayout, MemoryLayout
from kvbridge.lower import GroupBlocks, LoweredPlan, merge_adjacent
from kvbridge.memory import rank_memory
from kvbridge.models import load_model
from kvbridge.plan import plan_transfer
from kvbridge.prepped import PreparedGeometry
from kvbridge.transport.base import DirectRead
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
            _check_expands(geo, req, d)
            assert geo.size(ranges) == (req.count, d.total_bytes)  # no spans: 40 blocks < 2 x 64 - 1
            assert req.local_ids.dtype == np.int32


def _check_expands(geo, req, d):
    """``req``'s ids (through the rows they index) plus its tail are exactly the lowered descriptors
    ``d``, once both are sorted and merged."""
    lrows, rrows = geo.rows(req)
    la, ll = geo.addresses(lrows, req.local_ids)
    ra, rl = geo.addresses(rrows, req.remote_ids)
    assert np.array_equal(ll, rl)
    if req.tail is not None:
        ra, la, ll = (np.concatenate([a, b]) for a, b in zip((ra, la, ll), req.tail))
    got, want = _norm(ra, la, ll), _norm(d.src.copy(), d.dst.copy(), d.nbytes.copy())
    assert all(np.array_equal(x, y) for x, y in zip(got, want))
    assert int(ll.sum()) == d.total_bytes


def _run_nixl_read(case, shuffled=False, blocks=None, nb=40, inline="default"):
    """Read one request of ``case`` through NIXL's prepped lists (every prefill rank of decode rank
    (0, 0)); the decode buffer must equal the lowered descriptors' reference copy byte for byte.
    ``blocks(m, rng) -> (prefill blocks, decode blocks)`` overrides the block ids. Returns the posted
    requests (``PreppedRequest`` per prefill rank). ``inline``: "always" (every read small enough to be
    posted on this thread: each must be), "never" (inline_post_bytes=0: none may be), "busy" (the post
    thread is held by a read queued behind another job: no later read may be posted here, whatever
    its size), "default" (the transport's own setting)."""
    from kvbridge.testing.oracle import copy_runs_reference
    from kvbridge.transport.nixl import NixlTransport
    model, ptp, dtp, layout, pbs, dbs, tokens = case
    m, plan, nb = _setup(model, ptp, dtp, layout, pbs, dbs, nb)
    drank = (0, 0)
    d_t = NixlTransport("i14-dec")
    if inline != "default":
        d_t.inline_post_bytes = 0 if inline in ("never", "busy") else 1 << 40
    release_pool = threading.Event()
    p_ts, pbufs, bases, agents = {}, {}, {}, {}
    posted = []
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
        if blocks is None:
            pb, db = _blocks(m, tokens, pbs, nb, shuffled, rng, 3), _blocks(m, tokens, dbs, nb, shuffled, rng, 5)
        else:
            pb, db = blocks(m, rng)
        expect = np.zeros_like(dbuf)
        for d in lp.descriptors(tokens, pb, db):
            copy_runs_reference(expect, d.dst - dbase, pbufs[d.prefill], d.src - bases[d.prefill], d.nbytes)
        preps = {p: d_t.prepare(agents[p], lp, p) for p in agents}
        xs = []
        if inline == "busy":
            d_t._pool.submit(release_pool.wait, 30)  # the post thread is busy until the reads are all posted
        for p, prep in preps.items():
            if prep is None:
                continue
            ranges = prep.geometry.validate(tokens, pb, db)
            posted.append(prep.geometry.request(ranges, pb, db))  # what post builds on its thread
            xs.append((p, d_t.post(prep.peer, DirectRead(p, prep, ranges, pb, db, True), notif=b"done")))
            if inline == "busy":
                d_t.inline_post_bytes = 1 << 40  # the first read is queued: no later one may skip the queue
        if inline == "always":
            assert d_t.stats.inline_posts == len(xs) and all(x.future.done() for _, x in xs)
        elif inline in ("never", "busy"):
            assert d_t.stats.inline_posts == 0
            if inline == "busy":
                assert not any(x.future.done() for _, x in xs)
        release_pool.set()
        for _p, x in xs:
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
        assert d_t.stats.dlists_prepared == d_t.stats.dlists_released
    finally:
        d_t.close()
        for t in p_ts.values():
            t.close()
    return posted


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
@pytest.mark.parametrize("case", CASES[:4] + CASES[5:], ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("shuffled", [False, True])
def test_prepped_nixl_read_is_byte_exact(case, shuffled):
    _run_nixl_read(case, shuffled)


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
@pytest.mark.parametrize("inline", ["always", "never", "busy"])
def test_small_reads_are_posted_on_the_callers_thread_only_when_the_post_thread_is_idle(inline):
    """``inline_post_bytes``: a read no larger is posted (and on cma copied) on the caller's thread, unless a
    post is queued or running on the post thread (then it queues behind it, never overtaking it); byte-exact
    either way, every notification sent."""
    posted = _run_nixl_read(CASES[2], True, inline=inline)  # two prefill ranks, a partial last chunk each
    assert len(posted) == 2 and all(r.tail is not None for r in posted)


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
                work = DirectRead(d.prefill, prep, prep.geometry.validate(tokens, pb, db), pb, db, True)
                x = dec.post(prep.peer, work, b"ok")
            else:
                x = dec.read(agents[d.prefill], d.src, d.dst, d.nbytes, b"ok")
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


# ---- span lists (issue 14 point 4: MLA and other whole-block runs) --------------------------------
# Small caches (64 blocks) with levels (8, 4) so every path is reached; the thresholds that keep spans
# off where they save too few ids are set to 0 here (their own test below uses the defaults).
SPAN_CASES = [  # runs that are whole blocks on both sides
    ("tiny-mla", 2, 1, "flash_attn_hnd", 16, 16, 700),       # per-layer MLA blocks (P>D: replicated)
    ("tiny-dense", 1, 1, "flash_attn_hnd", 16, 16, 700),     # K and V blocks of each layer
    ("tiny-dense", 2, 2, "cross_layer", 16, 16, 700),        # one run = every layer of a block
]
NOT_BLOCK_CONTIGUOUS = [  # one side's runs are part of a block: no span rows at all
    ("tiny-dense", 1, 2, "flash_attn_hnd", 16, 16, 700),     # prefill: half the heads of its block
    ("tiny-dense", 2, 1, "flash_attn_hnd", 16, 16, 700),     # decode: half the heads of its block
    ("tiny-mla", 1, 1, "flash_attn_hnd", 16, 32, 700),       # two chunks per decode block
]
SPAN_NB = 64


@pytest.fixture
def span_levels(monkeypatch):
    monkeypatch.setattr(prepped, "SPAN_LEVELS", (8, 4))
    monkeypatch.setattr(prepped, "SPAN_MIN_SAVED_PER_STRETCH", 0)
    monkeypatch.setattr(prepped, "SPAN_MIN_IDS", 0)


def _ids(m, p_ids, d_ids, d_first=0):
    """Per-token groups get these ids (Mamba groups a slot)."""
    pb, db = {}, {}
    for g in m.groups:
        pb[g.name] = GroupBlocks(p_ids if g.per_token else [3])
        db[g.name] = GroupBlocks(d_ids if g.per_token else [5], d_first)
    return pb, db


def _stretches(starts_lens):
    ids = np.concatenate([np.arange(s, s + n) for s, n in starts_lens]).astype(np.int64)
    assert np.unique(ids).size == ids.size  # a block holds one token range
    return ids


TOKENS_BLOCKS = 44  # 700 tokens = 43 full blocks + a partial one (a tail)
PATTERNS = {
    # both sides contiguous, unaligned starts: spans of 8 and 4 from a phase != 0
    "contiguous": lambda rng: (np.arange(3, 47), np.arange(17, 61)),
    # one stretch crosses the other side's break: stretches 19|25 on prefill, 30|14 on decode -> 19|11|14
    "partial": lambda rng: (_stretches([(40, 19), (2, 25)]), _stretches([(0, 30), (45, 14)])),
    # stretches ending on the last block (the last entry of a phase row) and lengths 9, 13, 22
    "to-the-end": lambda rng: (_stretches([(55, 9), (0, 13), (30, 22)]), _stretches([(20, 9), (51, 13), (29, 22)])),
    "shuffled": lambda rng: (rng.permutation(SPAN_NB)[:TOKENS_BLOCKS], rng.permutation(SPAN_NB)[:TOKENS_BLOCKS]),
    # more stretches than the few-stretches path takes (the vectorised cut), breaks differing per side
    "many-stretches": lambda rng: (_gapped([5, 3, 9, 1, 4, 8, 2, 6, 4, 2]), _gapped([7, 7, 2, 9, 3, 5, 11])),
}


def _gapped(lens):
    """Stretches of ``lens`` blocks, one free block between them."""
    return _stretches([(sum(lens[:i]) + i, n) for i, n in enumerate(lens)])


@pytest.mark.parametrize("case", SPAN_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("few_pieces", [256, 0], ids=["lists", "segments"])
def test_span_ids_expand_to_the_lowered_descriptors(case, pattern, few_pieces, span_levels, monkeypatch):
    monkeypatch.setattr(prepped, "_FEW_PIECES", few_pieces)  # both ways of building a few stretches' pieces
    model, ptp, dtp, layout, pbs, dbs, tokens = case
    m, plan, nb = _setup(model, ptp, dtp, layout, pbs, dbs, SPAN_NB)
    rng = np.random.default_rng(5)
    bases = {r: (1 << 40) * (i + 1) for i, r in enumerate(plan.prefill_ranks_for((0, 0)))}
    lp = LoweredPlan(plan, (0, 0), bases, 1 << 44)
    pb, db = _ids(m, *PATTERNS[pattern](rng))
    for d in lp.descriptors(tokens, pb, db):
        geo = PreparedGeometry(lp, d.prefill)
        assert geo.local_span_rows is not None and any(sp is not None for sp in geo.spans)
        ranges = geo.validate(tokens, pb, db)
        req = geo.request(ranges, pb, db)
        _check_expands(geo, req, d)
        count, nbytes = geo.size(ranges)
        assert nbytes == d.total_bytes
        assert req.spans == (pattern != "shuffled")
        assert (req.count < count) if req.spans else (req.count == count)
        no_spans = PreparedGeometry(lp, d.prefill, span_levels=())
        assert no_spans.local_span_rows is None
        assert no_spans.request(ranges, pb, db).count == count


@pytest.mark.parametrize("case", SPAN_CASES + NOT_BLOCK_CONTIGUOUS, ids=lambda c: "-".join(map(str, c)))
def test_span_rows_are_dense_strided_rows_inside_the_buffers(case, span_levels):
    """NIXL's strided form needs ``len <= stride``; every entry of every row lies in the registered
    buffer (NIXL refuses the list otherwise: the byte-exact tests below prepare them for real)."""
    model, ptp, dtp, layout, pbs, dbs, tokens = case
    m, plan, nb = _setup(model, ptp, dtp, layout, pbs, dbs, SPAN_NB)
    lp = LoweredPlan(plan, (0, 0))
    spannable = case in SPAN_CASES
    for prank in plan.prefill_ranks_for((0, 0)):
        geo = PreparedGeometry(lp, prank)
        assert (geo.local_span_rows is not None) == spannable
        if not spannable:
            continue
        for rows, mem, base in ((geo.remote_span_rows, lp.p_mem(prank), 0), (geo.local_span_rows, lp.d_mem, 0)):
            r = rows.astype(np.int64)
            assert (r[:, 1] <= r[:, 3]).all() and (r[:, 4] >= 1).all()
            end = r[:, 0] + (r[:, 4] - 1) * r[:, 3] + r[:, 1]
            assert (r[:, 0] >= base).all() and (end <= base + mem.size).all()
            assert np.array_equal(rows[:len(geo.local_rows if mem is lp.d_mem else geo.remote_rows)],
                                  geo.local_rows if mem is lp.d_mem else geo.remote_rows)


def test_span_rows_stay_inside_one_engine_allocation():
    """Engine-owned memory (a registered allocation per layer): each span row lies in one allocation."""
    import kvbridge
    from kvbridge.testing.engines import allocate
    eng = kvbridge.EngineLayout(load_model("tiny-mla"), tp=1, block_size=16, num_blocks=160)
    p_mem = kvbridge.describe_memory(eng, (0, 0), allocate(eng, (0, 0), "separate").layers)
    d_mem = kvbridge.describe_memory(eng, (0, 0), allocate(eng, (0, 0), "separate", 1).layers)
    assert len(p_mem.allocations) > 1
    lp = LoweredPlan(plan_transfer(eng, eng), (0, 0), prefill_mems={(0, 0): p_mem}, decode_mem=d_mem)
    geo = PreparedGeometry(lp, (0, 0), span_levels=(64,))
    assert geo.local_span_rows is not None
    for rows, mem in ((geo.remote_span_rows, p_mem), (geo.local_span_rows, d_mem)):
        r = rows.astype(np.int64)
        end = r[:, 0] + (r[:, 4] - 1) * r[:, 3] + r[:, 1]
        assert all(mem.allocation_of(int(a), int(e - a)) >= 0 for a, e in zip(r[:, 0], end))
    # a run whose blocks are not all inside one allocation gets no span rows
    fake = type("M", (), {"allocations": p_mem.allocations})()
    lo = np.array([p_mem.allocations[0].addr, p_mem.allocations[0].end - 8])
    assert prepped._inside_one_allocation(fake, lo, lo + 16).tolist() == [True, False]


@pytest.mark.parametrize("case", NOT_BLOCK_CONTIGUOUS, ids=lambda c: "-".join(map(str, c)))
def test_no_spans_where_a_side_is_not_block_contiguous(case, span_levels):
    model, ptp, dtp, layout, pbs, dbs, tokens = case
    m, plan, nb = _setup(model, ptp, dtp, layout, pbs, dbs, SPAN_NB)
    lp = LoweredPlan(plan, (0, 0))
    pb, db = _ids(m, np.arange(0, 44), np.arange(-(-tokens // dbs)))
    for d in lp.descriptors(tokens, pb, db):
        geo = PreparedGeometry(lp, d.prefill)
        assert all(sp is None for sp in geo.spans) and geo.local_span_rows is None
        req = geo.request(geo.validate(tokens, pb, db), pb, db)
        assert not req.spans
        _check_expands(geo, req, d)


def test_spans_only_where_they_save_enough_ids():
    """Default thresholds, DeepSeek-V3 MLA (61 per-layer runs): a 2,048-block contiguous request and 8
    stretches of 256 blocks post spans of 64; stretches of 100 blocks (one span of 64 + 36 single blocks each)
    and a 200-block
    request (61 x 200 ids < SPAN_MIN_IDS) post per-block ids (measured slower with spans)."""
    m = load_model("deepseek-v3")
    P = EngineLayout(m, tp=1, block_size=16, memory=MemoryLayout.parse("flash_attn_hnd"), num_blocks=4096)
    lp = LoweredPlan(plan_transfer(P, P), (0, 0))
    geo = PreparedGeometry(lp, (0, 0), span_levels=(64,))
    runs = 61
    for ids, spans, n_ids in ((np.arange(100, 2148), True, runs * 32),
                              (_stretches([(i * 200, 100) for i in range(20)] + [(4000, 48)]), False, runs * 2048),
                              (np.arange(7, 207), False, runs * 200),
                              (_stretches([(i * 300, 256) for i in range(8)]), True, runs * 8 * 4)):
        pb, db = _ids(m, ids, ids)
        tokens = ids.size * 16
        req = geo.request(geo.validate(tokens, pb, db), pb, db)
        assert req.spans == spans and req.local_ids.size == n_ids
        _check_expands(geo, req, lp.descriptors(tokens, pb, db)[0])


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
@pytest.mark.parametrize("case", SPAN_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("pattern", list(PATTERNS) + ["prefix"])
def test_span_nixl_read_is_byte_exact(case, pattern, span_levels):
    """Spans posted through NIXL (two list pairs per prefill rank): contiguous, partly contiguous (a
    stretch crossing the other side's break, stretches ending on the last block), shuffled (no spans),
    and a prefix hit (decode blocks start at block 5 of the request)."""
    def blocks(m, rng):
        if pattern == "prefix":
            return _ids(m, np.arange(10, 54), np.arange(20, 59), d_first=5)
        return _ids(m, *PATTERNS[pattern](rng))
    posted = _run_nixl_read(case, blocks=blocks, nb=SPAN_NB)
    assert posted and any(r.spans for r in posted) == (pattern != "shuffled")


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
@pytest.mark.parametrize("case", NOT_BLOCK_CONTIGUOUS, ids=lambda c: "-".join(map(str, c)))
def test_not_block_contiguous_nixl_read_is_byte_exact(case, span_levels):
    def blocks(m, rng):
        return _ids(m, np.arange(3, 47), np.arange(10, 10 + -(-case[-1] // case[5])))
    posted = _run_nixl_read(case, blocks=blocks, nb=SPAN_NB)
    assert posted and not any(r.spans for r in posted)


@pytest.mark.parametrize("pattern", ["contiguous", "partial", "shuffled"])
def test_loopback_span_read_is_byte_exact(pattern, span_levels):
    from kvbridge.testing.oracle import copy_runs_reference
    from kvbridge.transport.loopback import LoopbackRegistry, LoopbackTransport
    m, plan, nb = _setup("tiny-mla", 2, 1, "flash_attn_hnd", 16, 16, SPAN_NB)
    reg = LoopbackRegistry()
    dec = LoopbackTransport("dec", reg)
    rng = np.random.default_rng(2)
    bufs, bases, agents = {}, {}, {}
    for prank in plan.prefill_ranks_for((0, 0)):
        t = LoopbackTransport(f"pre{prank}", reg)
        bufs[prank] = rng.integers(0, 256, rank_memory(plan.prefill, *prank).size, dtype=np.uint8)
        bases[prank] = t.register(bufs[prank])
        agents[prank] = dec.add_peer(t.metadata())
    dbuf = np.zeros(rank_memory(plan.decode, 0, 0).size, np.uint8)
    dbase = dec.register(dbuf)
    lp = LoweredPlan(plan, (0, 0), bases, dbase)
    pb, db = _ids(m, *PATTERNS[pattern](rng))
    expect = np.zeros_like(dbuf)
    for d in lp.descriptors(700, pb, db):
        copy_runs_reference(expect, d.dst - dbase, bufs[d.prefill], d.src - bases[d.prefill], d.nbytes)
        prep = dec.prepare(agents[d.prefill], lp, d.prefill)
        x = dec.post(prep.peer, DirectRead(d.prefill, prep, prep.geometry.validate(700, pb, db), pb, db, True), b"ok")
        dec.release(x)
        dec.unprepare(prep)
    assert np.array_equal(dbuf, expect) and expect.any()
    assert dec.stats.dlists_prepared == dec.stats.dlists_released == 4


def test_span_levels_setting():
    assert prepped._parse_levels("64") == (64,)
    assert prepped._parse_levels("16, 256") == (256, 16)
    assert prepped._parse_levels("0") == () and prepped._parse_levels("") == ()
    assert prepped._parse_levels("x") == (64,)


def test_partial_chunk_templates_are_built_on_first_use():
    """Handshake (the lists) builds only the full-chunk templates; a request whose last chunk is partial
    builds that one template, once, and its tail is the lowered descriptors' (byte-exact, above)."""
    m, plan, nb = _setup("tiny-dense", 2, 1, "flash_attn", 16, 16)
    drank = (0, 0)
    lp = LoweredPlan(
        plan, drank, {r: (1 << 40) * (i + 1) for i, r in enumerate(plan.prefill_ranks_for(drank))}, 1 << 44
    )
    prank = plan.prefill_ranks_for(drank)[0]
    geo = PreparedGeometry(lp, prank)
    lows = lp.by_prefill[prank]
    assert [sorted(low.templates) for low in lows] == [[low.chunk] for low in lows]
    rng = np.random.default_rng(0)
    for tokens in (16 * 3 + 5, 16 * 4 + 5, 16 * 2 + 9):
        pb, db = _blocks(m, tokens, 16, nb, True, rng, 0), _blocks(m, tokens, 16, nb, True, rng, 0)
        req = geo.request(geo.validate(tokens, pb, db), pb, db)
        _check_expands(geo, req, lp.descriptors(tokens, pb, db, only=[prank])[0])
    assert [sorted(low.templates) for low in lows] == [[5, 9, 16] for _ in lows]
