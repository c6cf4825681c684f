"""Counters in the spirit of vLLM's NIXL connector stats, readable as JSON and as Prometheus text."""
from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import Any

# upper bounds (seconds) of the transfer-duration histogram's buckets (the last one is +inf)
BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
                              30.0, 60.0, 120.0, float("inf"))


@dataclass
class Histogram:
    """Counts per bucket (``BUCKETS``: upper bounds); cumulative snapshots subtract and add exactly, so a
    quantile of any window (the difference of two snapshots) or of several ranks (their sum) is computed
    from the counts, never from quantiles of snapshots."""

    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.count += 1

    def quantile(self, q: float) -> float:
        return quantile_from_counts(self.counts, q)


def quantile_from_counts(counts: list[int], q: float) -> float:
    """The ``q`` quantile of a histogram over :data:`BUCKETS` (linear within the bucket; the last,
    unbounded bucket answers its lower bound). 0.0 when empty."""
    total = sum(counts)
    if total <= 0:
        return 0.0
    target, seen = q * total, 0
    for i, c in enumerate(counts):
        if c and seen + c >= target:
            lo = BUCKETS[i - 1] if i else 0.0
            hi = BUCKETS[i]
            if hi == float("inf"):
                return lo
            return lo + (hi - lo) * max(0.0, target - seen) / c
        seen += c
    return BUCKETS[-2]


@dataclass
class Metrics:
    transfers: int = 0
    transfer_bytes: int = 0
    descriptors: int = 0
    failed_transfers: int = 0
    failed_requests: int = 0
    finished_requests: int = 0
    expired_requests: int = 0
    aborted_requests: int = 0
    freed_requests: int = 0
    unknown_notifications: int = 0
    failed_notifications: int = 0
    handshakes: int = 0
    staged_transfers: int = 0
    staging_fallbacks: int = 0
    stage_waits: int = 0
    stage_full: int = 0
    stage_quota_full: int = 0
    failed_stage_requests: int = 0
    failed_handshakes: int = 0
    refused_reads: int = 0
    stale_messages: int = 0
    forged_messages: int = 0
    cancelled_reads: int = 0
    not_registered: int = 0
    restart_requeues: int = 0
    retried_failures: int = 0
    ignored_notifications: int = 0
    register_retries: int = 0
    heartbeats: int = 0
    transfer_seconds_sum: float = 0.0
    post_seconds_sum: float = 0.0
    stage_wait_seconds_sum: float = 0.0
    scatter_seconds_sum: float = 0.0
    transfer_hist: Histogram = field(default_factory=Histogram, repr=False)

    def observe_transfer(self, seconds: float) -> None:
        """One request's transfer (from start to its last byte), once per finished request."""
        self.transfer_seconds_sum += seconds
        self.transfer_hist.observe(seconds)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        h = d.pop("transfer_hist")
        d["transfer_seconds_count"] = h["count"]
        # counts per bucket (upper bound -> count, not cumulative): deltas between snapshots are exact
        d["transfer_seconds_buckets"] = {_le(b): int(c) for b, c in zip(BUCKETS, h["counts"])}
        d["transfer_seconds_p50"] = self.transfer_hist.quantile(0.5)
        d["transfer_seconds_p90"] = self.transfer_hist.quantile(0.9)
        return d

    def merge(self, other: dict[str, Any]) -> None:
        for k, v in other.items():
            if k == "transfer_seconds_buckets" and isinstance(v, dict):
                for i, b in enumerate(BUCKETS):
                    self.transfer_hist.counts[i] += int(v.get(_le(b), 0))
                self.transfer_hist.count = sum(self.transfer_hist.counts)
            elif k == "transfer_seconds_count" or k.startswith("transfer_seconds_p"):
                continue  # derived from the buckets
            elif hasattr(self, k) and isinstance(v, (int, float)) and not isinstance(getattr(self, k), list):
                setattr(self, k, getattr(self, k) + v)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


HELP = {
    "transfers": ("counter", "KV transfers posted (one per request and prefill rank)"),
    "transfer_bytes": ("counter", "bytes moved by KV transfers"),
    "descriptors": ("counter", "NIXL descriptors posted"),
    "failed_transfers": ("counter", "KV transfers that failed"),
    "failed_requests": ("counter", "requests reported failed"),
    "finished_requests": ("counter", "requests whose KV arrived"),
    "expired_requests": ("counter", "requests freed by the prefill after their lease expired"),
    "aborted_requests": ("counter", "requests aborted on the decode side"),
    "freed_requests": ("counter", "requests whose blocks the prefill freed after all readers were done"),
    "unknown_notifications": ("counter", "notifications for unknown or expired request ids"),
    "failed_notifications": ("counter", "notifications that could not be sent"),
    "handshakes": ("counter", "successful handshakes"),
    "staged_transfers": ("counter", "transfers done staged (packed by the prefill, one read, scattered)"),
    "staging_fallbacks": ("counter", "staged transfers that fell back to direct reads (no staging room)"),
    "stage_waits": ("counter", "stage requests that waited for staging space on the prefill"),
    "failed_stage_requests": ("counter", "stage requests that failed on the prefill while packing (answered with an error)"),
    "stage_full": ("counter", "stage requests the prefill refused (no staging space in time): read directly"),
    "stage_quota_full": ("counter", "stage requests refused because their decode engine held its share of staging"),
    "failed_handshakes": ("counter", "failed handshakes"),
    "refused_reads": ("counter", "acquire/stage requests the prefill refused (lease gone, other attempt, unknown reader)"),
    "stale_messages": ("counter", "Done/stage/acquire messages for another attempt of a live request (ignored)"),
    "forged_messages": ("counter", "messages from a reader that did not handshake or from another agent (ignored)"),
    "ignored_notifications": ("counter", "Done notifications with no effect: a pin the sender does not hold, a "
                                         "decline from a pin holder, a read settled already"),
    "retried_failures": ("counter", "failures of a read started again after it had failed (counted once in failed_requests)"),
    "restart_requeues": ("counter", "reads re-queued behind a background re-handshake of a restarted prefill"),
    "not_registered": ("counter", "acquire/stage requests refused because the lease was not registered yet (retried)"),
    "register_retries": ("counter", "acquire/stage requests retried after a not-registered refusal"),
    "heartbeats": ("counter", "lease heartbeats sent (queued requests and in-flight pins)"),
    "cancelled_reads": ("counter", "reads cancelled before the transport posted them (dead peer, failed request)"),
    "transfer_seconds_sum": ("counter", "total seconds spent in KV transfers"),
    "post_seconds_sum": ("counter", "total seconds spent building and posting descriptors"),
    "stage_wait_seconds_sum": ("counter", "total seconds from a stage request to the prefill's answer (its pack)"),
    "scatter_seconds_sum": ("counter", "total seconds spent scattering staged bytes into KV blocks"),
}


def escape_label_value(v: str) -> str:
    """Prometheus text format: backslash, double quote and newline are escaped in label values."""
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def to_prometheus(d: dict[str, Any], labels: dict[str, str] | None = None, prefix: str = "kvbridge_") -> str:
    lab = ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in (labels or {}).items())
    lab = "{" + lab + "}" if lab else ""
    lines = []
    for k, (typ, help_) in HELP.items():
        if k in d:
            name = prefix + k + ("_total" if typ == "counter" and not k.endswith("_sum") else "")
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {typ}", f"{name}{lab} {d[k]}"]
    return "\n".join(lines) + "\n"
