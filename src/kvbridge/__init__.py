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

Names: :func:`load_model`, :class:`EngineLayout`, :func:`describe_memory` (+ :class:`LayerKV`,
:class:`LayerState`, :class:`RawRegion`), :class:`KVMemory`, :class:`PrefillEndpoint`,
:class:`DecodeEndpoint`, :class:`ReadRequest`, :class:`GroupBlocks`, :class:`MemoryLayout`,
:class:`PrefillServer` (serves a prefill endpoint from a thread and the engine's loop),
:func:`nixl_transport` (an endpoint's transport with chosen NIXL backends and threads), for engine
integrations :func:`from_hf_config`, :class:`CacheGroup`, :class:`MambaSpec`, :func:`dtype_size`, and the
typed errors (:class:`KVBridgeError` and subclasses). Runtime classes load on first use: ``import
kvbridge`` pulls in neither ZMQ, NIXL, torch nor rich.
"""
from __future__ import annotations

from .describe import LayerKV, LayerState, describe_memory
from .errors import (
    Aborted,
    ConfigImportError,
    HandshakeError,
    IncompatibleLayoutsError,
    KVBridgeError,
    LayoutError,
    LeaseExpired,
    PeerDisconnected,
    PeerRestarted,
    ReadFailure,
    RemoteError,
    RequestError,
    TransferError,
    TransferFailed,
    TransferTimeout,
    TransportUnavailableError,
)
from .layout import CacheGroup, EngineLayout, MambaSpec, MemoryLayout, ModelSpec, dtype_size
from .lower import GroupBlocks
from .memory import KVMemory
from .models import from_hf_config, load_model
from .tensors import RawRegion

_LAZY = {
    "PrefillEndpoint": ("kvbridge.runtime.prefill", "PrefillRank"),
    "DecodeEndpoint": ("kvbridge.runtime.decode", "DecodeRank"),
    "ReadRequest": ("kvbridge.runtime.decode", "ReadRequest"),
    "PrefillServer": ("kvbridge.runtime.server", "PrefillServer"),
    "nixl_transport": ("kvbridge.runtime.server", "nixl_transport"),
    "PrefillConfig": ("kvbridge.runtime.config", "PrefillConfig"),
    "DecodeConfig": ("kvbridge.runtime.config", "DecodeConfig"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")


__all__ = ["load_model", "ModelSpec", "EngineLayout", "MemoryLayout", "describe_memory", "LayerKV", "LayerState",
           "RawRegion", "KVMemory", "PrefillEndpoint", "DecodeEndpoint", "ReadRequest", "GroupBlocks",
           "PrefillConfig", "DecodeConfig",
           "KVBridgeError", "LayoutError", "RequestError", "HandshakeError", "IncompatibleLayoutsError",
           "TransferError", "TransportUnavailableError", "ConfigImportError",
           # engine integrations (kvbridge.integrations.*): the config importer, group builders, the
           # read-failure types DecodeEndpoint.poll reports, and the serving thread for a prefill endpoint
           "from_hf_config", "CacheGroup", "MambaSpec", "dtype_size", "PrefillServer", "nixl_transport",
           "ReadFailure", "LeaseExpired", "PeerDisconnected", "PeerRestarted", "TransferTimeout", "Aborted",
           "RemoteError", "TransferFailed"]
