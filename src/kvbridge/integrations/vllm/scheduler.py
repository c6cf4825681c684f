"""The connector's scheduler side (runs in vLLM's engine core, next to its Scheduler; no kvbridge
endpoint, no I/O). Tested against vLLM's real Scheduler (``tests/vllm/test_connector_scheduler.py``).

* prefill (request has ``do_remote_decode``): ``request_finished_all_groups`` returns ``(True, params)``
  so vLLM holds the blocks (``delay_free``) until the worker reports the request in ``finished_sending``
  (the decode's Done, or the lease expiring on the prefill worker). ``params``: a
  :class:`~.config.TransferParams` as a dict (its fields say what each key carries; the token share of
  each prefill rank travels in the handshake's layout).
* decode (request has ``do_remote_prefill``): ``get_num_new_matched_tokens`` returns
  ``(num_prompt_tokens - num_computed_tokens, True)`` like vLLM's NixlConnector (the scheduler then
  recomputes the last prompt token itself); ``update_state_after_alloc`` records, per group, the blocks
  to fill: the newly allocated ones after the local prefix-cache hit (``first_block`` = number of hit
  blocks, so only the tail is read; under DCP one block id spans ``block_size * dcp`` tokens, and
  ``first_block`` counts those, as kvbridge's ``GroupBlocks`` does); ``build_connector_meta`` hands them with
  the remote params to the
  workers in :class:`KVBridgeConnectorMetadata`.

**vLLM ``n > 1``** (parallel sampling): vLLM's front end fans a request with ``n`` choices out into ``n`` child
requests ``"{i}_{parent id}"`` (``vllm/v1/engine/parallel_sampling.py``, ``ParentRequest.get_child_info``), each
with ``sampling_params.n == 1``, on the prefill as on the decode; the prefill's answer carries the
``kv_transfer_params`` of the child that finished last (the output processor aggregates the children's final
outputs and returns that one's params), and the decode's ``n`` children all read with those params. So the
prefill links the siblings of one parent with the same prompt (:class:`_Siblings`): the first one to finish
holds its blocks under a lease, every later one returns params naming that lease (its own blocks are freed at
once) and raises the lease's expected reads by one (``KVBridgeConnectorMetadata.expect``); the lease is freed
when that many decode reads (each its own ``read_id``) are done or declined, or when it expires.

**Mamba hybrids**: the decode recomputes the last prompt token after a load, so a prefill of a Mamba model
computes all but the last prompt token (:meth:`ConnectorScheduler.on_new_request`, as vLLM's NixlConnector)
and the decode loads that state and ``N - 1`` tokens; each Mamba group travels as the one block holding
the request's running state (:meth:`ConnectorScheduler.state_slot`).
"""
from __future__ import annotations

import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvbridge import RequestError

from .config import ConnectorConfig, TransferParams
from .translate import layout_fingerprint, prefill_backoff, state_groups

log = logging.getLogger(__name__)


@dataclass
class RecvReq:
    """One read a decode worker must do."""

    req_id: str
    local_block_ids: list[list[int]]  # per group: the blocks to fill (tail after the prefix hit)
    local_first_block: list[int]       # per group: number of locally cached (hit) blocks before them
    remote: dict[str, Any]             # the prefill's kv_transfer_params (TransferParams.to_dict)


# a prefill's kv_transfer_params as a dict (the wire form of config.TransferParams)
Params = dict[str, Any]
#: the connector's own mark in a prefill request's kv_transfer_params: its prompt was cut short (Mamba backoff)
TRUNCATED = "_kvbridge_truncated"


