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
"""
from __future__ import annotations

import sys

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
    src, dst, nbytes, lengths = _regroup(np.asarray(src, np.int64), np.asarray(dst, np.int64), np.asarray(nbytes, np.int64))
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


# ---- one code path for device tensors (issue 14.3) ------------------------------------------------
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


def _copy_runs_torch(torch, dst_buf, dst, src_buf, src, nbytes) -> None:
    """:func:`copy_runs` with torch index/copy operations on the tensors' own device (CPU or CUDA).

    Buffers are viewed as rows of ``u`` bytes, ``u`` the largest power of two dividing every position
    and length (up to 4 KiB); each run is ``nbytes/u`` consecutive rows, so one ``index_select`` plus one
    ``index_copy_`` (or a plain slice on a packed side) moves every run, whatever the lengths."""
    if nbytes.size == 0:
        return
    if dst_buf.device != src_buf.device:
        raise ValueError(f"staging copies stay on one device: {src_buf.device} -> {dst_buf.device}")
    dev = dst_buf.device
    bits = int(np.bitwise_or.reduce(np.concatenate([src, dst, nbytes]).astype(np.int64)))
    u = min(int(bits & -bits) if bits else 4096, 4096)
    pieces = nbytes // u
    first = np.cumsum(pieces) - pieces
    k = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(first, pieces)
    si = np.repeat(src // u, pieces) + k
    di = np.repeat(dst // u, pieces) + k
    # rows of u bytes (a trailing part shorter than a row holds no run: runs start and end on rows)
    s2 = src_buf[:src_buf.numel() // u * u].view(-1, u)
    d2 = dst_buf[:dst_buf.numel() // u * u].view(-1, u)
    s_packed = si.size and si[-1] - si[0] == si.size - 1 and np.all(np.diff(si) == 1)
    d_packed = di.size and di[-1] - di[0] == di.size - 1 and np.all(np.diff(di) == 1)
    if s_packed and d_packed:
        d2[int(di[0]):int(di[0]) + di.size].copy_(s2[int(si[0]):int(si[0]) + si.size])
    elif s_packed:  # scatter: packed source
        d2.index_copy_(0, torch.as_tensor(di, device=dev), s2[int(si[0]):int(si[0]) + si.size])
    elif d_packed:  # pack: gather straight into the packed destination
        torch.index_select(s2, 0, torch.as_tensor(si, device=dev), out=d2[int(di[0]):int(di[0]) + di.size])
    else:
        d2.index_copy_(0, torch.as_tensor(di, device=dev), s2.index_select(0, torch.as_tensor(si, device=dev)))


__all__ = ["pack", "scatter", "copy_runs", "offsets", "segment_bounds"]
