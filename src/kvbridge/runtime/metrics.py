"""Counters in the spirit of vLLM's NIXL connector stats, readable as JSON and as Prometheus text.

Besides counters, every read records the time of each of its phases (:data:`DECODE_PHASES` on the
decode side, :data:`PREFILL_PHASES` on the prefill side) into one histogram per phase
(:meth:`Metrics.observe_phase`): bucket counts over :data:`PHASE_BUCKETS`, mergeable across ranks and
snapshots like the transfer histogram, exported by ``to_json`` (``phase_seconds``) and as Prometheus
histograms (``kvbridge_phase_seconds{phase=...}``).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field, fields
from typing import Any

# upper bounds (seconds) of the transfer-duration histogram's buckets (the last one is +inf)
BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
                              30.0, 60.0, 120.0, float("inf"))


# upper bounds (seconds) of the phase histograms' buckets: 10 us to 60 s (the last one is +inf)
PHASE_BUCKETS: tuple[float, ...] = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                                    0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 60.0, float("inf"))

# A decode read's phases, in order (each runs from the end of the one before it that the read went through):
DECODE_PHASES: tuple[str, ...] = (
    "queue",       # start -> its acquire or stage request handed to ZMQ
    "grant",       # -> the pin granted (direct) or the first packed segment announced (staged): a round trip
    "post_queue",  # -> the post thread begins posting the READ
    "post",        # -> the post call returned (descriptor lists + NIXL transfer(); on cma the copy itself)
    "transfer",    # -> the read loop saw the transfer complete
    "scatter",     # -> staged bytes scattered into the KV blocks (staged reads only)
    "report",      # -> the read reported done (poll() returns it)
)
# beside the phases, in the same histograms: a decode read from its start to its end in the runtime (the
# phases' sum; an engine that polls on its steps sees it done at its next step)
WHOLE_READ = "read"
# A prefill rank's phases (each one its own duration, not a sequence):
PREFILL_PHASES: tuple[str, ...] = (
    "acquire",      # an acquire message received -> its answer handed to ZMQ
    "stage_first",  # a stage request received -> its first packed segment announced
    "stage",        # a stage request received -> its last packed segment announced (all packing)
    "pin_held",     # a pin granted -> the reader's Done received (the decode's whole read, as the prefill sees it)
    "serve_turn",   # one serving turn that had work (messages, notifications)
)


@dataclass
class Histogram:
    """Counts per bucket (``bounds``: upper bounds, :data:`BUCKETS` by default) and their sum; cumulative
    snapshots subtract and add exactly, so a quantile of any window (the difference of two snapshots) or
    of several ranks (their sum) is computed from the counts, never from quantiles of snapshots."""

    bounds: tuple[float, ...] = BUCKETS
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def quantile(self, q: float) -> float:
        return quantile_from_counts(self.counts, q, self.bounds)

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "sum": self.sum,
                "buckets": {_le(b): int(c) for b, c in zip(self.bounds, self.counts)}}

    def merge(self, d: dict[str, Any]) -> None:
        buckets = d.get("buckets", {})
        for i, b in enumerate(self.bounds):
            self.counts[i] += int(buckets.get(_le(b), 0))
        self.count = sum(self.counts)
        self.sum += float(d.get("sum", 0.0))


def quantile_from_counts(counts: list[int], q: float, bounds: tuple[float, ...] = BUCKETS) -> float:
    """The ``q`` quantile of a histogram over ``bounds`` (:data:`BUCKETS` by default; linear within the
    bucket; the last, unbounded bucket answers its lower bound). 0.0 when empty."""
    total = sum(counts)
    if total <= 0:
        return 0.0
    target, seen = q * total, 0
    for i, c in enumerate(counts):
        if c and seen + c >= target:
            lo = bounds[i - 1] if i else 0.0
            hi = bounds[i]
            if hi == float("inf"):
                return lo
            return lo + (hi - lo) * max(0.0, target - seen) / c
        seen += c
    return bounds[-2]


def phase_quantiles(phase_seconds: dict[str, Any], q: float = 0.5) -> dict[str, float]:
    """{phase: its ``q`` quantile (seconds)} from ``to_json()["phase_seconds"]`` (of one rank, or merged)."""
    out = {}
    for name, h in phase_seconds.items():
        b = h.get("buckets", {})
        out[name] = quantile_from_counts([int(b.get(_le(x), 0)) for x in PHASE_BUCKETS], q, PHASE_BUCKETS)
    return out


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
    host_staged_transfers: int = 0
    pushed_transfers: int = 0
    pushed_segments: int = 0
    failed_pushes: int = 0
    push_holds: int = 0
    degraded_links: int = 0
    staging_fallbacks: int = 0
    stage_waits: int = 0
    stage_full: int = 0
    stage_quota_full: int = 0
    failed_stage_requests: int = 0
    failed_handshakes: int = 0
    evicted_peers: int = 0
    refused_reads: int = 0
    stale_messages: int = 0
    forged_messages: int = 0
    cancelled_reads: int = 0
    not_registered: int = 0
    restart_requeues: int = 0
    retried_failures: int = 0
    ignored_notifications: int = 0
    register_retries: int = 0
    optimistic_reads: int = 0
    tag_checks: int = 0       # lease-tag READs posted (runtime/tags.py)
    checked_reads: int = 0    # optimistic reads the lease's tag proved live before any grant
    discarded_reads: int = 0
    heartbeats: int = 0
    transfer_seconds_sum: float = 0.0
    post_seconds_sum: float = 0.0
    stage_wait_seconds_sum: float = 0.0
    scatter_seconds_sum: float = 0.0
    transfer_hist: Histogram = field(default_factory=Histogram, repr=False)
    # phase name -> histogram of its durations (PHASE_BUCKETS)
    phases: dict[str, Histogram] = field(default_factory=dict, repr=False)
    # when a list: every phase observation is also appended as (phase, seconds), for a consumer that
    # drains it (the vLLM connector's /metrics); bounded by PHASE_SINK_MAX
    phase_sink: list[tuple[str, float]] | None = field(default=None, repr=False)

    def observe_transfer(self, seconds: float) -> None:
        """One request's transfer (from start to its last byte), once per finished request."""
        self.transfer_seconds_sum += seconds
        self.transfer_hist.observe(seconds)

    def observe_phase(self, name: str, seconds: float) -> None:
        """One duration of phase ``name`` (:data:`DECODE_PHASES`, :data:`PREFILL_PHASES`)."""
        h = self.phases.get(name)
        if h is None:
            h = self.phases[name] = Histogram(PHASE_BUCKETS)
        h.observe(seconds)
        sink = self.phase_sink
        if sink is not None and len(sink) < PHASE_SINK_MAX:
            sink.append((name, seconds))

    def observe_marks(self, marks: list[int]) -> dict[str, float]:
        """A finished decode read's phases from its marks (perf_counter_ns of the end of each phase of
        :data:`DECODE_PHASES`, index 0 the start; 0 where the read skipped the phase): each phase reached
        is observed, timed from the previous mark reached, and the whole read (:data:`WHOLE_READ`: start to
        the last mark reached, the phases' sum). Returns {phase: seconds} (the phases only)."""
        out: dict[str, float] = {}
        prev = marks[0]
        for name, t in zip(DECODE_PHASES, marks[1:]):
            if t:
                sec = max(0, t - prev) / 1e9
                out[name] = sec
                self.observe_phase(name, sec)
                prev = max(prev, t)
        self.observe_phase(WHOLE_READ, max(0, prev - marks[0]) / 1e9)
        return out

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_SCALAR}
        h = self.transfer_hist
        d["transfer_seconds_count"] = h.count
        # counts per bucket (upper bound -> count, not cumulative): deltas between snapshots are exact
        d["transfer_seconds_buckets"] = {_le(b): int(c) for b, c in zip(BUCKETS, h.counts)}
        d["transfer_seconds_p50"] = self.transfer_hist.quantile(0.5)
        d["transfer_seconds_p90"] = self.transfer_hist.quantile(0.9)
        d["phase_seconds"] = {name: ph.to_json() for name, ph in list(self.phases.items())}
        return d

    def merge(self, other: dict[str, Any]) -> None:
        for k, v in other.items():
            if k == "phase_seconds" and isinstance(v, dict):
                for name, ph in v.items():
                    h = self.phases.get(name)
                    if h is None:
                        h = self.phases[name] = Histogram(PHASE_BUCKETS)
                    h.merge(ph)
            elif k == "transfer_seconds_buckets" and isinstance(v, dict):
                for i, b in enumerate(BUCKETS):
                    self.transfer_hist.counts[i] += int(v.get(_le(b), 0))
                self.transfer_hist.count = sum(self.transfer_hist.counts)
            elif k == "transfer_seconds_count" or k.startswith("transfer_seconds_p"):
                continue  # derived from the buckets
            elif hasattr(self, k) and isinstance(v, (int, float)) and not isinstance(getattr(self, k), list):
                setattr(self, k, getattr(self, k) + v)


