"""The connector's figures for vLLM: :class:`KVBridgeStats` (what each worker reports per step, aggregated
over workers by vLLM and logged) and :class:`KVBridgePromMetrics` (the same on vLLM's ``/metrics``).

A worker reports *counter deltas* (additive: reads done, failed reads by failure type, bytes, leases
freed/expired, ...) and *observations* (each finished read's latency, seconds). Aggregating adds the
counters and concatenates the observations; quantiles are computed from the observations of the interval
(:meth:`KVBridgeStats.reduce`) or by Prometheus from the histogram, never by adding per-worker quantiles.

A decode worker also reports its *links* (:func:`link_rows`) whenever their figures change: per (decode
rank, prefill engine, prefill rank, path) whether the path is the chosen one, its measured GB/s and µs per
descriptor; they are gauges on ``/metrics`` (``vllm:kvbridge_link_*``), the last report wins.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

OBSERVATIONS = "read_seconds"  # list-valued: a finished read's latency per request and worker
PHASES = "phase_seconds"       # list-valued: [(side:phase, seconds)], each read's phases (runtime/metrics.py)
LINKS = "links"                # list-valued: link_rows, a decode worker's links when their figures changed

# counter key (worker's data) -> (Prometheus name, help)
PROM_COUNTERS = {
    "reads_done": ("vllm:kvbridge_reads_done", "KV reads completed (per request and decode worker)"),
    "decode_transfer_bytes": ("vllm:kvbridge_transfer_bytes", "bytes read by kvbridge KV transfers (decode)"),
    "decode_handshakes": ("vllm:kvbridge_handshakes", "side-channel handshakes with prefill ranks (decode)"),
    "decode_failed_handshakes": ("vllm:kvbridge_failed_handshakes", "failed side-channel handshakes (decode)"),
    "decode_failed_transfers": ("vllm:kvbridge_failed_transfers", "decode reads (per prefill rank) that failed"),
    "decode_staged_transfers": ("vllm:kvbridge_staged_transfers",
                                "decode reads (per prefill rank) over a staged path (device or host staging)"),
    "decode_host_staged_transfers": ("vllm:kvbridge_host_staged_transfers",
                                     "decode reads (per prefill rank) over host staging"),
    "decode_pushed_transfers": ("vllm:kvbridge_pushed_transfers",
                                "decode reads (per prefill rank) over the push path (the prefill WRITEs; no READ)"),
    "decode_tag_checks": ("vllm:kvbridge_tag_checks",
                          "lease-tag READs posted after an optimistic read ended before its grant (decode)"),
    "decode_checked_reads": ("vllm:kvbridge_checked_reads",
                             "direct reads completed on their lease's tag, before the prefill's grant (decode)"),
    "decode_degraded_links": ("vllm:kvbridge_degraded_links",
                              "links to prefill ranks warned degraded (a device path far below the host path or a "
                              "floor: the warning in the log names the link and the likely causes)"),
    "prefill_freed_requests": ("vllm:kvbridge_leases_freed", "prefill leases freed by every reader's Done"),
    "prefill_expired_requests": ("vllm:kvbridge_leases_expired", "prefill leases expired with no reader done"),
}
FAILED_PREFIX = "reads_failed_"
READ_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0]
PHASE_BUCKETS = [1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                 5.0, 10.0, 60.0]  # the runtime's phase histograms' bounds (runtime.metrics.PHASE_BUCKETS)


# link row field (link_rows) -> (Prometheus gauge name, help)
PROM_LINK_GAUGES = {
    "chosen": ("vllm:kvbridge_link_chosen",
               "1 on the path a decode rank reads a prefill rank's KV over (direct, staged, host, push), 0 on "
               "the others"),
    "gbps": ("vllm:kvbridge_link_gbps", "measured READ bandwidth of a path from a decode rank to a prefill rank "
                                        "(GB/s; probe at handshake)"),
    "us_per_desc": ("vllm:kvbridge_link_us_per_desc",
                    "measured READ cost per descriptor of a path from a decode rank to a prefill rank (us)"),
    "degraded": ("vllm:kvbridge_link_degraded", "1 when the decode rank warned its link to the prefill rank is "
                                                "degraded (the warning in the log names the causes)"),
    "measured": ("vllm:kvbridge_link_measured", "1 when a path's GB/s and us per descriptor were measured by the "
                                                "handshake's probe, 0 when they are the cost model's constants "
                                                "(the probe could not measure that path in time)"),
}
LINK_TRIGGERS = ("decode_handshakes", "decode_degraded_links")  # counters whose change may change a link's figures
LINK_LABELS = ("decode_rank", "peer", "prefill_rank", "path")
_LINK_FIELDS = (*LINK_LABELS, *PROM_LINK_GAUGES)

# one link_rows row: [decode_rank, peer, prefill_rank, path, chosen, gbps, us_per_desc, degraded, measured]
LinkRow = list[str | int | float]


def _rank_label(rank: Sequence[object]) -> str:
    return "pp{}tp{}".format(*rank)


def link_rows(rank: Sequence[object], links: dict[Any, dict[str, dict[str, Any]]]) -> list[LinkRow]:
    """A decode rank's links (``DecodeEndpoint.links()``: prefill engine -> prefill rank -> figures) as rows
    ``[decode_rank, peer, prefill_rank, path, chosen, gbps, us_per_desc, degraded, measured]`` (JSON, one per path;
    ranks as ``pp{pp}tp{tp}``)."""
    rows: list[LinkRow] = []
    for eid, per in sorted(links.items()):
        for prank, link in sorted(per.items()):
            p = prank.strip("()").replace(" ", "").split(",")
            for path, f in sorted(link.get("paths", {}).items()):
                rows.append([_rank_label(rank), str(eid), _rank_label(p), path, int(link.get("chosen") == path),
                             f["gbps"], f["us_per_desc"], int(bool(link.get("warning"))), int(bool(f.get("measured")))])
    return rows


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] if sorted_values else 0.0


class KVBridgeStats(KVConnectorStats):
    """Counter deltas (numbers, summed over workers) and ``read_seconds`` observations (concatenated)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVBridgeStats:
        for k, v in (other.data or {}).items():
            if isinstance(v, list):
                self.data[k] = list(self.data.get(k, [])) + v
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: the counters, and count / mean / p50 / p90 of this interval's read latencies
        (over every worker's observations)."""
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if not isinstance(v, list)}
        obs = sorted(self.data.get(OBSERVATIONS, []))
        if obs:
            out.update({"reads_timed": len(obs), "read_ms_mean": round(1e3 * sum(obs) / len(obs), 3),
                        "read_ms_p50": round(1e3 * _quantile(obs, 0.5), 3),
                        "read_ms_p90": round(1e3 * _quantile(obs, 0.9), 3)})
        by_phase: dict[str, list[float]] = {}
        for name, sec in self.data.get(PHASES, []):
            by_phase.setdefault(name, []).append(sec)
        for name, secs in sorted(by_phase.items()):  # "decode:grant_ms_p50": where a read's time goes
            out[f"{name}_ms_p50"] = round(1e3 * _quantile(sorted(secs), 0.5), 3)
        return out

    def is_empty(self) -> bool:
        return not self.data


