"""CPU of the prefill's lease table on an idle serving turn, against live leases: this tree's table and
the table of a baseline commit, alternated in one run (A/B, rounds interleaved).

A prefill's serving loop calls ``LeaseTable.tick`` every 2 ms when idle; ``core_share`` is the fraction
of one core those ticks take. Half the leases are pinned by a reader, none is due; ``--heartbeats`` per
turn push pinned deadlines later (a live decode's heartbeats). The table of the baseline commit is loaded
from git (``git show <commit>:src/kvbridge/runtime/lease.py``). Prints the machine load (``uptime``).

``--serve`` also times whole serving turns (``PrefillRank.serve_once``: side channel, NIXL notifications,
lease tick) of a real prefill rank holding the leases, CPU time per turn.

Run: ``PYTHONPATH=src python benchmarks/lease_tick.py [--baseline 2f72096] [--leases 100 1000 10000] [--serve]``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile

from kvbridge.runtime.lease import LeaseTable
from kvbridge.testing.leases import serve_turn_cost, tick_cost


def baseline_table(commit: str) -> type:
    src = subprocess.run(["git", "show", f"{commit}:src/kvbridge/runtime/lease.py"], check=True,
                         capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("kvbridge.runtime._lease_baseline", f.name)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    os.unlink(f.name)
    return mod.LeaseTable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="2f72096", help="git commit of the table to compare against")
    ap.add_argument("--leases", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--ticks", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heartbeats", type=int, default=0, help="heartbeats per turn")
    ap.add_argument("--serve", action="store_true", help="also time whole serving turns of a real prefill rank (NIXL)")
    args = ap.parse_args()
    print("load:", os.popen("uptime").read().strip())
    tables = {"baseline": baseline_table(args.baseline), "this tree": LeaseTable}
    print(f"{'leases':>7} {'table':>10} {'us/tick (median of rounds)':>28} {'% of a core':>12} {'us/heartbeat':>13}")
    for n in args.leases:
        got: dict[str, list[dict[str, float]]] = {k: [] for k in tables}
        for _ in range(args.rounds):  # alternate A and B
            for name, cls in tables.items():
                got[name].append(tick_cost(n, ticks=args.ticks, table=cls, heartbeats_per_tick=args.heartbeats))
        for name in tables:
            tick = statistics.median(r["tick_s"] for r in got[name])
            hb = statistics.median(r["heartbeat_s"] for r in got[name])
            print(f"{n:>7} {name:>10} {tick * 1e6:>28.2f} {tick / 0.002 * 100:>12.3f} {hb * 1e6:>13.2f}")
    if args.serve:
        print(f"{'leases':>7} {'table':>10} {'us CPU per serve_once':>28} {'% of a core':>12}  (turn every 2 ms)")
        for n in args.leases:
            got = {k: [] for k in tables}
            for _ in range(args.rounds):
                for name, cls in tables.items():
                    got[name].append(serve_turn_cost(n, turns=args.ticks, table=cls))
            for name in tables:
                turn = statistics.median(r["turn_s"] for r in got[name])
                print(f"{n:>7} {name:>10} {turn * 1e6:>28.2f} {turn / 0.002 * 100:>12.3f}")
    print("load:", os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
