"""Describe KV memory the engine allocated: per layer, which tensor holds which component, how.

Each layer's cache is given in the engine's *logical* shape, named by axis letters; the tensor's own
strides say where the bytes are, so physical permutations (HND memory behind an NHD shape, vLLM's
``KVCacheLayout`` orders, cross-layer blocks) and padding need no special case:

====  ==========================================================================================
B     block (size >= the engine's ``num_blocks``)
T, N  token within a block (size = ``block_size``)
H     KV head / unit of the TP-sharded axis (size = heads on this rank; absent for MLA)
D     element within a head (must be contiguous)
K     K or V (size 2: index 0 = K, 1 = V)
C     K and V packed along the last axis (vLLM 0.33: ``[..., :head_size]`` = K, the rest V); for
      MLA the latent itself
====  ==========================================================================================

Common forms::

    LayerKV(t, "BHNC")          # vLLM 0.33: [blocks, heads, tokens, K|V] view of its flat buffer
    LayerKV(t, "KBTHD")         # FlashAttention (2, num_blocks, block_size, heads, head_size)
    LayerKV(t, "BKTHD")         # FlashInfer (num_blocks, 2, block_size, heads, head_size)
    LayerKV(k=tk, v=tv, axes="BTHD")   # K and V in two tensors
    LayerKV(t, "BTD")           # MLA latent (num_blocks, block_size, kv_lora_rank + rope_dim)
    LayerState(conv=c, ssm=s)   # Mamba: conv (slots, channels, kernel-1), ssm (slots, heads, head_dim, d_state)
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .errors import LayoutError
from .layout import CacheGroup, Component, EngineLayout
from .memory import Allocation, ComponentView, GroupRegion, KVMemory
from .tensors import TensorInfo, tensor_info

_TOKEN_AXES = {"N": "T"}


@dataclass(frozen=True)
class LayerKV:
    """One attention or MLA layer's cache: one tensor with a K/V axis or packed K|V content, or
    separate ``k`` and ``v`` tensors with the same ``axes``."""

    tensor: object = None
    axes: str = ""
    k: object = None
    v: object = None


@dataclass(frozen=True)
class LayerState:
    """One Mamba layer's state: ``conv`` with axes ``conv_axes`` (B slot, C channel, W window; the
    channels are x, then B, then C groups, channel-major) and ``ssm`` with axes ``ssm_axes``
    (B slot, H head, P head_dim, S d_state)."""

    conv: object
    ssm: object
    conv_axes: str = "BCW"
    ssm_axes: str = "BHPS"


def _dims(info: TensorInfo, axes: str, where: str) -> dict[str, tuple[int, int]]:
    axes = "".join(_TOKEN_AXES.get(a, a) for a in axes)
    if len(axes) != len(info.shape) or len(set(axes)) != len(axes):
        raise LayoutError(f"{where}: axes {axes!r} do not name the tensor's {len(info.shape)} dimensions "
                          f"(shape {info.shape}) once each")
    return {a: (n, s) for a, n, s in zip(axes, info.shape, info.strides)}


def _check(cond: bool, where: str, field: str, msg: str) -> None:
    if not cond:
        raise LayoutError(f"{where}, field {field!r}: {msg}")


# one component of one layer: (address, block stride, token stride, unit stride, component, tensor)
_View = tuple[int, int, int, int, Component, TensorInfo]


def _attention_views(engine: EngineLayout, g: CacheGroup, tp_rank: int, layer: int, spec: LayerKV,
                     keep: list[object]) -> list[_View]:
    comps = g.components
    views: list[_View] = []
    sources: list[tuple[object, int, int | None]]
    if spec.k is not None or spec.v is not None:
        if g.kind == "mla":
            raise LayoutError(f"layer {layer} (group {g.name!r}, MLA): give the latent as one tensor, not k/v")
        sources = [(spec.k, 0, None), (spec.v, 1, None)]
    else:
        sources = [(spec.tensor, ci, ci) for ci in range(len(comps))]
    for ci, (t, _, sel) in enumerate(sources):
        c = comps[ci]
        where = f"layer {layer} (group {g.name!r}) component {c.name!r}"
        if t is None:
            raise LayoutError(f"{where}: no tensor given")
        info = tensor_info(t)
        keep.append(t)
        d = _dims(info, spec.axes, where)
        _check(info.itemsize == c.itemsize, where, "dtype",
               f"element size {info.itemsize} B, the model's {g.dtype} is {c.itemsize} B")
        addr = info.addr
        elem_axis = "D"
        if "K" in d:
            _check(
                g.kind != "mla" and sel is not None,
                where,
                "axes",
                "a K/V axis only for attention K and V in one tensor",
            )
            _check(d["K"][0] == 2, where, "shape", f"the K/V axis has size {d['K'][0]}, expected 2")
            addr += (sel or 0) * d["K"][1]
        if "C" in d:
            _check("D" not in d, where, "axes", "use C (packed content) or D, not both")
            n, st = d["C"]
            if g.kind == "mla":
                _check(n == c.unit_elems, where, "shape", f"latent size {n}, the model's is {c.unit_elems}")
            else:
                kd, vd = comps[0].unit_elems, comps[1].unit_elems
                _check(n == kd + vd, where, "shape", f"packed K|V size {n}, expected {kd} + {vd}")
                if sel == 1:
                    addr += kd * st
            elem_axis = "C"
            d = {**d, "D": (c.unit_elems, st)}
        _check("D" in d, where, "axes", "no element axis (D or C)")
        n, st = d["D"]
        _check(n == c.unit_elems, where, "shape", f"{n} elements per head, the model has {c.unit_elems}")
        _check(st == info.itemsize, where, "strides",
               f"elements of a head ({elem_axis}) must be contiguous: stride {st} B, element size {info.itemsize} B")
        want_units = c.units_per_rank(engine.tp)
        if "H" in d:
            _check(d["H"][0] == want_units, where, "shape",
                   f"{d['H'][0]} heads, rank {tp_rank} of tp={engine.tp} holds {want_units}")
            ustride = d["H"][1]
        else:
            _check(want_units == 1, where, "axes", f"no head axis H, but this rank holds {want_units} heads")
            ustride = c.unit_bytes
        _check("T" in d and d["T"][0] == engine.block_size_of(g), where, "shape",
               f"token axis T/N must have block_size={engine.block_size_of(g)} entries (axes {spec.axes!r}, "
               f"shape {info.shape})")
        _check("B" in d and d["B"][0] >= engine.num_blocks, where, "shape",
               f"block axis B has {d.get('B', (0,))[0]} blocks, the engine declares num_blocks={engine.num_blocks}")
        extra = set(d) - {"B", "T", "H", "D", "K", "C"}
        _check(not extra, where, "axes", f"unknown axes {sorted(extra)}")
        views.append((addr, d["B"][1], d["T"][1], ustride, c, info))
    return views


def _state_views(engine: EngineLayout, g: CacheGroup, layer: int, spec: LayerState,
                 keep: list[object]) -> list[_View]:
    m = g.mamba
    assert m is not None
    tp = engine.tp
    comps = {c.name: c for c in g.components}
    heads = comps["conv_x"].units_per_rank(tp)
    groups = comps["conv_b"].units_per_rank(tp) if "conv_b" in comps else 0
    views: list[_View] = []
    where = f"layer {layer} (Mamba group {g.name!r})"
    info = tensor_info(spec.conv)
    keep.append(spec.conv)
    d = _dims(info, spec.conv_axes, f"{where} conv state")
    k1 = m.conv_kernel - 1
    w = f"{where} conv state"
    _check(set(d) == {"B", "C", "W"}, w, "axes", f"conv state axes must be B, C, W; got {spec.conv_axes!r}")
    _check(info.itemsize == comps["conv_x"].itemsize, w, "dtype",
           f"element size {info.itemsize} B, the model's {g.dtype} is {comps['conv_x'].itemsize} B")
    channels = heads * m.head_dim + 2 * groups * m.d_state
    _check(d["C"][0] == channels, w, "shape", f"{d['C'][0]} channels, this rank holds {channels}")
    _check(d["W"][0] == k1, w, "shape", f"window {d['W'][0]}, expected conv_kernel-1 = {k1}")
    _check(d["W"][1] == info.itemsize and d["C"][1] == k1 * info.itemsize, w, "strides",
           "conv state must be channel-major with contiguous windows (vLLM's 'DS' layout)")
    _check(d["B"][0] >= engine.num_blocks, w, "shape", f"{d['B'][0]} slots, num_blocks={engine.num_blocks}")
    cst = d["C"][1]
    off = 0
    for name, units, per in (
        ("conv_x", heads, m.head_dim),
        ("conv_b", groups, m.d_state),
        ("conv_c", groups, m.d_state),
    ):
        if name in comps:
            views.append((info.addr + off * cst, d["B"][1], 0, per * cst, comps[name], info))
            off += units * per
    info2 = tensor_info(spec.ssm)
    keep.append(spec.ssm)
    w = f"{where} ssm state"
    d = _dims(info2, spec.ssm_axes, w)
    _check(set(d) == {"B", "H", "P", "S"}, w, "axes", f"ssm state axes must be B, H, P, S; got {spec.ssm_axes!r}")
    c = comps["ssm"]
    _check(
        info2.itemsize == c.itemsize,
        w,
        "dtype",
        f"element size {info2.itemsize} B, the model's {m.ssm_dtype} is {c.itemsize} B",
    )
    _check(d["H"][0] == c.units_per_rank(tp) and d["P"][0] == m.head_dim and d["S"][0] == m.d_state, w, "shape",
           f"shape {info2.shape} (axes {spec.ssm_axes}); expected heads={c.units_per_rank(tp)}, "
           f"head_dim={m.head_dim}, d_state={m.d_state}")
    _check(d["S"][1] == info2.itemsize and d["P"][1] == m.d_state * info2.itemsize, w, "strides",
           "one head's (head_dim, d_state) state must be contiguous")
    _check(d["B"][0] >= engine.num_blocks, w, "shape", f"{d['B'][0]} slots, num_blocks={engine.num_blocks}")
    views.append((info2.addr, d["B"][1], 0, d["H"][1], c, info2))
    return views


def describe_memory(engine: EngineLayout, rank: Sequence[int], layers: Mapping[int, LayerKV | LayerState],
                    extra_regions: Iterable[Allocation] = ()) -> KVMemory:
    """The :class:`KVMemory` of rank ``(pp_rank, tp_rank)`` of ``engine`` from the engine's tensors.

    ``layers`` maps every global layer index of this rank's PP stage to its :class:`LayerKV`
    (attention, MLA) or :class:`LayerState` (Mamba). Every distinct allocation behind the tensors
    becomes one registered region (``extra_regions``: more :class:`~kvbridge.memory.Allocation`, e.g.
    one flat buffer that several layer views share). Groups may overlay the same bytes (vLLM's hybrid
    allocator). Raises :class:`LayoutError` naming the layer, the component and the field when a
    tensor does not fit the model and the engine.

    >>> import numpy as np, kvbridge
    >>> eng = kvbridge.EngineLayout(kvbridge.load_model("tiny-dense"), tp=1, block_size=16, num_blocks=8)
    >>> g = eng.model.groups[0]
    >>> kv = {l: np.zeros((2, 8, 16, g.num_heads, g.head_dim), np.float16) for l in g.layers}
    >>> mem = kvbridge.describe_memory(eng, (0, 0), {l: kvbridge.LayerKV(t, "KBTHD") for l, t in kv.items()})
    >>> len(mem.allocations) == len(g.layers)
    True
    """
    rank = (rank[0], rank[1])
    pp_rank, tp_rank = rank[0], engine.tp_rank(rank[1])  # rank[1] = pcp_rank * tp + tp_rank
    keep: list[object] = []
    regions: dict[str, GroupRegion] = {}
    allocs: dict[tuple[int, int, str], Allocation] = {}
    for a in extra_regions:
        allocs[(a.addr, a.nbytes, a.device)] = a
    for g in engine.model.groups:
        stage = engine.stage_layers(g, pp_rank)
        if not stage:
            continue
        per_comp: list[list[_View]] = [[] for _ in g.components]
        for layer in stage:
            spec = layers.get(layer)
            if spec is None:
                raise LayoutError(f"no memory given for layer {layer} (group {g.name!r}) on rank {rank}; give every "
                                  f"layer of this PP stage: {list(stage)}")
            if g.per_token and isinstance(spec, LayerKV):
                vs = _attention_views(engine, g, tp_rank, layer, spec, keep)
            elif not g.per_token and isinstance(spec, LayerState):
                vs = _state_views(engine, g, layer, spec, keep)
            else:
                want = LayerKV if g.per_token else LayerState
                raise LayoutError(f"layer {layer} (group {g.name!r}, {g.kind}): give a {want.__name__}, "
                                  f"not {type(spec).__name__}")
            for ci, v in enumerate(vs):
                per_comp[ci].append(v)
                info = v[5]
                allocs.setdefault((info.alloc_addr, info.alloc_nbytes, info.device),
                                  Allocation(info.alloc_addr, info.alloc_nbytes, info.device))
        regions[g.name] = _group_region(engine, g, stage, tp_rank, per_comp)
    return KVMemory(engine, rank, regions, _merged(allocs.values()), keepalive=keep)


def _group_region(engine: EngineLayout, g: CacheGroup, stage: tuple[int, ...], tp_rank: int,
                  per_comp: list[list[_View]]) -> GroupRegion:
    """One group's region from its layers' views; every layer of a group must share its strides, and
    K and V their block and token strides."""
    comps: list[ComponentView] = []
    bstride: int | None = None
    tstride: int | None = None
    for ci, c in enumerate(g.components):
        rows = per_comp[ci]
        _, bs, ts, us, _, _ = rows[0]
        for li, (_, b2, t2, u2, _, _) in enumerate(rows):
            for field, first, this in (("block stride", bs, b2), ("token stride", ts, t2), ("head stride", us, u2)):
                if first != this:
                    raise LayoutError(f"layer {stage[li]} (group {g.name!r}) component {c.name!r}, field "
                                      f"{field!r}: {this} B, but layer {stage[0]} has {first} B; every layer of a "
                                      f"group must share its strides")
        if g.per_token:
            if bstride is not None and (bs, ts) != (bstride, tstride):
                raise LayoutError(f"group {g.name!r} component {c.name!r}: block/token strides ({bs}, {ts}) B "
                                  f"differ from component {g.components[0].name!r}'s ({bstride}, {tstride}) B; "
                                  f"K and V must share block and token strides")
            bstride, tstride = bs, ts
        comps.append(ComponentView(tuple(r[0] for r in rows), bs, ts, us, c.unit_bytes, c.itemsize, len(stage),
                                   c.units_per_rank(engine.tp), c.unit_range(engine.tp, tp_rank)[0], stage))
    if not g.per_token or bstride is None or tstride is None:
        bstride, tstride = comps[0].block_stride, 0 if not g.per_token else comps[0].token_stride
    return GroupRegion(g, 0, 0, bstride, tstride, engine.block_size_of(g) if g.per_token else 1, tuple(comps))


def _merged(allocs: Iterable[Allocation]) -> list[Allocation]:
    """The storage of every tensor, the allocations nested in another (views of one buffer) merged."""
    merged: list[Allocation] = []
    for a in sorted(allocs, key=lambda a: (a.device, a.addr, -a.nbytes)):
        if merged and merged[-1].device == a.device and a.addr < merged[-1].end:
            last = merged[-1]
            merged[-1] = Allocation(last.addr, max(last.end, a.end) - last.addr, last.device)
        else:
            merged.append(a)
    return merged


__all__ = ["LayerKV", "LayerState", "describe_memory"]
