"""Harness: KV caches allocated the way engines allocate them, and an oracle that never asks kvbridge.

Each form allocates one rank's tensors (numpy, or torch when ``xp`` is torch) and returns, per
layer, the :class:`~kvbridge.describe.LayerKV`/``LayerState`` handed to kvbridge *and* a logical
accessor built with the tensor's own indexing (``t[0]``, ``t[..., :D]``, ``transpose``) in the
engine's logical shape ``[block, token, head, elem]`` (state: ``[slot, unit, elem...]``). The oracle
fills and checks through those accessors only, so a wrong stride or offset in kvbridge's description
of the memory (``describe.py``/``memory.py``) makes it fail.

Forms (per-token groups): ``vllm-LBNHC``/``vllm-LBHNC``/``vllm-BLNHC`` (vLLM 0.33: per-layer 4-D
``[B, H, N, K|V]`` views of one flat buffer), ``flash_attn`` ``(2, B, T, H, D)``, ``flashinfer``
``(B, 2, T, H, D)``, ``split`` (separate K and V tensors), ``hnd`` (HND memory behind an NHD shape),
``padded`` (padding between heads and blocks), ``scattered`` (layers at shuffled offsets with gaps in
one buffer), ``separate`` (one allocation per layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..describe import LayerKV, LayerState
from ..layout import CacheGroup, EngineLayout
from ..lower import GroupBlocks

FORMS = ("vllm-LBNHC", "vllm-LBHNC", "vllm-BLNHC", "flash_attn", "flashinfer", "split", "hnd", "padded",
         "scattered", "separate")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


@dataclass
class RankCache:
    """One rank's engine-owned cache: what kvbridge gets, and logical views for the oracle."""

    layers: dict            # global layer -> LayerKV | LayerState
    logical: dict           # (global layer, component index) -> ndarray [B, T, H, D] / [slot, unit, elem]
    owners: list            # the allocations (keep alive)


def _units(c, tp):
    return c.units_per_rank(tp)


def _flat(nbytes: int) -> np.ndarray:
    return np.zeros(nbytes, dtype=np.uint8)


def _attention_layer(form: str, g: CacheGroup, eng: EngineLayout, dt, flat=None, off=0):
    """One layer in ``form``: (LayerKV, [logical view per component], owner)."""
    B, T = eng.num_blocks, eng.block_size_of(g)
    comps = g.components
    if g.kind == "mla":
        D = comps[0].unit_elems
        if form in ("padded",):
            t = np.zeros((B, T, D + 8), dt)[..., :D]
        else:
            t = np.zeros((B, T, D), dt)
        return LayerKV(t, "BTD"), [t[:, :, None, :]], t
    H = _units(comps[0], eng.tp)
    D, Dv = comps[0].unit_elems, comps[1].unit_elems
    if form == "flash_attn":
        t = np.zeros((2, B, T, H, D), dt)
        return LayerKV(t, "KBTHD"), [t[0], t[1]], t
    if form == "flashinfer":
        t = np.zeros((B, 2, T, H, D), dt)
        return LayerKV(t, "BKTHD"), [t[:, 0], t[:, 1]], t
    if form == "split":
        k, v = np.zeros((B, T, H, D), dt), np.zeros((B, T, H, Dv), dt)
        return LayerKV(k=k, v=v, axes="BTHD"), [k, v], (k, v)
    if form == "hnd":
        phys = np.zeros((2, B, H, T, D), dt)
        t = phys.transpose(0, 1, 3, 2, 4)  # logical NHD shape over HND memory
        return LayerKV(t, "KBTHD"), [t[0], t[1]], phys
    if form == "padded":
        phys = np.zeros((B + 1, 2, T, H, D + 8), dt)  # 8 elements of padding per head, one spare block
        t = phys[:, :, :, :, :D]
        return LayerKV(t, "BKTHD"), [t[:, 0], t[:, 1]], phys
    raise ValueError(form)


