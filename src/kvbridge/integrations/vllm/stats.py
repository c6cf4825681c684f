"""The connector's figures for vLLM: :class:`KVBridgeStats` (what each worker reports per step, aggregated
over workers by vLLM and logged) and :class:`KVBridgePromMetrics` (the same on vLLM's ``/metrics``).

A worker reports *counter deltas* (additive: reads done, failed reads by failure type, bytes, leases
freed/expired, ...) and *observations* (each finished read's latency, seconds). Aggregating adds the
counters and concatenates the observations; quantiles are computed from the observations of the interval
(:meth:`KVBridgeStats.reduce`) or by Prometheus from the histogram, never by adding per-worker quantiles.
"""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

OBSERVATIONS = "read_seconds"  # the one list-valued key: a finished read's latency per request and worker

# counter key (worker's data) -> (Prometheus name, help)
PROM_COUNTERS = {
    "reads_done": ("vllm:kvbridge_reads_done", "KV reads completed (per request and decode worker)"),
    "decode_transfer_bytes": ("vllm:kvbridge_transfer_bytes", "bytes read by kvbridge KV transfers (decode)"),
    "decode_handshakes": ("vllm:kvbridge_handshakes", "side-channel handshakes with prefill ranks (decode)"),
    "decode_failed_handshakes": ("vllm:kvbridge_failed_handshakes", "failed side-channel handshakes (decode)"),
    "decode_failed_transfers": ("vllm:kvbridge_failed_transfers", "decode reads (per prefill rank) that failed"),
    "prefill_freed_requests": ("vllm:kvbridge_leases_freed", "prefill leases freed by every reader's Done"),
    "prefill_expired_requests": ("vllm:kvbridge_leases_expired", "prefill leases expired with no reader done"),
}
FAILED_PREFIX = "reads_failed_"
READ_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0]


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] if sorted_values else 0.0


class KVBridgeStats(KVConnectorStats):
    """Counter deltas (numbers, summed over workers) and ``read_seconds`` observations (concatenated)."""

    def reset(self):
        self.data = {}

    def aggregate(self, other):
        for k, v in (other.data or {}).items():
            if isinstance(v, list):
                self.data[k] = list(self.data.get(k, [])) + v
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self):
        """For vLLM's log line: the counters, and count / mean / p50 / p90 of this interval's read latencies
        (over every worker's observations)."""
        out = {k: v for k, v in self.data.items() if not isinstance(v, list)}
        obs = sorted(self.data.get(OBSERVATIONS, []))
        if obs:
            out.update({"reads_timed": len(obs), "read_ms_mean": round(1e3 * sum(obs) / len(obs), 3),
                        "read_ms_p50": round(1e3 * _quantile(obs, 0.5), 3),
                        "read_ms_p90": round(1e3 * _quantile(obs, 0.9), 3)})
        return out

    def is_empty(self):
        return not self.data


class StatsDelta:
    """Turns a worker's cumulative counters (and the observations it drained) into one step's stats."""

    def __init__(self):
        self._seen: dict = {}

    def __call__(self, now: dict, observations: list[float] | None = None) -> KVBridgeStats | None:
        delta = {k: v - self._seen.get(k, 0) for k, v in now.items() if v != self._seen.get(k, 0)}
        self._seen = now
        if observations:
            delta[OBSERVATIONS] = list(observations)
        return KVBridgeStats(data=delta) if delta else None


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """kvbridge's counters and read-latency histogram on vLLM's ``/metrics`` (``vllm:kvbridge_*``), one
    child per engine label set as vLLM's other connectors do; failed reads by failure type
    (``vllm:kvbridge_reads_failed{reason=...}``)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for key, (name, doc) in PROM_COUNTERS.items():
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}
        self._failed = self._counter_cls(name="vllm:kvbridge_reads_failed",
                                         documentation="KV reads that failed, one per request and decode worker, "
                                                       "by failure type", labelnames=[*labelnames, "reason"])
        hist = self._histogram_cls(name="vllm:kvbridge_read_seconds",
                                   documentation="Time from a read's start on a decode worker to its completion "
                                                 "(per request and worker)",
                                   buckets=READ_BUCKETS, labelnames=labelnames)
        self._read_seconds = {i: hist.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
        for key, value in transfer_stats_data.items():
            if key == OBSERVATIONS:
                for x in value:
                    self._read_seconds[engine_idx].observe(x)
            elif key in self._counters and value > 0:
                self._counters[key][engine_idx].inc(value)
            elif key.startswith(FAILED_PREFIX) and value > 0:
                labels = [*self.per_engine_labelvalues[engine_idx], key[len(FAILED_PREFIX):]]
                self._failed.labels(*labels).inc(value)
