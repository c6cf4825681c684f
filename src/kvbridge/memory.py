"""Byte layout of one rank's registered KV memory.

A rank registers one buffer. Each cache group occupies a contiguous, 4 KiB-aligned region of it, in
model order. Inside a region every component of the group is a strided array of *atoms*: one atom is
the ``unit_bytes`` of one (layer, block, token, unit) cell, contiguous in memory. The strides come
from the engine's :class:`~kvbridge.layout.MemoryLayout` for per-token groups, and from the Mamba
state page layout for Mamba groups (see :mod:`kvbridge.layout`).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import numpy as np

from .errors import LayoutError
from .layout import CacheGroup, EngineLayout, ceil_div

ALIGN = 4096


@dataclass(frozen=True, slots=True)
class ComponentView:
    """Where one component of one group lives in a rank's memory (all values in bytes).

    Atom ``(layer_idx, block, token, unit_idx)`` (indices local to the rank) starts at
    ``layer_offsets[layer_idx] + block*block_stride + token*token_stride + unit_idx*unit_stride``
    and is ``unit_bytes`` long (contiguous). ``unit0`` is the global index of the rank's first unit.
    Offsets are relative to a buffer (kvbridge's default layout, :class:`RankMemory`) or absolute
    addresses (engine-owned memory, :class:`KVMemory`). Layers may live anywhere (separate
    allocations, any order, gaps); within a group every layer shares the strides.
    """

    layer_offsets: tuple[int, ...]
    block_stride: int
    token_stride: int
    unit_stride: int
    unit_bytes: int
    itemsize: int
    num_layers: int
    num_units: int
    unit0: int
    layers: tuple[int, ...]

    @property
    def offset(self) -> int:
        return self.layer_offsets[0]

    @property
    def layer_stride(self) -> int | None:
        """The common distance between consecutive layers, or None if layers are not evenly spaced."""
        o = self.layer_offsets
        if len(o) < 2:
            return 0
        d = o[1] - o[0]
        return d if all(b - a == d for a, b in zip(o, o[1:])) else None

    def shifted(self, delta: int) -> "ComponentView":
        return replace(self, layer_offsets=tuple(x + delta for x in self.layer_offsets))


@dataclass(frozen=True, slots=True)
class GroupRegion:
    group: CacheGroup
    offset: int
    size: int
    block_stride: int
    token_stride: int
    tokens_per_block: int
    components: tuple[ComponentView, ...]


def _per_token_region(engine: EngineLayout, g: CacheGroup, layers: tuple[int, ...], tp_rank: int,
                      offset: int) -> GroupRegion:
    comps = g.components
    if len({c.unit_bytes for c in comps}) != 1:
        raise LayoutError(f"group {g.name!r}: K and V must have the same head size for a paged layout")
    c0 = comps[0]
    sizes = {"L": len(layers), "K": len(comps), "B": engine.num_blocks, "T": engine.block_size_of(g),
             "H": c0.units_per_rank(engine.tp), "D": c0.unit_bytes}
    strides: dict[str, int] = {}
    s = 1
    for ax in reversed(engine.memory.order):
        strides[ax] = s
        s *= sizes[ax]
    views = tuple(ComponentView(
        layer_offsets=tuple(offset + k * strides["K"] + i * strides["L"] for i in range(len(layers))),
        block_stride=strides["B"],
        token_stride=strides["T"], unit_stride=strides["H"], unit_bytes=c.unit_bytes, itemsize=c.itemsize,
        num_layers=len(layers), num_units=c.units_per_rank(engine.tp),
        unit0=c.unit_range(engine.tp, tp_rank)[0], layers=layers) for k, c in enumerate(comps))
    return GroupRegion(g, offset, s, strides["B"], strides["T"], engine.block_size_of(g), views)


def attention_page_bytes(engine: EngineLayout) -> int | None:
    """Bytes of one block of one layer of the engine's first per-token group on one rank (K+V)."""
    for g in engine.model.groups:
        if g.per_token:
            return sum(c.units_per_rank(engine.tp) * c.unit_bytes for c in g.components) * engine.block_size_of(g)
    return None


def _mamba_region(engine: EngineLayout, g: CacheGroup, layers: tuple[int, ...], tp_rank: int,
                  offset: int) -> GroupRegion:
    comps = g.components
    state_bytes = sum(c.units_per_rank(engine.tp) * c.unit_bytes for c in comps)
    slot = state_bytes
    if engine.mamba_blocks_per_request is not None:
        page = attention_page_bytes(engine) or state_bytes
        slot = engine.mamba_blocks_per_request * page
        if slot < state_bytes:
            raise LayoutError(
                f"group {g.name!r}: Mamba state is {state_bytes} bytes per layer on one rank but "
                f"mamba_blocks_per_request={engine.mamba_blocks_per_request} x page {page} B = {slot} B; "
                f"use mamba_blocks_per_request >= {ceil_div(state_bytes, page)}")
    n_layers, n_slots = len(layers), engine.num_blocks
    if engine.memory.cross_layer:
        layer_stride, block_stride = slot, slot * n_layers
    else:
        layer_stride, block_stride = slot * n_slots, slot
    views, inner = [], 0
    for c in comps:
        n = c.units_per_rank(engine.tp)
        views.append(ComponentView(tuple(offset + inner + i * layer_stride for i in range(n_layers)), block_stride, 0,
                                   c.unit_bytes, c.unit_bytes, c.itemsize, n_layers, n,
                                   c.unit_range(engine.tp, tp_rank)[0], layers))
        inner += n * c.unit_bytes
    return GroupRegion(g, offset, slot * n_layers * n_slots, block_stride, 0, 1, tuple(views))


@dataclass(frozen=True)
class RankMemory:
    """Byte layout of rank ``(pp_rank, tp_rank)`` of ``engine``: one region per group with layers here.
    ``tp_rank`` is the rank's index in its PP stage (``pcp_rank * tp + tp_rank`` with PCP); its heads are
    those of TP rank ``tp_rank % tp``. Context parallelism does not change a rank's memory shape: a
    token-sharded rank keeps ``block_size`` tokens of its share per block."""

    engine: EngineLayout
    pp_rank: int
    tp_rank: int

    def __post_init__(self) -> None:
        regions: dict[str, GroupRegion] = {}
        offset = 0
        for g in self.engine.model.groups:
            layers = self.engine.stage_layers(g, self.pp_rank)
            if not layers:
                continue
            build = _per_token_region if g.per_token else _mamba_region
            r = build(self.engine, g, layers, self.engine.tp_rank(self.tp_rank), offset)
            regions[g.name] = r
            offset += ceil_div(r.size, ALIGN) * ALIGN
        object.__setattr__(self, "regions", regions)
        object.__setattr__(self, "size", max(offset, ALIGN))

    regions: dict[str, GroupRegion] = field(init=False, repr=False, compare=False)
    size: int = field(init=False, compare=False)

    def region(self, group: str) -> GroupRegion:
        return self.regions[group]

    def layer_index(self, group: str, layer: int) -> int:
        return self.regions[group].components[0].layers.index(layer)

    def element_view(self, buf: np.ndarray, group: str, comp: int) -> np.ndarray:
        """Writable ndarray view ``[layer, block, token, unit, elem]`` of one component in ``buf``."""
        r = self.regions[group]
        v = r.components[comp]
        dt = np.dtype(f"u{v.itemsize}")
        shape = (v.num_layers, self.engine.num_blocks, r.tokens_per_block, v.num_units, v.unit_bytes // v.itemsize)
        if v.layer_stride is None:
            raise LayoutError(f"group {group!r} component {comp}: layers are not evenly spaced (offsets "
                              f"{list(v.layer_offsets)}); view one layer at a time")
        strides = (v.layer_stride, v.block_stride, v.token_stride, v.unit_stride, v.itemsize)
        return np.ndarray(shape, dtype=dt, buffer=buf, offset=v.offset, strides=strides)


@cache
def rank_memory(engine: EngineLayout, pp_rank: int, tp_rank: int) -> RankMemory:
    return RankMemory(engine, pp_rank, tp_rank)


# ---- engine-owned memory -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Allocation:
    """One distinct piece of memory the engine allocated: registered with the transport once.

    ``device`` is ``"cpu"`` (host DRAM) or ``"cuda:N"`` (GPU N's memory)."""

    addr: int
    nbytes: int
    device: str = "cpu"

    @property
    def end(self) -> int:
        return self.addr + self.nbytes

    @property
    def device_kind(self) -> str:
        return self.device.split(":")[0]

    @property
    def device_id(self) -> int:
        return int(self.device.split(":")[1]) if ":" in self.device else 0


class KVMemory:
    """Where one rank's KV cache lives: absolute addresses in memory the engine owns.

    ``regions`` maps each cache group with layers on this rank to a :class:`GroupRegion` whose
    component views carry absolute per-layer addresses; ``allocations`` are the distinct pieces of
    memory behind them (each registered with the transport once). kvbridge never allocates or
    frees this memory; ``keepalive`` holds the engine's tensors so their memory outlives the
    description. Build one with :func:`kvbridge.describe.describe_memory` (tensors) or
    :meth:`from_buffer` (kvbridge's default layout in a buffer the caller allocated).
    """

    __slots__ = ("engine", "rank", "regions", "allocations", "keepalive", "_digest")

    def __init__(self, engine: EngineLayout, rank: Sequence[int], regions: dict[str, GroupRegion],
                 allocations: Iterable[Allocation], keepalive: Any = ()) -> None:
        self.engine = engine
        self.rank = tuple(rank)
        self.regions: dict[str, GroupRegion] = dict(regions)
        allocs = sorted({(a.addr, a.nbytes, a.device) for a in allocations})
        self.allocations: tuple[Allocation, ...] = tuple(Allocation(*a) for a in allocs)
        self.keepalive = tuple(keepalive)
        self._digest: str | None = None
        self._check_allocations()
        self.validate()

    # kvbridge's RankMemory interface (lowering reads these)
    def region(self, group: str) -> GroupRegion:
        return self.regions[group]

    def layer_index(self, group: str, layer: int) -> int:
        return self.regions[group].components[0].layers.index(layer)

    @property
    def device(self) -> str:
        devs = {a.device for a in self.allocations}
        return devs.pop() if len(devs) == 1 else "mixed"

    @classmethod
    def from_buffer(cls, engine: EngineLayout, rank: Sequence[int], buf: Any, device: str = "cpu") -> KVMemory:
        """kvbridge's default layout (:class:`RankMemory`) placed in a buffer the caller allocated
        (a numpy array or torch tensor of at least ``RankMemory(engine, *rank).size`` bytes)."""
        from .tensors import tensor_info
        mem = rank_memory(engine, *rank)
        info = tensor_info(buf)
        if info.nbytes < mem.size:
            raise LayoutError(f"rank {tuple(rank)} of {engine}: the buffer has {info.nbytes} B, the layout needs "
                              f"{mem.size} B; allocate at least that many bytes")
        regions = {g: replace(r, components=tuple(c.shifted(info.addr) for c in r.components))
                   for g, r in mem.regions.items()}
        return cls(engine, rank, regions, [Allocation(info.addr, info.nbytes, info.device)], keepalive=(buf,))

    # ---- checks ---------------------------------------------------------------------------------
    def _check_allocations(self) -> None:
        for a, b in zip(self.allocations, self.allocations[1:]):
            if b.addr < a.end:
                raise LayoutError(f"rank {self.rank}: memory regions [{a.addr:#x}, +{a.nbytes}) and "
                                  f"[{b.addr:#x}, +{b.nbytes}) overlap; give each allocation once")

    def allocation_of(self, addr: int, nbytes: int) -> int:
        """Index of the allocation holding ``[addr, addr+nbytes)``, or -1."""
        for i, a in enumerate(self.allocations):
            if a.addr <= addr and addr + nbytes <= a.end:
                return i
        return -1

    def extent(self, group: str, comp: int, layer_idx: int) -> tuple[int, int]:
        """Lowest address and end of every atom of one (group, component, layer) over all blocks."""
        r = self.regions[group]
        v = r.components[comp]
        base = v.layer_offsets[layer_idx]
        lo = hi = base
        for n, s in ((self.engine.num_blocks, v.block_stride), (r.tokens_per_block, v.token_stride),
                     (v.num_units, v.unit_stride)):
            step = (n - 1) * s
            lo, hi = lo + min(step, 0), hi + max(step, 0)
        return lo, hi + v.unit_bytes

    def validate(self) -> None:
        """Every atom inside one allocation; atoms of a group do not overlap (checked on two blocks,
        every layer, component, token and unit: a wrong stride or offset shows up there)."""
        for gname, r in self.regions.items():
            g = r.group
            for ci, v in enumerate(r.components):
                cname = g.components[ci].name
                for li, layer in enumerate(v.layers):
                    lo, hi = self.extent(gname, ci, li)
                    if self.allocation_of(lo, hi - lo) < 0:
                        raise LayoutError(
                            f"rank {self.rank}: group {gname!r} layer {layer} component {cname!r}: bytes "
                            f"[{lo:#x}, {hi:#x}) ({self.engine.num_blocks} blocks) are not inside one registered "
                            f"memory region {[(hex(a.addr), a.nbytes) for a in self.allocations][:4]}; check the "
                            f"tensor's num_blocks, strides and data pointer")
            nb = min(2, self.engine.num_blocks)
            starts, ends, names = [], [], []
            for ci, v in enumerate(r.components):
                off = np.asarray(v.layer_offsets, dtype=np.int64)
                s = (off[:, None, None, None] + np.arange(nb)[None, :, None, None] * v.block_stride
                     + np.arange(r.tokens_per_block)[None, None, :, None] * v.token_stride
                     + np.arange(v.num_units)[None, None, None, :] * v.unit_stride).ravel()
                starts.append(s)
                ends.append(s + v.unit_bytes)
                names.append(np.full(s.size, ci))
            s, e, n = np.concatenate(starts), np.concatenate(ends), np.concatenate(names)
            order = np.argsort(s, kind="stable")
            s, e, n = s[order], e[order], n[order]
            bad = np.nonzero(s[1:] < e[:-1])[0]
            if bad.size:
                i = int(bad[0])
                a, b = g.components[int(n[i])].name, g.components[int(n[i + 1])].name
                raise LayoutError(f"rank {self.rank}: group {gname!r}: bytes of component {a!r} and {b!r} overlap at "
                                  f"{int(s[i + 1]):#x} (within the first {nb} blocks); check block/token/head "
                                  f"strides and that K and V are distinct")

    # ---- wire form (handshake) ------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        return {"rank": list(self.rank),
                "allocations": [[a.addr, a.nbytes, a.device] for a in self.allocations],
                "groups": {g: {"block_stride": r.block_stride, "token_stride": r.token_stride,
                               "components": [[list(v.layer_offsets), v.block_stride, v.token_stride, v.unit_stride]
                                              for v in r.components]}
                           for g, r in self.regions.items()}}

    @property
    def digest(self) -> str:
        if self._digest is None:
            import hashlib
            import json
            self._digest = hashlib.sha256(json.dumps(self.to_wire(), sort_keys=True).encode()).hexdigest()[:16]
        return self._digest

    @classmethod
    def from_wire(cls, engine: EngineLayout, d: dict[str, Any]) -> KVMemory:
        """Rebuild a remote rank's description; the engine layout gives the shapes, the wire the
        addresses and strides. Raises LayoutError on anything inconsistent."""
        try:
            rank = tuple(int(x) for x in d["rank"])
            allocs = [Allocation(int(a), int(n), str(dev)) for a, n, dev in d["allocations"]]
            shape = rank_memory(engine, *rank)
            regions = {}
            if set(d["groups"]) != set(shape.regions):
                raise LayoutError(f"memory description has groups {sorted(d['groups'])}, the layout "
                                  f"{sorted(shape.regions)}")
            for gname, gd in d["groups"].items():
                r = shape.regions[gname]
                if len(gd["components"]) != len(r.components):
                    raise LayoutError(
                        f"group {gname!r}: {len(gd['components'])} components, expected {len(r.components)}"
                    )
                comps = []
                for v, (offs, bs, ts, us) in zip(r.components, gd["components"]):
                    if len(offs) != v.num_layers:
                        raise LayoutError(f"group {gname!r}: {len(offs)} layer addresses, expected {v.num_layers}")
                    comps.append(replace(v, layer_offsets=tuple(int(x) for x in offs), block_stride=int(bs),
                                         token_stride=int(ts), unit_stride=int(us)))
                regions[gname] = replace(r, block_stride=int(gd["block_stride"]), token_stride=int(gd["token_stride"]),
                                         components=tuple(comps))
        except (KeyError, TypeError, ValueError) as e:
            raise LayoutError(f"malformed memory description: {e!r}") from e
        return cls(engine, rank, regions, allocs)

    def __repr__(self) -> str:
        return (f"KVMemory(rank={self.rank}, groups={list(self.regions)}, "
                f"allocations={len(self.allocations)}, device={self.device})")
