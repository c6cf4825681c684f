"""Re-run the cost model's decisions against a benchmark's measurements (no transfers).

    KVBRIDGE_CALIBRATION=path/to/calibration.json .venv/bin/python benchmarks/recheck_cost_model.py [results.json]

For every row of the results (default: benchmarks/results.json) it rebuilds the same request as
``kvbridge bench`` (same seed, same order) and reports how often the handshake-time choice and the
per-request ``auto`` choice of the *currently loaded* cost model match the faster measured mode.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> int:
    import numpy as np
    from bench import ALLOCS, DECODE_RANK, SCENARIOS, engines

    from kvbridge.cost import CostModel, choose_modes, pair_shapes, request_chunks, request_modes
    from kvbridge.layout import ceil_div
    from kvbridge.lower import LoweredPlan
    from kvbridge.plan import plan_transfer
    from kvbridge.testing.verify import BlockPool, make_request

    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("results.json")
    rows = json.loads(path.read_text())["scenarios"]
    cm = CostModel.load()
    print(cm)
    hits_h = hits_a = 0
    for row in rows:
        sc = next(s for s in SCENARIOS if s.name == row["scenario"])
        n = ceil_div(sc.tokens, sc.block_size)
        p, d = engines(sc, row["layout"], n + n // 4 + 4)
        plan = plan_transfer(p, d)
        lp = LoweredPlan(plan, DECODE_RANK)
        modes = sorted({m.mode for m in choose_modes(plan, cm) if m.decode == DECODE_RANK})
        handshake = modes[0] if len(modes) == 1 else "mixed"
        rng = np.random.default_rng(0)  # the same requests as run_scenario: allocations in ALLOCS order
        reqs = {
            a: make_request(0, sc.tokens, p, d, BlockPool(p, rng, a == "shuffled"), BlockPool(d, rng, a == "shuffled"))
            for a in ALLOCS
        }
        req = reqs[row["alloc"]]
        chunks, frac = request_chunks(
            p.model.groups, req.decode_blocks, req.prefill_blocks, d.block_size, lp.chunk_tokens
        )
        picked = set(request_modes(cm, pair_shapes(lp), chunks, frac, lambda _: True).values())
        auto = picked.pop() if len(picked) == 1 else "mixed"
        hits_h += handshake == row["measured_faster"]
        hits_a += auto == row["measured_faster"]
        if auto != row["measured_faster"]:
            print(f"  auto picks {auto}, measured faster {row['measured_faster']}: {row['scenario']} {row['layout']} "
                  f"{row['alloc']} (direct {row['direct_gbps_best']:.2f}, staged {row['staged_gbps_best']:.2f} GB/s)")
    print(
        f"handshake-time choice matched {hits_h} of {len(rows)} rows; per-request auto choice {hits_a} of {len(rows)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
