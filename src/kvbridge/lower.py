"""Lowering: turn a plan's reads into byte-range descriptors (src = prefill, dst = decode).

At handshake time (:class:`LoweredPlan`, once per decode rank and remote prefill engine) each read is
turned into a *chunk template*: the byte runs of one chunk of ``g = gcd(prefill_bs, decode_bs)``
tokens (one state slot for Mamba), as ``(src_rel, dst_rel, nbytes)`` arrays relative to the two
rank buffers. The runs are the maximal runs contiguous on **both** sides (the common refinement of
the two layouts), so different layouts (NHD vs HND, K/V split vs interleaved, cross-layer) and
different block sizes are handled by finer descriptors, never by a branch.

Per request (:meth:`LoweredPlan.descriptors`) only integer array arithmetic runs: chunk positions
from the block ids, broadcast against the templates, then adjacent descriptors (contiguous on both
sides, e.g. consecutive blocks) are merged. No Python loop over blocks or layers.

Context parallelism: on a token-sharded side an aligned run of ``interleave`` tokens is contiguous
(one DCP rank, one block), so the chunk is ``gcd`` of each side's contiguous run (the interleave, or
the block size); per request the chunk starts are masked by the read's token shares
(:attr:`~kvbridge.plan.Read.tokens`) and located with vLLM's slot rule (:func:`locate`), all in numpy.
"""
from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn, Union

import numpy as np

from .errors import RequestError
from .layout import CacheGroup, CyclicShare, EngineLayout, ceil_div
from .memory import rank_memory
from .plan import Rank, Read, TransferPlan

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # (src, dst, nbytes)


