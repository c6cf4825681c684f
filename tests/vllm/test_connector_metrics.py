"""kvbridge's figures in vLLM: per-worker KVConnectorStats aggregate without summing quantiles, and
vLLM's own Prometheus plumbing (``KVConnectorProm`` -> ``KVBridgeConnector.build_prom_metrics``) puts them
on ``/metrics`` as ``vllm:kvbridge_*`` counters and a read-latency histogram."""
from __future__ import annotations

import tempfile

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
prometheus_client = pytest.importorskip("prometheus_client")

from sched_utils import TINY_LLAMA, make_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402

from kvbridge.integrations.vllm import KVBridgeStats  # noqa: E402
from kvbridge.integrations.vllm.stats import StatsDelta, link_rows  # noqa: E402


def test_worker_stats_aggregate_counters_and_observations_never_quantiles():
    """Two workers' steps: counters add, latencies concatenate, and the logged p50/p90 are quantiles of the
    union (a sum of per-worker quantiles would say 0.3 s here)."""
    w1, w2 = StatsDelta(), StatsDelta()
    a = w1({"reads_done": 2, "reads_failed_LeaseExpired": 1}, [0.010, 0.020])
    b = w2({"reads_done": 1, "decode_transfer_bytes": 4096}, [0.200])
    assert w1({"reads_done": 2, "reads_failed_LeaseExpired": 1}, []) is None  # nothing new: nothing reported
    total = KVBridgeStats(data={}).aggregate(a).aggregate(b)
    assert total.data["reads_done"] == 3 and total.data["reads_failed_LeaseExpired"] == 1
    assert sorted(total.data["read_seconds"]) == [0.010, 0.020, 0.200]
    r = total.reduce()
    assert r["reads_timed"] == 3 and r["read_ms_p50"] == 20.0 and r["read_ms_p90"] == 200.0
    assert all(not isinstance(v, list) for v in r.values())
    # phase durations travel as observations too: the logged median is over every worker's reads
    p1 = w1({"reads_done": 3}, [], [("decode:grant", 0.001), ("decode:grant", 0.003)])
    p2 = w2({"reads_done": 2}, [], [("decode:grant", 0.002), ("prefill:acquire", 0.0001)])
    r = KVBridgeStats(data={}).aggregate(p1).aggregate(p2).reduce()
    assert r["decode:grant_ms_p50"] == 2.0 and r["prefill:acquire_ms_p50"] == 0.1


def test_link_rows_are_reported_when_a_handshake_or_a_warning_changes_them():
    """A decode worker's links (``DecodeEndpoint.links()``) become one row per path; the worker asks for them
    only when a handshake completed or a link was warned degraded, and reports them only when they differ."""
    figs = {"gbps": 5.5, "us_per_desc": 2.2, "factor": 1.0, "last_gbps": 0.0, "measured": True}
    links = {"pre": {"(0, 1)": {"chosen": "host", "warning": "",
                                "paths": {"direct": figs, "host": {**figs, "gbps": 9.0, "measured": False}}}}}
    rows = link_rows((0, 0), links)
    assert rows == [["pp0tp0", "pre", "pp0tp1", "direct", 0, 5.5, 2.2, 0, 1],
                    ["pp0tp0", "pre", "pp0tp1", "host", 1, 9.0, 2.2, 0, 0]]
    asked = []

    def ask():
        asked.append(1)
        return link_rows((0, 0), links)

    d = StatsDelta()
    assert d({"decode_handshakes": 1}, links=ask).data["links"] == rows
    assert d({"decode_handshakes": 1, "reads_done": 1}, links=ask).data == {"reads_done": 1} and len(asked) == 1
    assert d({"decode_handshakes": 2, "reads_done": 1}, links=ask).data == {"decode_handshakes": 1}
    assert len(asked) == 2  # a second handshake with the same figures: asked, nothing new reported
    links["pre"]["(0, 1)"]["warning"] = "degraded"
    got = d({"decode_handshakes": 2, "decode_degraded_links": 1, "reads_done": 1}, links=ask).data["links"]
    assert [row[7] for row in got] == [1, 1]
    total = KVBridgeStats(data={}).aggregate(d({"decode_handshakes": 3}, links=lambda: rows))
    assert "links" not in total.reduce()  # the log line has the counters only


