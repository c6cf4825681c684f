"""Hypothesis strategies shared by the planner and lowering tests."""
from hypothesis import strategies as st

from kvbridge.layout import CacheGroup, MambaSpec, ModelSpec

HEADS = [1, 2, 3, 4, 6, 8, 12, 16]


@st.composite
def random_models(draw, max_layers: int = 12, max_window: int = 40):
    """1-3 groups of any kind (attention, sliding, MLA, Mamba with or without B/C groups) over up to
    ``max_layers`` layers, some layers without a cache; uneven head counts on purpose."""
    ng = draw(st.integers(1, 3))
    nl = draw(st.integers(ng, max_layers))
    owner = draw(st.lists(st.integers(-1, ng - 1), min_size=nl, max_size=nl))
    for gi, pos in enumerate(draw(st.permutations(range(nl)))[:ng]):
        owner[pos] = gi  # every group gets at least one layer
    groups = []
    for gi in range(ng):
        layers = tuple(i for i, o in enumerate(owner) if o == gi)
        kind = draw(st.sampled_from(["full_attention", "sliding_window", "mla", "mamba"]))
        dtype = draw(st.sampled_from(["bfloat16", "float32", "fp8"]))
        name = f"g{gi}"
        if kind == "mla":
            groups.append(CacheGroup(name, kind, layers, dtype, head_dim=draw(st.integers(1, 8))))
        elif kind == "mamba":
            nh = draw(st.sampled_from(HEADS))
            groups.append(CacheGroup(name, kind, layers, dtype, mamba=MambaSpec(
                num_heads=nh, head_dim=draw(st.integers(1, 2)), d_state=draw(st.integers(1, 4)),
                conv_kernel=draw(st.integers(2, 4)),
                n_groups=draw(st.sampled_from([0] + [d for d in HEADS if nh % d == 0])),
                ssm_dtype=draw(st.sampled_from(["float32", "bfloat16"])))))
        else:
            groups.append(
                CacheGroup(
                    name,
                    kind,
                    layers,
                    dtype,
                    num_heads=draw(st.sampled_from(HEADS)),
                    head_dim=draw(st.integers(1, 8)),
                    sliding_window=draw(st.integers(1, max_window)) if kind == "sliding_window" else None,
                )
            )
    return ModelSpec("rand", nl, tuple(groups))


@st.composite
def random_pp_layers(draw, num_layers: int, pp: int):
    """None (vLLM's default split) or random uneven contiguous stages."""
    if pp == 1 or not draw(st.booleans()):
        return None
    cuts = sorted(draw(st.lists(st.integers(1, num_layers - 1), min_size=pp - 1, max_size=pp - 1, unique=True)))
    b = [0, *cuts, num_layers]
    return tuple(zip(b, b[1:]))


# ---- context parallelism (issue 21) --------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_tps(model: ModelSpec, up_to: int) -> list[int]:
    """TP sizes up to ``up_to`` that every component's unit count allows."""
    from kvbridge.layout import valid_tps
    ok = set(range(1, up_to + 1))
    for g in model.groups:
        for c in g.components:
            ok &= set(valid_tps(c.num_units, up_to))
    return sorted(ok)


@st.composite
def cp_engine_of(draw, model: ModelSpec, max_tp: int, role: str, max_pp: int = 3, block_sizes=(1, 2, 3, 4, 6, 8, 16),
                 **kw):
    """An engine with TP, PP and, where vLLM allows it for this model, PCP/DCP with any interleave that
    divides the block size; settings vLLM refuses (ContextParallelError) fall back to no CP."""
    from kvbridge.layout import ContextParallelError, EngineLayout
    tp = draw(st.sampled_from(model_tps(model, max_tp)))
    pp = draw(st.integers(1, min(max_pp, model.num_layers)))
    pp_layers = draw(random_pp_layers(model.num_layers, pp))
    bs = draw(st.sampled_from(list(block_sizes)))
    pcp = draw(st.sampled_from([1, 1, 2, 3]))
    dcp = draw(st.sampled_from(_divisors(tp) if pcp == 1 else [1, pcp, tp * pcp]))
    il = draw(st.sampled_from(_divisors(bs)))
    try:
        return EngineLayout(model, tp=tp, pp=pp, pp_layers=pp_layers, block_size=bs, pcp=pcp, dcp=dcp,
                            cp_interleave=il, role=role, **kw)
    except ContextParallelError:
        return EngineLayout(model, tp=tp, pp=pp, pp_layers=pp_layers, block_size=bs, role=role, **kw)


@st.composite
def cp_models(draw, max_layers: int = 8):
    """Models CP applies to: MLA or full attention (GQA with few heads, so DCP fits), optionally with a
    Mamba group (DCP only), or any random model."""
    from kvbridge.layout import CacheGroup as G
    kind = draw(st.sampled_from(["mla", "gqa", "mla+mamba", "random"]))
    if kind == "random":
        return draw(random_models(max_layers=max_layers))
    nl = draw(st.integers(2, max_layers))
    dtype = draw(st.sampled_from(["bfloat16", "float32", "fp8"]))
    if kind == "gqa":
        g = G("full", "full_attention", tuple(range(nl)), dtype, num_heads=draw(st.sampled_from([1, 2, 4])),
              head_dim=draw(st.integers(1, 8)))
        return ModelSpec("cp-gqa", nl, (g,))
    mla = G("mla", "mla", tuple(range(0, nl, 2) if kind == "mla+mamba" else range(nl)), dtype,
            head_dim=draw(st.integers(1, 8)))
    if kind == "mla":
        return ModelSpec("cp-mla", nl, (mla,))
    mamba = G("ssm", "mamba", tuple(range(1, nl, 2)), dtype,
              mamba=MambaSpec(num_heads=draw(st.sampled_from([1, 2, 4])), head_dim=1, d_state=2, conv_kernel=2))
    return ModelSpec("cp-hybrid", nl, (mla, mamba))


@st.composite
def cp_topologies(draw, max_tp: int = 8, **kw):
    model = draw(cp_models())
    return draw(cp_engine_of(model, max_tp, "prefill", **kw)), draw(cp_engine_of(model, max_tp, "decode", **kw))