@dataclass(frozen=True, slots=True)
class GroupBlocks:
    """One side's blocks of one group for one request.

    ``block_ids[i]`` holds tokens ``[(first_block+i)*block_size, (first_block+i+1)*block_size)``.
    A decode side with a prefix-cache hit of k blocks has ``first_block=k``; a sliding-window prefill
    that kept only its last blocks has ``first_block>0``. Mamba groups have exactly one id (the state
    slot) and ignore ``first_block``.
    """

    block_ids: np.ndarray
    first_block: int = 0

    def __post_init__(self) -> None:
        # int64 always: block_id * block_stride overflows int32 for large caches
        if not (isinstance(self.block_ids, np.ndarray) and self.block_ids.dtype == np.int64):
            object.__setattr__(self, "block_ids", np.asarray(self.block_ids, dtype=np.int64))

    @staticmethod
    def of(ids: Any, first_block: int = 0) -> GroupBlocks:
        return GroupBlocks(np.asarray(ids, dtype=np.int64), first_block)

    # ---- token arithmetic (the one place that maps tokens to blocks) ---------------------------------
    def tokens(self, block_size: int, num_tokens: int) -> tuple[int, int]:
        """The token range ``[t0, t1)`` these blocks hold for a request of ``num_tokens`` tokens."""
        return (self.first_block * block_size,
                min((self.first_block + self.block_ids.size) * block_size, num_tokens))

    def locate(self, tokens: Any, block_size: int) -> tuple[Any, Any]:
        """(block id, offset in the block) of token position(s) ``tokens`` (an int or an int64 array)."""
        return self.block_ids[tokens // block_size - self.first_block], tokens % block_size


def locate(blocks: GroupBlocks, tokens: Any, block_size: int, cp: tuple[int, int] | None = None) -> tuple[Any, Any]:
    """(block id, offset in the block) of token position(s) ``tokens`` on one rank. ``cp = (interleave,
    dcp)`` for a token-sharded group: the block list has one entry per ``block_size * dcp`` tokens and
    the rank stores its share at local offset ``(o // (dcp * interleave)) * interleave + o % interleave``
    (vLLM's slot mapping); the caller passes only tokens of the rank's share."""
    if cp is None:
        return blocks.locate(tokens, block_size)
    il, n = cp
    vbs = block_size * n
    vb = tokens // vbs
    o = tokens - vb * vbs
    return blocks.block_ids[vb - blocks.first_block], (o // (n * il)) * il + o % il


def chunk_starts(low: _ReadLowering, t0: int, t1: int) -> tuple[np.ndarray, int | None]:
    """First tokens of the full chunks of ``[t0, t1)`` this read moves (int64 array), and the start of
    the partial last chunk (None if there is none or the read does not move it)."""
    g = low.chunk
    n_full, tail = divmod(t1 - t0, g)
    cs = t0 + np.arange(n_full, dtype=np.int64) * g
    last = t0 + n_full * g if tail else None
    for sh in low.shares:
        cs = cs[sh.holds(cs)]
        if last is not None and not sh.holds(last):
            last = None
    return cs, last


class _Outer:
    """Runs ``template run r`` x ``chunk c`` in factored form: src = src_rel[r] + s_chunk[c] (same for dst),
    emitted run-major (all chunks of run 0, then run 1, ...) or chunk-major."""

    __slots__ = ("s_chunk", "d_chunk", "src_rel", "dst_rel", "nbytes", "run_major", "uniform")

    def __init__(self, s_chunk: np.ndarray, d_chunk: np.ndarray, tpl: ChunkTemplate) -> None:
        self.s_chunk, self.d_chunk = s_chunk, d_chunk
        self.src_rel, self.dst_rel, self.nbytes = tpl.src_rel, tpl.dst_rel, tpl.nbytes
        self.run_major, self.uniform = tpl.run_major, tpl.uniform

    @property
    def count(self) -> int:
        return int(self.s_chunk.size * self.src_rel.size)

    @property
    def total_bytes(self) -> int:
        return int(self.s_chunk.size) * int(self.nbytes.sum())

    def _grid(self, out: np.ndarray) -> np.ndarray:
        c, r = self.s_chunk.size, self.src_rel.size
        return out.reshape((r, c) if self.run_major else (c, r))

    def _outer(self, chunk: np.ndarray, rel: np.ndarray, out: np.ndarray) -> None:
        if self.run_major:
            np.add(rel[:, None], chunk[None, :], out=self._grid(out))
        else:
            np.add(chunk[:, None], rel[None, :], out=self._grid(out))

    def write(self, src_out: np.ndarray | None, dst_out: np.ndarray | None, n_out: np.ndarray | None) -> None:
        """Expand into (possibly strided) 1-D outputs of length ``count``; None skips an output."""
        if src_out is not None:
            self._outer(self.s_chunk, self.src_rel, src_out)
        if dst_out is not None:
            self._outer(self.d_chunk, self.dst_rel, dst_out)
        if n_out is not None:
            if self.uniform:
                n_out[:] = self.nbytes[0]
            else:
                self._grid(n_out)[:] = self.nbytes[:, None] if self.run_major else self.nbytes[None, :]


# one part of a Descriptors: runs in factored form, or (src, dst, nbytes) arrays
_Part = Union[_Outer, Arrays]


def _merge_chunks(outer: _Outer, mergeable: bool) -> _Part:
    """Merge runs across chunks, deciding at chunk level (O(chunks + runs)) where possible.

    Returns ``outer`` itself (factored) when no two consecutive descriptors can merge; for uniform
    run-major templates whose merges are all inside a run (consecutive block ids), the merged runs
    directly (runs x segments); otherwise the expanded arrays through :func:`merge_adjacent`.
    """
    if not mergeable:
        return outer
    sc, dc, sr, dr = outer.s_chunk, outer.d_chunk, outer.src_rel, outer.dst_rel
    c, r = sc.size, sr.size
    if outer.run_major and outer.uniform:
        L = int(outer.nbytes[0])
        cross = (sr[:-1] + sc[-1] + L == sr[1:] + sc[0]) & (dr[:-1] + dc[-1] + L == dr[1:] + dc[0])
        if not cross.any():
            # every run of the template merges the same way across chunks: merge the chunk bases once
            starts = run_starts(sc, dc, L)
            if starts.size == c:
                return outer
            seg = np.diff(np.append(starts, c)) * L
            return ((sr[:, None] + sc[starts][None, :]).ravel(), (dr[:, None] + dc[starts][None, :]).ravel(),
                    np.tile(seg, r))
    elif not outer.run_major:
        last = int(outer.nbytes[-1])
        if not ((sc[:-1] + sr[-1] + last == sc[1:] + sr[0]) & (dc[:-1] + dr[-1] + last == dc[1:] + dr[0])).any():
            return outer  # runs inside a chunk were merged in the template; nothing joins across chunks
    out = np.empty((3, outer.count), dtype=np.int64)
    outer.write(out[0], out[1], out[2])
    s, d, n = merge_adjacent(out[0], out[1], out[2])
    return s, d, n


def _part_count(part: _Part) -> int:
    """Descriptors in one part: an :class:`_Outer` or a ``(src, dst, nbytes)`` tuple of arrays."""
    return part.count if isinstance(part, _Outer) else int(part[2].size)


class Descriptors:
    """Equal-length descriptor pairs for one (decode rank, prefill rank) transfer of one request.

    Addresses are absolute (buffer base included); ``src`` is in the prefill rank's buffer, ``dst`` in
    the decode rank's. Runs that cannot merge across chunks are kept *factored* (per-chunk bases x the
    handshake-time template, a few KB per request) until someone needs them: :attr:`src`/:attr:`dst`/
    :attr:`nbytes` materialise int64 arrays (cached); :meth:`nixl_arrays` writes NIXL's Nx3 descriptor
    arrays directly, once, on the thread that posts the read.
    """

    __slots__ = ("prefill", "_parts", "_arrays", "count", "total_bytes")

    def __init__(self, prefill: Rank | None, src: Any = None, dst: Any = None, nbytes: Any = None,
                 parts: Iterable[_Part] | None = None) -> None:
        self.prefill = prefill
        if parts is None:
            parts = [(np.asarray(src, np.int64), np.asarray(dst, np.int64), np.asarray(nbytes, np.int64))]
        self._parts = [p for p in parts if _part_count(p)]
        self._arrays: Arrays | None = None
        self.count = sum(_part_count(p) for p in self._parts)
        self.total_bytes = sum(p.total_bytes if isinstance(p, _Outer) else int(p[2].sum()) for p in self._parts)

    @property
    def factored(self) -> bool:
        return any(isinstance(p, _Outer) for p in self._parts)

    def _fill(self, src_out: np.ndarray | None, dst_out: np.ndarray | None, n_out: np.ndarray | None) -> None:
        i = 0
        for p in self._parts:
            k = _part_count(p)
            sl = slice(i, i + k)
            def pick(o: np.ndarray | None, sl: slice = sl) -> np.ndarray | None:
                return None if o is None else o[sl]
            if isinstance(p, _Outer):
                p.write(pick(src_out), pick(dst_out), pick(n_out))
            else:
                for o, v in zip((src_out, dst_out, n_out), p):
                    if o is not None:
                        o[sl] = v
            i += k

    def _materialise(self) -> Arrays:
        if self._arrays is None:
            if len(self._parts) == 1 and not isinstance(self._parts[0], _Outer):
                self._arrays = self._parts[0]
            else:
                out = np.empty((3, self.count), dtype=np.int64)
                self._fill(out[0], out[1], out[2])
                self._arrays = (out[0], out[1], out[2])
        return self._arrays

    @property
    def src(self) -> np.ndarray:
        return self._materialise()[0]

    @property
    def dst(self) -> np.ndarray:
        return self._materialise()[1]

    @property
    def nbytes(self) -> np.ndarray:
        return self._materialise()[2]

    def nixl_arrays(self, local_dev: int = 0, remote_dev: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(local = decode side, remote = prefill side) Nx3 uint64 arrays ``[addr, len, device]`` as
        NIXL's ``get_xfer_descs`` takes them, written in one pass from the factored form."""
        local = np.empty((self.count, 3), dtype=np.uint64)
        remote = np.empty((self.count, 3), dtype=np.uint64)
        if self._arrays is not None:
            local[:, 0], remote[:, 0], local[:, 1] = self._arrays[1], self._arrays[0], self._arrays[2]
        else:
            lv, rv = local.view(np.int64), remote.view(np.int64)
            self._fill(rv[:, 0], lv[:, 0], lv[:, 1])
        remote[:, 1] = local[:, 1]
        local[:, 2] = local_dev
        remote[:, 2] = remote_dev
        return local, remote

    def __repr__(self) -> str:
        return f"Descriptors(prefill={self.prefill}, count={self.count}, total_bytes={self.total_bytes})"


def run_starts(src: np.ndarray, dst: np.ndarray, nbytes: Any, key: np.ndarray | None = None) -> np.ndarray:
    """Indices of the descriptors that start a merged run: descriptor ``i`` continues ``i-1`` when it is
    contiguous with it on both sides (and, with ``key``, has the same key). ``nbytes``: an array, or
    one length for every descriptor. The one merge rule: :func:`merge_adjacent` and the chunk-level
    merge of the lowering both use it."""
    n = src.size
    if n <= 1:
        return np.zeros(min(n, 1), dtype=np.int64)
    prev = nbytes if np.ndim(nbytes) == 0 else nbytes[:-1]
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(src[1:], src[:-1] + prev, out=brk[1:])
    brk[1:] |= dst[1:] != dst[:-1] + prev
    if key is not None:
        brk[1:] |= key[1:] != key[:-1]
    return np.flatnonzero(brk)


def merge_adjacent(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                   key: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Merge consecutive descriptors contiguous on both sides (vectorised): ``(src, dst, nbytes)``, and the
    merged ``key`` fourth when given. With ``key``, only descriptors with equal keys merge (the same
    registered regions and strides on both sides)."""
    if src.size <= 1:
        return (src, dst, nbytes) if key is None else (src, dst, nbytes, key)
    starts = run_starts(src, dst, nbytes, key)
    if starts.size == src.size:
        return (src, dst, nbytes) if key is None else (src, dst, nbytes, key)
    out = (src[starts], dst[starts], np.add.reduceat(nbytes, starts))
    return out if key is None else out + (key[starts],)


@dataclass(frozen=True, slots=True)
class ChunkTemplate:
    src_rel: np.ndarray  # int64, prefill side, block 0 token 0 (relative to its buffer, or absolute)
    dst_rel: np.ndarray
    nbytes: np.ndarray
    run_major: bool      # emit (run, chunk) order instead of (chunk, run): lets blocks merge
    mergeable: bool      # some descriptors can merge across chunks with consecutive block ids
    runs_two_chunks: int  # runs of two chunks with consecutive block ids, after merging
    uniform: bool = False  # every run has the same length (head slices, whole blocks)
    src_bs: np.ndarray | None = None  # state groups: per-run slot stride (components may differ)
    dst_bs: np.ndarray | None = None


def _alloc_ids(mem: Any, addrs: np.ndarray) -> np.ndarray:
    """Which registered allocation each address is in (0 for kvbridge's single-buffer layout)."""
    allocs = getattr(mem, "allocations", None)
    if not allocs or len(allocs) == 1:
        return np.zeros(addrs.size, dtype=np.int64)
    starts = np.array([a.addr for a in allocs], dtype=np.int64)
    return np.searchsorted(starts, addrs, side="right") - 1


def _equal_key(cols: Sequence[np.ndarray]) -> np.ndarray:
    """One int64 per row, equal exactly where every column is equal (a constant column adds nothing)."""
    key = np.zeros(cols[0].size, dtype=np.int64)
    radix = 1
    for c in cols:
        if not c.size or c.item(c.argmin()) == c.item(c.argmax()):
            continue
        u, inv = np.unique(c, return_inverse=True)
        key += inv.ravel().astype(np.int64) * radix
        radix *= u.size
    return key


def _layer_index(have: tuple[int, ...], want: tuple[int, ...]) -> list[int]:
    """Positions of layers ``want`` in ``have``."""
    pos = {layer: i for i, layer in enumerate(have)}
    return [pos[layer] for layer in want]


def _atoms(p_mem: Any, d_mem: Any, read: Read, layers: tuple[int, ...], ntok: int) -> tuple[np.ndarray, ...]:
    """Every (layer, token, unit) atom of one chunk of ``read``: src, dst, length, and per atom the
    block (slot) stride of its component on each side."""
    gname = read.group
    pr, dr = p_mem.region(gname), d_mem.region(gname)
    src, dst, lens, sbs, dbs = [], [], [], [], []
    for ci, (u0, u1) in enumerate(read.units):
        if u1 <= u0:
            continue
        pv, dv = pr.components[ci], dr.components[ci]
        po = np.array(pv.layer_offsets, dtype=np.int64)[_layer_index(pv.layers, layers)]
        do = np.array(dv.layer_offsets, dtype=np.int64)[_layer_index(dv.layers, layers)]
        tok = np.arange(ntok, dtype=np.int64)
        units = np.arange(u0, u1, dtype=np.int64)
        s = (
            po[:, None, None]
            + tok[None, :, None] * pv.token_stride
            + (units - pv.unit0)[None, None, :] * pv.unit_stride
        )
        d = (
            do[:, None, None]
            + tok[None, :, None] * dv.token_stride
            + (units - dv.unit0)[None, None, :] * dv.unit_stride
        )
        src.append(s.ravel())
        dst.append(d.ravel())
        lens.append(np.full(s.size, pv.unit_bytes, dtype=np.int64))
        sbs.append(np.full(s.size, pv.block_stride, dtype=np.int64))
        dbs.append(np.full(s.size, dv.block_stride, dtype=np.int64))
    return tuple(np.concatenate(x) for x in (src, dst, lens, sbs, dbs))


def build_template(p_mem: Any, d_mem: Any, read: Read, layers: tuple[int, ...], ntok: int) -> ChunkTemplate:
    src, dst, lens, sbs, dbs = _atoms(p_mem, d_mem, read, layers, ntok)
    # runs merge only within one registered allocation on each side and with equal slot strides
    order = np.lexsort((src, dst))
    src, dst, lens, sbs, dbs = src[order], dst[order], lens[order], sbs[order], dbs[order]
    key = _equal_key((_alloc_ids(p_mem, src), _alloc_ids(d_mem, dst), sbs, dbs))
    starts = run_starts(src, dst, lens, key)
    if starts.size < src.size:
        src, dst, lens, sbs, dbs = src[starts], dst[starts], np.add.reduceat(lens, starts), sbs[starts], dbs[starts]
        key = key[starts]
    pr, dr = p_mem.region(read.group), d_mem.region(read.group)
    if not pr.group.per_token:
        # a state slot: one chunk per request; each run keeps its component's slot stride
        return ChunkTemplate(src, dst, lens, False, False, src.size, bool(lens.size and np.all(lens == lens[0])),
                             sbs, dbs)
    # Would two chunks with consecutive blocks merge? Try both emission orders on a 2-chunk sample.
    step_s = pr.block_stride if ntok >= pr.tokens_per_block else ntok * pr.token_stride
    step_d = dr.block_stride if ntok >= dr.tokens_per_block else ntok * dr.token_stride
    two_s = np.stack([src, src + step_s])
    two_d = np.stack([dst, dst + step_d])
    two_n = np.stack([lens, lens])
    two_k = np.stack([key, key])
    merged_run = merge_adjacent(two_s.T.ravel(), two_d.T.ravel(), two_n.T.ravel(), two_k.T.ravel())[0].size
    merged_chunk = merge_adjacent(two_s.ravel(), two_d.ravel(), two_n.ravel(), two_k.ravel())[0].size
    run_major = merged_run < merged_chunk
    # chunks smaller than a block: consecutive chunks also cross block boundaries, with another step
    # than the sample's; let the per-request check (_merge_chunks, exact and O(chunks)) decide
    mergeable = (min(merged_run, merged_chunk) < 2 * src.size or ntok < pr.tokens_per_block
                 or ntok < dr.tokens_per_block or bool(read.tokens))
    uniform = lens.size > 0 and bool(np.all(lens == lens[0]))
    return ChunkTemplate(src, dst, lens, run_major, mergeable, min(merged_run, merged_chunk), uniform)


# ---- templates shared across remote engines ------------------------------------------------------
_CANON_BASE = 1 << 30  # canonical address of the first allocation; each next one after a gap of this many bytes


@dataclass(frozen=True, eq=False)
class Canonical:
    """One rank's memory with every registered allocation moved to a fixed place (allocation ``i`` at
    ``starts[i]``, whatever its real address): two ranks whose memories differ only in where their
    allocations lie (every prefill engine serving one layout) have the same ``key`` and the same templates
    in these coordinates. ``delta[i]`` moves allocation ``i``'s canonical addresses to its real ones
    (None: kvbridge's own layout, whose offsets are already relative to the rank's buffer).

    Example: allocations at 0x7f00_0000_0000 (2 MiB) and 0x7e00_0000_0000 (4 MiB) sit at canonical
    ``2**30`` (the lower one) and ``2**30 + 4 MiB + 2**30``; a template run at canonical ``2**30 + 64``
    is at real ``0x7e00_0000_0040``."""

    key: tuple[Any, ...]
    mem: Any                    # what build_template reads: region(group) and allocations
    starts: np.ndarray          # canonical start of each allocation (sorted)
    delta: np.ndarray | None    # real - canonical start, per allocation

    def real(self, addrs: np.ndarray) -> np.ndarray:
        """Real addresses of canonical ones (each inside one allocation)."""
        if self.delta is None:
            return addrs
        out: np.ndarray = addrs + self.delta[np.searchsorted(self.starts, addrs, side="right") - 1]
        return out


@dataclass(frozen=True)
class _CanonicalMemory:
    regions: dict[str, Any]
    allocations: tuple[Any, ...]

    def region(self, group: str) -> Any:
        return self.regions[group]


def canonical(mem: Any) -> Canonical:
    """``mem`` in canonical coordinates (see :class:`Canonical`)."""
    allocs = getattr(mem, "allocations", None)
    if allocs is None:  # kvbridge's own layout: a function of the engine layout and the rank
        return Canonical(("buffer", mem.engine, mem.pp_rank, mem.tp_rank), mem, np.zeros(1, np.int64), None)
    from bisect import bisect_right

    from .memory import Allocation
    real = [a.addr for a in allocs]
    starts, c = [], _CANON_BASE
    for a in allocs:
        starts.append(c)
        c += -(-a.nbytes // _CANON_BASE) * _CANON_BASE + _CANON_BASE
    delta = [r - s for r, s in zip(real, starts)]

    def move(addr: int) -> int:
        return int(addr - delta[bisect_right(real, addr) - 1])

    regions = {g: replace(r, components=tuple(replace(v, layer_offsets=tuple(move(o) for o in v.layer_offsets))
                                              for v in r.components))
               for g, r in mem.regions.items()}
    sizes = tuple((a.nbytes, a.device) for a in allocs)
    cmem = _CanonicalMemory(regions, tuple(Allocation(s, a.nbytes, a.device) for s, a in zip(starts, allocs)))
    key = ("memory", mem.engine, sizes, tuple(sorted(regions.items())))
    return Canonical(key, cmem, np.array(starts, np.int64), np.array(delta, np.int64))


def moved(t: ChunkTemplate, p: Canonical, d: Canonical) -> ChunkTemplate:
    """Template ``t`` (canonical coordinates) at the real addresses of the two memories."""
    if p.delta is None and d.delta is None:
        return t
    return replace(t, src_rel=p.real(t.src_rel), dst_rel=d.real(t.dst_rel))


class TemplateCache:
    """Chunk templates by (prefill memory shape, decode memory shape, read, layers, tokens), shared by every
    remote engine of one layout pair; least recently used first out past ``max_bytes`` of arrays.
    Thread safe (handshake threads and post threads build templates)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[Any, ...], tuple[ChunkTemplate, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = self.hits = self.misses = 0

    def get(self, key: tuple[Any, ...], build: Callable[[], ChunkTemplate]) -> ChunkTemplate:
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return hit[0]
        t = build()  # outside the lock: two threads may build one template; both get equal arrays
        size = sum(a.nbytes for a in (t.src_rel, t.dst_rel, t.nbytes, t.src_bs, t.dst_bs) if a is not None)
        for a in (t.src_rel, t.dst_rel, t.nbytes, t.src_bs, t.dst_bs):
            if a is not None:
                a.flags.writeable = False  # shared by every engine of the layout pair
        with self._lock:
            self.misses += 1
            if key not in self._items:
                self._items[key] = (t, size)
                self.bytes += size
            while self.bytes > self.max_bytes and len(self._items) > 1:
                _, (_, n) = self._items.popitem(last=False)
                self.bytes -= n
        return t

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)


def _cache_bytes() -> int:
    text = os.environ.get("KVBRIDGE_TEMPLATE_CACHE_MB", "64")
    try:
        return max(0, int(float(text) * (1 << 20)))
    except ValueError:
        raise ValueError(f"KVBRIDGE_TEMPLATE_CACHE_MB={text!r}: give a size in MiB (default 64)") from None


# Templates shared across remote engines (bytes of arrays, KVBRIDGE_TEMPLATE_CACHE_MB, default 64 MiB)
TEMPLATES = TemplateCache(_cache_bytes())


@dataclass
class _ReadLowering:
    read: Read
    group_index: int
    per_token: bool
    layers: tuple[int, ...]
    templates: dict[int, ChunkTemplate]  # ntok -> ChunkTemplate
    chunk: int = 1   # tokens per chunk: gcd of the group's contiguous runs on both sides (1 for a state slot)
    bsp: int = 1     # the group's block size on the prefill side (tokens per block on one rank)
    bsd: int = 1     # ... and on the decode side
    p_cp: tuple[int, int] | None = None  # (interleave, dcp) where the prefill shards the group's tokens
    d_cp: tuple[int, int] | None = None
    shares: tuple[CyclicShare, ...] = ()  # the read's token shares (Read.tokens)

    @property
    def plain(self) -> bool:
        """No context parallelism on either side: chunk i of a request is chunk i of its blocks."""
        return self.p_cp is None and self.d_cp is None


class LoweredPlan:
    """The reads of one decode rank against one prefill engine, lowered to chunk templates.

    Built once per remote engine (at handshake). :meth:`descriptors` is the per-request hot path.
    ``prefill_bases`` maps each prefill rank to its buffer's base address; ``decode_base`` is the
    decode rank's buffer base address (0 and 0 give buffer-relative offsets).
    """

    def __init__(self, plan: TransferPlan, decode_rank: Rank, prefill_bases: dict[Rank, int] | None = None,
                 decode_base: int = 0, prefill_mems: dict[Rank, Any] | None = None, decode_mem: Any = None) -> None:
        self.plan = plan
        self.decode_rank = decode_rank
        self.prefill: EngineLayout = plan.prefill
        self.decode: EngineLayout = plan.decode
        # engine-owned memory (KVMemory, absolute addresses) or kvbridge's layout (RankMemory + a base)
        self.d_mem = decode_mem if decode_mem is not None else rank_memory(plan.decode, *decode_rank)
        self.p_mems = dict(prefill_mems or {})
        self.prefill_ranks = plan.prefill_ranks_for(decode_rank)
        self.prefill_bases = {r: 0 for r in self.prefill_ranks} | dict(prefill_bases or {})
        self.decode_base = decode_base
        self._canonical_d = canonical(self.d_mem)
        self._canonical_p: dict[Rank, Canonical] = {}
        # tokens per chunk of each per-token group (groups may have their own block sizes, vLLM's hybrid
        # allocator); ``chunk_tokens`` is their gcd, the unit the cost model counts in
        self.group_chunks = {g.name: math.gcd(self.prefill.contiguous_tokens(g), self.decode.contiguous_tokens(g))
                             for g in self.prefill.model.groups if g.per_token}
        self.chunk_tokens = math.gcd(*self.group_chunks.values()) if self.group_chunks else 1
        groups = [g.name for g in self.prefill.model.groups]
        self.by_prefill: dict[Rank, list[_ReadLowering]] = {r: [] for r in self.prefill_ranks}
        for read in plan.reads_for(decode_rank):
            g = self.prefill.model.group(read.group)
            low = _ReadLowering(read, groups.index(read.group), g.per_token, plan.group_layers(read), {},
                                self.group_chunks.get(g.name, 1), self.prefill.block_size_of(g),
                                self.decode.block_size_of(g), _cp(self.prefill, g), _cp(self.decode, g), read.tokens)
            self.template(low, low.chunk)
            self.by_prefill[read.prefill].append(low)
        groups_read = {l.read.group for lows in self.by_prefill.values() for l in lows}
        # (group name, per-token, prefill and decode block size, sliding window) of every group this decode
        # rank reads, in model order: what :meth:`validate` needs per request, looked up once
        # (block sizes here: tokens per entry of the request's block list, block_size * dcp when token-sharded)
        self._read_groups = tuple((g.name, g.per_token, self.prefill.scheduler_block_size(g),
                                   self.decode.scheduler_block_size(g), _window(g))
                                  for g in self.prefill.model.groups if g.name in groups_read)

    def template(self, low: _ReadLowering, ntok: int) -> ChunkTemplate:
        """The chunk template of ``ntok`` tokens of one read, built on first use: taken from the templates
        shared by every remote engine whose memory has the same shape (:data:`TEMPLATES`) and moved to
        this engine's addresses, then kept on the read."""
        t = low.templates.get(ntok)
        if t is None:
            pc = self._canonical_p.get(low.read.prefill)
            if pc is None:
                pc = self._canonical_p[low.read.prefill] = canonical(self.p_mem(low.read.prefill))
            dc = self._canonical_d
            key = (pc.key, dc.key, low.read, low.layers, ntok)
            shared = TEMPLATES.get(key, lambda: build_template(pc.mem, dc.mem, low.read, low.layers, ntok))
            t = low.templates[ntok] = moved(shared, pc, dc)
        return t

    def p_mem(self, prank: Rank) -> Any:
        m = self.p_mems.get(prank)
        return m if m is not None else rank_memory(self.prefill, *prank)

    @property
    def num_templates_runs(self) -> int:
        return sum(t.nbytes.size for lows in self.by_prefill.values() for l in lows for t in l.templates.values())

    # ---- per request -------------------------------------------------------------------------
    def token_range(self, group_index: int, num_tokens: int, prefill: GroupBlocks,
                    decode: GroupBlocks) -> tuple[int, int]:
        """Validated token range [t0, t1) the decode side needs for a per-token group."""
        gname = self.prefill.model.groups[group_index].name
        bsp, bsd = self.prefill.scheduler_block_size(gname), self.decode.scheduler_block_size(gname)
        window = _window(self.prefill.model.groups[group_index])
        r = _token_range(num_tokens, bsp, bsd, prefill.first_block, prefill.block_ids.size, decode.first_block,
                         decode.block_ids.size, window)
        if r is None:
            self._raise_token_range(gname, num_tokens, bsp, bsd, prefill, decode, window)
        return r

    def _raise_token_range(self, gname: str, num_tokens: int, bsp: int, bsd: int, prefill: GroupBlocks,
                           decode: GroupBlocks, window: int | None) -> NoReturn:
        nd = decode.block_ids.size
        t0, t1 = decode.tokens(bsd, num_tokens)
        if t1 <= t0:
            raise RequestError(f"group {gname!r}: decode blocks start at token {t0} but the request has only "
                               f"{num_tokens} tokens; send at most {ceil_div(num_tokens, bsd)} blocks in total")
        if decode.first_block + nd > ceil_div(num_tokens, bsd):
            raise RequestError(f"group {gname!r}: decode has {decode.first_block}+{nd} blocks of {bsd} tokens "
                               f"but the request has {num_tokens} tokens; allocate {ceil_div(num_tokens, bsd)} blocks")
        p0, p1 = prefill.tokens(bsp, num_tokens)
        t0 = _window_start(t0, t1, p0, num_tokens, window)
        raise RequestError(f"group {gname!r}: decode needs tokens [{t0}, {t1}) but the prefill sent blocks "
                           f"for tokens [{p0}, {p1}); the decode request has more blocks than the prefill sent")

    def descriptors(self, num_tokens: int, prefill_blocks: dict[str, GroupBlocks],
                    decode_blocks: dict[str, GroupBlocks], only: Collection[Rank] | None = None,
                    ranges: dict[str, tuple[int, int]] | None = None) -> list[Descriptors]:
        """Descriptors of one request, one :class:`Descriptors` per prefill rank of this decode rank
        (only those in ``only`` if given).

        Raises :class:`RequestError` (before anything moves) on missing groups, out-of-range block
        ids, or a decode side asking for tokens the prefill did not send. ``ranges``: what
        :meth:`validate` returned for this request (skips validating it again).
        """
        if ranges is None:
            ranges = self.validate(num_tokens, prefill_blocks, decode_blocks)
        out = []
        for prank, lows in self.by_prefill.items():
            if only is not None and prank not in only:
                continue
            parts = []
            for low in lows:
                gname = low.read.group
                parts += self._lower_read(low, ranges[gname], prefill_blocks[gname], decode_blocks[gname],
                                          self.prefill_bases[prank], self.decode_base)
            out.append(Descriptors(prank, parts=parts))
        return out

    def validate(self, num_tokens: int, prefill_blocks: Mapping[str, GroupBlocks],
                 decode_blocks: Mapping[str, GroupBlocks]) -> dict[str, tuple[int, int]]:
        """Validate one request and return the token range ``(t0, t1)`` per group read (``(0, 1)`` for a
        state group); raises :class:`RequestError` before anything moves.

        The per-request check on the caller's thread: ``argmax`` and ``argmin`` per block-id array
        (as :func:`ids_in_range`, inline) and integer arithmetic; the precise error message is worked out
        only when a check fails. Written flat (no helper calls on the good path): the caller's caches are
        cold between an engine's steps, where every extra call or lookup costs microseconds."""
        ranges: dict[str, tuple[int, int]] = {}
        pnb, dnb = self.prefill.num_blocks, self.decode.num_blocks
        for gname, per_token, bsp, bsd, window in self._read_groups:
            pb, db = prefill_blocks.get(gname), decode_blocks.get(gname)
            if pb is None or db is None:
                self._raise_invalid(gname, prefill_blocks, decode_blocks)
            p, d = pb.block_ids, db.block_ids
            n_p, n_d = p.size, d.size
            if ((n_p and (p.item(p.argmax()) >= pnb or p.item(p.argmin()) < 0))
                    or (n_d and (d.item(d.argmax()) >= dnb or d.item(d.argmin()) < 0))):
                self._raise_invalid(gname, prefill_blocks, decode_blocks)
            if per_token:
                r = _token_range(num_tokens, bsp, bsd, pb.first_block, n_p, db.first_block, n_d, window)
                if r is None:
                    self._raise_token_range(gname, num_tokens, bsp, bsd, pb, db, window)
                ranges[gname] = r
            else:
                if n_p != 1 or n_d != 1:
                    side, n = ("prefill", n_p) if n_p != 1 else ("decode", n_d)
                    raise RequestError(f"Mamba group {gname!r} needs exactly one {side} state slot id per "
                                       f"request, got {n}")
                ranges[gname] = (0, 1)
        return ranges

    def _raise_invalid(self, gname: str, prefill_blocks: Mapping[str, GroupBlocks],
                       decode_blocks: Mapping[str, GroupBlocks]) -> NoReturn:
        for side, blocks, eng in (("prefill", prefill_blocks, self.prefill), ("decode", decode_blocks, self.decode)):
            b = blocks.get(gname)
            if b is None:
                raise RequestError(f"request has no {side} block ids for group {gname!r}; "
                                   f"give one list per group: {[x.name for x in eng.model.groups]}")
            ids = b.block_ids
            if not ids_in_range(ids, eng.num_blocks):
                bad = ids[(ids < 0) | (ids >= eng.num_blocks)][:3].tolist()
                raise RequestError(f"{side} block ids {bad} of group {gname!r} are out of range "
                                   f"[0, {eng.num_blocks}); use ids of blocks the {side} engine allocated")
        raise AssertionError("unreachable: the request passed every check")

    def _lower_read(self, low: _ReadLowering, trange: tuple[int, int], pb: GroupBlocks, db: GroupBlocks,
                    base_s: int = 0, base_d: int = 0) -> list[_Part]:
        """Parts of one read's descriptors (see :class:`Descriptors`): per-chunk bases (small arrays) x the
        template, kept factored unless runs can merge across chunks (then merged arrays)."""
        t0, t1 = trange
        if not low.per_token:
            t = low.templates[1]
            assert t.src_bs is not None and t.dst_bs is not None, "a state group's template has slot strides"
            return [(t.src_rel + t.src_bs * int(pb.block_ids[0]) + base_s,
                     t.dst_rel + t.dst_bs * int(db.block_ids[0]) + base_d, t.nbytes)]
        if t1 <= t0:
            return []
        g, bsp, bsd = low.chunk, low.bsp, low.bsd
        pr = self.p_mem(low.read.prefill).region(low.read.group)
        dr = self.d_mem.region(low.read.group)
        if low.plain:
            n_full, tail = divmod(t1 - t0, g)
            full = t0 + np.arange(n_full, dtype=np.int64) * g
            last = t0 + n_full * g if tail else None
        else:
            full, last = chunk_starts(low, t0, t1)
        parts = []
        for cs, ntok in ((full, g), (None if last is None else np.array([last], np.int64), t1 - (last or 0))):
            if cs is None or not cs.size:
                continue
            tpl = self.template(low, ntok)
            pblk, poff = locate(pb, cs, bsp, low.p_cp)
            dblk, doff = locate(db, cs, bsd, low.d_cp)
            s_chunk = pblk * pr.block_stride + poff * pr.token_stride + base_s
            d_chunk = dblk * dr.block_stride + doff * dr.token_stride + base_d
            parts.append(_merge_chunks(_Outer(s_chunk, d_chunk, tpl), tpl.mergeable))
        return parts

    def needed_bytes(self, num_tokens: int, prefill_blocks: Mapping[str, GroupBlocks],
                     decode_blocks: Mapping[str, GroupBlocks]) -> int:
        """Bytes of the decode rank's box for this request (what an ideal transfer moves)."""
        ranges = self.validate(num_tokens, prefill_blocks, decode_blocks)
        total = 0
        for g in self.decode.model.groups:
            if g.name not in ranges:
                continue
            t0, t1 = ranges[g.name]
            layers = self.decode.stage_layers(g, self.decode_rank[0])
            share = self.decode.token_share(g, self.decode_rank[1])
            n = share.count(t0, t1) if share is not None else t1 - t0
            total += n * len(layers) * g.bytes_per_rank(self.decode.tp)
        return total


def ids_in_range(ids: np.ndarray, n: int) -> bool:
    """Every id in ``[0, n)``. ``argmax``/``argmin`` rather than ``min``/``max``: numpy's arg functions
    are a plain loop, its reductions go through the ufunc machinery, which costs tens of microseconds
    when the caller's caches are cold (as they are between an engine's steps)."""
    if not ids.size:
        return True
    return bool(ids.item(ids.argmax()) < n and ids.item(ids.argmin()) >= 0)


def _cp(engine: EngineLayout, g: CacheGroup) -> tuple[int, int] | None:
    """(interleave, dcp) if ``engine`` shards group ``g``'s tokens, else None."""
    return (engine.cp_interleave, engine.dcp) if engine.token_sharded(g) else None


def _window(g: CacheGroup) -> int | None:
    """The sliding window of a sliding-window group (None for any other)."""
    return g.sliding_window if g.kind == "sliding_window" else None


def _window_start(t0: int, t1: int, p0: int, num_tokens: int, window: int | None) -> int:
    """Where the decode's read starts in a sliding-window group: tokens ``[t0, p0)`` that the prefill's
    window already dropped are not read (no later token attends to them; their slots keep what they
    hold)."""
    if window is not None and t0 < p0 and p0 <= max(0, num_tokens - window + 1):
        return min(p0, t1)
    return t0


def _token_range(num_tokens: int, bsp: int, bsd: int, p_first: int, p_n: int, d_first: int, d_n: int,
                 window: int | None = None) -> tuple[int, int] | None:
    """The token range [t0, t1) the decode side needs for a per-token group whose prefill holds ``p_n``
    blocks from block ``p_first`` on and the decode ``d_n`` from ``d_first`` (the arithmetic of
    :meth:`GroupBlocks.tokens`, on plain ints), or None if the request is inconsistent
    (:meth:`LoweredPlan.token_range` says why)."""
    t0 = d_first * bsd
    if not d_n:
        return t0, t0
    t1 = (d_first + d_n) * bsd
    if t1 > num_tokens:
        t1 = num_tokens
    if t1 <= t0 or d_first + d_n > -(-num_tokens // bsd):
        return None
    p0, p1 = p_first * bsp, (p_first + p_n) * bsp
    if p1 > num_tokens:
        p1 = num_tokens
    if window is not None:
        t0 = _window_start(t0, t1, p0, num_tokens, window)
    if t0 < p0 or t1 > p1:
        return None
    return t0, t1
