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
``(src, dst, nbytes)`` tail that the transport posts through its ordinary path.

Transport independent: NIXL prepares the rows with ``prep_xfer_dlist``; the loopback transport expands
indices back to addresses (:meth:`PreparedGeometry.addresses`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .lower import LoweredPlan

INT32_MAX = (1 << 31) - 1
# chunk sizes up to this many tokens get every partial-chunk template built at handshake (g - 1 of them)
PRECOMPUTE_TAILS_UP_TO = 64


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


@dataclass
class Prepared:
    """What a transport's ``prepare`` returns: the geometry plus the transport's list handles."""

    peer: str
    geometry: "PreparedGeometry"
    local: object = None
    remote: object = None
    released: bool = False
    remote_type: str | None = None  # the transport's memory kind of the remote list (NIXL: DRAM or VRAM)


@dataclass
class PreppedRequest:
    """One request's work for one prefill rank: prepped indices plus an optional unprepped tail."""

    local_ids: np.ndarray
    remote_ids: np.ndarray
    tail: tuple | None  # (src, dst, nbytes) int64 absolute addresses, or None

    @property
    def count(self) -> int:
        return int(self.local_ids.size) + (0 if self.tail is None else int(self.tail[2].size))


class PreparedGeometry:
    """Strided prepped lists for the reads of one decode rank from one prefill rank (see module doc).

    ``local_rows`` / ``remote_rows``: Nx5 uint64 ``(addr, len, device, stride, count)`` in NIXL's order.
    """

    def __init__(self, lowered: LoweredPlan, prank, local_dev: int = 0, remote_dev: int = 0):
        self.lowered, self.prank = lowered, tuple(prank)
        self.local_dev, self.remote_dev = local_dev, remote_dev
        lows = lowered.by_prefill[self.prank]
        base_s, base_d = lowered.prefill_bases[self.prank], lowered.decode_base
        p_mem = lowered.p_mem(self.prank)
        self.reads: list[tuple] = []  # (low, _PreppedRead)
        lrows, rrows = [], []
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
            p_off += runs * p_k * p_nb
            d_off += runs * d_k * d_nb
        for low, pre, _ in self.reads:  # partial last chunks: build their templates now, not per request
            if pre.per_token and low.chunk <= PRECOMPUTE_TAILS_UP_TO:
                for ntok in range(1, low.chunk):
                    lowered.template(low, ntok)
        self.remote_rows = np.concatenate(rrows) if rrows else np.empty((0, 5), np.uint64)
        self.local_rows = np.concatenate(lrows) if lrows else np.empty((0, 5), np.uint64)
        self.remote_entries, self.local_entries = p_off, d_off
        self.index_dtype = np.int32 if max(p_off, d_off) <= INT32_MAX else np.int64

    # ---- per request -------------------------------------------------------------------------
    def validate(self, num_tokens: int, prefill_blocks, decode_blocks) -> dict:
        """Validated token ranges per group (raises :class:`~kvbridge.errors.RequestError`); cheap."""
        return self.lowered.validate(num_tokens, prefill_blocks, decode_blocks)

    def size(self, ranges) -> tuple[int, int]:
        """(descriptors before merging, bytes) of a validated request: arithmetic only."""
        count = nbytes = 0
        for low, pre, tpl in self.reads:
            g = low.chunk
            t0, t1 = ranges[low.read.group]
            if not pre.per_token:
                count += pre.runs
                nbytes += pre.run_bytes
                continue
            n_full, tail = divmod(max(0, t1 - t0), g)
            count += n_full * pre.runs
            nbytes += n_full * pre.run_bytes
            if tail:
                t = self.lowered.template(low, tail)
                count += int(t.nbytes.size)
                nbytes += int(t.nbytes.sum())
        return count, nbytes

    def request(self, ranges, prefill_blocks, decode_blocks) -> PreppedRequest:
        """Index arrays (local, remote) and the unprepped tail of one validated request."""
        lo = self.lowered
        dt = self.index_dtype
        l_parts, r_parts, tails = [], [], []
        base_s, base_d = lo.prefill_bases[self.prank], lo.decode_base
        for low, pre, tpl in self.reads:
            gname = low.read.group
            g, bsp, bsd = low.chunk, low.bsp, low.bsd
            pb, db = prefill_blocks[gname], decode_blocks[gname]
            run_r = pre.p_off + np.arange(pre.runs, dtype=np.int64) * (pre.p_k * pre.p_nb)
            run_l = pre.d_off + np.arange(pre.runs, dtype=np.int64) * (pre.d_k * pre.d_nb)
            if not pre.per_token:
                r_parts.append((run_r + int(pb.block_ids[0])).astype(dt))
                l_parts.append((run_l + int(db.block_ids[0])).astype(dt))
                continue
            t0, t1 = ranges[gname]
            if t1 <= t0:
                continue
            n_full, tail = divmod(t1 - t0, g)
            if n_full:
                cs = t0 + np.arange(n_full, dtype=np.int64) * g
                pblk, poff = pb.locate(cs, bsp)
                dblk, doff = db.locate(cs, bsd)
                pos_r = (poff // g) * pre.p_nb + pblk
                pos_l = (doff // g) * pre.d_nb + dblk
                for parts, run, pos in ((r_parts, run_r, pos_r), (l_parts, run_l, pos_l)):
                    out = np.empty((pre.runs, n_full) if pre.run_major else (n_full, pre.runs), dtype=dt)
                    if pre.run_major:
                        np.add(run.astype(dt)[:, None], pos.astype(dt)[None, :], out=out)
                    else:
                        np.add(pos.astype(dt)[:, None], run.astype(dt)[None, :], out=out)
                    parts.append(out.ravel())
            if tail:
                t = lo.template(low, tail)
                pr = lo.p_mem(low.read.prefill).region(gname)
                dr = lo.d_mem.region(gname)
                c = t0 + n_full * g
                (pblk, poff), (dblk, doff) = pb.locate(c, bsp), db.locate(c, bsd)
                s = int(pblk) * pr.block_stride + poff * pr.token_stride
                d = int(dblk) * dr.block_stride + doff * dr.token_stride
                tails.append((t.src_rel + (s + base_s), t.dst_rel + (d + base_d), t.nbytes))
        cat = lambda xs: np.concatenate(xs) if len(xs) > 1 else (xs[0] if xs else np.empty(0, dt))  # noqa: E731
        tail = None
        if tails:
            tail = tuple(np.concatenate([t[i] for t in tails]).astype(np.int64) for i in range(3))
        return PreppedRequest(cat(l_parts), cat(r_parts), tail)

    # ---- for transports that move bytes themselves (loopback) and for tests -------------------
    @staticmethod
    def addresses(rows: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(addresses, lengths) of entries ``ids`` of a strided list ``rows``."""
        counts = rows[:, 4].astype(np.int64)
        first = np.concatenate(([0], np.cumsum(counts)))
        ids = np.asarray(ids, np.int64)
        row = np.searchsorted(first, ids, side="right") - 1
        addr = rows[row, 0].astype(np.int64) + (ids - first[row]) * rows[row, 3].astype(np.int64)
        return addr, rows[row, 1].astype(np.int64)