class StatsDelta:
    """Turns a worker's cumulative counters (and the observations it drained) into one step's stats."""

    def __init__(self) -> None:
        self._seen: dict[str, int | float] = {}
        self._links: list[LinkRow] = []

    def __call__(self, now: dict[str, int | float], observations: list[float] | None = None,
                 phases: list[tuple[str, float]] | None = None,
                 links: Callable[[], list[LinkRow]] | None = None) -> KVBridgeStats | None:
        """``links``: the worker's :func:`link_rows`, asked only when a handshake completed or a link was
        warned degraded since the last call (what changes the gauges' figures), reported when they differ."""
        delta: dict[str, Any] = {}
        if now is not self._seen:  # (the same dict again: a worker's counters() with nothing changed)
            seen = self._seen
            delta = {k: v - seen.get(k, 0) for k, v in now.items() if v != seen.get(k, 0)}
            self._seen = now
        if links is not None and any(k in delta for k in LINK_TRIGGERS):
            rows = links()
            if rows != self._links:
                delta[LINKS] = [list(r) for r in rows]
                self._links = rows
        if observations:
            delta[OBSERVATIONS] = list(observations)
        if phases:
            delta[PHASES] = [list(p) for p in phases]
        return KVBridgeStats(data=delta) if delta else None


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """kvbridge's counters and read-latency histogram on vLLM's ``/metrics`` (``vllm:kvbridge_*``), one
    child per engine label set as vLLM's other connectors do; failed reads by failure type
    (``vllm:kvbridge_reads_failed{reason=...}``)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}  # key -> engine index -> prometheus child
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
        self._phase_seconds = self._histogram_cls(
            name="vllm:kvbridge_phase_seconds",
            documentation="Duration of each phase of a KV read (side:phase; decode: queue, grant, post_queue, "
                          "post, transfer, scatter, report; prefill: acquire, stage, pin_held, ...)",
            buckets=PHASE_BUCKETS, labelnames=[*labelnames, "phase"])
        self._link_gauges = {k: self._gauge_cls(name=name, documentation=doc, labelnames=[*labelnames, *LINK_LABELS],
                                                multiprocess_mode="mostrecent")
                             for k, (name, doc) in PROM_LINK_GAUGES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key == OBSERVATIONS:
                for x in value:
                    self._read_seconds[engine_idx].observe(x)
            elif key == PHASES:
                labels = self.per_engine_labelvalues[engine_idx]
                for name, sec in value:
                    self._phase_seconds.labels(*labels, name).observe(sec)
            elif key == LINKS:
                labels = self.per_engine_labelvalues[engine_idx]
                for row in value:
                    f = dict(zip(_LINK_FIELDS, row))
                    for k, gauge in self._link_gauges.items():
                        gauge.labels(*labels, *(str(f[x]) for x in LINK_LABELS)).set(f[k])
            elif key in self._counters and value > 0:
                self._counters[key][engine_idx].inc(value)
            elif key.startswith(FAILED_PREFIX) and value > 0:
                labels = [*self.per_engine_labelvalues[engine_idx], key[len(FAILED_PREFIX):]]
                self._failed.labels(*labels).inc(value)