def _vllm_views(g: CacheGroup, eng: EngineLayout, dt, order: str, layers: list[int], flat: np.ndarray | None):
    """vLLM 0.33: every layer a [B, H, N, C] view (C = K|V packed) of one flat buffer; ``order`` is its
    KVCacheLayout (physical order of L, B, H, N, C)."""
    B, T = eng.num_blocks, eng.block_size_of(g)
    comps = g.components
    H = _units(comps[0], eng.tp) if g.kind != "mla" else 1
    C = sum(c.unit_elems for c in comps) if g.kind != "mla" else comps[0].unit_elems
    item = np.dtype(dt).itemsize
    sizes = {"L": len(layers), "B": B, "H": H, "N": T, "C": C}
    strides, s = {}, item
    for ax in reversed(order):
        strides[ax] = s
        s *= sizes[ax]
    if flat is None:
        flat = _flat(s)
    out = {}
    for i, layer in enumerate(layers):
        t = np.lib.stride_tricks.as_strided(
            flat[i * strides["L"]:].view(dt), shape=(B, H, T, C),
            strides=(strides["B"], strides["H"], strides["N"], strides["C"]), writeable=True)
        if g.kind == "mla":
            out[layer] = (LayerKV(t, "BHNC"), [t.transpose(0, 2, 1, 3)])
        else:
            D = comps[0].unit_elems
            out[layer] = (LayerKV(t, "BHNC"), [t[..., :D].transpose(0, 2, 1, 3), t[..., D:].transpose(0, 2, 1, 3)])
    return out, flat


def _state_layer(g: CacheGroup, eng: EngineLayout):
    m = g.mamba
    comps = {c.name: c for c in g.components}
    tp = eng.tp
    heads = comps["conv_x"].units_per_rank(tp)
    groups = comps["conv_b"].units_per_rank(tp) if "conv_b" in comps else 0
    dt = {1: np.uint8, 2: np.float16, 4: np.float32}[comps["conv_x"].itemsize]
    sdt = {2: np.float16, 4: np.float32}[comps["ssm"].itemsize]
    k1 = m.conv_kernel - 1
    conv = np.zeros((eng.num_blocks, heads * m.head_dim + 2 * groups * m.d_state, k1), dt)
    ssm = np.zeros((eng.num_blocks, heads, m.head_dim, m.d_state), sdt)
    views, pos = [], 0
    for name, units, per in (
        ("conv_x", heads, m.head_dim),
        ("conv_b", groups, m.d_state),
        ("conv_c", groups, m.d_state),
    ):
        if name in comps:
            views.append(conv[:, pos:pos + units * per, :].reshape(eng.num_blocks, units, per * k1))
            pos += units * per
    views.append(ssm.reshape(eng.num_blocks, heads, m.head_dim * m.d_state))
    return LayerState(conv, ssm), views, (conv, ssm)


def allocate(eng: EngineLayout, rank, form: str, seed: int = 0) -> RankCache:
    """Allocate rank ``rank``'s cache in ``form`` (per-token groups; Mamba groups use conv/ssm tensors)."""
    pp_rank = rank[0]
    layers, logical, owners = {}, {}, []
    rng = np.random.default_rng(seed)
    for g in eng.model.groups:
        stage = list(eng.stage_layers(g, pp_rank))
        if not stage:
            continue
        if not g.per_token:
            for layer in stage:
                spec, views, own = _state_layer(g, eng)
                layers[layer] = spec
                owners.append(own)
                for ci, v in enumerate(views):
                    logical[(layer, ci)] = v
            continue
        dt = {1: np.uint8, 2: np.float16, 4: np.float32}[g.components[0].itemsize]
        if form.startswith("vllm-"):
            views, flat = _vllm_views(g, eng, dt, form[5:], stage, None)
            owners.append(flat)
            for layer, (spec, vs) in views.items():
                layers[layer] = spec
                for ci, v in enumerate(vs):
                    logical[(layer, ci)] = v
            continue
        if form == "scattered":  # one buffer, layers at shuffled offsets with gaps between them
            if g.kind == "mla":
                shape = (eng.num_blocks, eng.block_size_of(g), g.components[0].unit_elems)
            else:
                shape = (
                    2,
                    eng.num_blocks,
                    eng.block_size_of(g),
                    _units(g.components[0], eng.tp),
                    g.components[0].unit_elems,
                )
            nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
            per = nbytes + 4096
            flat = _flat(per * len(stage) + 4096)
            owners.append(flat)
            slots = rng.permutation(len(stage))
            for i, layer in enumerate(stage):
                base = flat[int(slots[i]) * per + 64:]
                t = base[:nbytes].view(dt).reshape(shape)
                if g.kind == "mla":
                    layers[layer] = LayerKV(t, "BTD")
                    logical[(layer, 0)] = t[:, :, None, :]
                else:
                    layers[layer] = LayerKV(t, "KBTHD")
                    logical[(layer, 0)], logical[(layer, 1)] = t[0], t[1]
            continue
        sub = "flash_attn" if form == "separate" else form
        for layer in stage:
            spec, vs, own = _attention_layer(sub, g, eng, dt)
            layers[layer] = spec
            owners.append(own)
            for ci, v in enumerate(vs):
                logical[(layer, ci)] = v
    return RankCache(layers, logical, owners)