@dataclass
class KVBridgeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    recv: dict[str, RecvReq] = field(default_factory=dict)
    send: dict[str, tuple[list[list[int]], int]] = field(
        default_factory=dict
    )  # prefill: req id -> (held block ids per group, attempt)
    # prefill: leases (req id, registered before) that must now wait for more reads -> (attempt, reads)
    expect: dict[str, tuple[int, int]] = field(default_factory=dict)
    # decode: requests that finished (any status) or need nothing without reading: req id -> remote params
    release: dict[str, Params] = field(default_factory=dict)
    # decode: requests still queued here, whose prefill leases must not run out: req id -> remote params
    heartbeat: dict[str, Params] = field(default_factory=dict)
    # decode: prefill engines of requests seen for the first time (the workers start their background
    # handshakes now, off the step that reads them): engine id -> remote params
    connect: dict[str, Params] = field(default_factory=dict)


# vLLM's child request id of parallel sampling: f"{index}_{parent request id}" (ParentRequest.get_child_info)
_CHILD_ID = re.compile(r"(\d+)_(.+)", re.S)


@dataclass
class _Siblings:
    """Prefill: the children of one parent request (vLLM ``n > 1``) sharing one lease."""

    lease_id: str          # the request whose blocks are held
    attempt: int
    prompt: tuple[Any, ...]  # what the children must share to share KV (prompt ids, computed tokens, LoRA, salt, mm)
    params: Params         # the kv_transfer_params every child returns
    reads: int = 1
    indices: set[int] = field(default_factory=set)


