"""The cost of the prefill's lease table on a serving turn, measured in-process (no sockets).

:func:`tick_cost` fills a :class:`~kvbridge.runtime.lease.LeaseTable` with live leases, none due
(a share of them pinned by a reader that heartbeats, the rest waiting for their reader), and times
:meth:`~kvbridge.runtime.lease.LeaseTable.tick` as a prefill's serving loop calls it: every
``tick_interval_s`` of a simulated clock. ``benchmarks/lease_tick.py`` and ``benchmarks/scale.py`` report it.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..runtime.lease import LeaseTable

# the prefill's serving loop turns every 2 ms when idle (PrefillServer)
TICK_INTERVAL_S = 0.002


def tick_cost(n_leases: int, ticks: int = 2000, pinned: float = 0.5, heartbeats_per_tick: int = 0,
              tick_interval_s: float = TICK_INTERVAL_S, table: Callable[..., Any] = LeaseTable) -> dict[str, float]:
    """Seconds of CPU one idle serving turn spends in ``tick`` with ``n_leases`` live leases.

    ``pinned``: the share of leases a reader pinned; ``heartbeats_per_tick``: heartbeats of pinned reads
    between two ticks (each pushes a deadline later); ``table``: the class (or factory) to measure, called
    as ``table(lease_s=..., pin_s=...)`` (another version of the table, for an A/B). Returns the mean
    ``tick_s``, the mean ``heartbeat_s`` and ``core_share``: the fraction of one core the ticks take at one
    turn per ``tick_interval_s``."""
    t = table(lease_s=3600.0, pin_s=7200.0)
    reader = ("bench-decode", (0, 0))
    n_pinned = int(n_leases * pinned)
    for i in range(n_leases):
        t.register(f"r{i}", None, 1, 0.0)
        if i < n_pinned:
            t.acquire(f"r{i}", 1, reader, f"r{i}", 1, 0.0)
    now, tick_s, hb_s, hb_n, k = 0.0, 0.0, 0.0, 0, 0
    for _ in range(ticks):
        now += tick_interval_s
        if heartbeats_per_tick and n_pinned:
            t0 = time.perf_counter()
            for _ in range(heartbeats_per_tick):
                rid = f"r{k % n_pinned}"
                t.heartbeat(rid, 1, reader, rid, now)
                k += 1
            hb_s += time.perf_counter() - t0
            hb_n += heartbeats_per_tick
        t0 = time.perf_counter()
        ended = t.tick(now)
        tick_s += time.perf_counter() - t0
        if ended:
            raise AssertionError(f"a lease ended during the measurement: {ended[:3]}")
    mean = tick_s / ticks
    return {"leases": float(n_leases), "tick_s": mean, "heartbeat_s": hb_s / hb_n if hb_n else 0.0,
            "core_share": mean / tick_interval_s}


def serve_turn_cost(n_leases: int, turns: int = 500, pinned: float = 0.5, table: Callable[..., Any] | None = None,
                    turn_interval_s: float = TICK_INTERVAL_S) -> dict[str, float]:
    """CPU of one idle serving turn (:meth:`~kvbridge.runtime.prefill.PrefillRank.serve_once`: side
    channel, NIXL notifications, lease tick) of a real prefill rank (tiny model, NIXL) holding
    ``n_leases`` live leases, ``pinned`` of them pinned by a reader; no message arrives. While pins are
    held a serving loop turns every ``turn_interval_s``. ``table``: another lease table class to
    install (an A/B). Returns the mean ``turn_s`` and ``core_share`` at that rate."""
    import numpy as np

    from ..layout import EngineLayout
    from ..lower import GroupBlocks
    from ..models import preset
    from ..runtime.prefill import PrefillRank
    from .engine import default_memory

    layout = EngineLayout(preset("tiny-dense"), tp=1, block_size=4, num_blocks=64, role="prefill")
    pre = PrefillRank(layout, (0, 0), "lease-bench", memory=default_memory(layout, (0, 0)), lease_s=3600.0,
                      pin_s=7200.0)
    try:
        if table is not None:
            pre.table = table(lease_s=3600.0, pin_s=7200.0)
        blocks = {g.name: GroupBlocks(np.arange(4, dtype=np.int64)) for g in layout.model.groups}
        reader = ("bench-decode", (0, 0))
        now = time.monotonic()
        for i in range(n_leases):
            pre.table.register(f"r{i}", blocks, 1, now)
            if i < int(n_leases * pinned):
                pre.table.acquire(f"r{i}", 1, reader, f"r{i}", 1, now)
        total = 0.0
        for _ in range(turns):
            t0 = time.process_time()
            pre.serve_once()
            total += time.process_time() - t0
            time.sleep(turn_interval_s)
        if len(pre.table.leases) != n_leases:
            raise AssertionError("a lease ended during the measurement")
        return {"leases": float(n_leases), "turn_s": total / turns, "core_share": total / turns / turn_interval_s}
    finally:
        pre.close()
