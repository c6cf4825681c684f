"""Write the stats of several ranks as one JSON file and one Prometheus text-exposition file.

``stats_by_rank`` maps a rank key to that rank's ``stats()`` dict (``PrefillRank.stats()`` /
``DecodeRank.stats()``, or ``EngineProcs.call_all("stats")`` values). A key becomes the series'
labels: ``(pp, tp)`` -> ``pp``, ``tp``; ``(engine_id, (pp, tp))`` -> ``engine``, ``pp``, ``tp``;
anything else -> ``rank="<str(key)>"``.

Each metric family gets one ``# HELP``/``# TYPE`` pair followed by one sample per rank (calling
:func:`kvbridge.runtime.metrics.to_prometheus` per rank and concatenating would repeat them, which the
format forbids). Label values are escaped as the format requires.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .metrics import HELP, PHASE_HELP, Metrics, escape_label_value, phase_samples

# stats() keys outside "metrics": (family suffix, type, help)
_GAUGES = {
    "inflight": ("gauge", "requests in flight on a decode rank"),
    "live_handles": ("gauge", "NIXL transfer handles created and not yet released"),
    "peers": ("gauge", "NIXL remote agents currently loaded"),
    "leases": ("gauge", "requests whose blocks a prefill rank holds for readers"),
}
_QUANTILES = {
    "transfer_seconds_p50": ("gauge", "median KV transfer duration (seconds) over the recorded transfers"),
    "transfer_seconds_p90": ("gauge", "90th percentile KV transfer duration (seconds)"),
}
_NIXL = {
    "handles_created": "NIXL transfer handles created",
    "handles_released": "NIXL transfer handles released",
    "regions_registered": "memory regions registered with NIXL",
    "regions_deregistered": "memory regions deregistered from NIXL",
    "peers_added": "NIXL remote agents added",
    "peers_removed": "NIXL remote agents removed",
}

# a decode rank's per-link figures (stats()["links"]): path key -> (family suffix, help)
_LINK = {
    "gbps": ("link_gbps", "measured READ bandwidth of a path to a prefill rank (GB/s; probe at handshake)"),
    "us_per_desc": ("link_us_per_desc", "measured READ cost per descriptor of a path to a prefill rank (us)"),
    "factor": ("link_factor", "moving ratio of observed to predicted transfer time on a path (1: as measured)"),
    "last_gbps": ("link_last_gbps", "effective GB/s of the last completed transfer on a path (0: none yet)"),
}
_LINK_CHOSEN = "1 for the path a decode rank chose for a prefill rank at handshake (auto re-decides per request)"
_LINK_DEGRADED = "1 when a decode rank warned that its link to a prefill rank is degraded (device path slow)"


def rank_labels(key: object) -> dict[str, str]:
    if isinstance(key, tuple) and len(key) == 2 and all(isinstance(x, int) for x in key):
        return {"pp": str(key[0]), "tp": str(key[1])}
    if (isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], tuple) and len(key[1]) == 2
            and all(isinstance(x, int) for x in key[1])):
        return {"engine": str(key[0]), "pp": str(key[1][0]), "tp": str(key[1][1])}
    return {"rank": str(key)}


def _value(v: float) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if v.is_integer() and abs(v) < 2 ** 53 else repr(v)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label_value(v)}"' for k, v in sorted(labels.items())) + "}"


# one sample: (labels, value, name suffix such as "_bucket")
Sample = tuple[dict[str, str], float, str]
# one family as yielded by _families: (name, type, help, samples)
Family = tuple[str, str, str, list[Sample]]


class _Families:
    """Families collected in first-seen order: name -> (type, help, samples)."""

    def __init__(self) -> None:
        self.fams: dict[str, tuple[str, str, list[Sample]]] = {}

    def add(self, name: str, typ: str, help_: str, labels: dict[str, str], value: float, suffix: str = "") -> None:
        self.fams.setdefault(name, (typ, help_, []))[2].append((labels, value, suffix))


def _add_metrics(out: _Families, prefix: str, labels: dict[str, str], m: dict[str, Any]) -> None:
    """The counters and histograms of ``stats()["metrics"]``, then its transfer quantiles."""
    for k, (typ, help_) in HELP.items():
        if k in m:
            out.add(prefix + k + ("_total" if typ == "counter" and not k.endswith("_sum") else ""), typ, help_,
                    labels, m[k])
    for k, (typ, help_) in _QUANTILES.items():
        if k in m:
            out.add(prefix + k, typ, help_, labels, m[k])


def _add_rank_gauges(out: _Families, prefix: str, labels: dict[str, str], st: dict[str, Any]) -> None:
    """The numeric gauges at the top of a rank's stats() and its NIXL agent counters."""
    for k, (typ, help_) in _GAUGES.items():
        if isinstance(st.get(k), (int, float)):
            out.add(prefix + k, typ, help_, labels, st[k])
    for k, help_ in _NIXL.items():
        if k in st.get("nixl", {}):
            out.add(prefix + "nixl_" + k + "_total", "counter", help_, labels, st["nixl"][k])


