"""The facade vLLM loads (``kv_connector: KVBridgeConnector``): reads the settings once
(:class:`.config.ConnectorConfig`) and routes each call to its role's side, :class:`.scheduler.ConnectorScheduler`
(engine core) or :class:`.worker.ConnectorWorker` (each worker process). It holds no state of its own."""
from __future__ import annotations

import faulthandler
import os
import signal

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .config import ConnectorConfig
from .scheduler import ConnectorScheduler, KVBridgeConnectorMetadata
from .stats import KVBridgePromMetrics, KVBridgeStats, StatsDelta, link_rows
from .worker import ConnectorWorker


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """Pull-model P/D connector moving KV with kvbridge (see the package docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = ConnectorConfig.from_vllm(vllm_config)
        self.engine_id = self.cfg.engine_id
        self.scheduler = ConnectorScheduler(vllm_config, kv_cache_config, self.cfg) \
            if role == KVConnectorRole.SCHEDULER else None
        self.worker = ConnectorWorker(vllm_config, kv_cache_config, self.cfg) \
            if role == KVConnectorRole.WORKER else None
        self._stats_delta = StatsDelta()
        _stacks_on_signal()

    # ------------------------------------------------------------------ scheduler side
    def on_new_request(self, request):
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self.scheduler.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids):
        return self.scheduler.request_finished_all_groups(request, block_ids)

    def update_connector_output(self, connector_output):
        self.scheduler.update_connector_output(connector_output)

    def held_requests(self) -> list[str]:
        """Prefill: requests whose blocks vLLM still holds for a remote read."""
        return self.scheduler.held_requests()

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches):
        ktc = self._kv_transfer_config
        self.worker.register_kv_caches(kv_caches, ktc.is_kv_producer, ktc.is_kv_consumer)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeConnectorMetadata)
        self.worker.start_load_kv(meta)

    def get_transfer_results(self, finished_req_ids):
        sending, recving, failed = self.worker.transfer_results()
        out = KVConnectorTransferResults(finished_sending=sending, finished_recving=recving)
        out.failed_recving = failed
        return out

    def get_finished(self, finished_req_ids):
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None), (r.finished_recving or None)

    def get_block_ids_with_load_errors(self):
        return self.worker.block_ids_with_load_errors()

    def get_kv_connector_stats(self):
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
    def build_kv_connector_stats(cls, data=None):
        return KVBridgeStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """kvbridge's counters and read-latency histogram on vLLM's ``/metrics`` (``vllm:kvbridge_*``)."""
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """No: sleep mode frees and re-allocates the KV memory kvbridge registered with NIXL, and peers would
        keep reading the old registration; vLLM refuses ``--enable-sleep-mode`` with this connector."""
        return False

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    def shutdown(self):
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