def _sample(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no sample {name} {labels}")


def test_vllms_prometheus_plumbing_exports_kvbridge_figures_from_a_real_run():
    """A prefill TP2 -> decode TP1 run over NIXL (vLLM's tensors), its workers' stats aggregated as vLLM
    aggregates them and handed to vLLM's KVConnectorProm (which loads the connector class from the
    kv-transfer config and calls build_prom_metrics): /metrics text has the reads, bytes, leases freed, a
    histogram with one observation per read, and failed reads by type."""
    pytest.importorskip("nixl._api")
    pytest.importorskip("vllm.v1.core.kv_cache_planning")
    from worker_harness import Side, llama, run_pair

    r = run_pair(llama(2), Side(2, 1, 16), Side(1, 1, 16), requests=((60, 0), (33, 1), (100, 0)))
    assert r.failed == [] and len(r.done) == 3
    cfg = make_vllm_config(tempfile.mkdtemp(), TINY_LLAMA, kv_transfer_config=dict(
        kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.integrations.vllm", kv_role="kv_both"))
    prom = KVConnectorProm(cfg, ["model_name", "engine"], {0: ["tiny", "0"]})
    assert prom.prom_metrics is not None
    prom.observe(r.stats, 0)
    prom.observe({"reads_failed_LeaseExpired": 2, "reads_failed_PeerDisconnected": 1}, 0)
    text = prometheus_client.generate_latest().decode()
    eng = {"model_name": "tiny", "engine": "0"}
    assert _sample(text, "vllm:kvbridge_reads_done_total", **eng) == 3
    assert _sample(text, "vllm:kvbridge_read_seconds_count", **eng) == 3
    assert _sample(text, "vllm:kvbridge_read_seconds_sum", **eng) > 0
    assert _sample(text, "vllm:kvbridge_transfer_bytes_total", **eng) == r.stats["decode_transfer_bytes"] > 0
    # the path each read took, and the degraded-link warnings (link-aware paths)
    for key in ("staged_transfers", "host_staged_transfers", "degraded_links"):
        assert _sample(text, f"vllm:kvbridge_{key}_total", **eng) == r.stats.get(f"decode_{key}", 0)
    assert _sample(text, "vllm:kvbridge_leases_freed_total", **eng) == 3 * 2  # every request on both prefill ranks
    assert _sample(text, "vllm:kvbridge_reads_failed_total", reason="LeaseExpired", **eng) == 2
    assert _sample(text, "vllm:kvbridge_reads_failed_total", reason="PeerDisconnected", **eng) == 1
    # each read's phases, both sides: one decode "report" per read, the prefill's pins held until Done
    assert _sample(text, "vllm:kvbridge_phase_seconds_count", phase="decode:report", **eng) == 3
    assert _sample(text, "vllm:kvbridge_phase_seconds_count", phase="decode:grant", **eng) == 3
    assert _sample(text, "vllm:kvbridge_phase_seconds_count", phase="prefill:pin_held", **eng) >= 3
    # per link (decode rank, prefill engine and rank, path): the chosen path, measured GB/s and µs per
    # descriptor, as the decode worker measured them at handshake; one chosen path per prefill rank
    rows = r.stats["links"]
    assert {(row[0], row[1], row[2]) for row in rows} == {("pp0tp0", "prefill-e", "pp0tp0"),
                                                          ("pp0tp0", "prefill-e", "pp0tp1")}
    for d, peer, p, path, chosen, gbps, us, degraded, measured in rows:
        lab = dict(decode_rank=d, peer=peer, prefill_rank=p, path=path, **eng)
        assert _sample(text, "vllm:kvbridge_link_chosen", **lab) == chosen
        assert _sample(text, "vllm:kvbridge_link_gbps", **lab) == gbps > 0
        assert _sample(text, "vllm:kvbridge_link_us_per_desc", **lab) == us >= 0
        assert _sample(text, "vllm:kvbridge_link_degraded", **lab) == degraded
        assert _sample(text, "vllm:kvbridge_link_measured", **lab) == measured
    for p in ("pp0tp0", "pp0tp1"):
        assert sum(row[4] for row in rows if row[2] == p) == 1


def test_worker_counters_read_directly_name_what_the_endpoints_stats_name():
    """The worker reads the endpoints' counters every engine step without their ``stats()`` (which copies
    the whole state): the same keys and values as the numeric, additive part of ``Metrics.to_json``."""
    from kvbridge.integrations.vllm.worker import _counters
    from kvbridge.runtime.metrics import Metrics

    m = Metrics(transfers=3, transfer_bytes=4096, handshakes=1)
    m.observe_transfer(0.01)
    m.observe_transfer(2.0)
    want = {k: v for k, v in m.to_json().items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.endswith(("_p50", "_p90"))}
    assert _counters(m) == want
    assert want["transfer_seconds_count"] == 2 and want["transfers"] == 3


def test_worker_counters_of_an_unchanged_step_are_the_same_dict_and_the_delta_skips_them():
    """``ConnectorWorker.counters()`` runs every engine step: with nothing changed it returns the previous
    dict itself (one tuple comparison, no dict built) and ``StatsDelta`` reports nothing; any change (a
    counter, the transfer histogram's count, a failure type) gives a new dict with exact deltas."""
    from collections import Counter
    from types import SimpleNamespace

    from kvbridge.integrations.vllm.worker import ConnectorWorker, _counters
    from kvbridge.runtime.metrics import Metrics

    m = Metrics(transfers=1)
    w = object.__new__(ConnectorWorker)
    w.received, w.released, w.failures, w.server = 0, 0, Counter(), None
    w.decode = SimpleNamespace(metrics=m)
    w._counters_key, w._counters_now = (), {}
    d = StatsDelta()
    a = w.counters()
    assert d(a).data == {"decode_transfers": 1}
    b = w.counters()
    assert b is a and d(b) is None
    m.transfers += 2
    m.observe_transfer(0.5)
    w.failures["TransferTimeout"] += 1
    c = w.counters()
    assert c is not a and {k: c[f"decode_{k}"] for k in _counters(m)} == _counters(m)
    assert d(c).data == {"decode_transfers": 2, "decode_transfer_seconds_count": 1, "decode_transfer_seconds_sum": 0.5,
                         "reads_failed_TransferTimeout": 1}
    assert w.counters() is c and d(c) is None