class ConnectorScheduler:
    """Scheduler-side state of one engine (DP rank): reads to start, leases to register, blocks held."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self.fingerprint = layout_fingerprint(vllm_config, kv_cache_config)
        # per vLLM KV-cache group: None (attention), or the speculative scratch slots of a Mamba group
        self.state_groups = state_groups(kv_cache_config)
        # trailing prompt tokens the prefill leaves to the decode: vLLM's decode always recomputes the last
        # prompt token after a load; a Mamba state must then be the state *before* it; a multi-module MTP
        # drafter's lookahead window stays off the prefill
        self.backoff = prefill_backoff(vllm_config, kv_cache_config)
        self._pending_recv: dict[str, RecvReq] = {}
        self._pending_send: dict[str, tuple[list[list[int]], int]] = {}
        self._pending_release: dict[str, Params] = {}
        self._queued: dict[str, Params] = {}  # decode: requests seen, not allocated yet -> remote params
        self._pending_connect: dict[str, Params] = {}  # decode: prefill engine id -> params (handshake hint)
        self._next_heartbeat = 0.0
        self._held: dict[str, list[list[int]]] = {}  # prefill: blocks vLLM holds for a remote read
        self._pending_expect: dict[str, tuple[int, int]] = {}
        self._siblings: dict[str, _Siblings] = {}     # prefill: parent request id -> its children's lease

    # ---- decode -----------------------------------------------------------------------------------
    def remote_token_count(self, num_prompt_tokens: int) -> int:
        """Prompt tokens a decode loads: all of them, or (Mamba models) all but the last ``backoff``,
        which the prefill did not compute (:meth:`on_new_request`) and the decode computes itself."""
        b = self.backoff
        return num_prompt_tokens - b if b and num_prompt_tokens > b else num_prompt_tokens

    def on_new_request(self, request: Any) -> None:
        """Decode: track the request for heartbeats until its read is set up.

        Prefill of a Mamba hybrid: drop the last prompt token before scheduling, as vLLM's NixlConnector
        does. vLLM's decode recomputes the last prompt token after any load (``_update_waiting_for_remote_kv``
        sets ``num_computed_tokens = num_tokens - 1``); attention K/V of that token is rewritten with the
        same values, but a Mamba state would take the token twice. So the prefill stops one token short and
        its final state is the one the decode's recompute starts from."""
        p = request.kv_transfer_params
        t = _params(p)
        if t is not None and t.do_remote_prefill and t.readable:
            # decode: the prefill's lease must not run out while the request waits here (heartbeats, as vLLM's
            # NixlConnector tracks them from on_new_request; get_num_new_matched_tokens has no side effects)
            self._queued[request.request_id] = t.to_dict()
            # the workers start the handshake with its prefill engine now (in the background)
            self._pending_connect[str(t.remote_engine_id)] = self._queued[request.request_id]
        b = self.backoff
        if (not b or t is None or not t.do_remote_decode or p.get(TRUNCATED)
                or request.num_prompt_tokens <= b or request.prompt_token_ids is None):
            return
        if hasattr(request, "get_skip_reading_prefix_cache") and request.get_skip_reading_prefix_cache():
            return  # prompt logprobs: the decode recomputes the whole prompt (nothing loaded)
        del request.prompt_token_ids[-b:]
        del request._all_token_ids[-b:]
        request.num_prompt_tokens -= b
        request.max_tokens = 1
        p[TRUNCATED] = True

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        t = _params(request.kv_transfer_params)
        if t is not None and t.do_remote_prefill and t.remote_block_ids is not None:
            want = self.remote_token_count(len(request.prompt_token_ids or []))
            remote = t.remote_num_tokens
            if self.backoff and remote is not None and remote != want:
                # a Mamba state (or MTP draft KV) after more or fewer tokens than the decode resumes from
                # would be wrong
                log.warning("kvbridge: %s: the prefill computed %s prompt tokens, this decode resumes after %d "
                            "(Mamba state / MTP lookahead); computing the prompt locally", request.request_id,
                            remote, want)
                return 0, False
            count = want - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def state_slot(self, g: int, ids: list[int]) -> list[int]:
        """The one block of Mamba group ``g`` holding the request's running state: the last one before the
        speculative scratch slots (vLLM's ``clip_ssm_state_blocks``). In mode "none" a request has that
        block only (plus scratch); in mode "align" its list is positional (null blocks, checkpoint
        blocks, then the state at block ``cdiv(num_computed_tokens, block_size) - 1``)."""
        ids = list(ids)
        n_spec = self.state_groups[g] or 0
        if not ids:
            return ids
        if n := min(n_spec, len(ids) - 1):
            ids = ids[:-n]
        return ids[-1:]

    def is_state_group(self, g: int) -> bool:
        return g < len(self.state_groups) and self.state_groups[g] is not None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        p = request.kv_transfer_params
        t = _params(p)
        if t is None or not t.do_remote_prefill:
            return
        self._queued.pop(request.request_id, None)
        if num_external_tokens <= 0 and t.readable:
            # nothing to read (the local prefix cache holds it all, or the params do not fit this engine):
            # the prefill may free its blocks now
            self._pending_release[request.request_id] = t.to_dict()
        if num_external_tokens > 0:
            local, first = [], []
            for g, group in enumerate(blocks.blocks):
                if self.is_state_group(g):  # the state slot the decode resumes from; no token offset
                    first.append(0)
                    local.append(self.state_slot(g, [b.block_id for b in group]))
                    continue
                hit = sum(1 for b in group if b.block_hash is not None and not b.is_null)
                first.append(hit)
                local.append([b.block_id for b in group[hit:]])
            self._pending_recv[request.request_id] = RecvReq(request.request_id, local, first, t.to_dict())
        # only one read per request
        p["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeConnectorMetadata:
        meta = KVBridgeConnectorMetadata(recv=self._pending_recv, send=self._pending_send,
                                         release=self._pending_release, connect=self._pending_connect,
                                         expect=self._pending_expect)
        self._pending_recv, self._pending_send, self._pending_release, self._pending_connect = {}, {}, {}, {}
        self._pending_expect = {}
        now = time.monotonic()
        if self._queued and now >= self._next_heartbeat:  # vLLM's NixlConnector beats every lease / 6
            meta.heartbeat = dict(self._queued)
            self._next_heartbeat = now + self.cfg.lease_s / 6
        return meta

    # ---- prefill ----------------------------------------------------------------------------------
    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Params | None]:
        from vllm.v1.request import RequestStatus

        p = request.kv_transfer_params
        t = _params(p)
        self._queued.pop(request.request_id, None)
        if t is not None and t.do_remote_prefill and t.readable:
            # a decode request that finished (aborted, rejected, errored, any status) before its read was
            # set up: tell the prefill at once instead of holding its blocks for the lease
            self._pending_release[request.request_id] = t.to_dict()
            p["do_remote_prefill"] = False
            return False, None
        if t is None or not t.do_remote_decode:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted/errored prefill: free now
        ids = [list(map(int, g)) for g in block_ids]
        if not any(ids):
            return False, None
        # a Mamba group's list -> its state slot (vLLM still holds every block of the request until
        # finished_sending; only that one is read)
        ids = [self.state_slot(g, x) if self.is_state_group(g) else x for g, x in enumerate(ids)]
        child = _CHILD_ID.fullmatch(request.request_id)
        key = _prompt_key(request) if child else ()
        sib = self._siblings.get(child.group(2)) if child else None
        if (child is not None and sib is not None and sib.lease_id in self._held and sib.prompt == key
                and int(child.group(1)) not in sib.indices):
            # a sibling of a child whose blocks are held (vLLM n > 1, same prompt): its readers read those;
            # its own blocks go back now
            sib.reads += 1
            sib.indices.add(int(child.group(1)))
            self._pending_expect[sib.lease_id] = (sib.attempt, sib.reads)
            return False, dict(sib.params)
        # one lease attempt id for every prefill rank, carried to the decode (53 bits: exact in any JSON)
        attempt = secrets.randbits(53) | 1
        self._held[request.request_id] = ids
        self._pending_send[request.request_id] = (ids, attempt)
        params = self._lease_params(request, ids, attempt)
        if child:
            self._siblings[child.group(2)] = _Siblings(request.request_id, attempt, key, params,
                                                       indices={int(child.group(1))})
        return True, dict(params)

    def _lease_params(self, request: Any, ids: list[list[int]], attempt: int) -> Params:
        cfg = self.cfg
        return TransferParams(
            do_remote_prefill=True, do_remote_decode=False, remote_engine_id=cfg.engine_id, remote_host=cfg.host,
            remote_port=cfg.port, remote_block_ids=ids, remote_request_id=request.request_id,
            remote_num_tokens=int(request.num_computed_tokens), remote_tp_size=cfg.tp, remote_pp_size=cfg.pp,
            remote_pcp_size=cfg.pcp, remote_dcp_size=cfg.dcp, remote_cp_interleave=cfg.cp_interleave,
            remote_dp_rank=cfg.dp_index, remote_layout=self.fingerprint, remote_speculative=cfg.speculative,
            remote_attempt=attempt).to_dict()

    def update_connector_output(self, connector_output: Any) -> None:
        done = set(connector_output.finished_sending or ())
        for rid in done:
            self._held.pop(rid, None)
        if done and self._siblings:
            self._siblings = {k: v for k, v in self._siblings.items() if v.lease_id not in done}

    def held_requests(self) -> list[str]:
        """Prefill: requests whose blocks vLLM still holds for a remote read."""
        return sorted(self._held)


def _prompt_key(request: Any) -> tuple[Any, ...]:
    """What two requests must share for one's prompt KV to stand for the other's."""
    lora = getattr(request, "lora_request", None)
    mm = tuple(getattr(f, "identifier", None) for f in (getattr(request, "mm_features", None) or ()))
    return (tuple(request.prompt_token_ids or ()), int(request.num_computed_tokens),
            getattr(lora, "lora_name", None), getattr(request, "cache_salt", None), mm)


def _params(p: Params | None) -> TransferParams | None:
    """A request's ``kv_transfer_params`` parsed (:meth:`TransferParams.from_dict`: the connector's own ``_``
    keys and vLLM's other keys ignored); None without params, or for params that do not parse (logged: the
    request is not the connector's, as for params naming no engine or blocks)."""
    if not p:
        return None
    try:
        return TransferParams.from_dict(p)
    except RequestError as e:
        log.warning("kvbridge: ignoring kv_transfer_params that do not parse: %s", e)
        return None
