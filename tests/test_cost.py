"""Cost model: loading calibration files, and the per-request decision."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvbridge import cost
from kvbridge.cost import CostModel, pair_shapes, request_chunks, request_modes
from kvbridge.layout import EngineLayout, MemoryLayout
from kvbridge.lower import GroupBlocks, LoweredPlan
from kvbridge.models import preset
from kvbridge.plan import plan_transfer


@pytest.mark.parametrize("content,expect", [
    ({"per_desc_us": 3.5, "wire_gbps": 11.0, "copy_gbps": 16.0, "gather_ns_per_run": 20.0}, (3.5, 11.0, 16.0, 20.0)),
    ({"per_desc_us": 7.1, "wire_gbps": 2.9, "copy_gbps": 3.1}, (7.1, 2.9, 3.1, 50.0)),  # older file: no gather key
    ({"per_desc_us": -1, "wire_gbps": 2.9, "copy_gbps": 3.1}, (4.5, 10.0, 10.0, 50.0)),  # nonsense: defaults
    ({"per_desc_us": "fast"}, (4.5, 10.0, 10.0, 50.0)),
    ([1, 2], (4.5, 10.0, 10.0, 50.0)),
    ("{\"per_desc_us\": 1e999999}", (4.5, 10.0, 10.0, 50.0)),  # inf
    ("{\"per_desc_us\": 1" + "0" * 400 + "}", (4.5, 10.0, 10.0, 50.0)),  # int too large for a float
    ("not json", (4.5, 10.0, 10.0, 50.0)),
])
def test_calibration_file_loads_or_falls_back(tmp_path, monkeypatch, content, expect):
    f = tmp_path / "calibration.json"
    f.write_text(content if isinstance(content, str) else json.dumps(content))
    monkeypatch.setattr(cost, "CALIBRATION_FILE", f)
    cm = CostModel.load()
    assert (cm.per_desc_us, cm.wire_gbps, cm.copy_gbps, cm.gather_ns_per_run) == expect
    if expect == (4.5, 10.0, 10.0, 50.0):
        assert cm == CostModel()  # source says "defaults", not the file
    # the model is usable either way (an older file once crashed here)
    assert cm.staged_us(100, 1 << 20) > 0 and cm.direct_us(100, 1 << 20) > 0


def test_calibration_round_trip_and_missing_file(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "CALIBRATION_FILE", tmp_path / "sub" / "calibration.json")
    assert CostModel.load() == CostModel()
    CostModel(per_desc_us=3.0, wire_gbps=12.0, copy_gbps=15.0, gather_ns_per_run=40.0).save()
    cm = CostModel.load()
    assert (cm.per_desc_us, cm.wire_gbps, cm.copy_gbps, cm.gather_ns_per_run) == (3.0, 12.0, 15.0, 40.0)


def test_request_modes_follow_block_contiguity():
    """Equal TP, per-layer layout: shuffled blocks mean one descriptor per (layer, K/V, block) -> staged;
    consecutive blocks merge into one run per (layer, K/V) -> direct."""
    m = preset("llama-3.1-70b")
    eng = lambda role: EngineLayout(m, tp=4, block_size=16, memory=MemoryLayout.parse("flash_attn_hnd"),  # noqa: E731
                                    num_blocks=4096, role=role)
    p, d = eng("prefill"), eng("decode")
    lp = LoweredPlan(plan_transfer(p, d), (0, 0))
    shapes = pair_shapes(lp)
    rng = np.random.default_rng(0)
    for ids, want in ((rng.permutation(4096)[:256], "staged"), (np.arange(100, 356), "direct")):
        blocks = {"full": GroupBlocks(ids)}
        chunks, frac = request_chunks(m.groups, blocks, blocks, d.block_size, lp.chunk_tokens)
        assert chunks == 256
        assert frac == 1.0 if want == "direct" else frac < 0.05
        assert set(request_modes(CostModel(), shapes, chunks, frac, lambda _: True).values()) == {want}
        assert set(request_modes(CostModel(), shapes, chunks, frac, lambda _: False).values()) == {"direct"}


def test_a_very_slow_links_figures_export_as_slow_not_zero():
    """Bandwidths are exported to 4 significant digits: a link a stalled probe measured at 20 KB/s reads
    2e-05 GB/s in ``to_json`` (Prometheus, ``plan --probe``), not 0.0; ordinary figures keep 4 digits."""
    slow = cost.PathFigures(19766.0, 2.0e-5, 0.0, measured=True).to_json()
    assert slow["gbps"] == pytest.approx(2.0e-5) and slow["gbps"] > 0
    assert cost.PathFigures(1.0, 7.56789, 0.0).to_json()["gbps"] == 7.568
    assert cost.PathFigures(1.0, 0.0, 0.0).to_json()["gbps"] == 0.0
