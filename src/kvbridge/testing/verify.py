"""In-process end-to-end check: plan, lower, move bytes with a transport, compare with the oracle."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..layout import EngineLayout, ceil_div
from ..lower import Descriptors, GroupBlocks, LoweredPlan
from ..memory import rank_memory
from ..plan import plan_transfer
from ..transport.reference import ReferenceTransport
from .oracle import count_mismatches, fill_prefill, new_buffer, write_expected


@dataclass
class Request:
    """One request: its tokens and, per side, per group, the blocks that hold it."""

    req_id: int
    num_tokens: int
    prefill_blocks: dict[str, GroupBlocks]
    decode_blocks: dict[str, GroupBlocks]


class BlockPool:
    """Free-list allocator of block ids per group (random order, like a busy engine)."""

    def __init__(self, engine: EngineLayout, rng: np.random.Generator, shuffled: bool = True):
        self.free = {
            g.name: list((rng.permutation(engine.num_blocks) if shuffled else np.arange(engine.num_blocks)).tolist())
            for g in engine.model.groups
        }

    def take(self, group: str, n: int) -> np.ndarray:
        f = self.free[group]
        if n > len(f):
            raise MemoryError(f"group {group!r}: {n} blocks requested, {len(f)} free; raise num_blocks")
        out, self.free[group] = f[:n], f[n:]
        return np.array(out, dtype=np.int64)

    def give(self, group: str, ids: np.ndarray) -> None:
        self.free[group].extend(ids.tolist())


def make_request(req_id: int, num_tokens: int, prefill: EngineLayout, decode: EngineLayout,
                 p_pool: BlockPool, d_pool: BlockPool, prefix_tokens: int = 0) -> Request:
    """Allocate blocks for a request on both sides.

    ``prefix_tokens``: tokens the decode already has (prefix-cache hit), rounded down to its blocks.
    Sliding-window groups keep only the blocks covering the window on both sides.
    """
    pb, db = {}, {}
    for g in prefill.model.groups:
        # entries of the block list hold block_size * dcp tokens where the engine shards tokens (vLLM)
        bsp, bsd = prefill.scheduler_block_size(g), decode.scheduler_block_size(g)
        if not g.per_token:
            pb[g.name] = GroupBlocks(p_pool.take(g.name, 1))
            db[g.name] = GroupBlocks(d_pool.take(g.name, 1))
            continue
        t_win = max(0, num_tokens - g.sliding_window) if g.kind == "sliding_window" else 0
        d_first = max(prefix_tokens // bsd, t_win // bsd)
        p_first = min(t_win // bsp, (d_first * bsd) // bsp)
        d_total, p_total = ceil_div(num_tokens, bsd), ceil_div(num_tokens, bsp)
        d_first = min(d_first, d_total)
        pb[g.name] = GroupBlocks(p_pool.take(g.name, p_total - p_first), p_first)
        db[g.name] = GroupBlocks(d_pool.take(g.name, d_total - d_first), d_first)
    return Request(req_id, num_tokens, pb, db)


@dataclass
class VerifyResult:
    prefill: str
    decode: str
    requests: int = 0
    bytes_moved: int = 0
    bytes_needed: int = 0
    descriptors: int = 0
    mismatched_bytes: int = 0
    checked_bytes: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def amplification(self) -> float:
        return self.bytes_moved / self.bytes_needed if self.bytes_needed else 1.0

    @property
    def ok(self) -> bool:
        return not self.errors and self.mismatched_bytes == 0 and self.bytes_moved == self.bytes_needed


def verify(prefill: EngineLayout, decode: EngineLayout, num_requests: int = 4, seed: int = 0,
           max_tokens: int | None = None, prefix_hits: bool = True, shuffled: bool = True) -> VerifyResult:
    """Run ``num_requests`` random requests through the reference transport; check every decode byte."""
    rng = np.random.default_rng(seed)
    plan = plan_transfer(prefill, decode)
    res = VerifyResult(str(prefill), str(decode))
    transport = ReferenceTransport()
    p_bufs, d_bufs, p_addr, d_addr = {}, {}, {}, {}
    for r in prefill.ranks():
        p_bufs[r] = new_buffer(rank_memory(prefill, *r))
        p_addr[r] = transport.register(p_bufs[r])
    for r in decode.ranks():
        d_bufs[r] = new_buffer(rank_memory(decode, *r))
        d_addr[r] = transport.register(d_bufs[r])
    expected = {r: b.copy() for r, b in d_bufs.items()}
    lowered = {r: LoweredPlan(plan, r, p_addr, d_addr[r]) for r in decode.ranks()}
    p_pool, d_pool = BlockPool(prefill, rng, shuffled), BlockPool(decode, rng, shuffled)
    # every request must fit in whole blocks on both sides (n tokens take ceil(n / block_size) blocks)
    per_req = max(1, num_requests)
    cap_tokens = min(
        (prefill.num_blocks // per_req) * min(prefill.scheduler_block_size(g) for g in prefill.model.groups),
        (decode.num_blocks // per_req) * min(decode.scheduler_block_size(g) for g in decode.model.groups),
    )
    max_tokens = max(1, min(max_tokens or cap_tokens, cap_tokens))
    for i in range(num_requests):
        n = int(rng.integers(1, max_tokens + 1))
        prefix = int(rng.integers(0, n)) if prefix_hits and rng.random() < 0.5 else 0
        req = make_request(i, n, prefill, decode, p_pool, d_pool, prefix)
        for r in prefill.ranks():
            fill_prefill(p_bufs[r], rank_memory(prefill, *r), i, n, req.prefill_blocks)
        for r in decode.ranks():
            lp = lowered[r]
            descs: list[Descriptors] = lp.descriptors(n, req.prefill_blocks, req.decode_blocks)
            for d in descs:
                h = transport.read(f"prefill{d.prefill}", d.src, d.dst, d.nbytes)
                transport.check(h)
                transport.release(h)
                res.descriptors += d.count
                res.bytes_moved += d.total_bytes
            ranges = lp.validate(n, req.prefill_blocks, req.decode_blocks)
            res.bytes_needed += write_expected(expected[r], rank_memory(decode, *r), i, ranges, req.decode_blocks)
        res.requests += 1
    for r in decode.ranks():
        res.mismatched_bytes += count_mismatches(d_bufs[r], expected[r])
        res.checked_bytes += d_bufs[r].size
    if transport.live_handles():
        res.errors.append(f"{transport.live_handles()} transfer handles leaked")
    return res
