"""A prefill rank's lowering cache: the lowered plan per stage requests' decode layout and rank."""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, TypeVar, cast

from ..errors import LayoutError
from ..layout import EngineLayout, engine_from_dict
from ..lower import LoweredPlan
from ..memory import KVMemory
from ..plan import plan_transfer
from .lease import Rank
from .memhost import wire_key
from .protocol import Stage

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

LoweringKey = tuple[str, tuple[int, ...], bytes]  # (decode layout, decode rank, decode memory)


def json_key(d: dict[str, Any]) -> str:
    return json.dumps(d, sort_keys=True)


def remember(d: OrderedDict[K, V], key: K, value: V, cap: int) -> None:
    """Put ``key`` in the LRU ``d`` (most recent last), dropping the oldest beyond ``cap``."""
    d[key] = value
    d.move_to_end(key)
    while len(d) > cap:
        d.popitem(last=False)


class Lowerings:
    """(decode layout, decode rank, decode memory) -> (LoweredPlan, decode engine that caused it): LRU,
    bounded in total (``cap``) and per decode engine (``per_peer``)."""

    def __init__(self, engine: EngineLayout, rank: Rank, mem: KVMemory, cap: int, per_peer: int) -> None:
        self.engine, self.rank, self.mem = engine, rank, mem
        self.cap, self.per_peer = cap, per_peer
        self.entries: OrderedDict[LoweringKey, tuple[LoweredPlan, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, msg: Stage) -> LoweredPlan:
        """The lowered plan for the stage request's decode layout and rank: LRU cache, bounded in total
        and per decode engine (distinct layouts from one peer evict that peer's oldest first)."""
        key = (json_key(msg.decode_layout), tuple(msg.decode_rank), wire_key(msg.decode_memory))
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
            return hit[0]
        decode = engine_from_dict(msg.decode_layout)
        d_mem = KVMemory.from_wire(decode, msg.decode_memory)
        if d_mem.rank != tuple(msg.decode_rank):
            raise LayoutError(f"stage request from rank {tuple(msg.decode_rank)} describes rank {d_mem.rank}")
        lp = LoweredPlan(plan_transfer(self.engine, decode), cast(Rank, tuple(msg.decode_rank)),
                         prefill_mems={self.rank: self.mem}, decode_mem=d_mem)
        mine = [k for k, (_, owner) in self.entries.items() if owner == msg.decode_engine]
        if len(mine) >= self.per_peer:
            del self.entries[mine[0]]
        remember(self.entries, key, (lp, msg.decode_engine), self.cap)
        return lp
