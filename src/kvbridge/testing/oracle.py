"""Oracle: fill prefill memory from global coordinates, check every decode byte.

The value of an element is a hash of its global coordinates (request, group, global layer, token,
component, global unit, element), truncated to the element size. :func:`expected_decode` builds the
exact buffer a decode rank must hold after a request: untouched sentinel bytes everywhere except the
request's transferred cells, so both missing and stray writes show up as mismatched bytes.
"""
from __future__ import annotations

import numpy as np

from ..lower import GroupBlocks
from ..memory import RankMemory

SENTINEL = 0xA5
_K = [np.uint64(x) for x in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93,
                             0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3, 0x589965CC75374CC3)]


def element_values(req: int, group_idx: int, layers, tokens, comp: int, units, elems, itemsize: int) -> np.ndarray:
    """Values for the broadcast grid layers[:,None,None,None] x tokens x units x elems (+ leading dims)."""
    with np.errstate(over="ignore"):
        x = (np.uint64(req) * _K[0]) ^ (np.uint64(group_idx + 1) * _K[1]) ^ (np.uint64(comp + 1) * _K[5])
        x = x ^ (np.asarray(layers, dtype=np.uint64) * _K[2])
        x = x ^ (np.asarray(tokens, dtype=np.uint64) * _K[3])
        x = x ^ (np.asarray(units, dtype=np.uint64) * _K[4])
        x = x ^ (np.asarray(elems, dtype=np.uint64) * _K[6])
        x = x ^ (x >> np.uint64(29))
        x = x * _K[7]
        x = x ^ (x >> np.uint64(32))
    return x.astype(np.dtype(f"u{itemsize}"))


def _cells(mem: RankMemory, group: str, comp: int, req: int, blocks: GroupBlocks, t0: int, t1: int):
    """(view, index tuple, values) for the cells of tokens [t0, t1) of one component (Mamba: t0=t1-1=0)."""
    engine = mem.engine
    r = mem.regions[group]
    v = r.components[comp]
    gi = [g.name for g in engine.model.groups].index(group)
    g = engine.model.group(group)
    layers = np.array(v.layers)[:, None, None, None]
    units = (v.unit0 + np.arange(v.num_units))[None, None, :, None]
    elems = np.arange(v.unit_bytes // v.itemsize)[None, None, None, :]
    if g.per_token:
        tok = np.arange(t0, t1)
        bs = engine.block_size_of(group)
        blk = blocks.block_ids[tok // bs - blocks.first_block]
        idx = (slice(None), blk, tok % bs)
        values = element_values(req, gi, layers, tok[None, :, None, None], comp, units, elems, v.itemsize)
    else:
        idx = (slice(None), int(blocks.block_ids[0]), 0)
        values = element_values(req, gi, layers[:, 0], 0, comp, units[:, 0], elems[:, 0], v.itemsize)
    return None, idx, values


def fill_prefill(buf: np.ndarray, mem: RankMemory, req: int, num_tokens: int, blocks: dict[str, GroupBlocks]) -> None:
    """Write the global-coordinate values of request ``req`` into a prefill rank's buffer."""
    for gname, r in mem.regions.items():
        b = blocks[gname]
        bs = mem.engine.block_size_of(gname)
        t0 = b.first_block * bs
        t1 = min((b.first_block + b.block_ids.size) * bs, num_tokens)
        for ci in range(len(r.components)):
            _, idx, values = _cells(mem, gname, ci, req, b, t0, t1)
            mem.element_view(buf, gname, ci)[idx] = values


def write_expected(buf: np.ndarray, mem: RankMemory, req: int, ranges: dict[str, tuple[int, int]],
                   blocks: dict[str, GroupBlocks]) -> int:
    """Write into ``buf`` what decode rank ``mem`` must hold for the token ranges moved; returns bytes."""
    total = 0
    for gname, (t0, t1) in ranges.items():
        if gname not in mem.regions or t1 <= t0:
            continue
        for ci in range(len(mem.regions[gname].components)):
            _, idx, values = _cells(mem, gname, ci, req, blocks[gname], t0, t1)
            mem.element_view(buf, gname, ci)[idx] = values
            total += values.nbytes
    return total


def new_buffer(mem: RankMemory) -> np.ndarray:
    buf = np.empty(mem.size, dtype=np.uint8)
    buf.fill(SENTINEL)
    return buf


def count_mismatches(actual: np.ndarray, expected: np.ndarray) -> int:
    return int(np.count_nonzero(actual != expected))


def copy_runs_reference(dst_buf: np.ndarray, dst, src_buf: np.ndarray, src, nbytes) -> None:
    """Slow, obviously correct run copy (a Python loop over runs): the oracle for
    :func:`kvbridge.staging.copy_runs` and the transports' copies, for tests only."""
    d, s = dst_buf.reshape(-1).view(np.uint8), src_buf.reshape(-1).view(np.uint8)
    for a, b, n in zip(np.asarray(dst).tolist(), np.asarray(src).tolist(), np.asarray(nbytes).tolist()):
        d[a:a + n] = s[b:b + n]


__all__ = ["fill_prefill", "write_expected", "new_buffer", "count_mismatches", "element_values", "copy_runs_reference"]
