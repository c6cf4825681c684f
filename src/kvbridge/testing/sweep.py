"""Verification sweep: every preset (shrunk to tiny per-unit sizes) over a grid of topologies,
memory layouts and block sizes.

:func:`shrink` keeps a model's *geometry* (layers, groups, kinds, head/unit counts, Mamba heads and
groups, sliding window) and only shrinks the bytes per unit, so the planner and the lowering see the
same index spaces as for the real model while the oracle's buffers stay small.

:func:`sweep_cases` yields ``(prefill, decode)`` :class:`~kvbridge.layout.EngineLayout` pairs. Quick
mode (the default, used by the tests and ``kvbridge verify --sweep``) has 8 TP pairs per preset
(prefill > decode, decode > prefill, equal, and TP larger than some group's unit count), each with
one PP pair; the full mode takes every TP pair of ``{1,2,4,8}^2`` with every PP pair. Memory layouts
and block sizes are cycled so that every ordered pair of distinct layout presets occurs.

:func:`cp_sweep_cases` adds context parallelism: every preset over a grid of prefill
TP x PCP x DCP -> decode TP x PCP x DCP pairs (:data:`CP_TOPOLOGIES`), cycling block sizes,
interleaves and layouts; settings vLLM refuses for a model (SWA or Mamba with CP, GQA with too few TP
ranks per head) are skipped. ``kvbridge verify --sweep`` runs both.

Measured on the 2-core development machine: quick mode (104 cases) runs through
``verify(..., num_requests=3)`` in about 8 s; full mode (832 cases) in about 52 s.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import LayoutError
from ..layout import LAYOUT_PRESETS, EngineLayout, MambaSpec, MemoryLayout, ModelSpec, ceil_div
from ..memory import attention_page_bytes
from ..models import PRESETS, preset

TPS: tuple[int, ...] = (1, 2, 4, 8)
# (prefill tp, decode tp) pairs of quick mode: equal, P>D, D>P; tp 8 exceeds the head count of
# tiny-dense (4), tiny-hybrid (2) and gemma-4's full group (4); every tp > 1 exceeds MLA's 1 unit.
QUICK_TP_PAIRS: tuple[tuple[int, int], ...] = ((1, 1), (8, 8), (4, 2), (8, 1), (2, 8), (1, 4), (8, 2), (4, 8))
PP_PAIRS: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (1, 2), (2, 3))
BLOCK_SIZES: tuple[tuple[int, int], ...] = ((16, 16), (16, 64), (64, 16), (8, 32), (4, 4))
LAYOUTS: tuple[str, ...] = tuple(LAYOUT_PRESETS)
NUM_BLOCKS = 24


def shrink(model: ModelSpec, max_dim: int = 8) -> ModelSpec:
    """``model`` with the same geometry but tiny per-unit sizes (see the module docstring)."""
    groups = []
    for g in model.groups:
        kw: dict = {"head_dim": min(g.head_dim, max_dim)}
        if g.v_head_dim is not None:
            kw["v_head_dim"] = min(g.v_head_dim, max_dim)
        if g.mamba is not None:
            m = g.mamba
            kw["mamba"] = MambaSpec(num_heads=m.num_heads, head_dim=min(m.head_dim, 2), d_state=min(m.d_state, 4),
                                    conv_kernel=m.conv_kernel, n_groups=m.n_groups, ssm_dtype=m.ssm_dtype)
        groups.append(replace(g, **kw))
    return ModelSpec(model.name + "-small", model.num_layers, tuple(groups))


def pad_mamba(engine: EngineLayout, extra: int = 0) -> EngineLayout:
    """``engine`` with ``mamba_blocks_per_request`` set to the fewest attention pages that hold one
    Mamba layer's state on a rank (the largest Mamba group's), plus ``extra`` (vLLM pads the state slot to
    whole pages). Returned
    unchanged if the model lacks a Mamba group or a per-token group."""
    state = max((g.bytes_per_rank(engine.tp) for g in engine.model.groups if g.kind == "mamba"), default=None)
    page = attention_page_bytes(engine)
    if state is None or page is None:
        return engine
    return replace(engine, mamba_blocks_per_request=ceil_div(state, page) + extra)


def _engine(model: ModelSpec, tp: int, pp: int, bs: int, layout: str, role: str, padded: int | None) -> EngineLayout:
    """Build one side; ``padded`` not None: pad the Mamba slot (see :func:`pad_mamba`)."""
    e = EngineLayout(model, tp=tp, pp=pp, block_size=bs, memory=MemoryLayout.parse(layout),
                     num_blocks=NUM_BLOCKS, role=role)
    return e if padded is None else pad_mamba(e, padded)


def sweep_cases(quick: bool = True) -> list[tuple[EngineLayout, EngineLayout]]:
    """``(prefill, decode)`` pairs over every shrunk preset; topologies a layout rejects are skipped."""
    cases: list[tuple[EngineLayout, EngineLayout]] = []
    i = 0  # global case counter: drives the layout / block size / PP / Mamba padding cycles
    for pi, name in enumerate(PRESETS):
        model = shrink(preset(name))
        if quick:  # the PP pair rotates with the preset so each TP pair meets several PP pairs
            combos = [(tp, PP_PAIRS[(k + pi) % len(PP_PAIRS)]) for k, tp in enumerate(QUICK_TP_PAIRS)]
        else:
            combos = [((tp_p, tp_d), pp) for tp_p in TPS for tp_d in TPS for pp in PP_PAIRS]
        for (tp_p, tp_d), (pp_p, pp_d) in combos:
            if max(pp_p, pp_d) > model.num_layers:
                continue
            lay_p = LAYOUTS[i % len(LAYOUTS)]
            # decode layout: a different preset; the shift walks 1..5 so every ordered pair occurs
            lay_d = LAYOUTS[(i + 1 + (i // len(LAYOUTS)) % (len(LAYOUTS) - 1)) % len(LAYOUTS)]
            bs_p, bs_d = BLOCK_SIZES[i % len(BLOCK_SIZES)]
            # hybrid models: every other case pads the Mamba slot to whole attention pages (vLLM style)
            pad_p = (i // 2) % 2 if i % 2 == 0 else None
            pad_d = (i // 3) % 2 if i % 3 == 0 else None
            i += 1
            try:
                prefill = _engine(model, tp_p, pp_p, bs_p, lay_p, "prefill", pad_p)
                decode = _engine(model, tp_d, pp_d, bs_d, lay_d, "decode", pad_d)
            except LayoutError:
                continue
            cases.append((prefill, decode))
    return cases


# ((tp, pcp, dcp), (tp, pcp, dcp)) prefill -> decode; block sizes and interleaves cycle below
CP_TOPOLOGIES: tuple = (
    ((4, 1, 1), (4, 1, 4)),   # MLA TP4 -> TP4 x DCP4 (vLLM NIXL's DCP = transfer TP)
    ((1, 2, 1), (2, 1, 2)),   # PCP2 (replicated) -> DCP2
    ((2, 1, 2), (3, 1, 3)),   # DCP sizes that do not divide each other
    ((1, 2, 2), (2, 1, 1)),   # PCP x DCP (TP1) -> plain TP2
    ((2, 2, 4), (4, 1, 2)),   # DCP over TP x PCP -> DCP2
    ((8, 1, 1), (8, 1, 8)),   # GQA with heads replicated 8/heads times -> DCP8 where it fits
    ((8, 1, 4), (2, 2, 2)),   # DCP4 -> PCP x DCP
    ((2, 1, 1), (8, 1, 2)),
    ((16, 1, 2), (4, 1, 1)),  # GQA models with 8 KV heads: DCP needs TP > heads
    ((4, 1, 1), (16, 1, 2)),
)
CP_BLOCKS: tuple = (
    (16, 16, 16, 16),
    (16, 4, 8, 8),
    (8, 2, 32, 1),
    (4, 4, 12, 3),
    (32, 8, 16, 2),
)  # bs_p, il_p, bs_d, il_d


def cp_sweep_cases() -> list[tuple[EngineLayout, EngineLayout]]:
    """``(prefill, decode)`` pairs with context parallelism on either side or both, over every preset
    (shrunk); pairs a side refuses (vLLM's CP rules, TP sharding) are skipped."""
    cases: list[tuple[EngineLayout, EngineLayout]] = []
    i = 0
    for name in PRESETS:
        model = shrink(preset(name))
        for (tp_p, pcp_p, dcp_p), (tp_d, pcp_d, dcp_d) in CP_TOPOLOGIES:
            bs_p, il_p, bs_d, il_d = CP_BLOCKS[i % len(CP_BLOCKS)]
            lay_p, lay_d = LAYOUTS[i % len(LAYOUTS)], LAYOUTS[(i * 5 + 3) % len(LAYOUTS)]
            i += 1
            try:
                prefill = EngineLayout(model, tp=tp_p, pcp=pcp_p, dcp=dcp_p, cp_interleave=il_p, block_size=bs_p,
                                       memory=MemoryLayout.parse(lay_p), num_blocks=NUM_BLOCKS, role="prefill")
                decode = EngineLayout(model, tp=tp_d, pcp=pcp_d, dcp=dcp_d, cp_interleave=il_d, block_size=bs_d,
                                      memory=MemoryLayout.parse(lay_d), num_blocks=NUM_BLOCKS, role="decode")
            except LayoutError:
                continue
            cases.append((prefill, decode))
    return cases


__all__ = ["shrink", "sweep_cases", "cp_sweep_cases", "CP_TOPOLOGIES",
           "pad_mamba", "QUICK_TP_PAIRS", "PP_PAIRS", "BLOCK_SIZES", "LAYOUTS", "NUM_BLOCKS"]
