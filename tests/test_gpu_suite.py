"""The GPU suite (benchmarks/gpu/driver.py) run end to end on CPU torch tensors, small configuration.

The same driver runs on a GPU with ``--device cuda`` (benchmarks/gpu/run.sh); here it proves the suite
itself: prefill TP4 and decode TP2 rank processes, KV caches allocated with torch in engine layouts
(vLLM BHNC flat-buffer views, FlashAttention KBTHD, FlashInfer BKTHD, MLA BTD), described with the public
API, moved through NIXL in direct and staged modes, every decode byte checked by the device-side oracle,
and every figure of every row produced. Timings are reported by the driver, never asserted here.
Skipped where torch or NIXL is missing (kvbridge's own .venv has no torch; .venv-vllm has both).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.transport.nixl import nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="nixl not installed")]

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ("dense-gqa", "mla", "swa-fa")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("gpu_suite")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "driver.py"), "--device", "cpu", "--small",
                           "--reps", "1", "--warmup", "0", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    path = out / "gpu_suite_cpu_small.json"
    assert path.exists(), f"driver wrote no JSON (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(path.read_text())


def test_driver_exits_zero_and_prints_the_table(suite):
    proc, res = suite
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kvbridge GPU suite" in proc.stdout and "NOT GPU figures" in proc.stdout
    assert res["environment"]["device"] == "cpu" and res["all_byte_exact"] is True


def test_every_pair_and_mode_has_a_row_with_every_figure(suite):
    _, res = suite
    rows = {(r["pair"], r["mode"]): r for r in res["rows"]}
    assert set(rows) == {(p, m) for p in PAIRS for m in ("direct", "staged")}
    for (pair, mode), r in rows.items():
        assert r["prefill"]["tp"] == 4 and r["decode"]["tp"] == 2, r
        for k in ("gbps_median", "d2d_gbps_median", "nixl_peak_gbps_median", "vs_nixl_peak", "vs_d2d",
                  "start_ms_median", "poll_ms_median", "seconds_median"):
            assert isinstance(r[k], float) and math.isfinite(r[k]) and r[k] > 0, (pair, mode, k, r[k])
        if mode == "staged":
            for k in ("pack_gbps_median", "scatter_gbps_median", "pack_vs_d2d", "scatter_vs_d2d"):
                assert math.isfinite(r[k]) and r[k] > 0, (pair, k, r[k])
    # the engine layouts named in the issue are all exercised
    forms = {r["prefill"]["form"] for r in rows.values()} | {r["decode"]["form"] for r in rows.values()}
    assert forms == {"vllm", "flash_attn", "flashinfer", "mla"}
    # different block sizes on the two sides of every pair; SWA+FA has two groups with different head counts
    assert all(r["prefill"]["block_size"] != r["decode"]["block_size"] for r in rows.values())


def test_every_decode_byte_is_exact_and_the_check_can_fail(suite):
    _, res = suite
    for r in res["rows"]:
        assert r["mismatched_elements"] == 0 and r["stray_bytes"] == 0, r
        assert r["cell_bytes"] > 0 and r["checked_bytes"] > r["cell_bytes"], r
        assert r["bytes_per_request"] == r["oracle_bytes"] > 0, r  # kvbridge moved exactly the request's cells
        assert r["byte_exact"] is True
    # the control: one corrupted cell byte and one stray byte per decode rank, both caught
    assert set(res["controls"]) == set(PAIRS)
    for name, per_rank in res["controls"].items():
        assert len(per_rank) == 2
        assert all(c == {"mismatched_elements": 1, "stray_bytes": 1} for c in per_rank), (name, per_rank)


def test_modes_really_differ_and_leases_are_freed(suite):
    _, res = suite
    for r in res["rows"]:
        if r["mode"] == "staged":  # staged for real: packed by the prefill, no fallback to direct reads
            assert r["staged_transfers"] > 0 and r["staging_fallbacks"] == 0, r
            assert r["descriptors_per_request"] <= 2 * r["prefill"]["tp"], r
        else:
            assert r["staged_transfers"] == 0, r
    for name, lease in res["leases"].items():
        assert lease["requests"] == 2 and lease["freed_on_every_rank"] == 2 and lease["expired"] == 0, (name, lease)
