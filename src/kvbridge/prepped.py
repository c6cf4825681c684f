"""Prepared (prepped) descriptor lists: a lowered plan as regular strided lists plus per-request indices.

At handshake, for one (decode rank, prefill rank) pair of a :class:`~kvbridge.lower.LoweredPlan`, every
full-chunk template run ``i`` of every read becomes, on each side, ``K`` strided rows (``K`` = chunks
per block on that side, 1 for a Mamba state slot): row ``(i, k)`` is the run at sub-chunk ``k`` of
every block, ``count = num_blocks`` entries ``stride = block_stride`` apart. Both sides' lists are
regular (an address, a length, a stride, a count per row: NIXL's Nx5 strided form), independent of the
number of blocks in their size, and built once.

Per request only index arrays are computed (vectorised, int32 where the list fits): entry ``(i, k, b)``
has index ``off + (i*K + k)*NB + b``. Indices are emitted run-major when the template says consecutive
blocks merge that way (so NIXL's prepped path merges adjacent ids itself), chunk-major otherwise, in the
same order as :class:`~kvbridge.lower.Descriptors`. The last, partial chunk of a request whose token
count is not a multiple of the chunk size has no entry in the lists: it comes back as a small
``(src, dst, nbytes)`` tail that the transport posts through its ordinary path; the template of a
partial chunk of ``n`` tokens is built on the first request that needs it (and shared with every remote
engine of the same memory shapes: :data:`kvbridge.lower.TEMPLATES`), not at handshake.

Span lists (multi-resolution). A template run whose consecutive blocks are adjacent in memory on both
sides (one chunk per block and run length == block stride on both sides, e.g. a whole MLA block of one
layer, or a whole cross-layer block) also gets, for each span level ``G`` (:data:`SPAN_LEVELS`), entries
that cover ``G`` consecutive blocks ``b .. b+G-1``, for every start ``b`` (``num_blocks - G + 1`` of
them), kept only where every block of the run lies in one registered allocation on each side. NIXL's
strided form refuses ``len > stride``, so the span entries of one run are ``G`` rows, one per phase
``b % G``: row ``(i, G, phase)`` starts at block ``phase``, ``length = stride = G * block stride``
(dense), ``count = (num_blocks - phase) // G``. They form a second list pair (``*_span_rows``: the
per-block rows, then the span rows, so per-block ids are the same in both pairs): NIXL's cost per posted
id grows with the rows of the list and, more, with every change of row between consecutive ids, so
requests without spans keep the small per-block lists. Per request, each maximal stretch of chunks
whose block ids are consecutive on both sides at once is cut (numpy, no loop over blocks; a few
stretches in plain Python) into spans of the largest level first, then smaller levels, then single
blocks; a 2,048-block contiguous MLA request posts 61 x 32 ids at ``G = 64`` instead of 61 x 2,048.
Spans are used only where they save at least :data:`SPAN_MIN_SAVED_PER_STRETCH` ids per stretch that
gets one; otherwise (shuffled ids, short stretches) the per-block path runs unchanged.
``KVBRIDGE_PREPPED_SPANS``: the levels, comma separated (default ``64``); ``0`` turns span lists off.
A level needs ``2G - 1 <= num_blocks`` on both sides (every phase row non-empty).

Transport independent: NIXL prepares the rows with ``prep_xfer_dlist``; the loopback transport expands
indices back to addresses (:meth:`PreparedGeometry.addresses`).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .lower import GroupBlocks, LoweredPlan, chunk_starts, locate

INT32_MAX = (1 << 31) - 1


def _parse_levels(text: str) -> tuple[int, ...]:
    """``"64"`` -> (64,), ``"256,16"`` -> (256, 16), ``"0"`` or ``""`` -> () (levels below 2 dropped)."""
    try:
        return tuple(sorted({int(x) for x in text.replace(" ", "").split(",") if x and int(x) > 1}, reverse=True))
    except ValueError:
        logging.getLogger(__name__).warning("KVBRIDGE_PREPPED_SPANS=%r is not a comma-separated list of integers; "
                                            "using 64", text)
        return (64,)


# span levels (blocks per span entry), largest first; () = no span lists. Read when a geometry is built.
SPAN_LEVELS: tuple[int, ...] = _parse_levels(os.environ.get("KVBRIDGE_PREPPED_SPANS", "64"))
# Spans are used for a request only where they save at least this many ids per stretch that gets one.
# Measured on NIXL 1.5 (MLA, 61 runs): an id costs make_prepped_xfer ~2 ns, but each change of row
# between consecutive ids (a span row, then the per-block row for the remainder, then the next
# stretch's span row) ~50-100 ns; stretches of 100 blocks with G = 64 posted slower with spans.
SPAN_MIN_SAVED_PER_STRETCH = 100
# ... and only where the request has at least this many per-block ids on the runs that have span rows:
# below it NIXL's saving (~2 ns an id) does not pay for cutting the request into spans (~15-100 µs of
# numpy and Python, more under load); e.g. a cross-layer block (one run) never qualifies, MLA's 61
# per-layer runs from 269 blocks (4,304 tokens at 16 a block) on.
SPAN_MIN_IDS = 16384


@dataclass(frozen=True)
class _PreppedRead:
    per_token: bool
    runs: int
    run_major: bool
    p_off: int     # first index of this read's entries in the remote (prefill) list
    d_off: int     # ... in the local (decode) list
    p_k: int       # chunks per block on each side
    d_k: int
    p_nb: int      # blocks (entries per row) on each side
    d_nb: int
    run_bytes: int  # bytes of one chunk (sum of the template's runs)


@dataclass(frozen=True)
class _Spans:
    """The span rows of one read: ``runs`` (template runs with span rows, in order), ``plain`` (the other
    runs), ``sizes`` (blocks per piece: the levels then 1); per side (0 remote, 1 local) ``tbl``
    ``(2, len(runs), levels+1)``: the first index of each run's rows of each size (column -1: its
    per-block row), and ``ph`` ``(2, levels+1, max level)``: where phase ``p``'s row starts among them.
    A piece of ``S`` blocks from block ``b`` is entry ``tbl[side, :, col] + ph[side, col, b % S] + b // S``."""

    runs: np.ndarray
    plain: np.ndarray
    sizes: np.ndarray
    tbl: np.ndarray
    ph: np.ndarray
    sizes_py: list[int]  # sizes and ph as Python lists (the few-stretches path reads single values)
    ph_py: list[Any]  # [side][level][phase]


