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
            groups.append(CacheGroup(name, kind, layers, dtype, num_heads=draw(st.sampled_from(HEADS)),
                                     head_dim=draw(st.integers(1, 8)),
                                     sliding_window=draw(st.integers(1, max_window)) if kind == "sliding_window" else None))
    return ModelSpec("rand", nl, tuple(groups))


@st.composite
def random_pp_layers(draw, num_layers: int, pp: int):
    """None (vLLM's default split) or random uneven contiguous stages."""
    if pp == 1 or not draw(st.booleans()):
        return None
    cuts = sorted(draw(st.lists(st.integers(1, num_layers - 1), min_size=pp - 1, max_size=pp - 1, unique=True)))
    b = [0, *cuts, num_layers]
    return tuple(zip(b, b[1:]))