PHASE_SINK_MAX = 100_000
_NOT_SCALAR = frozenset({"transfer_hist", "phases", "phase_sink"})


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
    "degraded_links": (
        "counter",
        "links to a prefill rank warned degraded (a device path far below the host path or a floor)",
    ),
    "host_staged_transfers": (
        "counter",
        "staged transfers through host staging (device -> host, host READ, host -> device)",
    ),
    "pushed_transfers": (
        "counter",
        "staged transfers over the push path (the prefill WRITEs into this rank's staging; no READ)",
    ),
    "pushed_segments": ("counter", "packed segments this prefill rank WRITEs into decode ranks' staging (push path)"),
    "failed_pushes": ("counter", "push stage requests whose WRITE failed on this prefill rank (answered typed)"),
    "push_holds": (
        "counter",
        "push slots held past their read's end until the prefill's last answer (or its pin bound): never reused early",
    ),
    "staging_fallbacks": ("counter", "staged transfers that fell back to direct reads (no staging room)"),
    "stage_waits": ("counter", "stage requests that waited for staging space on the prefill"),
    "failed_stage_requests": (
        "counter",
        "stage requests that failed on the prefill while packing (answered with an error)",
    ),
    "stage_full": ("counter", "stage requests the prefill refused (no staging space in time): read directly"),
    "stage_quota_full": ("counter", "stage requests refused because their decode engine held its share of staging"),
    "failed_handshakes": ("counter", "failed handshakes"),
    "evicted_peers": (
        "counter",
        "prefill engines released after peer_idle_s unused (or past max_peers); handshaken again on their next read",
    ),
    "refused_reads": (
        "counter",
        "acquire/stage requests the prefill refused (lease gone, other attempt, unknown reader)",
    ),
    "stale_messages": ("counter", "Done/stage/acquire messages for another attempt of a live request (ignored)"),
    "forged_messages": ("counter", "messages from a reader that did not handshake or from another agent (ignored)"),
    "ignored_notifications": (
        "counter",
        "Done notifications with no effect: a pin the sender does not hold, a "
        "decline from a pin holder, a read settled already",
    ),
    "retried_failures": (
        "counter",
        "failures of a read started again after it had failed (counted once in failed_requests)",
    ),
    "restart_requeues": ("counter", "reads re-queued behind a background re-handshake of a restarted prefill"),
    "not_registered": ("counter", "acquire/stage requests refused because the lease was not registered yet (retried)"),
    "register_retries": ("counter", "acquire/stage requests retried after a not-registered refusal"),
    "optimistic_reads": ("counter", "direct reads posted beside their acquire, before the pin (optimistic_reads)"),
    "tag_checks": ("counter", "lease-tag READs posted after an optimistic read ended before its grant"),
    "checked_reads": ("counter", "optimistic reads completed on the lease's tag, before the prefill's grant"),
    "discarded_reads": ("counter", "optimistic reads whose bytes were discarded (not registered yet) and read again"),
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