def _inside_one_allocation(mem: Any, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per run: ``[lo, hi)`` (memory-relative addresses) lies in one registered allocation of ``mem``
    (kvbridge's own layout: one buffer of ``mem.size`` bytes)."""
    allocs = getattr(mem, "allocations", None)
    if allocs is None:
        return (lo >= 0) & (hi <= int(mem.size))
    starts = np.array([a.addr for a in allocs], dtype=np.int64)
    ends = np.array([a.end for a in allocs], dtype=np.int64)
    i = np.searchsorted(starts, lo, side="right") - 1
    ok = i >= 0
    return ok & (hi <= np.where(ok, ends[np.maximum(i, 0)], -1))


def _pieces(pos_r: np.ndarray, pos_l: np.ndarray, sp: _Spans, dt: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """Cut chunks (block positions ``pos_r``/``pos_l`` on the two sides, ``< 2**31``) into pieces: each
    maximal stretch of chunks consecutive on both sides at once becomes spans of ``sp.sizes[0]`` blocks,
    then of ``sp.sizes[1]`` ..., then single blocks (``sizes[-1] == 1``). Returns, in chunk order, the
    column of ``sizes`` of each piece and ``(2, pieces)`` offsets of its entry within its run's rows of
    that size (remote, local: ``ph[side, col, b % S] + b // S`` for a piece of ``S`` blocks from block
    ``b``); None when no stretch is as long as the smallest span or the spans save too few ids to pay
    for the row changes (:data:`SPAN_MIN_SAVED_PER_STRETCH`)."""
    sizes = sp.sizes
    n, gmin = pos_r.size, int(sizes[-2])
    if n < gmin:
        return None
    if _consecutive(pos_r) and _consecutive(pos_l):  # one stretch (contiguous on both sides): no ufuncs
        return _pieces_few([], n, sp, pos_r, pos_l, dt)
    key = pos_r << 32
    key += pos_l  # consecutive on both sides <=> key steps by 2**32 + 1
    brk = np.flatnonzero((key[1:] - key[:-1]) != _BOTH_NEXT)
    if brk.size > n - gmin:  # too few consecutive pairs left for even one span
        return None
    if brk.size < _FEW_STRETCHES:  # a few stretches: plain Python, fewer numpy calls
        return _pieces_few(brk.tolist(), n, sp, pos_r, pos_l, dt)
    lens = np.diff(brk, prepend=-1, append=n - 1)
    cnt = np.empty((lens.size, sizes.size), np.int64)
    rem = lens
    for k in range(sizes.size - 1):
        cnt[:, k], rem = np.divmod(rem, sizes[k])
    cnt[:, -1] = rem
    spanned = int(np.count_nonzero(lens >= gmin))
    if not spanned or n - int(cnt.sum()) < SPAN_MIN_SAVED_PER_STRETCH * spanned:  # see the constant
        return None
    col = np.repeat(np.tile(np.arange(sizes.size), lens.size), cnt.ravel())
    size = sizes[col]
    first = np.cumsum(size)
    first -= size  # the pieces tile the chunks in order
    b = np.empty((2, first.size), np.int64)
    np.take(pos_r, first, out=b[0])
    np.take(pos_l, first, out=b[1])
    q, phase = np.divmod(b, size)
    q += sp.ph[_SIDES, col, phase]
    return col, q.astype(dt)


_BOTH_NEXT = (1 << 32) + 1
_ARANGE = np.arange(0, dtype=np.int64)


def _consecutive(pos: np.ndarray) -> bool:
    """``pos`` (int64) is ``p0, p0+1, ...``: the end points, then the bytes against a cached arange
    (a memcmp: right after an engine step numpy's ufuncs cost tens of µs each, cold)."""
    global _ARANGE
    n, p0 = pos.size, pos.item(0)
    if pos.item(n - 1) - p0 != n - 1 or p0 < 0:
        return False
    if _ARANGE.size < p0 + n:
        _ARANGE = np.arange(max(p0 + n, 2 * _ARANGE.size), dtype=np.int64)  # replaced whole: thread safe
    return pos.tobytes() == _ARANGE[p0:p0 + n].tobytes()


_FEW_STRETCHES = 8


def _pieces_few(brk: list[int], n: int, sp: _Spans, pos_r: np.ndarray, pos_l: np.ndarray,
                dt: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`_pieces` for a few stretches (``brk``: the last chunk of every stretch but the last): the
    pieces of one size in one stretch are consecutive entries of one row on each side (one segment)."""
    sizes, (ph_r, ph_l) = sp.sizes_py, sp.ph_py
    gmin = sizes[-2]
    segs = []  # (col, pieces, first offset remote, first offset local)
    spanned = pieces = st = 0
    for end in brk + [n - 1]:
        left = end + 1 - st
        spanned += left >= gmin
        for k, size in enumerate(sizes):
            q, left = divmod(left, size)
            if q:
                br, bl = pos_r.item(st), pos_l.item(st)
                segs.append((k, q, ph_r[k][br % size] + br // size, ph_l[k][bl % size] + bl // size))
                pieces += q
                st += q * size
    if not spanned or n - pieces < SPAN_MIN_SAVED_PER_STRETCH * spanned:
        return None
    if pieces <= _FEW_PIECES:  # a few dozen values: lists, then one array each
        cols: list[int] = []
        o_r: list[int] = []
        o_l: list[int] = []
        for k, q, r0, l0 in segs:
            cols += [k] * q
            o_r += range(r0, r0 + q)
            o_l += range(l0, l0 + q)
        return np.array(cols), np.array((o_r, o_l), dt)
    ks, qs, r0, l0 = (np.array(x) for x in zip(*segs))
    start = np.cumsum(qs) - qs
    off = np.repeat(np.array((r0 - start, l0 - start), dt), qs, axis=1)
    off += np.arange(pieces, dtype=dt)
    return np.repeat(ks, qs), off


_FEW_PIECES = 256
_SIDES = np.arange(2)[:, None]  # (side, 1): fancy-indexes the remote (0) and local (1) tables at once


@dataclass
class Prepared:
    """What a transport's ``prepare`` returns: the geometry plus the transport's list handles."""

    peer: str
    geometry: "PreparedGeometry"
    local: object = None
    remote: object = None
    released: bool = False
    local_span: object = None   # the span lists' handles (None: the geometry has no span rows)
    remote_span: object = None
    remote_type: str | None = None  # the transport's memory kind of the remote list (NIXL: DRAM or VRAM)


@dataclass
class PreppedRequest:
    """One request's work for one prefill rank: prepped indices plus an optional unprepped tail."""

    local_ids: np.ndarray
    remote_ids: np.ndarray
    tail: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # (src, dst, nbytes) int64 absolute addresses, or None
    spans: bool = False  # the ids index the span lists (``*_span_rows``), not the per-block lists

    @property
    def count(self) -> int:
        return int(self.local_ids.size) + (0 if self.tail is None else int(self.tail[2].size))


class PreparedGeometry:
    """Strided prepped lists for the reads of one decode rank from one prefill rank (see module doc).

    ``local_rows`` / ``remote_rows``: Nx5 uint64 ``(addr, len, device, stride, count)`` in NIXL's order;
    ``local_span_rows`` / ``remote_span_rows``: the same rows followed by the span rows, or None.
    """

    def __init__(self, lowered: LoweredPlan, prank: tuple[int, int], local_dev: int = 0, remote_dev: int = 0,
                 span_levels: tuple[int, ...] | None = None) -> None:
        self.lowered, self.prank = lowered, (prank[0], prank[1])
        levels = tuple(SPAN_LEVELS if span_levels is None else span_levels)
        self.local_dev, self.remote_dev = local_dev, remote_dev
        lows = lowered.by_prefill[self.prank]
        base_s, base_d = lowered.prefill_bases[self.prank], lowered.decode_base
        p_mem = lowered.p_mem(self.prank)
        self.reads: list[tuple[Any, _PreppedRead, Any]] = []  # (low, _PreppedRead, full-chunk template)
        self.spans: list[_Spans | None] = []  # per read
        lrows: list[np.ndarray] = []
        rrows: list[np.ndarray] = []
        span_todo = []  # (read index, runs with spans, the other runs, levels, per side (its rows, nb))
        p_off = d_off = 0
        for low in lows:
            pr, dr = p_mem.region(low.read.group), lowered.d_mem.region(low.read.group)
            g = low.chunk
            if low.per_token:
                tpl = lowered.template(low, g)
                p_k, d_k = pr.tokens_per_block // g, dr.tokens_per_block // g
                p_step, d_step = g * pr.token_stride, g * dr.token_stride
                p_bs, d_bs = pr.block_stride, dr.block_stride
            else:  # a state slot: each run has its component's slot stride
                tpl = lowered.template(low, 1)
                p_k = d_k = 1
                p_step = d_step = 0
                p_bs = tpl.src_bs if tpl.src_bs is not None else pr.block_stride
                d_bs = tpl.dst_bs if tpl.dst_bs is not None else dr.block_stride
            p_nb, d_nb = lowered.prefill.num_blocks, lowered.decode.num_blocks
            runs = int(tpl.nbytes.size)
            # rows (run i, sub-chunk k), run-major then k: entry (i, k, b) = off + (i*K + k)*NB + b
            for side_rows, rel, base, K, step, stride, nb, dev in (
                    (rrows, tpl.src_rel, base_s, p_k, p_step, p_bs, p_nb, remote_dev),
                    (lrows, tpl.dst_rel, base_d, d_k, d_step, d_bs, d_nb, local_dev)):
                r = np.empty((runs, K, 5), dtype=np.uint64)
                r[:, :, 0] = (base + rel[:, None] + np.arange(K, dtype=np.int64)[None, :] * step).astype(np.uint64)
                r[:, :, 1] = tpl.nbytes[:, None].astype(np.uint64)
                r[:, :, 2] = dev
                r[:, :, 3] = (np.broadcast_to(np.asarray(stride, np.int64).reshape(-1, 1), (runs, K))
                              .astype(np.uint64))
                r[:, :, 4] = nb
                side_rows.append(r.reshape(-1, 5))
            pre = _PreppedRead(low.per_token, runs, bool(tpl.run_major), p_off, d_off, p_k, d_k, p_nb, d_nb,
                               int(tpl.nbytes.sum()))
            self.reads.append((low, pre, tpl))
            self.spans.append(None)
            lv = tuple(G for G in levels if 2 * G - 1 <= min(p_nb, d_nb))  # every phase row non-empty
            if lv and low.per_token and p_k == 1 and d_k == 1:
                # runs whose consecutive blocks touch on both sides, all blocks inside one allocation
                n = tpl.nbytes
                ok = (n == p_bs) & (n == d_bs)
                ok &= _inside_one_allocation(p_mem, tpl.src_rel, tpl.src_rel + p_nb * p_bs)
                ok &= _inside_one_allocation(lowered.d_mem, tpl.dst_rel, tpl.dst_rel + d_nb * d_bs)
                if ok.any():
                    span_todo.append((len(self.reads) - 1, np.flatnonzero(ok), np.flatnonzero(~ok), lv,
                                      (rrows[-1], p_nb), (lrows[-1], d_nb)))
            p_off += runs * p_k * p_nb
            d_off += runs * d_k * d_nb
        self.remote_entries, self.local_entries = p_off, d_off  # the per-block lists
        rspan: list[np.ndarray] = []  # span rows: a second list pair (the per-block rows, then these)
        lspan: list[np.ndarray] = []
        for ri, sruns, plain, lv, (r_rows, p_nb), (l_rows, d_nb) in span_todo:
            # after every per-block row: row (run i, level G, phase p) entry q = blocks p+qG .. p+qG+G-1 of run i
            pre = self.reads[ri][1]
            out: list[Any] = []
            for side_rows, rows, nb, off, base_off in ((rspan, r_rows, p_nb, p_off, pre.p_off),
                                                        (lspan, l_rows, d_nb, d_off, pre.d_off)):
                tbl = np.empty((sruns.size, len(lv) + 1), np.int64)
                ph = np.zeros((len(lv) + 1, max(lv)), np.int64)
                src = rows[sruns]
                for k, G in enumerate(lv):
                    phase = np.arange(G, dtype=np.int64)
                    cnt = (nb - phase) // G
                    ph[k, :G] = np.cumsum(cnt) - cnt
                    r = np.empty((sruns.size, G, 5), np.uint64)
                    r[:, :, 0] = (src[:, None, 0].astype(np.int64) + phase[None, :] * src[:, None, 3].astype(np.int64)
                                  ).astype(np.uint64)
                    r[:, :, 1] = src[:, None, 1] * np.uint64(G)
                    r[:, :, 2] = src[:, None, 2]
                    r[:, :, 3] = src[:, None, 3] * np.uint64(G)
                    r[:, :, 4] = cnt.astype(np.uint64)[None, :]
                    side_rows.append(r.reshape(-1, 5))
                    per_run = nb - G + 1  # == cnt.sum()
                    tbl[:, k] = off + np.arange(sruns.size, dtype=np.int64) * per_run
                    off += sruns.size * per_run
                tbl[:, -1] = base_off + sruns * nb
                out += [tbl, ph, off]
            r_tbl, r_ph, p_off, l_tbl, l_ph, d_off = out
            ph = np.stack([r_ph, l_ph])
            self.spans[ri] = _Spans(sruns, plain, np.array(lv + (1,), np.int64), np.stack([r_tbl, l_tbl]), ph,
                                    list(lv + (1,)), ph.tolist())
        self.remote_rows = np.concatenate(rrows) if rrows else np.empty((0, 5), np.uint64)
        self.local_rows = np.concatenate(lrows) if lrows else np.empty((0, 5), np.uint64)
        # NIXL's cost per posted id grows with the rows of the list it indexes, so requests that use no
        # span keep posting through the per-block lists; the span lists repeat those rows first (same ids)
        self.remote_span_rows = np.concatenate([self.remote_rows] + rspan) if rspan else None
        self.local_span_rows = np.concatenate([self.local_rows] + lspan) if lspan else None
        self.index_dtype = np.int32 if max(p_off, d_off) <= INT32_MAX else np.int64
        dt = self.index_dtype
        self.spans = [None if sp is None else _Spans(sp.runs, sp.plain, sp.sizes, sp.tbl.astype(dt), sp.ph.astype(dt),
                                                     sp.sizes_py, sp.ph_py)
                      for sp in self.spans]
        # per read: the first index of each run's rows on each side (entry (i, 0, 0))
        self._run_ids = [((pre.p_off + np.arange(pre.runs, dtype=np.int64) * (pre.p_k * pre.p_nb)).astype(dt),
                          (pre.d_off + np.arange(pre.runs, dtype=np.int64) * (pre.d_k * pre.d_nb)).astype(dt))
                         for _, pre, _ in self.reads]
        # reads_any: the token-range groups of this rank's reads; a state read always moves its slot
        self._token_groups = tuple(dict.fromkeys(low.read.group for low, pre, _ in self.reads
                                                 if pre.per_token and low.plain))
        # context parallelism: a read restricted to token shares may miss a short range entirely
        self._cp_reads = tuple(low for low, pre, _ in self.reads if pre.per_token and not low.plain)
        self._has_state = any(not pre.per_token for _, pre, _ in self.reads)

    # ---- per request -------------------------------------------------------------------------
    def validate(self, num_tokens: int, prefill_blocks: Mapping[str, GroupBlocks],
                 decode_blocks: Mapping[str, GroupBlocks]) -> dict[str, tuple[int, int]]:
        """Validated token ranges per group (raises :class:`~kvbridge.errors.RequestError`); cheap."""
        return self.lowered.validate(num_tokens, prefill_blocks, decode_blocks)

    def reads_any(self, ranges: Mapping[str, tuple[int, int]]) -> bool:
        """Whether a validated request reads anything from this rank (no sizes: caller's-thread cheap)."""
        if self._has_state:
            return True
        for g in self._token_groups:
            t0, t1 = ranges[g]
            if t1 > t0:
                return True
        for low in self._cp_reads:
            t0, t1 = ranges[low.read.group]
            if t1 > t0:
                full, last = chunk_starts(low, t0, t1)
                if full.size or last is not None:
                    return True
        return False

    def size(self, ranges: Mapping[str, tuple[int, int]]) -> tuple[int, int]:
        """(descriptors before merging, bytes) of a validated request: arithmetic only."""
        count = nbytes = 0
        for low, pre, _tpl in self.reads:
            g = low.chunk
            t0, t1 = ranges[low.read.group]
            if not pre.per_token:
                count += pre.runs
                nbytes += pre.run_bytes
                continue
            if low.plain:
                n_full, tail = divmod(max(0, t1 - t0), g)
            else:  # context parallelism: only the chunks in the read's token shares
                full, last = chunk_starts(low, t0, t1) if t1 > t0 else (np.empty(0, np.int64), None)
                n_full, tail = full.size, (0 if last is None else t1 - last)
            count += n_full * pre.runs
            nbytes += n_full * pre.run_bytes
            if tail:
                t = self.lowered.template(low, tail)
                count += int(t.nbytes.size)
                nbytes += int(t.nbytes.sum())
        return count, nbytes

    def request(self, ranges: Mapping[str, tuple[int, int]], prefill_blocks: Mapping[str, GroupBlocks],
                decode_blocks: Mapping[str, GroupBlocks]) -> PreppedRequest:
        """Index arrays (local, remote) and the unprepped tail of one validated request."""
        lo = self.lowered
        dt = self.index_dtype
        l_parts, r_parts, tails = [], [], []
        spans = False
        base_s, base_d = lo.prefill_bases[self.prank], lo.decode_base
        for (low, pre, _tpl), sp, (run_r, run_l) in zip(self.reads, self.spans, self._run_ids):
            gname = low.read.group
            g, bsp, bsd = low.chunk, low.bsp, low.bsd
            pb, db = prefill_blocks[gname], decode_blocks[gname]
            if not pre.per_token:
                r_parts.append((run_r + int(pb.block_ids[0])).astype(dt))
                l_parts.append((run_l + int(db.block_ids[0])).astype(dt))
                continue
            t0, t1 = ranges[gname]
            if t1 <= t0:
                continue
            if low.plain:
                n_full, tail = divmod(t1 - t0, g)
                full, last = None, (t0 + n_full * g if tail else None)
            else:  # context parallelism: only the chunks in the read's token shares
                full, last = chunk_starts(low, t0, t1)
                n_full, tail = full.size, (0 if last is None else t1 - last)
            if n_full:
                if full is None and g == bsp == bsd and t0 % g == 0:  # a chunk is a whole block on both sides
                    i0 = t0 // g
                    pos_r = pb.block_ids[i0 - pb.first_block:i0 - pb.first_block + n_full]
                    pos_l = db.block_ids[i0 - db.first_block:i0 - db.first_block + n_full]
                else:
                    cs = t0 + np.arange(n_full, dtype=np.int64) * g if full is None else full
                    pblk, poff = locate(pb, cs, bsp, low.p_cp)
                    dblk, doff = locate(db, cs, bsd, low.d_cp)
                    pos_r = (poff // g) * pre.p_nb + pblk
                    pos_l = (doff // g) * pre.d_nb + dblk
                pieces = None
                if sp is not None and sp.runs.size * n_full >= SPAN_MIN_IDS:
                    pieces = _pieces(pos_r, pos_l, sp, dt)
                if pieces is not None and sp is not None:  # spannable runs: spans + single blocks, run-major
                    col, off = pieces
                    spans = True
                    ids = sp.tbl[:, :, col]  # (side, run, piece)
                    ids += off[:, None, :]
                    ids = ids.reshape(2, -1)
                    r_parts.append(ids[0])
                    l_parts.append(ids[1])
                    # the other runs of the read (if any) take the per-block path below
                    run_r, run_l = (run_r[sp.plain], run_l[sp.plain]) if sp.plain.size else (run_r[:0], run_l[:0])
                for parts, run, pos in ((r_parts, run_r, pos_r), (l_parts, run_l, pos_l)):
                    if not run.size:
                        continue
                    out = np.empty((run.size, n_full) if pre.run_major else (n_full, run.size), dtype=dt)
                    if pre.run_major:
                        np.add(run[:, None], pos.astype(dt)[None, :], out=out)
                    else:
                        np.add(pos.astype(dt)[:, None], run[None, :], out=out)
                    parts.append(out.ravel())
            if tail:
                t = lo.template(low, tail)
                pr = lo.p_mem(low.read.prefill).region(gname)
                dr = lo.d_mem.region(gname)
                c = last
                (pblk, poff), (dblk, doff) = locate(pb, c, bsp, low.p_cp), locate(db, c, bsd, low.d_cp)
                s = int(pblk) * pr.block_stride + poff * pr.token_stride
                d = int(dblk) * dr.block_stride + doff * dr.token_stride
                tails.append((t.src_rel + (s + base_s), t.dst_rel + (d + base_d), t.nbytes))
        def cat(xs: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(xs) if len(xs) > 1 else (xs[0] if xs else np.empty(0, dt))
        tail = None
        if tails:
            tail = tuple(np.concatenate([t[i] for t in tails]).astype(np.int64) for i in range(3))
        return PreppedRequest(cat(l_parts), cat(r_parts), tail, spans)

    # ---- for transports that move bytes themselves (loopback) and for tests -------------------
    def rows(self, req: PreppedRequest) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) rows that ``req``'s ids index."""
        if req.spans and self.local_span_rows is not None and self.remote_span_rows is not None:
            return self.local_span_rows, self.remote_span_rows
        return self.local_rows, self.remote_rows

    @staticmethod
    def addresses(rows: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(addresses, lengths) of entries ``ids`` of a strided list ``rows``."""
        counts = rows[:, 4].astype(np.int64)
        first = np.concatenate(([0], np.cumsum(counts)))
        ids = np.asarray(ids, np.int64)
        row = np.searchsorted(first, ids, side="right") - 1
        addr = rows[row, 0].astype(np.int64) + (ids - first[row]) * rows[row, 3].astype(np.int64)
        return addr, rows[row, 1].astype(np.int64)