def _add_links(out: _Families, prefix: str, labels: dict[str, str], links: dict[Any, Any]) -> None:
    """A decode rank's measured links: engine -> prefill rank -> {"warning", "chosen", "paths"}."""
    for eng, per in links.items():
        for prank, link in per.items():
            lab = {**labels, "peer": str(eng), "prefill": str(prank)}
            out.add(prefix + "link_degraded", "gauge", _LINK_DEGRADED, lab, 1 if link.get("warning") else 0)
            for path, f in link.get("paths", {}).items():
                plab = {**lab, "path": path}
                out.add(prefix + "link_chosen", "gauge", _LINK_CHOSEN, plab, 1 if link.get("chosen") == path else 0)
                for k, (name, help_) in _LINK.items():
                    out.add(prefix + name, "gauge", help_, plab, f[k])


def _families(stats_by_rank: dict[Any, dict[str, Any]], prefix: str) -> Iterator[Family]:
    """Yield (name, type, help, [(labels, value, suffix)]) for every family present in some rank's stats."""
    out = _Families()
    for key, st in stats_by_rank.items():
        labels = rank_labels(key)
        m = st.get("metrics", {})
        _add_metrics(out, prefix, labels, m)
        _add_rank_gauges(out, prefix, labels, st)
        for suffix, lab, v in phase_samples(m.get("phase_seconds") or {}, labels):
            out.add(prefix + "phase_seconds", "histogram", PHASE_HELP, lab, v, suffix)
        _add_links(out, prefix, labels, st.get("links") or {})
    for name, (typ, help_, samples) in out.fams.items():
        yield name, typ, help_, samples


def to_prometheus_text(stats_by_rank: dict[Any, dict[str, Any]], prefix: str = "kvbridge_") -> str:
    lines: list[str] = []
    for name, typ, help_, samples in _families(stats_by_rank, prefix):
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {typ}"]
        lines += [f"{name}{suffix}{_labels(lab)} {_value(v)}" for lab, v, suffix in samples]
    return "\n".join(lines) + "\n"


def to_json(stats_by_rank: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    total = Metrics()
    for st in stats_by_rank.values():
        total.merge(st.get("metrics", {}))
    tj = total.to_json()
    tj.pop("transfer_seconds_p50", None)  # quantiles do not add up across ranks
    tj.pop("transfer_seconds_p90", None)
    return {"ranks": {_key_str(k): st for k, st in stats_by_rank.items()}, "total": tj}


def _key_str(key: object) -> str:
    return "/".join(f"{k}={v}" for k, v in rank_labels(key).items())


def _atomic_write(path: str | os.PathLike[str], text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_metrics(stats_by_rank: dict[Any, dict[str, Any]], json_path: str | os.PathLike[str] | None,
                  prom_path: str | os.PathLike[str] | None, prefix: str = "kvbridge_") -> str:
    """Write ``json_path`` (per-rank stats + summed counters) and ``prom_path`` (Prometheus text format,
    e.g. for node_exporter's textfile collector); either path may be None. Returns the Prometheus text."""
    text = to_prometheus_text(stats_by_rank, prefix)
    if json_path is not None:
        _atomic_write(json_path, json.dumps(to_json(stats_by_rank), indent=1, sort_keys=True, default=str) + "\n")
    if prom_path is not None:
        _atomic_write(prom_path, text)
    return text


__all__ = ["write_metrics", "to_prometheus_text", "to_json", "rank_labels", "escape_label_value"]
