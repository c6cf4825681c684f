"""The connector's counters as vLLM's ``KVConnectorStats`` (logged by vLLM, aggregated over workers)."""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


class KVBridgeStats(KVConnectorStats):
    """Counters (sums over workers and intervals)."""

    def reset(self):
        self.data = {}

    def aggregate(self, other):
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self):
        return dict(self.data)

    def is_empty(self):
        return not self.data


class StatsDelta:
    """Turns a worker's cumulative counters into what changed since the previous call."""

    def __init__(self):
        self._seen: dict = {}

    def __call__(self, now: dict) -> KVBridgeStats | None:
        delta = {k: v - self._seen.get(k, 0) for k, v in now.items() if v != self._seen.get(k, 0)}
        self._seen = now
        return KVBridgeStats(data=delta) if delta else None
