"""Oracle: fill prefill memory from global coordinates, check every decode byte.

The value of an element is a hash of its global coordinates (request, group, global layer, token,
component, global unit, element), truncated to the element size. :func:`expected_decode` builds the
exact buffer a decode rank must hold after a request: untouched sentinel bytes everywhere except the
request's transferred cells, so both missing and stray writes show up as mismatched bytes.

Context parallelism is mapped here on its own, not through :mod:`kvbridge.layout` or the planner:
:func:`vllm_dcp_rank` rebuilds vLLM's DCP groups the way ``initialize_model_parallel`` does and
:func:`vllm_slots` is vLLM's slot-mapping kernel (``block_table.py``) line by line, in numpy.
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


def vllm_dcp_rank(tp: int, pcp: int, dcp: int, stage_rank: int) -> int:
    """DCP rank of the worker at ``stage_rank`` (= pcp_rank * tp + tp_rank) of one PP stage, as vLLM 0.33
    builds the groups: ranks laid out ``[pcp, tp]``, ``transpose(-1, -2).reshape(-1, dcp)``."""
    if dcp == 1:
        return 0
    groups = np.arange(pcp * tp).reshape(pcp, tp).T.reshape(-1, dcp)
    return int(np.argwhere(groups == stage_rank)[0][1])


def vllm_slots(positions: np.ndarray, block_table: GroupBlocks, block_size: int, dcp: int, dcp_rank: int,
               interleave: int):
    """vLLM's ``ComputeSlotMappingKernel`` for one request: (is_local, block number, offset in block)."""
    virtual_block_size = block_size * dcp
    virtual_block_indices = positions // virtual_block_size
    virtual_block_offsets = positions - virtual_block_indices * virtual_block_size
    is_local = (virtual_block_offsets // interleave) % dcp == dcp_rank
    local_block_offsets = (virtual_block_offsets // (dcp * interleave)) * interleave + (
        virtual_block_offsets % interleave
    )
    block_numbers = block_table.block_ids[virtual_block_indices - block_table.first_block]
    return is_local, block_numbers, local_block_offsets


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
        dcp = engine.dcp  # vLLM shards every attention group over DCP (Mamba state is replicated)
        local, blk, off = vllm_slots(tok, blocks, bs, dcp, vllm_dcp_rank(engine.tp, engine.pcp, dcp, mem.tp_rank),
                                     engine.cp_interleave)
        tok, blk, off = tok[local], blk[local], off[local]
        idx = (slice(None), blk, off)
        values = element_values(req, gi, layers, tok[None, :, None, None], comp, units, elems, v.itemsize)
    else:
        idx = (slice(None), int(blocks.block_ids[0]), 0)
        values = element_values(req, gi, layers[:, 0], 0, comp, units[:, 0], elems[:, 0], v.itemsize)
    return None, idx, values


def fill_prefill(buf: np.ndarray, mem: RankMemory, req: int, num_tokens: int, blocks: dict[str, GroupBlocks]) -> None:
    """Write the global-coordinate values of request ``req`` into a prefill rank's buffer."""
    for gname, r in mem.regions.items():
        b = blocks[gname]
        bs = mem.engine.block_size_of(gname) * (mem.engine.dcp if r.group.per_token else 1)
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


__all__ = ["vllm_dcp_rank", "vllm_slots",
           "fill_prefill", "write_expected", "new_buffer", "count_mismatches", "element_values", "copy_runs_reference"]
