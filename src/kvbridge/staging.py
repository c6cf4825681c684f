"""Staged transfers: pack a request's byte runs into a contiguous buffer, scatter them back.

``pack(buf, src, nbytes, out)`` copies the runs ``buf[src[i] : src[i] + nbytes[i]]`` one after the
other into ``out``; ``scatter(staging, buf, dst, nbytes)`` is the inverse (run ``i`` of ``staging``
goes to ``buf[dst[i] : dst[i] + nbytes[i]]``). Both are vectorised: no Python loop over runs.

How: for each distinct run length ``L`` the byte buffers are viewed as arrays of
``np.dtype((np.void, L))`` items: a plain view when every position is a multiple of ``L`` (the usual
case: head slices and blocks are aligned to their size), else an overlapping view with a stride of one
byte (item ``k`` is the ``L`` bytes starting at byte ``k``). A fancy-indexed assignment then copies every
run of that length with one memcpy each inside numpy. Scatter (fancy destination, plain source slice)
needs no temporary; gather (fancy source) uses ``np.take(..., out=, mode="clip")`` on plain views,
which writes the destination directly (indices are in range by construction), and otherwise copies
through a temporary in 4 MiB chunks that stay in cache. The Python loop is over *distinct lengths*
(usually one or two: a head slice, a merged run); when there are many distinct lengths the runs are
cut into pieces of their common divisor first so the number of groups stays small.

Torch tensors (CPU or CUDA) take the device path below (:class:`DeviceCopies`, :class:`RunSlice`): index
tensors on the tensors' own device, a request's run starts computed there from the lowering's factored
descriptors, rows of the widest element the alignment allows.
"""
from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections import OrderedDict

import numpy as np

MAX_LENGTH_GROUPS = 8


def _byte_view(buf: np.ndarray) -> np.ndarray:
    b = buf.reshape(-1).view(np.uint8) if buf.dtype != np.uint8 else buf.reshape(-1)
    if not b.flags.c_contiguous:
        raise ValueError("staging needs contiguous byte buffers")
    return b


def _items(buf: np.ndarray, length: int) -> np.ndarray:
    """Overlapping view of ``buf``: item ``k`` is ``buf[k : k + length]`` as one void item."""
    n = buf.size - length + 1
    if n <= 0:
        return np.ndarray((0,), dtype=np.dtype((np.void, length)))
    return np.ndarray((n,), dtype=np.dtype((np.void, length)), buffer=buf, offset=0, strides=(1,))


def _regroup(a: np.ndarray, b: np.ndarray, nbytes: np.ndarray):
    """Cut runs into pieces of their common length divisor when there are too many distinct lengths."""
    lengths = np.unique(nbytes)
    if lengths.size <= MAX_LENGTH_GROUPS:
        return a, b, nbytes, lengths
    g = int(np.gcd.reduce(lengths))
    pieces = nbytes // g
    idx = np.repeat(np.arange(nbytes.size), pieces)
    first = np.cumsum(pieces) - pieces
    k = (np.arange(idx.size) - np.repeat(first, pieces)) * g
    return a[idx] + k, b[idx] + k, np.full(idx.size, g, dtype=np.int64), np.array([g])


CHUNK_BYTES = 4 << 20


def _view(buf: np.ndarray, length: int, pos: np.ndarray):
    """A void-item view of ``buf`` and item indices for byte positions ``pos``: a plain (contiguous)
    view when every position is a multiple of ``length``, else the overlapping stride-1 view."""
    if length <= 1 << 30 and pos.size and not np.any(pos % length):
        n = buf.size // length
        return buf[:n * length].view(np.dtype((np.void, length))), pos // length, True
    return _items(buf, length), pos, False


def _consecutive(idx: np.ndarray, step: int) -> bool:
    return idx.size <= 1 or bool(np.all(np.diff(idx) == step))


