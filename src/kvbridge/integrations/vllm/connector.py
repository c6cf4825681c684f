"""The facade vLLM loads (``kv_connector: KVBridgeConnector``): reads the settings once
(:class:`.config.ConnectorConfig`) and routes each call to its role's side, :class:`.scheduler.ConnectorScheduler`
(engine core) or :class:`.worker.ConnectorWorker` (each worker process). It holds no state of its own."""
from __future__ import annotations

import faulthandler
import os
import signal
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .config import ConnectorConfig
from .scheduler import ConnectorScheduler, KVBridgeConnectorMetadata, Params
from .stats import KVBridgePromMetrics, KVBridgeStats, StatsDelta, link_rows
from .translate import KVCacheConfig, Tensor, VllmConfig
from .worker import ConnectorWorker


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """Pull-model P/D connector moving KV with kvbridge (see the package docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = ConnectorConfig.from_vllm(vllm_config)
        self.engine_id = self.cfg.engine_id
        self.scheduler = ConnectorScheduler(vllm_config, kv_cache_config, self.cfg) \
            if role == KVConnectorRole.SCHEDULER else None
        self.worker = ConnectorWorker(vllm_config, kv_cache_config, self.cfg) \
            if role == KVConnectorRole.WORKER else None
        self._stats_delta = StatsDelta()
        _stacks_on_signal()

    @property
    def _sched(self) -> ConnectorScheduler:
        """The scheduler side (vLLM calls the scheduler-side methods on the scheduler's connector only)."""
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side call on a worker's KVBridgeConnector")
        return self.scheduler

    @property
    def _work(self) -> ConnectorWorker:
        """The worker side (vLLM calls the worker-side methods on the workers' connectors only)."""
        if self.worker is None:
            raise RuntimeError("a worker-side call on the scheduler's KVBridgeConnector")
        return self.worker

    # ------------------------------------------------------------------ scheduler side
    def on_new_request(self, request: Any) -> None:
        self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Params | None]:
        return self._sched.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, Params | None]:
        return self._sched.request_finished_all_groups(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.update_connector_output(connector_output)

    def held_requests(self) -> list[str]:
        """Prefill: requests whose blocks vLLM still holds for a remote read."""
        return self._sched.held_requests()

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Tensor]) -> None:
        ktc = self._kv_transfer_config
        self._work.register_kv_caches(kv_caches, ktc.is_kv_producer, ktc.is_kv_consumer)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeConnectorMetadata)
        self._work.start_load_kv(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work.transfer_results()
        out = KVConnectorTransferResults(finished_sending=sending, finished_recving=recving)
        out.failed_recving = failed
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None), (r.finished_recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        """kvbridge's counters since the previous call (reads done and failed by type, bytes, prefill
        leases freed/expired): vLLM aggregates them across workers and logs them."""
        if self.worker is None:  # vLLM's scheduler asks its connector too: the counters live on the workers
            return None
        d = self.worker.decode
        return self._stats_delta(
            self.worker.counters(),
            self.worker.take_read_seconds(),
            self.worker.take_phase_seconds(),
            None if d is None else lambda: link_rows(d.rank, d.links()),
        )

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVBridgePromMetrics:
        """kvbridge's counters and read-latency histogram on vLLM's ``/metrics`` (``vllm:kvbridge_*``)."""
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: sleep mode frees and re-allocates the KV memory kvbridge registered with NIXL, and peers would
        keep reading the old registration; vLLM refuses ``--enable-sleep-mode`` with this connector."""
        return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


def _stacks_on_signal() -> None:
    """``KVBRIDGE_STACKS_DIR=/some/dir``: this process prints every thread's Python stack to stderr on SIGUSR1
    (``faulthandler``: works while another thread holds the GIL) and leaves its pid in that directory, so an
    operator or a test that sees a wedged engine can ask where each connector process is."""
    where = os.environ.get("KVBRIDGE_STACKS_DIR")
    if not where or not hasattr(signal, "SIGUSR1"):
        return
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        os.makedirs(where, exist_ok=True)
        open(os.path.join(where, str(os.getpid())), "w").close()
    except (OSError, RuntimeError, ValueError):  # a debugging aid: never fails the engine
        pass
