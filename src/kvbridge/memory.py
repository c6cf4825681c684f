"""Byte layout of one rank's registered KV memory.

A rank registers one buffer. Each cache group occupies a contiguous, 4 KiB-aligned region of it, in
model order. Inside a region every component of the group is a strided array of *atoms*: one atom is
the ``unit_bytes`` of one (layer, block, token, unit) cell, contiguous in memory. The strides come
from the engine's :class:`~kvbridge.layout.MemoryLayout` for per-token groups, and from the Mamba
state page layout for Mamba groups (see :mod:`kvbridge.layout`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import numpy as np

from .errors import LayoutError
from .layout import CacheGroup, EngineLayout, ceil_div

ALIGN = 4096


@dataclass(frozen=True, slots=True)
class ComponentView:
    """Where one component of one group lives in a rank's buffer (all values in bytes).

    Atom ``(layer_idx, block, token, unit_idx)`` (indices local to the rank) starts at
    ``offset + layer_idx*layer_stride + block*block_stride + token*token_stride + unit_idx*unit_stride``
    and is ``unit_bytes`` long. ``unit0`` is the global index of the rank's first unit.
    """

    offset: int
    layer_stride: int
    block_stride: int
    token_stride: int
    unit_stride: int
    unit_bytes: int
    itemsize: int
    num_layers: int
    num_units: int
    unit0: int
    layers: tuple[int, ...]


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
    sizes = {"L": len(layers), "K": len(comps), "B": engine.num_blocks, "T": engine.block_size,
             "H": c0.units_per_rank(engine.tp), "D": c0.unit_bytes}
    strides: dict[str, int] = {}
    s = 1
    for ax in reversed(engine.memory.order):
        strides[ax] = s
        s *= sizes[ax]
    views = tuple(ComponentView(
        offset=offset + k * strides["K"], layer_stride=strides["L"], block_stride=strides["B"],
        token_stride=strides["T"], unit_stride=strides["H"], unit_bytes=c.unit_bytes, itemsize=c.itemsize,
        num_layers=len(layers), num_units=c.units_per_rank(engine.tp),
        unit0=c.unit_range(engine.tp, tp_rank)[0], layers=layers) for k, c in enumerate(comps))
    return GroupRegion(g, offset, s, strides["B"], strides["T"], engine.block_size, views)


def attention_page_bytes(engine: EngineLayout) -> int | None:
    """Bytes of one block of one layer of the engine's first per-token group on one rank (K+V)."""
    for g in engine.model.groups:
        if g.per_token:
            return sum(c.units_per_rank(engine.tp) * c.unit_bytes for c in g.components) * engine.block_size
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
        views.append(ComponentView(offset + inner, layer_stride, block_stride, 0, c.unit_bytes, c.unit_bytes,
                                   c.itemsize, n_layers, n, c.unit_range(engine.tp, tp_rank)[0], layers))
        inner += n * c.unit_bytes
    return GroupRegion(g, offset, slot * n_layers * n_slots, block_stride, 0, 1, tuple(views))


@dataclass(frozen=True)
class RankMemory:
    """Byte layout of rank ``(pp_rank, tp_rank)`` of ``engine``: one region per group with layers here."""

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
            r = build(self.engine, g, layers, self.tp_rank, offset)
            regions[g.name] = r
            offset += ceil_div(r.size, ALIGN) * ALIGN
        object.__setattr__(self, "regions", regions)
        object.__setattr__(self, "size", max(offset, ALIGN))

    regions: dict = field(init=False, repr=False, compare=False)
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
        strides = (v.layer_stride, v.block_stride, v.token_stride, v.unit_stride, v.itemsize)
        return np.ndarray(shape, dtype=dt, buffer=buf, offset=v.offset, strides=strides)


@cache
def rank_memory(engine: EngineLayout, pp_rank: int, tp_rank: int) -> RankMemory:
    return RankMemory(engine, pp_rank, tp_rank)
