"""Layout description: what a model caches, how an engine shards it, how a rank lays it out in memory.

Conventions (used by every other module):

* **Global index space of a cache group.** A group caches, for each of its layers (global layer
  indices of the model), one or more *components* (``k`` and ``v``; ``latent`` for MLA; ``conv_x``,
  ``conv_b``, ``conv_c``, ``ssm`` for Mamba). Each component is an array
  ``[token, unit, elem]`` per layer for per-token groups, or ``[unit, elem]`` per request for
  Mamba state. ``unit`` is the axis sharded over tensor parallelism: KV heads, Mamba heads or
  Mamba groups; MLA's latent has one unit, so it is replicated on every rank.
* **Sharding over TP.** A component with ``U`` units on ``tp`` ranks: if ``tp <= U`` (``U % tp == 0``)
  rank ``r`` holds units ``[r*U/tp, (r+1)*U/tp)``; if ``tp > U`` (``tp % U == 0``) rank ``r`` holds the
  single unit ``r*U//tp`` and ``tp/U`` ranks are replicas. Anything else is a :class:`LayoutError`.
* **Sharding over PP.** Global layers ``[0, num_layers)`` are split into contiguous stages; the
  default split is vLLM's (``num_layers // pp`` each, the remainder added to the stages just before
  the last one).
* **Tokens and blocks.** Token ``t`` of a request lives in the ``t // block_size``-th block of that
  request's block list, at offset ``t % block_size``. Mamba state has one slot per request.
* **Context parallelism (vLLM 0.33's rule).** An engine has ``tp * pcp`` ranks per PP stage; the
  second index of a rank ``(pp_rank, r)`` is ``r = pcp_rank * tp + tp_rank`` (vLLM's PP x PCP x TP
  order), so ``tp_rank = r % tp`` gives its heads. With ``dcp > 1`` the per-token groups are sharded
  along the token axis: token ``t`` is stored by DCP rank ``(t // interleave) % dcp`` only (a
  :class:`CyclicShare`), one block of a request's block list (a *scheduler block*) spans
  ``block_size * dcp`` tokens and every DCP rank keeps its share of it in the same block id, at local
  offset ``(o // (dcp * interleave)) * interleave + o % interleave`` (``o = t % (block_size * dcp)``).
  DCP ranks come from vLLM's group construction: ``tp_rank % dcp`` when ``pcp == 1`` (DCP reuses TP
  ranks, heads stay TP-sharded), ``pcp_rank`` when ``dcp == pcp``, ``tp_rank * pcp + pcp_rank`` when
  ``dcp == tp * pcp``. PCP alone (``dcp == 1``) replicates the whole cache on every PCP rank. Mamba
  state is never token-sharded (replicated over DCP ranks).
* **Memory.** Each rank registers one buffer; each group occupies a contiguous region of it. Inside a
  per-token group's region the axes are ordered by :class:`MemoryLayout` (outer to inner, e.g.
  ``"LKBTHD"``: layer, K/V, block, token, head, dim). Mamba regions are ``[layer, slot, state]``
  (or ``[slot, layer, state]`` for a cross-layer layout), the state being the concatenation of
  ``conv_x, conv_b, conv_c`` (channel-major, "DS" layout) and ``ssm``.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import LayoutError

GroupKind = Literal["full_attention", "sliding_window", "mla", "mamba"]
GROUP_KINDS: tuple[str, ...] = ("full_attention", "sliding_window", "mla", "mamba")

DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
    "float8_e4m3fn": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "uint8": 1,
}


class ContextParallelError(LayoutError):
    """A context-parallel setting (pcp, dcp, interleave) that vLLM cannot express or that leaves tokens
    held by no rank."""


@dataclass(frozen=True, slots=True, order=True)
class CyclicShare:
    """The tokens ``t`` with ``(t // interleave) % size == rank``: one DCP rank's share of a token axis
    dealt round robin in chunks of ``interleave`` tokens."""

    interleave: int
    rank: int
    size: int

    def holds(self, t: Any) -> Any:
        """Whether token(s) ``t`` (an int or an int64 array) are in the share."""
        return (t // self.interleave) % self.size == self.rank

    def count(self, t0: int, t1: int) -> int:
        """Tokens of ``[t0, t1)`` in the share (arithmetic)."""
        def upto(t: int) -> int:
            per = self.interleave * self.size
            q, r = divmod(t, per)
            return q * self.interleave + min(max(r - self.rank * self.interleave, 0), self.interleave)
        return max(0, upto(t1) - upto(t0)) if t1 > t0 else 0

    @property
    def period(self) -> int:
        return self.interleave * self.size

    def __str__(self) -> str:
        return f"{self.rank}/{self.size}x{self.interleave}"


def shares_intersect(shares: Iterable[CyclicShare]) -> bool:
    """Whether some token lies in every share (checked over one common period)."""
    shares = tuple(shares)
    if not shares:
        return True
    import math

    import numpy as np
    period = math.lcm(*(s.period for s in shares))
    t = np.arange(period, dtype=np.int64)
    m = np.ones(period, dtype=bool)
    for s in shares:
        m &= s.holds(t)
    return bool(m.any())


def dtype_size(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (a name such as "bfloat16", "float8_e4m3fn"); a name not in
    :data:`DTYPE_SIZES` raises :class:`~kvbridge.errors.LayoutError` listing the known ones."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise LayoutError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_SIZES)}") from None


@dataclass(frozen=True, slots=True)
class Component:
    """One array cached per layer: ``[token, unit, elem]`` (per-token) or ``[unit, elem]`` (state).

    ``num_units`` is the global size of the TP-sharded axis; ``unit_elems`` the elements per unit
    (per token for per-token groups).
    """

    name: str
    num_units: int
    unit_elems: int
    itemsize: int

    def __post_init__(self) -> None:
        if self.num_units < 1 or self.unit_elems < 1 or self.itemsize < 1:
            raise LayoutError(f"component {self.name!r}: sizes must be positive, got {self!r}")

    @property
    def unit_bytes(self) -> int:
        return self.unit_elems * self.itemsize

    def units_per_rank(self, tp: int) -> int:
        return self.num_units // tp if tp <= self.num_units else 1

    def unit_range(self, tp: int, tp_rank: int) -> tuple[int, int]:
        """Global half-open unit range held by ``tp_rank`` of ``tp`` ranks."""
        if tp <= self.num_units:
            n = self.num_units // tp
            return (tp_rank * n, tp_rank * n + n)
        u = tp_rank * self.num_units // tp
        return (u, u + 1)

    def check_tp(self, tp: int, where: str) -> None:
        if tp % self.num_units and self.num_units % tp:
            raise LayoutError(
                f"{where}: component {self.name!r} has {self.num_units} units (heads/groups) which cannot be "
                f"sharded over tp={tp}; use a tp that divides {self.num_units} or is a multiple of it "
                f"(valid tp up to 16: {valid_tps(self.num_units)})")


def valid_tps(num_units: int, up_to: int = 16) -> list[int]:
    return [t for t in range(1, up_to + 1) if t % num_units == 0 or num_units % t == 0]


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """Mamba state shape. Mamba2: ``num_heads`` heads of ``head_dim`` channels, ``n_groups`` B/C groups.
    Mamba1: ``num_heads`` = d_inner channels, ``head_dim`` = 1, ``n_groups`` = 0 (no B/C in the conv)."""

    num_heads: int
    head_dim: int
    d_state: int
    conv_kernel: int
    n_groups: int = 0
    ssm_dtype: str = "float32"

    def __post_init__(self) -> None:
        if min(self.num_heads, self.head_dim, self.d_state, self.conv_kernel) < 1 or self.n_groups < 0:
            raise LayoutError(f"invalid Mamba state shape {self!r}")
        if self.n_groups and self.num_heads % self.n_groups:
            raise LayoutError(f"mamba num_heads={self.num_heads} must be a multiple of n_groups={self.n_groups}")


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """A set of layers whose cache has the same shape (vLLM's KV-cache group).

    ``num_heads`` is the number of KV heads (attention) or Mamba heads; None for MLA.
    ``head_dim`` is the per-head size (attention) or the latent size (MLA, e.g. 512+64).
    """

    name: str
    kind: GroupKind
    layers: tuple[int, ...]
    dtype: str
    num_heads: int | None = None
    head_dim: int = 0
    v_head_dim: int | None = None
    sliding_window: int | None = None
    mamba: MambaSpec | None = None

    def __post_init__(self) -> None:
        where = f"group {self.name!r}"
        if self.kind not in GROUP_KINDS:
            raise LayoutError(f"{where}: kind {self.kind!r} is not one of {GROUP_KINDS}")
        if not self.layers or list(self.layers) != sorted(set(self.layers)) or self.layers[0] < 0:
            raise LayoutError(f"{where}: layers must be a non-empty strictly increasing tuple of indices >= 0")
        dtype_size(self.dtype)
        if self.kind == "mamba":
            if self.mamba is None:
                raise LayoutError(f"{where}: a mamba group needs a MambaSpec")
            object.__setattr__(self, "num_heads", self.mamba.num_heads)
        elif self.kind == "mla":
            if self.num_heads not in (None, 1) or self.head_dim < 1:
                raise LayoutError(f"{where}: MLA caches one latent vector per token: num_heads=None, head_dim>0")
            object.__setattr__(self, "num_heads", None)
        else:
            if not self.num_heads or self.num_heads < 1 or self.head_dim < 1:
                raise LayoutError(f"{where}: attention needs num_heads>=1 and head_dim>=1, got "
                                  f"num_heads={self.num_heads} head_dim={self.head_dim}")
            if self.kind == "sliding_window" and not self.sliding_window:
                raise LayoutError(f"{where}: a sliding_window group needs sliding_window > 0")

    @property
    def per_token(self) -> bool:
        return self.kind != "mamba"

    @property
    def components(self) -> tuple[Component, ...]:
        item = dtype_size(self.dtype)
        if self.kind == "mla":
            return (Component("latent", 1, self.head_dim, item),)
        if self.kind == "mamba":
            m = self.mamba
            assert m is not None
            k1 = m.conv_kernel - 1
            comps = [Component("conv_x", m.num_heads, m.head_dim * k1, item)]
            if m.n_groups:
                comps += [Component("conv_b", m.n_groups, m.d_state * k1, item),
                          Component("conv_c", m.n_groups, m.d_state * k1, item)]
            comps.append(Component("ssm", m.num_heads, m.head_dim * m.d_state, dtype_size(m.ssm_dtype)))
            return tuple(comps)
        assert self.num_heads is not None
        return (Component("k", self.num_heads, self.head_dim, item),
                Component("v", self.num_heads, self.v_head_dim or self.head_dim, item))

    @property
    def head_component(self) -> Component | None:
        """The component whose unit range is reported as ``heads`` (None for MLA)."""
        if self.kind == "mla":
            return None
        return self.components[-1] if self.kind == "mamba" else self.components[0]

    def check_tp(self, tp: int, where: str) -> None:
        for c in self.components:
            c.check_tp(tp, f"{where}, group {self.name!r}")

    def bytes_per_rank(self, tp: int) -> int:
        """Bytes per token (per-token groups) or per request (Mamba) per layer on one rank."""
        return sum(c.units_per_rank(tp) * c.unit_bytes for c in self.components)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model's KV cache: ``num_layers`` global layers and the groups that cache some of them."""

    name: str
    num_layers: int
    groups: tuple[CacheGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise LayoutError(f"model {self.name!r} has no cache groups")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise LayoutError(f"model {self.name!r}: group names must be unique, got {names}")
        seen: set[int] = set()
        for g in self.groups:
            if g.layers[-1] >= self.num_layers:
                raise LayoutError(f"model {self.name!r}: group {g.name!r} has layer {g.layers[-1]} "
                                  f">= num_layers={self.num_layers}")
            dup = seen.intersection(g.layers)
            if dup:
                raise LayoutError(f"model {self.name!r}: layers {sorted(dup)[:5]} are in more than one group")
            seen.update(g.layers)

    def group(self, name: str) -> CacheGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise LayoutError(f"model {self.name!r} has no group {name!r}; groups: {[g.name for g in self.groups]}")

    @property
    def fingerprint(self) -> str:
        """Stable hash of everything that must match between prefill and decode."""
        import hashlib
        return hashlib.sha256(repr((self.num_layers, self.groups)).encode()).hexdigest()[:16]


AXES = "LKBTHD"
LAYOUT_PRESETS: dict[str, str] = {
    # name: axis order, outer to inner (L layer, K k/v component, B block, T token, H head, D dim)
    "flash_attn": "LKBTHD",       # per layer [2, num_blocks, block_size, heads, dim] (NHD)
    "flash_attn_hnd": "LKBHTD",   # per layer [2, num_blocks, heads, block_size, dim] (HND)
    "flashinfer": "LBKHTD",       # per layer [num_blocks, 2, heads, block_size, dim] (HND, K/V in one page)
    "flashinfer_nhd": "LBKTHD",   # per layer [num_blocks, 2, block_size, heads, dim]
    "cross_layer": "BLKHTD",      # one block holds all layers [num_blocks, layers, 2, heads, block_size, dim]
    "cross_layer_nhd": "BLKTHD",
    # head-major cross-layer block, Dynamo KVBM's "universal" block [heads, layers, 2, block_size, dim]:
    # one KV head of one block is contiguous across all layers, so a rank of another TP reads
    # whole (block, head-group) runs instead of one 4 KiB slice per layer (kernels see strided views)
    "universal": "BHLKTD",
    # vLLM 0.33's KVCacheLayout names: per-layer [B, H, N, C] views, K|V packed in C (so K sits just
    # outside D); the letters give the physical order of layer, block, head, token (N), content
    "LBNHC": "LBTHKD", "LBHNC": "LBHTKD", "LHBNC": "LHBTKD", "BLNHC": "BLTHKD", "BLHNC": "BLHTKD", "BHLNC": "BHLTKD",
}


@dataclass(frozen=True, slots=True)
class MemoryLayout:
    """Axis order of a rank's per-token cache regions, outer to inner, over ``LKBTHD``.

    ``D`` must be innermost. Mamba regions follow the position of ``L`` relative to ``B``:
    ``[layer, slot, state]`` when L is outside B, else ``[slot, layer, state]`` (cross-layer).
    """

    order: str = "LKBTHD"

    def __post_init__(self) -> None:
        if sorted(self.order) != sorted(AXES) or self.order[-1] != "D":
            raise LayoutError(f"memory layout order {self.order!r} must be a permutation of {AXES!r} "
                              f"ending in 'D'; presets: {LAYOUT_PRESETS}")

    @classmethod
    def parse(cls, text: str) -> "MemoryLayout":
        return cls(LAYOUT_PRESETS.get(text, text))

    @property
    def name(self) -> str:
        for k, v in LAYOUT_PRESETS.items():
            if v == self.order:
                return k
        return self.order

    @property
    def cross_layer(self) -> bool:
        return self.order.index("B") < self.order.index("L")

    def __str__(self) -> str:
        return self.name


def default_pp_layers(num_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """vLLM's default split: ``num_layers // pp`` each, remainder added to stages before the last."""
    if pp < 1 or pp > num_layers:
        raise LayoutError(f"pp={pp} must be between 1 and num_layers={num_layers}")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    out, start = [], 0
    for n in parts:
        out.append((start, start + n))
        start += n
    return tuple(out)


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """One engine: a model, its parallelism, block size and memory layout.

    ``mamba_blocks_per_request``: a Mamba state slot spans this many kernel blocks (vLLM's
    physical-blocks-per-logical); the slot stride is padded to that many attention pages of the
    engine's first per-token group. None means the slot is exactly the state size.
    """

    model: ModelSpec
    tp: int = 1
    pp: int = 1
    block_size: int = 16
    memory: MemoryLayout = field(default_factory=MemoryLayout)
    pp_layers: tuple[tuple[int, int], ...] | None = None
    mamba_blocks_per_request: int | None = None
    num_blocks: int = 64
    role: str = "engine"
    group_block_sizes: tuple[tuple[str, int], ...] = ()
    pcp: int = 1
    dcp: int = 1
    cp_interleave: int = 1

    def block_size_of(self, group: "str | CacheGroup") -> int:
        """Tokens per block of one group: ``group_block_sizes`` where given (vLLM's hybrid allocator gives
        groups different block sizes so that their pages have one size), else ``block_size``."""
        name = group if isinstance(group, str) else group.name
        for n, bs in self.group_block_sizes:
            if n == name:
                return bs
        return self.block_size

    def __post_init__(self) -> None:
        where = f"{self.role} engine (tp={self.tp}, pp={self.pp})"
        if self.tp < 1 or self.pp < 1:
            raise LayoutError(f"{where}: tp and pp must be >= 1")
        if self.block_size < 1 or self.num_blocks < 1:
            raise LayoutError(f"{where}: block_size and num_blocks must be >= 1")
        if self.pp_layers is None:
            try:
                object.__setattr__(self, "pp_layers", default_pp_layers(self.model.num_layers, self.pp))
            except LayoutError as e:
                raise LayoutError(f"{where}: {e}") from None
        pl = tuple(tuple(x) for x in self.pp_layers)  # type: ignore[union-attr]
        object.__setattr__(self, "pp_layers", pl)
        if len(pl) != self.pp or pl[0][0] != 0 or pl[-1][1] != self.model.num_layers or any(
                a[1] != b[0] for a, b in zip(pl, pl[1:])) or any(s >= e for s, e in pl):
            raise LayoutError(f"{where}: pp_layers {list(pl)} must be {self.pp} contiguous non-empty "
                              f"[start, stop) ranges covering layers 0..{self.model.num_layers}")
        for g in self.model.groups:
            g.check_tp(self.tp, where)
        gbs = self.group_block_sizes
        gbs = tuple(sorted((str(n), int(b)) for n, b in (gbs.items() if isinstance(gbs, dict) else gbs)))
        object.__setattr__(self, "group_block_sizes", gbs)
        names = {g.name for g in self.model.groups}
        for n, b in gbs:
            if n not in names or b < 1:
                raise LayoutError(f"{where}: group_block_sizes entry {n!r}={b} must name a group of the model "
                                  f"({sorted(names)}) with a block size >= 1")
        if self.mamba_blocks_per_request is not None and self.mamba_blocks_per_request < 1:
            raise LayoutError(f"{where}: mamba_blocks_per_request must be >= 1")
        self._check_cp(where)

    def _check_cp(self, where: str) -> None:
        """vLLM 0.33's context-parallel rules (config/parallel.py, kv_cache_coordinator.py,
        kv_cache_interface.py, config/model.py), and that every (unit, token) is held by some rank."""
        tp, pcp, dcp, il = self.tp, self.pcp, self.dcp, self.cp_interleave
        if pcp < 1 or dcp < 1 or il < 1:
            raise ContextParallelError(f"{where}: prefill_context_parallel_size={pcp}, decode_context_parallel_size="
                                       f"{dcp} and cp_kv_cache_interleave_size={il} must all be >= 1")
        if dcp == 1 and il != 1:
            object.__setattr__(self, "cp_interleave", 1)  # no token sharding: the interleave means nothing
            il = 1
        if pcp == 1 and tp % dcp:
            raise ContextParallelError(
                f"{where}: decode_context_parallel_size={dcp} must divide tensor_parallel_size={tp} (without PCP "
                f"vLLM carves DCP groups out of the TP ranks); "
                f"use dcp in {[d for d in range(1, tp + 1) if tp % d == 0]}")
        if pcp > 1 and dcp not in (1, pcp, tp * pcp):
            raise ContextParallelError(
                f"{where}: with prefill_context_parallel_size={pcp}, decode_context_parallel_size={dcp} must be "
                f"1, pcp={pcp} or tp*pcp={tp * pcp} (vLLM: DCP disabled, spanning the PCP axis or TP x PCP)")
        for g in self.model.groups:
            if pcp > 1 and g.kind not in ("full_attention", "mla"):
                raise ContextParallelError(
                    f"{where}: group {g.name!r} is {g.kind}; vLLM's prefill_context_parallel_size={pcp} supports "
                    f"only full attention and MLA groups; set pcp=1 for this model")
            if dcp > 1 and g.kind == "sliding_window":
                raise ContextParallelError(
                    f"{where}: group {g.name!r} is sliding_window; vLLM does not shard sliding-window caches over "
                    f"decode_context_parallel_size={dcp}; set dcp=1 for this model")
            if dcp > 1 and g.per_token and self.block_size_of(g) % il:
                raise ContextParallelError(
                    f"{where}: group {g.name!r} has block_size {self.block_size_of(g)}, which "
                    f"cp_kv_cache_interleave_size={il} does not divide; use an interleave that divides every "
                    f"block size (vLLM's NIXL P/D uses the block size)")
        if dcp > 1:
            # every (unit, DCP rank) pair must be held by some rank, else those tokens are lost
            for g in self.model.groups:
                if not g.per_token:
                    continue
                for c in g.components:
                    seen = {(u, self.dcp_rank(r)) for r in range(tp * pcp)
                            for u in range(*c.unit_range(tp, r % tp))}
                    if len(seen) != c.num_units * dcp:
                        raise ContextParallelError(
                            f"{where}: group {g.name!r} component {c.name!r}: with {c.num_units} KV heads on tp={tp}, "
                            f"decode_context_parallel_size={dcp} leaves tokens of some head on no rank (vLLM: DCP for "
                            f"GQA needs tp > KV heads and dcp <= tp // KV heads = {max(1, tp // c.num_units)})")

    # ---- context parallelism ----------------------------------------------------------------------
    @property
    def ranks_per_stage(self) -> int:
        """Ranks per PP stage: ``tp * pcp`` (rank index ``r = pcp_rank * tp + tp_rank``)."""
        return self.tp * self.pcp

    def tp_rank(self, r: int) -> int:
        return r % self.tp

    def pcp_rank(self, r: int) -> int:
        return r // self.tp

    def dcp_rank(self, r: int) -> int:
        """The DCP rank of stage rank ``r`` (vLLM's DCP groups: TP ranks, the PCP axis, or TP x PCP)."""
        if self.dcp == 1:
            return 0
        if self.pcp == 1:
            return (r % self.tp) % self.dcp
        if self.dcp == self.pcp:
            return r // self.tp
        return (r % self.tp) * self.pcp + r // self.tp

    def token_sharded(self, group: "str | CacheGroup") -> bool:
        g = self.model.group(group) if isinstance(group, str) else group
        return self.dcp > 1 and g.per_token

    def token_share(self, group: "str | CacheGroup", r: int) -> "CyclicShare | None":
        """The tokens of ``group`` that stage rank ``r`` stores (None: all of them)."""
        if not self.token_sharded(group):
            return None
        return CyclicShare(self.cp_interleave, self.dcp_rank(r), self.dcp)

    def scheduler_block_size(self, group: "str | CacheGroup") -> int:
        """Tokens per entry of a request's block list: ``block_size * dcp`` for token-sharded groups."""
        return self.block_size_of(group) * (self.dcp if self.token_sharded(group) else 1)

    def contiguous_tokens(self, group: "str | CacheGroup") -> int:
        """Aligned runs of this many tokens are contiguous in one rank's memory: the interleave when
        token-sharded, else the block size."""
        return self.cp_interleave if self.token_sharded(group) else self.block_size_of(group)

    @property
    def num_ranks(self) -> int:
        return self.tp * self.pp * self.pcp

    def ranks(self) -> list[tuple[int, int]]:
        return [(p, t) for p in range(self.pp) for t in range(self.tp * self.pcp)]

    @property
    def stages(self) -> tuple[tuple[int, int], ...]:
        """``[start, end)`` layers of each PP stage (``pp_layers``, filled in at construction)."""
        return self.pp_layers or default_pp_layers(self.model.num_layers, self.pp)

    def stage_of_layer(self, layer: int) -> int:
        for i, (s, e) in enumerate(self.stages):
            if s <= layer < e:
                return i
        raise LayoutError(f"layer {layer} outside model")

    def stage_layers(self, group: CacheGroup, pp_rank: int) -> tuple[int, ...]:
        s, e = self.stages[pp_rank]
        return tuple(l for l in group.layers if s <= l < e)

    def __str__(self) -> str:
        bs = str(self.block_size) + "".join(f",{n}:{b}" for n, b in self.group_block_sizes)
        cp = (f",pcp={self.pcp}" if self.pcp > 1 else "") + (f",dcp={self.dcp}x{self.cp_interleave}"
                                                               if self.dcp > 1 else "")
        return f"{self.model.name}[tp={self.tp}{cp},pp={self.pp},bs={bs},{self.memory}]"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "CyclicShare", "ContextParallelError", "shares_intersect",
    "Component", "MambaSpec", "CacheGroup", "ModelSpec", "MemoryLayout", "EngineLayout",
    "LAYOUT_PRESETS", "default_pp_layers", "dtype_size", "valid_tps", "ceil_div", "engine_to_dict", "engine_from_dict",
]


# ---- plain-data form (for the handshake) ---------------------------------------------------------
def engine_to_dict(e: EngineLayout) -> dict[str, Any]:
    def group(g: CacheGroup) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": g.name,
            "kind": g.kind,
            "layers": list(g.layers),
            "dtype": g.dtype,
            "num_heads": g.num_heads,
            "head_dim": g.head_dim,
            "v_head_dim": g.v_head_dim,
            "sliding_window": g.sliding_window,
            "mamba": None,
        }
        if g.mamba is not None:
            m = g.mamba
            d["mamba"] = {"num_heads": m.num_heads, "head_dim": m.head_dim, "d_state": m.d_state,
                          "conv_kernel": m.conv_kernel, "n_groups": m.n_groups, "ssm_dtype": m.ssm_dtype}
        return d

    return {
        "model": {"name": e.model.name, "num_layers": e.model.num_layers, "groups": [group(g) for g in e.model.groups]},
        "tp": e.tp,
        "pp": e.pp,
        "block_size": e.block_size,
        "memory": e.memory.order,
        "pp_layers": [list(x) for x in e.stages],
        "mamba_blocks_per_request": e.mamba_blocks_per_request,
        "num_blocks": e.num_blocks,
        "role": e.role,
        "group_block_sizes": [list(x) for x in e.group_block_sizes],
        "pcp": e.pcp,
        "dcp": e.dcp,
        "cp_interleave": e.cp_interleave,
    }


def engine_from_dict(d: dict[str, Any]) -> EngineLayout:
    """Inverse of :func:`engine_to_dict`; raises LayoutError on malformed input."""
    try:
        m = d["model"]
        groups = []
        for g in m["groups"]:
            g = dict(g)
            ms = g.pop("mamba")
            groups.append(CacheGroup(**{**g, "layers": tuple(g["layers"]), "mamba": MambaSpec(**ms) if ms else None}))
        model = ModelSpec(m["name"], m["num_layers"], tuple(groups))
        return EngineLayout(model, tp=d["tp"], pp=d["pp"], block_size=d["block_size"], memory=MemoryLayout(d["memory"]),
                            pp_layers=tuple(tuple(x) for x in d["pp_layers"]),
                            mamba_blocks_per_request=d["mamba_blocks_per_request"], num_blocks=d["num_blocks"],
                            role=d.get("role", "engine"),
                            group_block_sizes=tuple((str(n), int(b)) for n, b in d.get("group_block_sizes", ())),
                            pcp=int(d.get("pcp", 1)), dcp=int(d.get("dcp", 1)),
                            cp_interleave=int(d.get("cp_interleave", 1)))
    except (KeyError, TypeError) as e:
        raise LayoutError(f"malformed engine layout description: {e!r}") from e
