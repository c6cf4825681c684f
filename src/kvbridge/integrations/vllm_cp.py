"""vLLM 0.33's context parallelism -> kvbridge's CP settings. Pure translation: no engine, no
process groups needed (the worker passes its ranks); vllm is imported only by :func:`cp_from_worker` and,
if installed, for ``resolve_dcp_kv_block_size`` in :func:`check_cp_against_vllm`.

vLLM's rules, which :class:`~kvbridge.layout.EngineLayout` mirrors (``config/parallel.py``,
``distributed/parallel_state.py``, ``v1/worker/block_table.py``, ``v1/core/kv_cache_utils.py``):

* workers of one PP stage are laid out ``[pcp, tp]``; kvbridge's rank index in the stage is
  ``pcp_rank * tp + tp_rank`` (so ``(pp_rank, stage_rank)`` is the rank to give kvbridge);
* DCP groups: ``transpose(-1, -2).reshape(-1, dcp)`` over that grid, i.e. ``tp_rank % dcp`` without PCP
  (DCP reuses the TP ranks; KV heads stay TP-sharded), ``pcp_rank`` when ``dcp == pcp``,
  ``tp_rank * pcp + pcp_rank`` when ``dcp == tp * pcp``; PCP alone replicates the cache;
* token ``t`` of a DCP-sharded group lives on DCP rank ``(t // interleave) % dcp``; a scheduler block
  spans ``block_size * dcp`` tokens (``resolve_dcp_kv_block_size``), each rank keeps ``block_size``.

Use (connector, worker side, once the process groups exist)::

    cp = cp_from_worker(vllm_config)                      # or cp_from_vllm(parallel_config, tp_rank=, ...)
    engine = EngineLayout(model, tp=..., pp=..., block_size=..., **cp.engine_kwargs())
    rank = cp.rank(pp_rank)                               # (pp_rank, pcp_rank * tp + tp_rank)
    check_cp_against_vllm(engine, kv_cache_config, group_names, tensor_tokens={name: tokens_per_block})
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from ..layout import ContextParallelError, EngineLayout


class VLLMContextParallelError(ContextParallelError):
    """vLLM's context-parallel configuration, process groups, KV-cache specs or tensors disagree with each
    other or with kvbridge's geometry; the message names the setting."""


def _dcp_rank(tp: int, pcp: int, dcp: int, tp_rank: int, pcp_rank: int) -> int:
    if dcp == 1:
        return 0
    if pcp == 1:
        return tp_rank % dcp
    if dcp == pcp:
        return pcp_rank
    return tp_rank * pcp + pcp_rank


class CPKwargs(TypedDict):
    """:class:`~kvbridge.EngineLayout` keyword arguments of context parallelism."""

    pcp: int
    dcp: int
    cp_interleave: int


@dataclass(frozen=True, slots=True)
class VLLMCPSettings:
    """One worker's context-parallel settings in kvbridge's terms."""

    tp: int
    pcp: int
    dcp: int
    cp_interleave: int
    tp_rank: int
    pcp_rank: int
    dcp_rank: int

    @property
    def stage_rank(self) -> int:
        """The worker's rank index in its PP stage as kvbridge numbers it: ``pcp_rank * tp + tp_rank``."""
        return self.pcp_rank * self.tp + self.tp_rank

    def rank(self, pp_rank: int) -> tuple[int, int]:
        """The kvbridge rank ``(pp_rank, stage_rank)`` of this worker."""
        return (pp_rank, self.stage_rank)

    def engine_kwargs(self) -> CPKwargs:
        """``EngineLayout`` keyword arguments: ``pcp``, ``dcp``, ``cp_interleave``."""
        return {"pcp": self.pcp, "dcp": self.dcp, "cp_interleave": self.cp_interleave}


def cp_from_vllm(
    parallel_config: Any, *, tp_rank: int, pcp_rank: int = 0, dcp_rank: int | None = None
) -> VLLMCPSettings:
    """kvbridge's CP settings from vLLM's ``ParallelConfig`` and this worker's ranks. ``dcp_rank``: the
    worker's rank in its DCP group as vLLM built it (``get_dcp_group().rank_in_group``); given, it must
    match vLLM's group rule, else :class:`VLLMContextParallelError`."""
    pc = parallel_config
    tp = int(pc.tensor_parallel_size)
    pcp = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
    raw = getattr(pc, "cp_kv_cache_interleave_size", 1)
    il = int(raw) if raw is not None else 1  # None: unresolved; vLLM's default is 1
    if dcp == 1:
        il = 1  # no token sharding: the interleave means nothing
    if not (0 <= tp_rank < tp) or not (0 <= pcp_rank < pcp):
        raise VLLMContextParallelError(
            f"worker ranks tp_rank={tp_rank}, pcp_rank={pcp_rank} are outside tensor_parallel_size={tp}, "
            f"prefill_context_parallel_size={pcp}")
    if (pcp == 1 and tp % dcp) or (pcp > 1 and dcp not in (1, pcp, tp * pcp)):
        raise VLLMContextParallelError(
            f"decode_context_parallel_size={dcp} with tensor_parallel_size={tp} and prefill_context_parallel_size="
            f"{pcp}: vLLM requires dcp | tp without PCP, and dcp in (1, pcp, tp*pcp) with PCP")
    expect = _dcp_rank(tp, pcp, dcp, tp_rank, pcp_rank)
    if dcp_rank is not None and int(dcp_rank) != expect:
        raise VLLMContextParallelError(
            f"this worker (tp_rank={tp_rank}, pcp_rank={pcp_rank}) is DCP rank {dcp_rank} in vLLM's DCP group, but "
            f"vLLM 0.33's group rule gives {expect} for tp={tp}, pcp={pcp}, dcp={dcp}; kvbridge would map its "
            "tokens wrongly (a vLLM version with another DCP group layout?)")
    return VLLMCPSettings(tp, pcp, dcp, il, int(tp_rank), int(pcp_rank), expect)