# ---- the oracle ------------------------------------------------------------------------------------
def value(req: int, layer: int, comp: int, token, unit, elem, itemsize: int):
    """Expected value of one element, from global coordinates only (never zero: 0 is 'not written')."""
    x = (np.int64(req) * 1000003 + layer * 7919 + comp * 104729 + token * 131 + unit * 31 + elem) * 2654435761
    return (x % ((1 << (8 * min(itemsize, 2))) - 1) + 1).astype(_UINT[itemsize])


def _global_units(c, tp: int, tp_rank: int, n: int) -> np.ndarray:
    if tp <= c.num_units:
        return tp_rank * (c.num_units // tp) + np.arange(n)
    return np.full(n, tp_rank * c.num_units // tp)


def write_request(cache: RankCache, eng: EngineLayout, rank, req: int, num_tokens: int, blocks: dict,
                  first_block: dict | None = None, check: bool = False) -> int:
    """Fill (or, with ``check``, count mismatches of) request ``req``'s tokens in ``blocks``
    (group -> block ids; Mamba: [slot]) through the logical views."""
    bad = 0
    for g in eng.model.groups:
        if g.name not in blocks:
            continue
        ids = np.asarray(blocks[g.name], dtype=np.int64)
        fb = (first_block or {}).get(g.name, 0)
        for layer in eng.stage_layers(g, rank[0]):
            for ci, c in enumerate(g.components):
                v = cache.logical[(layer, ci)]
                u = _UINT[c.itemsize]
                if g.per_token:
                    # context parallelism through the oracle's own map (vLLM's DCP groups and slot kernel)
                    from .oracle import vllm_dcp_rank, vllm_slots
                    bs = eng.block_size_of(g)
                    t0 = fb * bs * eng.dcp
                    t1 = min((fb + ids.size) * bs * eng.dcp, num_tokens)
                    if t1 <= t0:
                        continue
                    tok = np.arange(t0, t1)
                    local, b, off = vllm_slots(tok, GroupBlocks(ids, fb), bs, eng.dcp,
                                               vllm_dcp_rank(eng.tp, eng.pcp, eng.dcp, rank[1]), eng.cp_interleave)
                    tok, b, off = tok[local], b[local], off[local]
                    units = _global_units(c, eng.tp, rank[1] % eng.tp, v.shape[2])
                    want = value(req, layer, ci, tok[:, None, None], units[None, :, None],
                                 np.arange(v.shape[3])[None, None, :], c.itemsize)
                    view = v.view(u)
                    if check:
                        bad += int(np.count_nonzero(view[b, off] != want))
                    else:
                        view[b, off] = want
                else:
                    units = _global_units(c, eng.tp, rank[1] % eng.tp, v.shape[1])
                    want = value(req, layer, ci, 0, units[:, None], np.arange(v.shape[2])[None, :], c.itemsize)
                    view = v.view(u) if v.dtype.itemsize == c.itemsize else v
                    if check:
                        bad += int(np.count_nonzero(view[ids[0]] != want))
                    else:
                        view[ids[0]] = want
    return bad
