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

**Context parallelism** (issue 21): the sizes and interleave come from vLLM's ``ParallelConfig``
(:func:`context_parallel`); what vLLM itself forbids is refused there with
:class:`~kvbridge.integrations.vllm_cp.VLLMContextParallelError`; what kvbridge cannot move (DCP with the CPU
backend's block-granular form) the worker refuses with :class:`ContextParallelUnsupported`.

**Side-channel host**, first of: the ``KVBRIDGE_SIDE_CHANNEL_HOST`` environment variable (per node), the
extra-config ``side_channel_host`` (``"auto"``: this node's address as vLLM discovers it), vLLM's
``VLLM_NIXL_SIDE_CHANNEL_HOST`` (per node), ``127.0.0.1``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .translate import VLLMConfigError, speculative_fingerprint

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5600
HOST_ENV = "KVBRIDGE_SIDE_CHANNEL_HOST"
VLLM_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
DEFAULT_BACKENDS = ("UCX",)


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


def side_channel_host(extra: dict, environ=os.environ) -> str:
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


def _backends(extra: dict) -> tuple[str, ...]:
    b = extra.get("backends", list(DEFAULT_BACKENDS))
    if isinstance(b, str):
        b = [b]
    if not isinstance(b, (list, tuple)) or not b or not all(isinstance(x, str) and x for x in b):
        raise VLLMConfigError(f"kv_connector_extra_config.backends={b!r}: give a list of NIXL backend names, "
                              "e.g. [\"UCX\"] or [\"LIBFABRIC\"]")
    return tuple(b)


def context_parallel(parallel_config) -> tuple[int, int, int]:
    """``(pcp, dcp, cp_interleave)`` of an engine, from vLLM's ``ParallelConfig``: both roles, any sizes
    vLLM accepts (prefill TP x PCP -> decode TP x DCP, any interleave dividing the block size). Raises
    :class:`~kvbridge.integrations.vllm_cp.VLLMContextParallelError` for sizes vLLM's own groups cannot
    form (what kvbridge cannot move is refused by the worker, :class:`ContextParallelUnsupported`)."""
    from ..vllm_cp import cp_from_vllm
    cp = cp_from_vllm(parallel_config, tp_rank=0)  # the sizes only (rank 0 exists in every engine)
    return cp.pcp, cp.dcp, cp.cp_interleave


class ContextParallelUnsupported(VLLMConfigError):
    """A context-parallel setting kvbridge cannot move (the message names it and what to change)."""


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
    lease_s: float = 30.0
    staging_bytes: int = 64 << 20
    lease_grace_s: float = 5.0
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    num_threads: int | None = None
    decode_options: dict = field(default_factory=dict)
    speculative: str | None = None  # fingerprint of the draft model's settings (None: no draft KV)

    @classmethod
    def from_vllm(cls, vllm_config, environ=os.environ) -> "ConnectorConfig":
        ktc, pc = vllm_config.kv_transfer_config, vllm_config.parallel_config
        extra: dict[str, Any] = dict(ktc.kv_connector_extra_config or {})
        tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
        dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
        dp_index = int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)
        pcp, dcp, il = context_parallel(pc)
        num_threads = extra.get("num_threads")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise VLLMConfigError(f"kv_connector_extra_config.num_threads={num_threads!r}: give a positive integer")
        return cls(
            engine_id=dp_engine_id(str(ktc.engine_id), dp_size, dp_index),
            host=side_channel_host(extra, environ),
            port=dp_port_base(int(extra.get("side_channel_port", DEFAULT_PORT)), dp_index, tp, pp, pcp),
            tp=tp, pp=pp, pcp=pcp, dcp=dcp, cp_interleave=il, dp_size=dp_size, dp_index=dp_index,
            lease_s=float(extra.get("lease_s", 30.0)),
            staging_bytes=int(extra.get("staging_bytes", 64 << 20)),
            # a decode read that reaches the prefill before its worker registered the request retries this long
            lease_grace_s=float(extra.get("lease_grace_s", 5.0)),
            backends=_backends(extra),
            num_threads=num_threads,
            # decode endpoint options (kvbridge.DecodeEndpoint): timeouts on this engine's clock, transfer mode
            decode_options={k: type_(extra[k]) for k, type_ in (
                ("handshake_timeout_s", float), ("stage_timeout_s", float), ("transfer_timeout_s", float),
                ("connect_timeout_s", float), ("transfer_mode", str)) if k in extra},
            speculative=speculative_fingerprint(vllm_config),
        )

    def endpoint(self, rank: tuple[int, int]) -> tuple[str, int]:
        """(host, port) this engine's worker ``rank = (pp_rank, pcp_rank * tp + tp_rank)`` binds."""
        return self.host, rank_port(self.port, rank, self.tp, self.pcp)