def _copy_group(dst_buf, d, src_buf, s, L) -> None:
    dv, di, d_contig = _view(dst_buf, L, d)
    sv, si, s_contig = _view(src_buf, L, s)
    d_step, s_step = (1 if d_contig else L), (1 if s_contig else L)
    if _consecutive(si, s_step):  # a plain slice on the source side: no temporary
        dv[di] = sv[si[0]:si[0] + si.size * s_step:s_step]
    elif _consecutive(di, d_step) and s_contig and d_contig:
        # gather straight into the destination (mode="clip": no buffering). Only on plain views: with
        # the overlapping stride-1 views numpy's overlap check for ``out`` can take very long.
        d0 = int(di[0]) if di.size else 0
        if L % 8 == 0 and dst_buf.ctypes.data % 8 == 0 and src_buf.ctypes.data % 8 == 0:
            # rows of uint64 instead of void items: numpy's take copies each row with one memmove
            # instead of a per-item copy function (~1.3x faster for 4 KiB rows here)
            n_s, n_d = src_buf.size // L, dst_buf.size // L
            sv = src_buf[:n_s * L].view(np.uint64).reshape(n_s, L // 8)
            dv = dst_buf[:n_d * L].view(np.uint64).reshape(n_d, L // 8)
            np.take(sv, si, axis=0, out=dv[d0:d0 + si.size], mode="clip")
        else:
            np.take(sv, si, out=dv[d0:d0 + si.size], mode="clip")
    elif _consecutive(di, d_step):  # gather through a temporary, in 4 MiB chunks that stay in cache
        c = max(1, CHUNK_BYTES // L)
        d0 = int(di[0]) if di.size else 0
        for k in range(0, si.size, c):
            part = si[k:k + c]
            dv[d0 + k * d_step:d0 + (k + part.size) * d_step:d_step] = sv[part]
    else:  # fancy on both sides
        c = max(1, CHUNK_BYTES // L)
        for k in range(0, si.size, c):
            dv[di[k:k + c]] = sv[si[k:k + c]]


def copy_runs(dst_buf, dst, src_buf, src, nbytes) -> None:
    """``dst_buf[dst[i]:dst[i]+nbytes[i]] = src_buf[src[i]:src[i]+nbytes[i]]`` for every i (runs must not
    overlap; positions are byte offsets into the buffers). The one run-copy routine: numpy buffers are
    copied with numpy; torch tensors (CPU or CUDA) with torch index/copy operations on their own device."""
    nbytes = np.asarray(nbytes, np.int64)
    if nbytes.size == 0:
        return
    torch = _torch_of(dst_buf, src_buf)
    if torch is not None:
        _copy_runs_torch(torch, _tensor_bytes(torch, dst_buf), np.asarray(dst, np.int64),
                         _tensor_bytes(torch, src_buf), np.asarray(src, np.int64), nbytes)
        return
    dst_buf, src_buf = _byte_view(dst_buf), _byte_view(src_buf)
    src, dst, nbytes, lengths = _regroup(
        np.asarray(src, np.int64), np.asarray(dst, np.int64), np.asarray(nbytes, np.int64)
    )
    for L in lengths.tolist():
        if L <= 0:
            continue
        if lengths.size == 1:
            s, d = src, dst
        else:
            m = nbytes == L
            s, d = src[m], dst[m]
        _copy_group(dst_buf, d, src_buf, s, int(L))


def offsets(nbytes: np.ndarray) -> np.ndarray:
    """Start of each run in the packed (staging) buffer."""
    nbytes = np.asarray(nbytes, np.int64)
    out = np.empty(nbytes.size, dtype=np.int64)
    if nbytes.size:
        out[0] = 0
        np.cumsum(nbytes[:-1], out=out[1:])
    return out


def segment_bounds(nbytes: np.ndarray, segment_bytes: int) -> list[tuple[int, int]]:
    """Split runs into consecutive ``[start, stop)`` run ranges of about ``segment_bytes`` each (at run
    boundaries), so packing, reading and scattering of a staged transfer can overlap."""
    n = int(np.asarray(nbytes).size)
    if n == 0:
        return []
    seg = offsets(nbytes) // max(1, int(segment_bytes))
    cuts = (np.flatnonzero(np.diff(seg)) + 1).tolist()
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:]))


def _nbytes_of(buf) -> int:
    return int(buf.nbytes) if isinstance(buf, np.ndarray) else int(buf.numel() * buf.element_size())


def pack(buf, src: np.ndarray, nbytes: np.ndarray, out, out_offset: int = 0) -> int:
    """Pack the runs ``(src, nbytes)`` of ``buf`` contiguously into ``out`` from ``out_offset``; returns the
    bytes packed. ``buf`` and ``out``: numpy arrays, or torch tensors on one device (the copy runs there)."""
    nbytes = np.asarray(nbytes, np.int64)
    total = int(nbytes.sum())
    if out_offset + total > _nbytes_of(out):
        raise ValueError(f"staging buffer too small: {out_offset + total} bytes needed, {_nbytes_of(out)} available")
    copy_runs(out, offsets(nbytes) + out_offset, buf, src, nbytes)
    return total


def scatter(staging, buf, dst: np.ndarray, nbytes: np.ndarray, staging_offset: int = 0) -> int:
    """Inverse of :func:`pack`: run ``i`` of ``staging`` (from ``staging_offset``) goes to ``buf[dst[i]:]``
    (numpy arrays, or torch tensors on one device)."""
    nbytes = np.asarray(nbytes, np.int64)
    copy_runs(buf, dst, staging, offsets(nbytes) + staging_offset, nbytes)
    return int(nbytes.sum())


# ---- torch tensors (CPU or CUDA): index tensors on the tensors' own device ----------------------------
#
# A side of a copy is one 1-D uint8 tensor (a rank's KV memory seen as one byte span, or a staging
# buffer) and runs in it. Runs are *packed* on one side (one after the other from an offset: the staging
# buffer) and scattered on the other. The scattered side is described on the device by ``_Runs``: the
# start of every run (an int64 tensor there), the run length (one length for all, or a tensor), and a
# divisor of every start known on the host. The copy views both tensors as rows of ``R`` bytes, ``R`` the
# gcd of the starts and the lengths (a run is ``L/R`` consecutive rows), each row as elements of the
# widest integer type that divides it and both base pointers (int64 when 8 divides them), and moves
# every run with one ``index_select`` (gather into the packed side) or one ``index_copy_`` (scatter from
# it). When every start is a multiple of the run length ``L`` (head slices and blocks aligned to their
# size, the usual case) a row is a whole run and there is one index per run.
#
# A request's runs come factored from the lowering (per-chunk bases x a template of runs, see
# :class:`kvbridge.lower.Descriptors`): the template arrays are uploaded to the device once per
# lowering and cached there; per request only the chunk bases (one int64 per chunk, derived from the
# block ids) are uploaded, and the run starts are their outer sum, computed on the device.

def _torch_of(*bufs):
    """The torch module when any of ``bufs`` is a torch tensor (torch is never imported here)."""
    torch = sys.modules.get("torch")
    if torch is not None and any(isinstance(b, torch.Tensor) for b in bufs):
        return torch
    return None


def _tensor_bytes(torch, t):
    if not isinstance(t, torch.Tensor):
        t = torch.from_numpy(np.ascontiguousarray(t).reshape(-1).view(np.uint8))
    if not t.is_contiguous():
        raise ValueError("staging needs contiguous byte buffers")
    return t.reshape(-1).view(torch.uint8)


_DTYPE_NAMES = {16: "complex128", 8: "int64", 4: "int32", 2: "int16", 1: "uint8"}
# the widest element a copy moves (bytes; 16 copies complex128 elements: bits, no arithmetic)
MAX_ELEMENT = 8
# scatter into CPU tensors: "numpy" (put of whole rows on the same memory, one memcpy each: faster than
# torch's index_copy_ on CPU) or "torch" (index_copy_, the operation CUDA tensors take)
CPU_COPIES = "numpy"
# how a gather whose starts are not multiples of the run length reads its rows: "rows" (one index per
# row of R bytes) or "strided" (one index per run into an overlapping view, rows of L bytes R apart)
GATHER_UNALIGNED = "strided"


def _width(*values: int) -> int:
    """The widest element (up to :data:`MAX_ELEMENT` bytes) dividing every value (byte counts and addresses)."""
    g = math.gcd(*values)
    return next(w for w in (16, 8, 4, 2, 1) if w <= MAX_ELEMENT and g % w == 0)


def _typed(torch, t, w: int, k: int):
    """1-D uint8 tensor ``t`` as rows of ``k`` elements of ``w`` bytes (a trailing part that fills no row
    is left out: no run reaches into it)."""
    n = t.numel() // (w * k) * (w * k)
    return t[:n].view(getattr(torch, _DTYPE_NAMES[w])).view(-1, k)


class _Runs:
    """Scattered runs of one side on the device, in packed order: byte ``starts`` (int64 tensor), a
    uniform ``length`` (0 when lengths differ: then ``lengths``, an int64 tensor), the gcd ``unit`` of
    the lengths, ``align`` (a divisor of every start, 0 when every start is 0) and ``nbytes`` in all."""

    __slots__ = ("starts", "length", "lengths", "unit", "align", "nbytes")

    def __init__(self, starts, length: int, lengths, unit: int, align: int, nbytes: int):
        self.starts, self.length, self.lengths = starts, length, lengths
        self.unit, self.align, self.nbytes = unit, align, nbytes

    @property
    def count(self) -> int:
        return int(self.starts.numel())


def _row_index(torch, runs: _Runs, R: int):
    """Index of every ``R``-byte row of the runs, in packed order (computed on the device)."""
    first = runs.starts // R
    if runs.length:
        k = runs.length // R
        if k == 1:
            return first
        return (first[:, None] + torch.arange(k, device=first.device, dtype=first.dtype)[None, :]).reshape(-1)
    counts = runs.lengths // R
    total = runs.nbytes // R
    rep = torch.repeat_interleave(first - (torch.cumsum(counts, 0) - counts), counts, output_size=total)
    return rep + torch.arange(total, device=first.device, dtype=first.dtype)


def _gather(torch, buf, runs: _Runs, out) -> None:
    """``out`` (contiguous uint8, ``runs.nbytes`` long) <- the runs of ``buf``, one after the other."""
    if not runs.count or not runs.nbytes:
        return
    L = runs.length
    R = math.gcd(runs.unit, runs.align)
    if L and R != L and GATHER_UNALIGNED == "strided":  # one index per run into overlapping rows
        w = _width(R, L, buf.data_ptr(), out.data_ptr())
        flat = _typed(torch, buf, w, 1).reshape(-1)
        n_rows = (flat.numel() - L // w) // (R // w) + 1
        rows = flat.as_strided((n_rows, L // w), (R // w, 1))
        torch.index_select(rows, 0, runs.starts // R, out=_typed(torch, out, w, L // w))
        return
    w = _width(R, buf.data_ptr(), out.data_ptr())
    torch.index_select(_typed(torch, buf, w, R // w), 0, _row_index(torch, runs, R), out=_typed(torch, out, w, R // w))


def _scatter(torch, buf, runs: _Runs, packed) -> None:
    """Inverse of :func:`_gather`: the runs of ``packed`` (contiguous uint8) go to their places in ``buf``."""
    if not runs.count or not runs.nbytes:
        return
    R = math.gcd(runs.unit, runs.align)
    w = _width(R, buf.data_ptr(), packed.data_ptr())
    rows, idx, src = _typed(torch, buf, w, R // w), _row_index(torch, runs, R), _typed(torch, packed, w, R // w)
    if rows.device.type == "cpu" and CPU_COPIES == "numpy":
        item = np.dtype((np.void, R))
        np.put(rows.numpy().view(item).reshape(-1), idx.numpy(), src.numpy().view(item).reshape(-1))
    else:
        rows.index_copy_(0, idx, src)


def _gcd_of(a: np.ndarray) -> int:
    return int(np.gcd.reduce(a)) if a.size else 0


def _host_runs(torch, pos: np.ndarray, nbytes: np.ndarray, device) -> _Runs:
    """:class:`_Runs` from host arrays (positions relative to the buffer): uploaded as they are."""
    n_min, n_max = (int(nbytes.min()), int(nbytes.max())) if nbytes.size else (0, 0)
    uniform = n_min == n_max
    lengths = None if uniform else torch.as_tensor(nbytes, device=device)
    return _Runs(torch.as_tensor(pos, device=device), n_min if uniform else 0, lengths,
                 n_min if uniform else _gcd_of(nbytes), _gcd_of(pos), int(nbytes.sum()))


def _packed_at(pos: np.ndarray, nbytes: np.ndarray) -> int | None:
    """The start when the runs at ``pos`` lie one after the other, else None."""
    if pos.size and np.array_equal(pos[1:], pos[:-1] + nbytes[:-1]):
        return int(pos[0])
    return None


def _copy_runs_torch(torch, dst_buf, dst, src_buf, src, nbytes) -> None:
    """:func:`copy_runs` with torch index/copy operations on the tensors' own device (CPU or CUDA).

    ``dst``/``src``: per side, host positions (int64 array, with ``nbytes``), the start of a packed
    range (int), or :class:`_Runs` already on the device. One side packed: one gather or one scatter;
    neither: a gather into a temporary, then a scatter."""
    if dst_buf.device != src_buf.device:
        raise ValueError(f"staging copies stay on one device: {src_buf.device} -> {dst_buf.device}")
    dev = dst_buf.device
    sides = []
    for pos in (dst, src):
        if isinstance(pos, np.ndarray):
            at = _packed_at(pos, nbytes)
            pos = at if at is not None else _host_runs(torch, pos, nbytes, dev)
        sides.append(pos)
    dst, src = sides
    total = src.nbytes if isinstance(src, _Runs) else dst.nbytes if isinstance(dst, _Runs) else int(nbytes.sum())
    if not total:
        return
    if isinstance(src, _Runs) and isinstance(dst, _Runs):
        tmp = torch.empty(total, dtype=torch.uint8, device=dev)
        _gather(torch, src_buf, src, tmp)
        _scatter(torch, dst_buf, dst, tmp)
    elif isinstance(src, _Runs):
        _gather(torch, src_buf, src, dst_buf[dst:dst + total])
    elif isinstance(dst, _Runs):
        _scatter(torch, dst_buf, dst, src_buf[src:src + total])
    else:
        dst_buf[dst:dst + total].copy_(src_buf[src:src + total])


# ---- a request's runs, from the lowering's factored descriptors -------------------------------------
class RunSlice:
    """Runs ``[a, b)`` of one request's descriptors (:class:`kvbridge.lower.Descriptors`) on one side,
    ``"src"`` (the prefill's memory) or ``"dst"`` (the decode's), in packed order: what a segment of a
    staged transfer packs or scatters. Kept factored: :meth:`DeviceCopies.pack` computes the
    addresses on the device; :meth:`addresses` gives them on the host (numpy memory)."""

    __slots__ = ("desc", "side", "a", "b")

    def __init__(self, desc, side: str, a: int = 0, b: int | None = None):
        if side not in ("src", "dst"):
            raise ValueError(f"side must be 'src' (prefill) or 'dst' (decode), not {side!r}")
        self.desc, self.side, self.a = desc, side, int(a)
        self.b = int(desc.count if b is None else b)

    def addresses(self) -> np.ndarray:
        return np.asarray(self.desc.src if self.side == "src" else self.desc.dst, np.int64)[self.a:self.b]

    def __repr__(self) -> str:
        return f"RunSlice({self.desc!r}, {self.side!r}, {self.a}, {self.b})"


def _parts(desc) -> list:
    parts = getattr(desc, "_parts", None)
    if parts is not None:
        return parts
    return [(getattr(desc, "src", None), getattr(desc, "dst", None), np.asarray(desc.nbytes, np.int64))]


def _part_count(p) -> int:
    return int(p[2].size) if isinstance(p, tuple) else int(p.count)


def run_lengths(desc) -> np.ndarray:
    """Length of every run of ``desc`` in packed order, without computing its addresses (for segment
    bounds and packed offsets: a request's lengths repeat its template's)."""
    out = []
    for p in _parts(desc):
        if isinstance(p, tuple):
            out.append(np.asarray(p[2], np.int64))
        elif p.uniform:
            out.append(np.full(p.count, int(p.nbytes[0]), np.int64))
        else:
            out.append(np.repeat(p.nbytes, p.s_chunk.size) if p.run_major else np.tile(p.nbytes, p.s_chunk.size))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


class _Uploaded:
    """A host int64 array on the device (shifted by a base), with what the host knows of its values."""

    __slots__ = ("host", "dev", "first", "gdiff", "gcd", "min", "max")

    def __init__(self, torch, host: np.ndarray, shift: int, device):
        a = np.asarray(host, np.int64)
        self.host = host  # kept: the cache is keyed by its id
        self.dev = torch.tensor(a - shift if shift else a, device=device)  # a copy: the host array stays read-only
        self.first = int(a[0]) - shift if a.size else 0
        self.gdiff = _gcd_of(np.diff(a)) if a.size > 1 else 0
        self.gcd = _gcd_of(a)
        self.min, self.max = (int(a.min()), int(a.max())) if a.size else (0, 0)


CACHE_ARRAYS = 64


class DeviceCopies:
    """Pack and scatter between one rank's KV memory and staging buffers, on the memory's device.

    ``space``: one 1-D uint8 tensor over the rank's KV memory (every allocation inside it), ``base``
    its address. The lowering's template arrays and each request's chunk bases are uploaded to the
    device once (an LRU of :data:`CACHE_ARRAYS` arrays, keyed by the host array); run starts are
    computed there. On CUDA the copies run on a stream of their own and :meth:`pack` / :meth:`scatter`
    wait for that stream only (never for the device or the engine's streams); on CPU they are plain
    torch operations."""

    def __init__(self, torch, space, base: int):
        self.torch, self.space, self.base = torch, space, int(base)
        self.device = space.device
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._cache: OrderedDict[tuple[int, int], _Uploaded] = OrderedDict()
        self._lock = threading.Lock()

    def _up(self, host: np.ndarray, shift: int = 0) -> _Uploaded:
        key = (id(host), shift)
        with self._lock:
            u = self._cache.get(key)
            if u is not None and u.host is host:
                self._cache.move_to_end(key)
                return u
            u = _Uploaded(self.torch, host, shift, self.device)
            self._cache[key] = u
            while len(self._cache) > CACHE_ARRAYS:
                self._cache.popitem(last=False)
            return u

    def _outer(self, p, side: str, lo: int, hi: int) -> _Runs:
        """Runs ``[lo, hi)`` of a factored part: chunk bases (per request) + template offsets (per lowering)."""
        chunk = self._up(p.s_chunk if side == "src" else p.d_chunk, self.base)
        rel = self._up(p.src_rel if side == "src" else p.dst_rel)
        C, K = p.s_chunk.size, p.src_rel.size
        major, minor, m = (rel, chunk, C) if p.run_major else (chunk, rel, K)
        i0, i1 = lo // m, -(-hi // m)
        grid = major.dev[i0:i1, None] + minor.dev[None, :]
        starts = grid.reshape(-1)[lo - i0 * m:hi - i0 * m]
        align = math.gcd(chunk.gdiff, rel.gdiff, chunk.first + rel.first)
        if p.uniform:
            L = int(p.nbytes[0])
            return _Runs(starts, L, None, L, align, (hi - lo) * L)
        n = self._up(p.nbytes)
        shape = (i1 - i0, m)
        lens = (
            (n.dev[i0:i1, None] if p.run_major else n.dev[None, :])
            .expand(*shape)
            .reshape(-1)[lo - i0 * m : hi - i0 * m]
        )
        host = (np.repeat(p.nbytes[i0:i1], m) if p.run_major else np.tile(p.nbytes, i1 - i0))[lo - i0 * m:hi - i0 * m]
        return _Runs(starts, 0, lens, n.gcd, align, int(host.sum()))

    def _plain(self, pos: np.ndarray, nbytes: np.ndarray, lo: int, hi: int) -> _Runs:
        """Runs ``[lo, hi)`` of explicit arrays (absolute positions)."""
        up = self._up(pos, self.base)
        n = self._up(nbytes)
        align = math.gcd(up.gdiff, up.first)
        if n.min == n.max:
            L = n.min
            return _Runs(up.dev[lo:hi], L, None, L, align, (hi - lo) * L)
        return _Runs(up.dev[lo:hi], 0, n.dev[lo:hi], n.gcd, align, int(nbytes[lo:hi].sum()))

    def runs(self, rs: RunSlice) -> list[_Runs]:
        """The runs of ``rs`` on the device, one :class:`_Runs` per part of its descriptors."""
        out, i = [], 0
        for p in _parts(rs.desc):
            k = _part_count(p)
            lo, hi = max(rs.a, i) - i, min(rs.b, i + k) - i
            if lo < hi:
                if isinstance(p, tuple):
                    out.append(self._plain(p[0] if rs.side == "src" else p[1], p[2], lo, hi))
                else:
                    out.append(self._outer(p, rs.side, lo, hi))
            i += k
        return out

    def _each(self, runs, nbytes, offset: int, copy) -> int:
        torch = self.torch
        ctx = contextlib.nullcontext()
        if self.stream is not None:
            # after what this thread queued before (the staging buffer's fill): an event, not a wait of the host
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            ctx = torch.cuda.stream(self.stream)
        pos = offset
        with ctx:
            if isinstance(runs, RunSlice):
                for r in self.runs(runs):
                    copy(r, pos)
                    pos += r.nbytes
            else:
                nbytes = np.asarray(nbytes, np.int64)
                copy(np.asarray(runs, np.int64) - self.base, pos, nbytes)
                pos += int(nbytes.sum())
        if self.stream is not None:
            self.stream.synchronize()  # this stream only: the engine's streams go on
        return pos - offset

    def pack(self, runs, nbytes, staging, offset: int) -> int:
        """Runs (a :class:`RunSlice`, or absolute addresses with ``nbytes``) of the KV memory one after the
        other into ``staging`` (a uint8 tensor on the device) from byte ``offset``; returns the bytes
        packed, the copy finished."""
        torch = self.torch
        return self._each(runs, nbytes, offset, lambda r, at, n=None: _copy_runs_torch(
            torch, staging, at if n is None else offsets(n) + at, self.space, r, n))

    def scatter(self, staging, runs, nbytes, offset: int) -> int:
        """Inverse of :meth:`pack`: the packed bytes from ``offset`` of ``staging`` to the runs; returns when
        they are in the KV memory."""
        torch = self.torch
        return self._each(runs, nbytes, offset, lambda r, at, n=None: _copy_runs_torch(
            torch, self.space, r, staging, at if n is None else offsets(n) + at, n))


__all__ = ["pack", "scatter", "copy_runs", "offsets", "segment_bounds", "run_lengths", "RunSlice", "DeviceCopies"]