PHASE_HELP = "duration of each phase of a KV read (decode phases: queue ... report; prefill: acquire, stage, pin_held)"


def phase_samples(phase_seconds: dict[str, Any], labels: dict[str, str]) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus histogram samples (suffix, labels, value) of ``to_json()["phase_seconds"]``: cumulative
    ``_bucket{le=...}``, ``_sum`` and ``_count`` per phase (label ``phase``)."""
    out: list[tuple[str, dict[str, str], float]] = []
    for name, h in sorted(phase_seconds.items()):
        lab = {**labels, "phase": name}
        b, acc = h.get("buckets", {}), 0
        for bound in PHASE_BUCKETS:
            acc += int(b.get(_le(bound), 0))
            out.append(("_bucket", {**lab, "le": _le(bound)}, float(acc)))
        out += [("_sum", lab, float(h.get("sum", 0.0))), ("_count", lab, float(acc))]
    return out


def to_prometheus(d: dict[str, Any], labels: dict[str, str] | None = None, prefix: str = "kvbridge_") -> str:
    lab = ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in (labels or {}).items())
    lab = "{" + lab + "}" if lab else ""
    lines = []
    for k, (typ, help_) in HELP.items():
        if k in d:
            name = prefix + k + ("_total" if typ == "counter" and not k.endswith("_sum") else "")
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {typ}", f"{name}{lab} {d[k]}"]
    if d.get("phase_seconds"):
        name = prefix + "phase_seconds"
        lines += [f"# HELP {name} {PHASE_HELP}", f"# TYPE {name} histogram"]
        for suffix, plab, v in phase_samples(d["phase_seconds"], {str(k): str(x) for k, x in (labels or {}).items()}):
            inner = ",".join(f'{k}="{escape_label_value(x)}"' for k, x in plab.items())
            lines.append(f"{name}{suffix}{{{inner}}} {v!r}")
    return "\n".join(lines) + "\n"