def cp_from_worker(vllm_config: Any) -> VLLMCPSettings:
    """:func:`cp_from_vllm` with the ranks taken from vLLM's process groups (worker side, after
    ``initialize_model_parallel``); ranks 0 where a group does not exist (PCP/DCP size 1)."""
    from vllm.distributed import parallel_state as ps
    pc = vllm_config.parallel_config
    tp_rank = ps.get_tp_group().rank_in_group
    pcp = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
    pcp_rank = ps.get_pcp_group().rank_in_group if pcp > 1 else 0
    dcp_rank = ps.get_dcp_group().rank_in_group if dcp > 1 else None
    return cp_from_vllm(pc, tp_rank=tp_rank, pcp_rank=pcp_rank, dcp_rank=dcp_rank)


def _spec(group: Any) -> Any:
    """The (first) layer spec of a vLLM KV-cache group (UniformTypeKVCacheSpecs holds one per layer)."""
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)
    return next(iter(inner.values())) if inner else spec


def check_cp_against_vllm(engine: EngineLayout, kv_cache_config: Any, group_names: Sequence[str], *,
                          tensor_tokens: dict[str, int] | None = None,
                          scheduler_block_sizes: dict[str, int] | None = None) -> None:
    """Cross-check kvbridge's CP geometry against what vLLM gives the connector; raises
    :class:`VLLMContextParallelError` naming the group and the setting on any disagreement.

    ``kv_cache_config``: the worker's ``KVCacheConfig`` (group ``i`` is kvbridge group ``group_names[i]``);
    its specs carry the per-rank block size and ``dcp_sharded``. ``tensor_tokens``: {kvbridge group name:
    tokens per block of the tensors ``register_kv_caches`` got (the ``N``/``T`` axis)}.
    ``scheduler_block_sizes``: {kvbridge group name: tokens per block id as the scheduler allocates them}
    (default: vLLM's ``resolve_dcp_kv_block_size`` of the spec).
    """
    try:
        from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
    except ImportError:  # the same rule, for a vLLM without it
        def resolve_dcp_kv_block_size(spec: Any, dcp: int) -> int:
            return int(spec.block_size) * (dcp if getattr(spec, "dcp_sharded", False) else 1)
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != len(group_names):
        raise VLLMContextParallelError(f"vLLM has {len(groups)} KV-cache groups, kvbridge {len(group_names)}")
    for i, (vg, name) in enumerate(zip(groups, group_names)):
        g = engine.model.group(name)
        spec = _spec(vg)
        where = f"vLLM KV-cache group {i} ({type(spec).__name__}) = kvbridge group {name!r}"
        sharded = bool(getattr(spec, "dcp_sharded", False)) and engine.dcp > 1
        if sharded != engine.token_sharded(g):
            raise VLLMContextParallelError(
                f"{where}: vLLM {'shards' if sharded else 'does not shard'} its tokens over "
                f"decode_context_parallel_size={engine.dcp}, "
                f"kvbridge {'does' if engine.token_sharded(g) else 'does not'}"
                " (kvbridge shards every attention group with DCP, never Mamba state)")
        if not g.per_token:
            continue
        if int(spec.block_size) != engine.block_size_of(g):
            raise VLLMContextParallelError(
                f"{where}: vLLM's per-rank block_size is {spec.block_size}, the engine layout says "
                f"{engine.block_size_of(g)}")
        sched = int(resolve_dcp_kv_block_size(spec, engine.dcp))
        if scheduler_block_sizes is not None and name in scheduler_block_sizes:
            sched = int(scheduler_block_sizes[name])
        if sched != engine.scheduler_block_size(g):
            raise VLLMContextParallelError(
                f"{where}: the scheduler's block ids hold {sched} tokens each, kvbridge expects "
                f"{engine.scheduler_block_size(g)} (block_size {engine.block_size_of(g)} x dcp {engine.dcp})")
        if tensor_tokens is not None and name in tensor_tokens and int(tensor_tokens[name]) != engine.block_size_of(g):
            raise VLLMContextParallelError(
                f"{where}: the registered tensors hold {tensor_tokens[name]} tokens per block, the layout "
                f"{engine.block_size_of(g)}; with DCP each rank keeps block_size tokens of its share per block")
        if engine.token_sharded(g) and engine.block_size_of(g) % engine.cp_interleave:
            raise VLLMContextParallelError(
                f"{where}: cp_kv_cache_interleave_size={engine.cp_interleave} does not divide block_size "
                f"{engine.block_size_of(g)}")


__all__ = ["VLLMCPSettings", "VLLMContextParallelError", "cp_from_vllm", "cp_from_worker", "check_cp_against_vllm"]
