"""kvbridge: move LLM KV caches from a prefill engine to a decode engine, whatever their parallelism.

The embedding API (what an engine imports)::

    import kvbridge

    model = kvbridge.load_model("path/to/config.json")          # or a preset name
    engine = kvbridge.EngineLayout(model, tp=4, pp=1, block_size=16, num_blocks=num_blocks)
    memory = kvbridge.describe_memory(engine, (pp_rank, tp_rank),
                                      {layer: kvbridge.LayerKV(kv_caches[layer], "BHNC") for layer in ...})

    # prefill rank
    p = kvbridge.PrefillEndpoint(engine, (pp_rank, tp_rank), "prefill-0", memory=memory, port=5600)
    attempt = p.add_request(req_id, {group: kvbridge.GroupBlocks.of(block_ids)})  # lease; pass attempt on
    p.serve_once()                                                        # in the engine loop (or a thread)

    # decode rank
    d = kvbridge.DecodeEndpoint(engine, (pp_rank, tp_rank), "decode-0", memory=memory)
    d.handshake("prefill-0", {(0, 0): "host:5600", ...})                  # once per remote engine
    d.start(kvbridge.ReadRequest(req_id, "prefill-0", num_tokens, prefill_blocks, decode_blocks, attempt=attempt))
    done, failed = d.poll()                                               # or d.wait(timeout_s)
    d.connect("prefill-0", {(0, 0): "host:5600", ...})                    # or: handshake in the background
    d.heartbeat([read_request, ...])                                      # queued requests keep their leases
    d.abort(req_id)                                                       # give up a read in flight
    d.release(read_request)                                               # give up one never started

Names (25):

* Describing an engine: :func:`load_model` (a preset or a Hugging Face ``config.json`` -> :class:`ModelSpec`),
  :class:`ModelSpec` (a model's KV-cache groups), :class:`EngineLayout` (a model, its parallelism, block
  size and memory layout), :class:`MemoryLayout` (the axis order of a rank's cache regions).
* Describing a rank's memory: :func:`describe_memory` (an engine's tensors -> :class:`KVMemory`),
  :class:`LayerKV` (one layer's KV tensor and its axes), :class:`LayerState` (one Mamba layer's state
  tensors), :class:`RawRegion` (memory given by address), :class:`KVMemory` (where every region lives).
* Moving KV: :class:`PrefillEndpoint` and :class:`DecodeEndpoint` (one rank each side), their options
  :class:`PrefillConfig` and :class:`DecodeConfig`, :class:`PrefillServer` (serves a prefill endpoint from
  a thread and the engine's loop), :class:`ReadRequest` (one read), :class:`GroupBlocks` (a request's block
  ids in one cache group).
* Errors: :class:`KVBridgeError` (the base of every error kvbridge raises on purpose), :class:`LayoutError`,
  :class:`IncompatibleLayoutsError`, :class:`ConfigError`, :class:`RequestError`, :class:`HandshakeError`,
  :class:`TransferError`, :class:`TransportUnavailableError`, and :class:`ReadFailure`, the base of the
  read failures ``DecodeEndpoint.poll`` reports (each kind in :mod:`kvbridge.failures`).

Engine integrations find their helpers in :mod:`kvbridge.integrations` (``from_hf_config``, ``CacheGroup``,
``MambaSpec``, ``dtype_size``, ``nixl_transport``); transfer modes in :mod:`kvbridge.modes`. Runtime
classes load on first use: ``import kvbridge`` pulls in neither ZMQ, NIXL, torch nor rich.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .describe import LayerKV, LayerState, describe_memory
from .errors import (
    ConfigError,
    HandshakeError,
    IncompatibleLayoutsError,
    KVBridgeError,
    LayoutError,
    ReadFailure,
    RequestError,
    TransferError,
    TransportUnavailableError,
)
from .layout import EngineLayout, MemoryLayout, ModelSpec
from .lower import GroupBlocks
from .memory import KVMemory
from .models import load_model
from .tensors import RawRegion

if TYPE_CHECKING:
    from .runtime.config import DecodeConfig, PrefillConfig
    from .runtime.decode import DecodeRank as DecodeEndpoint
    from .runtime.prefill import PrefillRank as PrefillEndpoint
    from .runtime.request import ReadRequest
    from .runtime.server import PrefillServer

_LAZY = {
    "PrefillEndpoint": ("kvbridge.runtime.prefill", "PrefillRank"),
    "DecodeEndpoint": ("kvbridge.runtime.decode", "DecodeRank"),
    "ReadRequest": ("kvbridge.runtime.request", "ReadRequest"),
    "PrefillServer": ("kvbridge.runtime.server", "PrefillServer"),
    "PrefillConfig": ("kvbridge.runtime.config", "PrefillConfig"),
    "DecodeConfig": ("kvbridge.runtime.config", "DecodeConfig"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = ["load_model", "ModelSpec", "EngineLayout", "MemoryLayout",
           "describe_memory", "LayerKV", "LayerState", "RawRegion", "KVMemory",
           "PrefillEndpoint", "DecodeEndpoint", "PrefillConfig", "DecodeConfig", "PrefillServer", "ReadRequest",
           "GroupBlocks",
           "KVBridgeError", "LayoutError", "IncompatibleLayoutsError", "ConfigError", "RequestError", "HandshakeError",
           "TransferError", "TransportUnavailableError", "ReadFailure"]
