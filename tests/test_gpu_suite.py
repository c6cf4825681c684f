"""The GPU suite (benchmarks/gpu/driver.py) run end to end on CPU torch tensors: the quick profile.

The same driver runs on a GPU with ``--device cuda`` (benchmarks/gpu/run.sh --quick); here it proves the suite
itself: prefill TP4 and decode TP2 rank processes, KV caches of the suite's models allocated with torch in
engine layouts (vLLM BHNC flat-buffer views, FlashAttention KBTHD, FlashInfer BKTHD, MLA BTD), described with
the public API, moved through NIXL on every path, every decode byte checked by the device-side oracle, every
figure of every row produced, the JSON written after every row, and rows the cost model predicts past the
bounds skipped with their prediction. Tokens are fewer than the GPU's quick profile (a short run on a small
CPU machine). Timings are reported by the driver, never asserted here. Skipped where torch or NIXL is
missing (kvbridge's own .venv has no torch; .venv-vllm has both).
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
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("gpu_suite")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("OUT", None)
    # the quick profile's 150 s budget is sized for a GPU; a loaded 2-core machine gets 500 s (rows are never
    # skipped for time here: every pair and path must run and be checked)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "driver.py"), "--device", "cpu", "--quick",
                           "--tokens", "48", "--budget-s", "500", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    path = out / "gpu_suite_cpu_quick.json"
    assert path.exists(), f"driver wrote no JSON (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(path.read_text())


def test_driver_exits_zero_and_prints_the_table(suite):
    proc, res = suite
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kvbridge GPU suite" in proc.stdout and "NOT GPU figures" in proc.stdout
    assert res["environment"]["device"] == "cpu" and res["all_byte_exact"] is True


def test_every_pair_and_path_has_a_row_with_every_figure_or_a_skip_with_its_prediction(suite):
    import driver
    _, res = suite
    rows = {(r["pair"], r["mode"]): r for r in res["rows"]}
    skipped = {(r["pair"], r["mode"]): r for r in res["skipped"]}
    assert not set(rows) & set(skipped)
    assert set(rows) | set(skipped) == {(p, m) for p in PAIRS for m in driver.MODES}
    assert rows, "no row ran"
    assert res["profile"] == "quick" and res["row_bound_s"] == driver.QUICK["row_bound_s"]
    for sk in skipped.values():  # skipped only where the cost model's prediction is past a bound
        assert sk["prediction"]["seconds"] > 0 and "predicted" in sk["why"], sk
    for (pair, mode), r in rows.items():
        assert r["prefill"]["tp"] == 4 and r["decode"]["tp"] == 2, r
        for k in ("gbps_median", "d2d_gbps_median", "nixl_peak_gbps_median", "vs_nixl_peak", "vs_d2d",
                  "start_ms_median", "poll_ms_median", "seconds_median", "predicted_s", "row_s"):
            assert isinstance(r[k], float) and math.isfinite(r[k]) and r[k] > 0, (pair, mode, k, r[k])
        # a staging path packs and scatters (auto only where the cost model chose staging for some transfer)
        if mode in ("staged", "host") or (mode == "auto" and r["staged_transfers"] > 0):
            for k in ("pack_gbps_median", "scatter_gbps_median", "pack_vs_d2d", "scatter_vs_d2d"):
                assert math.isfinite(r[k]) and r[k] > 0, (pair, k, r[k])
    # the suite's pairs (the engine layouts, different block sizes on the two sides)
    pairs = res["pairs"]
    assert {p["p"][2] for p in pairs.values()} | {p["d"][2] for p in pairs.values()} == {
        "vllm",
        "flash_attn",
        "flashinfer",
        "mla",
    }
    assert all(p["p"][1] != p["d"][1] for p in pairs.values())
    assert {p["model"] for p in pairs.values()} == {"llama-3.1-8b", "deepseek-v3", "gemma-4-31b"}
    c = res["calibration"]
    assert c["wire_gbps"] > 0 and c["per_desc_us"] > 0


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
        elif r["mode"] == "direct":
            assert r["staged_transfers"] == 0, r
    per_pair = res["warmup"] + res["reps"]
    for name, lease in res["leases"].items():
        n = per_pair * sum(1 for r in res["rows"] if r["pair"] == name)
        assert lease["requests"] == n and lease["freed_on_every_rank"] == n and lease["expired"] == 0, (name, lease)


def test_the_cost_model_skips_what_would_not_fit_a_short_slot():
    """No ranks: the quick profile's prediction (kvbridge.cost with the link figures of the first H100 run:
    ~32 us per descriptor, 0.56 GB/s) skips dense GQA's direct path at the full 8,192 tokens (~2 M descriptors
    per decode rank) and keeps its staged path and every path at the quick profile's tokens below the bound."""
    import driver
    calib = {"per_desc_us": 32.0, "wire_gbps": 0.56}
    full = driver.pairs_config(False)
    bound = driver.QUICK["row_bound_s"]
    direct = driver.predict(full["dense-gqa"], "direct", 2, calib, 0.56, 1105.0)
    staged = driver.predict(full["dense-gqa"], "staged", 2, calib, 0.56, 1105.0)
    assert direct["descriptors_per_request"] > 4e6 and direct["seconds"] > 5 * bound  # both decode ranks
    assert "per-row bound" in driver.skip_reason(direct, bound, 1e9)
    assert staged["seconds"] < direct["seconds"] / 10
    assert "left of the run's budget" in driver.skip_reason(staged, bound, staged["seconds"] / 2)
    assert driver.skip_reason(staged, 0.0, 1e9) == ""


def test_device_check_runs_every_part_bounded_on_cpu(tmp_path):
    """benchmarks/gpu/device_check.sh with DEVICE=cpu (the same parts as on a GPU, smallest settings): the pack
    micro-benchmark, the UCX lane probe (UCX_PROTO_INFO=y logged the protocol of the READ) and the quick suite
    each exit 0 within their bounds, and the summary and every JSON land in $OUT."""
    pytest.importorskip("torch")
    env = dict(
        os.environ,
        DEVICE="cpu",
        PYTHON=sys.executable,
        OUT=str(tmp_path),
        PACK_ARGS="--small --pairs mla --reps 1",
        PROBE_ARGS="--mib 1 --descs 16",
        QUICK_ARGS="--small --pairs mla --reps 1 --warmup 0",
        PACK_S="120",
        PROBE_S="120",
        QUICK_S="300",
    )
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "device_check.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((tmp_path / "device_check.json").read_text())
    assert summary["exit_codes"] == {"pack_bench": 0, "ucx_probe": 0, "quick": 0}, summary
    pb = json.loads((tmp_path / "pack_bench_cpu.json").read_text())
    assert all(pb["pairs"]["mla"]["byte_exact"].values()) and pb["pairs"]["mla"]["byte_exact"], pb["pairs"]["mla"]
    assert "remote memory read" in (tmp_path / "ucx_probe.log").read_text()
    assert "UCX_PROBE_JSON" in out
    quick = json.loads((tmp_path / "gpu_suite_cpu_small_quick.json").read_text())
    assert quick["all_byte_exact"] is True and quick["profile"] == "quick"
