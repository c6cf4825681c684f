"""Counters in the spirit of vLLM's NIXL connector stats, readable as JSON and as Prometheus text."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    ignored_notifications: int = 0
    register_retries: int = 0
    heartbeats: int = 0
    transfer_seconds_sum: float = 0.0
    post_seconds_sum: float = 0.0
    stage_wait_seconds_sum: float = 0.0
    scatter_seconds_sum: float = 0.0
    durations: list[float] = field(default_factory=list, repr=False)

    def observe_transfer(self, seconds: float) -> None:
        self.transfer_seconds_sum += seconds
        if len(self.durations) < 100_000:
            self.durations.append(seconds)

    def to_json(self) -> dict:
        d = asdict(self)
        durs = sorted(d.pop("durations"))
        d["transfer_seconds_p50"] = durs[len(durs) // 2] if durs else 0.0
        d["transfer_seconds_p90"] = durs[int(len(durs) * 0.9)] if durs else 0.0
        return d

    def merge(self, other: dict) -> None:
        for k, v in other.items():
            if hasattr(self, k) and isinstance(v, (int, float)) and not isinstance(getattr(self, k), list):
                setattr(self, k, getattr(self, k) + v)


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


def to_prometheus(d: dict, labels: dict[str, str] | None = None, prefix: str = "kvbridge_") -> str:
    lab = ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in (labels or {}).items())
    lab = "{" + lab + "}" if lab else ""
    lines = []
    for k, (typ, help_) in HELP.items():
        if k in d:
            name = prefix + k + ("_total" if typ == "counter" and not k.endswith("_sum") else "")
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {typ}", f"{name}{lab} {d[k]}"]
    return "\n".join(lines) + "\n"
