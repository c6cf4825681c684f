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
from kvbridge.integrations.vllm.stats import StatsDelta  # noqa: E402


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
    assert _sample(text, "vllm:kvbridge_leases_freed_total", **eng) == 3 * 2  # every request on both prefill ranks
    assert _sample(text, "vllm:kvbridge_reads_failed_total", reason="LeaseExpired", **eng) == 2
    assert _sample(text, "vllm:kvbridge_reads_failed_total", reason="PeerDisconnected", **eng) == 1


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
