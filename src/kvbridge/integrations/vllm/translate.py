"""vLLM's description of a worker's KV cache -> kvbridge's (pure: no I/O, no endpoint).

:func:`engine_from_vllm` turns what vLLM gives a connector (the Hugging Face config, TP/PP, the
``KVCacheConfig`` groups and specs, the ``register_kv_caches`` tensors) into kvbridge's
:class:`~kvbridge.EngineLayout`, one kvbridge group per vLLM KV-cache group, and a per-layer memory
description, cross-checked; :class:`VLLMConfigError` names what disagrees. One builder per vLLM spec kind
(:data:`SPEC_KINDS`); every other spec class vLLM 0.33 defines is refused by name (:data:`REFUSED_SPECS`).
Only the public ``kvbridge`` API is used.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import kvbridge
from kvbridge.integrations import CacheGroup, GroupKind, MambaSpec, dtype_size, from_hf_config

# vLLM's objects (VllmConfig, CacheConfig, KVCacheConfig, its KVCacheGroupSpecs and their KVCacheSpecs) and
# torch tensors: Any to a type checker (vLLM and torch are not imported here), named for what they are
VllmConfig = Any
CacheConfig = Any
KVCacheConfig = Any
KVCacheGroup = Any
KVCacheSpec = Any
Tensor = Any
# what one layer's tensor becomes in kvbridge's memory description
LayerMemory = kvbridge.LayerKV | kvbridge.LayerState

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
# vLLM's prefix for the layers of a separate draft model (speculative method "draft_model"): they are
# numbered from 0 like the target's, kvbridge puts them after the target's layers
DRAFT_MODEL_PREFIX = "draft_model."
# the kvbridge group holding the draft layers of vLLM group ``g{i}`` whose KV shape differs from its target
# layers' (vLLM keeps same-kind layers of any shape in one group, one block table)
DRAFT_GROUP_SUFFIX = "-draft"


class VLLMConfigError(kvbridge.LayoutError):
    """What vLLM handed the connector does not agree with itself or with the model's config, or asks for
    something kvbridge does not move (the message names the setting to change)."""


# vLLM spec class (exact name: a subclass is another cache kind) -> kvbridge group kind
SPEC_KINDS: dict[str, GroupKind] = {"FullAttentionSpec": "full_attention", "SlidingWindowSpec": "sliding_window",
                              "MLAAttentionSpec": "mla", "MambaSpec": "mamba"}
# every other KVCacheSpec class of vLLM 0.33 (vllm.v1.kv_cache_interface), refused with the reason
REFUSED_SPECS: dict[str, str] = {
    "KVCacheSpec": "an abstract spec (no cache layout)",
    "AttentionSpec": "an abstract attention spec",
    "UniformTypeKVCacheSpecs": "resolved to its layers' one spec kind (mixed kinds in one group are refused)",
    "HiSparseHotSpec": "HiSparse hot caches are rebuilt from their source group, not transferred",
    "HiSparseResidentSpec": "HiSparse host-resident caches (DeepSeek-V3.2 sparse attention) are not supported",
    "HiddenStateCacheSpec": "hidden-state caches (extract_hidden_states) are not KV",
    "RSWASpec": "ring sliding-window caches are not supported",
    "ChunkedLocalAttentionSpec": "chunked local attention (Llama-4 iRoPE) caches are not supported",
    "CircularBufferSpec": "circular-buffer (CSA linear) caches are not supported",
    "SlidingWindowMLASpec": "sliding-window MLA caches are not supported",
    "EncoderOnlyAttentionSpec": "encoder-only attention has no KV cache to transfer",
    "CrossAttentionSpec": "encoder-decoder cross-attention caches are not supported",
    "SinkFullAttentionSpec": "attention-sink caches are not supported",
}


def layer_index(name: str, num_target_layers: int | None = None) -> int:
    """``"model.layers.3.self_attn.attn"`` -> 3 (the global layer index vLLM puts in the name). A separate
    draft model's layer (``"draft_model.model.layers.0.self_attn.attn"``) comes after the target's
    ``num_target_layers`` layers: ``num_target_layers + 0``."""
    m = _LAYER_RE.search(name)
    if m is None:
        raise ValueError(f"cannot find a layer index in vLLM layer name {name!r}")
    if name.startswith(DRAFT_MODEL_PREFIX):
        if num_target_layers is None:
            raise ValueError(f"{name!r} is a draft model's layer: its index needs the target's number of layers")
        return num_target_layers + int(m.group(1))
    return int(m.group(1))


def block_sources(group_names: list[str], kvbridge_groups: Iterable[CacheGroup]) -> dict[str, int]:
    """{kvbridge group name: the vLLM KV-cache group whose block ids it uses}: group ``i`` is
    ``group_names[i]``; a draft group split off it (:data:`DRAFT_GROUP_SUFFIX`) shares its block ids."""
    index = {n: i for i, n in enumerate(group_names)}
    out: dict[str, int] = {}
    for g in kvbridge_groups:
        name = g.name
        base = name[:-len(DRAFT_GROUP_SUFFIX)] if name.endswith(DRAFT_GROUP_SUFFIX) else name
        if base not in index:
            raise VLLMConfigError(f"kvbridge group {name!r} belongs to no vLLM KV-cache group {group_names}")
        out[name] = index[base]
    return out


def layer_spec(group: KVCacheGroup) -> KVCacheSpec:
    """The one spec of a vLLM KV-cache group (a UniformTypeKVCacheSpecs must hold equal specs)."""
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    if per_layer:
        kinds = {type(x).__name__ for x in per_layer.values()}
        if len(kinds) != 1:
            raise VLLMConfigError(f"KV-cache group of layers {list(group.layer_names)[:4]} mixes specs {sorted(kinds)}")
        spec = next(iter(per_layer.values()))
    return spec


def spec_kind(spec: KVCacheSpec, where: str = "") -> GroupKind:
    """kvbridge's group kind for a vLLM spec, or :class:`VLLMConfigError` naming the spec class."""
    name = type(spec).__name__
    kind = SPEC_KINDS.get(name)
    if kind is None:
        why = REFUSED_SPECS.get(name, "an unknown spec class")
        raise VLLMConfigError(f"{where or 'a KV-cache group'}: kvbridge cannot move {name} caches ({why}); "
                              f"supported: {sorted(SPEC_KINDS)}")
    return kind


def is_mamba(vgroup: KVCacheGroup) -> bool:
    return type(layer_spec(vgroup)).__name__ == "MambaSpec"


def state_groups(kv_cache_config: KVCacheConfig) -> list[int | None]:
    """Per vLLM KV-cache group: None (per-token cache), or the number of speculative scratch slots a
    Mamba group allocates after the request's state slot."""
    return [int(getattr(layer_spec(g), "num_speculative_blocks", 0) or 0) if is_mamba(g) else None
            for g in (getattr(kv_cache_config, "kv_cache_groups", None) or [])]


def speculative_fingerprint(vllm_config: VllmConfig) -> str | None:
    """A short hash of the speculative-decoding settings that decide which draft KV a request carries
    (method, draft model and revision, parallel drafting, draft KV dtype), as vLLM's NixlConnector hashes
    them; None without a draft model (no speculative decoding, or n-gram / suffix drafting: no draft KV).
    A decode reads a prefill's KV only when both fingerprints are equal."""
    sc = getattr(vllm_config, "speculative_config", None)
    draft = getattr(sc, "draft_model_config", None) if sc is not None else None
    if draft is None:
        return None
    d = {"method": getattr(sc, "method", None), "model": getattr(draft, "model", None),
         "revision": getattr(draft, "revision", None), "code_revision": getattr(draft, "code_revision", None),
         "parallel_drafting": getattr(sc, "parallel_drafting", None),
         "kv_cache_dtype": str(getattr(sc, "kv_cache_dtype", None) or vllm_config.cache_config.cache_dtype)}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def prefill_backoff(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Trailing prompt tokens the prefill leaves to the decode (as vLLM's NixlConnector): 1 for a Mamba
    hybrid (the decode recomputes the last prompt token, a state must not take it twice); a multi-module
    MTP drafter's lookahead window less one (``num_prefill_lookahead_tokens - 1``: unverified drafts must not
    be embedded in the MTP layers' KV); else 0."""
    mamba = 1 if any(x is not None for x in state_groups(kv_cache_config)) else 0
    try:
        lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
    except Exception:  # noqa: BLE001 - a partial speculative config (tests, older vLLM)
        lookahead = 0
    return max(mamba, lookahead - 1)


def layout_fingerprint(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """A short hash of what both sides must agree on to read each other's blocks (model, parallelism,
    block sizes, group specs, KV-cache layout). Informational: kvbridge's handshake checks the real
    layouts."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    groups: list[list[Any]] = []
    for g in getattr(kv_cache_config, "kv_cache_groups", []) or []:
        spec = g.kv_cache_spec
        groups.append([type(spec).__name__, getattr(spec, "block_size", None), getattr(spec, "num_kv_heads", None),
                       getattr(spec, "head_size", None), str(getattr(spec, "dtype", "")), len(g.layer_names)])
    d = {"model": getattr(mc.hf_config, "model_type", None), "arch": getattr(mc.hf_config, "architectures", None),
         "tp": pc.tensor_parallel_size, "pp": pc.pipeline_parallel_size, "block": cc.block_size,
         "layout": str(cc.kv_cache_layout), "groups": groups}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def kv_content_form(vllm_config: VllmConfig) -> str:
    """How the attention backend uses the last axis ``C`` of vLLM's ``[B, H, N, C]`` layer view:
    ``"packed"`` (K then V of each token: GPU backends) or ``"kv_blocks"`` (vLLM's CPU backend: per block and
    head, K stored transposed ``[D][N]`` then V ``[N][D]``, measured through ``cpu_attn_reshape_and_cache``).
    The CPU form has no per-token run of K, so the connector moves it block-granular: each block of a head
    is one unit (see :func:`engine_from_vllm`); both engines then need the same block size. Override with
    ``kv_connector_extra_config["kv_content"]``."""
    extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
    form = extra.get("kv_content")
    if form is None:
        try:
            from vllm.platforms import current_platform
            form = "kv_blocks" if current_platform.is_cpu() else "packed"
        except Exception:  # noqa: BLE001
            form = "packed"
    if form not in ("packed", "kv_blocks"):
        raise VLLMConfigError(f"kv_content={form!r}: use 'packed' (K|V per token) or 'kv_blocks' (vLLM's CPU backend)")
    return form


def _torch_dtype_name(d: object) -> str:
    return str(d).replace("torch.", "")


# ---------------------------------------------------------------------- the translation
@dataclass
class _Ctx:
    """What every group builder needs: the model (HF importer), TP/PP, content form, vLLM's groups."""

    hf_model: kvbridge.ModelSpec
    kind_of: dict[int, CacheGroup]  # model layer -> kvbridge model group
    tp: int
    pp: int
    content: str
    vgroups: list[KVCacheGroup]
    cache_config: CacheConfig
    speculative: bool = False  # the engine has a draft model: layers past the config's are its layers
    draft_kv_heads: int | None = None  # the draft model's KV heads, from its config (None: not known)

    def layer(self, name: str) -> int:
        """The model layer of a vLLM layer name (a separate draft model's after the target's)."""
        return layer_index(name, self.hf_model.num_layers)


@dataclass
class _Built:
    """One vLLM group translated: the kvbridge group, its block size, and how to cut a layer's tensor."""

    group: CacheGroup
    block_size: int
    view: Callable[[str, Tensor], LayerMemory]  # (vLLM layer name, its tensor) -> its memory description
    extra: dict[str, Any] = field(default_factory=dict)
    layer_names: tuple[str, ...] = ()  # the vLLM layers it describes


def _hf_dict(hf_config: Any) -> dict[str, Any]:
    hf: dict[str, Any] = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    # transformers 5 serialises some configs without keys it computes as properties (Nemotron-H:
    # num_hidden_layers and hybrid_override_pattern, replaced by layers_block_type): take them from the object
    for key in ("num_hidden_layers", "hybrid_override_pattern"):
        if hf.get(key) is None and isinstance(getattr(hf_config, key, None), (int, str)):
            hf[key] = getattr(hf_config, key)
    return hf


def _model_layers(ctx: _Ctx, names: list[str], spec: KVCacheSpec, kind: GroupKind,
                  where: str) -> tuple[tuple[int, ...], CacheGroup]:
    """(layers of the kvbridge group, the model group they belong to) for vLLM layers ``names`` of one spec:
    these layers (PP 1) or the whole model group's (PP > 1: a worker sees its stage's layers only)."""
    local = sorted({ctx.layer(n) for n in names})
    drafts = _draft_layers(ctx, local, where)
    if drafts and len(drafts) == len(local):
        return tuple(local), _draft_only_group(ctx, spec, kind, local, where)
    local_target = [x for x in local if x not in drafts]
    hgs = sorted({ctx.kind_of[x].name for x in local_target})
    hg = _model_group(ctx, hgs, kind, local, where)
    if ctx.pp == 1:
        return tuple(local), hg  # draft layers with the target's spec travel in the target's group
    return _whole_model_group(ctx, hgs, hg, where), hg


def _model_group(ctx: _Ctx, hgs: list[str], kind: GroupKind, local: list[int], where: str) -> CacheGroup:
    """The model-config group the vLLM group's layers belong to, checked against vLLM's spec kind."""
    hg = ctx.hf_model.group(hgs[0])
    if len(hgs) > 1:  # HMA off: vLLM caches sliding-window layers as full attention, in one group
        shapes = {(ctx.hf_model.group(n).num_heads, ctx.hf_model.group(n).head_dim) for n in hgs}
        if kind != "full_attention" or len(shapes) != 1:
            raise VLLMConfigError(f"{where}: layers {local} span model groups {hgs} of different shapes {shapes}")
    if kind != hg.kind and not (kind == "full_attention" and hg.kind in ("sliding_window", "full_attention")):
        raise VLLMConfigError(f"{where}: vLLM says {kind}, the model's config says {hg.kind} for layers {local}")
    return hg


def _whole_model_group(ctx: _Ctx, hgs: list[str], hg: CacheGroup, where: str) -> tuple[int, ...]:
    """PP > 1: a worker sees its stage's layers only; the kvbridge group takes the whole model group(s),
    if vLLM kept them in one group."""
    same = [v for v in ctx.vgroups if v.layer_names and ctx.kind_of.get(ctx.layer(v.layer_names[0])) is not None
            and ctx.kind_of[ctx.layer(v.layer_names[0])].name in hgs]
    if len(same) != 1:
        raise VLLMConfigError(f"{where}: with pipeline parallelism kvbridge needs one vLLM group per kind of "
                              f"layer, but {len(same)} groups hold {hg.kind} layers; use pipeline "
                              "parallelism 1 for this model")
    return tuple(sorted(x for n in hgs for x in ctx.hf_model.group(n).layers))


def _draft_layers(ctx: _Ctx, local: list[int], where: str) -> list[int]:
    """The layers of ``local`` past the model config's: a draft model's (EAGLE / MTP register theirs after
    the target's, ``model.layers.{num_hidden_layers + i}``; a separate draft model (``draft_model``) its own
    ``draft_model.model.layers.{i}``, numbered here after the target's), moved with the target's (PP 1 only)."""
    extra = [x for x in local if x not in ctx.kind_of]
    if not extra:
        return []
    if not ctx.speculative or any(x < ctx.hf_model.num_layers for x in extra):
        raise VLLMConfigError(f"{where}: layers {extra} are not cached layers of the model's config "
                              f"({ctx.hf_model.num_layers} layers) and the engine has no speculative_config")
    if ctx.pp > 1:
        raise VLLMConfigError(f"{where}: draft-model layers {extra} with pipeline parallelism: kvbridge moves "
                              "draft KV with pipeline_parallel_size 1 only (or drop the speculative_config)")
    return extra


def _draft_only_group(ctx: _Ctx, spec: KVCacheSpec, kind: GroupKind, layers: list[int], where: str) -> CacheGroup:
    """Draft layers of their own shape (a vLLM group of draft layers only, or draft layers whose KV shape
    differs from the target layers' of their vLLM group): the shape from vLLM's spec (MLA: the latent;
    attention: the draft config's KV heads, or KV heads per rank x TP when that is not ambiguous)."""
    dtype = _torch_dtype_name(spec.dtype)
    if kind == "mla":
        return CacheGroup("draft", "mla", tuple(layers), dtype, None, int(spec.head_size))
    if kind not in ("full_attention", "sliding_window"):
        raise VLLMConfigError(f"{where}: draft-model layers cached as {kind}: not supported")
    per_rank = int(spec.num_kv_heads)
    total = ctx.draft_kv_heads
    if total is None or total < 1 or (total // ctx.tp if ctx.tp <= total else 1) != per_rank:
        if per_rank == 1 and ctx.tp > 1:
            raise VLLMConfigError(f"{where}: the draft model's layers hold 1 KV head per rank at tp={ctx.tp}: split "
                                  "or replicated cannot be told from vLLM's spec (the draft config names no "
                                  "num_key_value_heads that gives it); kvbridge cannot move them")
        total = per_rank * ctx.tp
    return CacheGroup("draft", kind, tuple(layers), dtype, total, int(spec.head_size), None,
                               getattr(spec, "sliding_window", None) if kind == "sliding_window" else None)


def _attention_group(ctx: _Ctx, name: str, layers: tuple[int, ...], spec: KVCacheSpec, hg: CacheGroup,
                     kind: GroupKind, where: str) -> _Built:
    """Full or sliding-window attention: K and V per token and KV head (packed), or one unit per block
    and head (vLLM's CPU backend form)."""
    dtype = _torch_dtype_name(getattr(spec, "dtype", hg.dtype))
    hs, hsv = int(spec.head_size), int(getattr(spec, "head_size_v", spec.head_size) or spec.head_size)
    if hs != hg.head_dim:
        raise VLLMConfigError(f"{where}: vLLM head_size {hs}, the model's config {hg.head_dim}")
    window = getattr(spec, "sliding_window", None) if kind == "sliding_window" else None
    if ctx.content == "kv_blocks":  # one unit per block and head: K^T [D][N] | V [N][D]
        if hsv != hs:
            raise VLLMConfigError(f"{where}: the CPU backend form needs head_size_v == head_size")
        n = int(spec.block_size)
        g = CacheGroup(name, kind, layers, dtype, hg.num_heads, hs * n, None,
                                (-(-window // n) + 1) if window else None)
        block_size = 1
    else:
        g = CacheGroup(name, kind, layers, dtype, hg.num_heads, hs, hsv if hsv != hs else None, window)
        block_size = int(spec.block_size)
    want = g.components[0].units_per_rank(ctx.tp)
    if int(spec.num_kv_heads) != want:
        raise VLLMConfigError(f"{where}: vLLM holds {spec.num_kv_heads} KV heads per rank; {hg.num_heads} KV "
                              f"heads at tp={ctx.tp} give {want} per rank in kvbridge")

    def view(lname: str, t: Tensor) -> LayerMemory:
        if ctx.content == "kv_blocks":
            B, H, N, C = tuple(t.shape)  # a block of a head: K^T (N*D elements), then V (N*D): one "token"
            return kvbridge.LayerKV(t.view(B, 1, H, 2, N * C // 2), "BTHKD")
        return kvbridge.LayerKV(t, "BHNC")

    return _Built(g, block_size, view)


def _mla_group(ctx: _Ctx, name: str, layers: tuple[int, ...], spec: KVCacheSpec, hg: CacheGroup, kind: GroupKind,
               where: str) -> _Built:
    """MLA: one latent vector per token, replicated on every TP rank."""
    dtype = _torch_dtype_name(getattr(spec, "dtype", hg.dtype))
    g = CacheGroup(name, "mla", layers, dtype, None, int(spec.head_size))
    return _Built(g, int(spec.block_size), lambda lname, t: kvbridge.LayerKV(t, "BHNC"))


def _mamba_group(ctx: _Ctx, name: str, layers: tuple[int, ...], spec: KVCacheSpec, hg: CacheGroup,
                 kind: GroupKind, where: str) -> _Built:
    """kvbridge's Mamba group for one vLLM ``MambaSpec`` group, and a function cutting one layer's raw
    ``int8 [B, 1, 1, page]`` view into a :class:`~kvbridge.LayerState`.

    The state shapes come from the model's config (kvbridge's importer: heads, head_dim, d_state,
    n_groups, conv kernel), the dtypes from vLLM's spec (conv: ``mamba_cache_dtype``, ssm:
    ``mamba_ssm_cache_dtype``, what vLLM allocated); vLLM's per-rank ``spec.shapes`` and the tensors are
    checked against them. In a page vLLM stores the conv state at byte 0, then the ssm state
    (``MambaBase.bind_kv_cache``), the page padded to ``page_size_padded`` (the tensor's block stride).
    kvbridge needs the conv state channel-major (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT=DS``): in the default
    "SD" layout one rank's channels of a head are not contiguous."""
    m, tp = hg.mamba, ctx.tp
    mtype = str(getattr(getattr(spec, "mamba_type", None), "name", getattr(spec, "mamba_type", ""))).lower()
    if m is None or mtype not in ("mamba1", "mamba2"):
        raise VLLMConfigError(f"{where}: vLLM caches {mtype or 'unknown'} state; kvbridge moves Mamba-1/Mamba-2 "
                              "conv + ssm state only")
    if (m.n_groups > 0) != (mtype == "mamba2"):
        raise VLLMConfigError(f"{where}: vLLM says {mtype}, the model's config describes "
                              f"{'Mamba-2 (n_groups > 0)' if m.n_groups else 'Mamba-1 (no B/C groups)'}")
    shapes, dtypes = [tuple(int(x) for x in s) for s in spec.shapes], list(spec.dtypes)
    if len(shapes) != 2 or len(dtypes) != 2:
        raise VLLMConfigError(f"{where}: vLLM caches {len(shapes)} state tensors per Mamba layer; kvbridge moves "
                              "conv + ssm (2); ReplaySSM ring buffers are not supported")
    if getattr(spec, "tp_replicated", False):
        raise VLLMConfigError(f"{where}: a TP-replicated Mamba state is not supported (kvbridge splits the heads)")
    conv_dt, ssm_dt = _torch_dtype_name(dtypes[0]), _torch_dtype_name(dtypes[1])
    _check_state_dtypes(where, ctx.cache_config, conv_dt, ssm_dt)
    g = CacheGroup(name, "mamba", layers, conv_dt, mamba=MambaSpec(
        m.num_heads, m.head_dim, m.d_state, m.conv_kernel, m.n_groups, ssm_dt))
    comps = {c.name: c for c in g.components}
    heads = comps["conv_x"].units_per_rank(tp)
    ngroups = comps["conv_b"].units_per_rank(tp) if "conv_b" in comps else 0
    channels, k1 = heads * m.head_dim + 2 * ngroups * m.d_state, m.conv_kernel - 1
    conv_shape, ssm_shape = shapes
    if conv_shape != (channels, k1):
        _refuse_conv_shape(where, conv_shape, channels, k1, tp, heads, m, ngroups)
    ssm_heads = comps["ssm"].units_per_rank(tp)
    ok = (ssm_heads, m.head_dim, m.d_state)
    if ssm_shape != ok and not (m.head_dim == 1 and ssm_shape == (ssm_heads, m.d_state)):
        raise VLLMConfigError(f"{where}: vLLM's ssm state per rank is {ssm_shape}; the model's config at tp={tp} "
                              f"gives {ok} (heads, head_dim, d_state)")
    conv_b = math.prod(conv_shape) * dtype_size(conv_dt)
    ssm_b = math.prod(ssm_shape) * dtype_size(ssm_dt)
    cdt, sdt = dtypes[0], dtypes[1]

    def view(lname: str, t: Tensor) -> LayerMemory:
        import torch

        if t.dim() != 4 or tuple(t.shape[1:3]) != (1, 1) or t.dtype != torch.int8:
            raise VLLMConfigError(f"Mamba layer {lname!r}: expected vLLM's raw int8 [blocks, 1, 1, page] view, got "
                                  f"{t.dtype} {tuple(t.shape)}")
        if int(t.shape[3]) != conv_b + ssm_b:
            raise VLLMConfigError(
                f"Mamba layer {lname!r}: a page holds {int(t.shape[3])} B of state, conv {conv_shape} "
                f"{conv_dt} + ssm {ssm_shape} {ssm_dt} make {conv_b} + {ssm_b} B"
            )
        pages = t[:, 0, 0, :]
        conv = pages[:, :conv_b].view(cdt).unflatten(1, (channels, k1))
        ssm = pages[:, conv_b:conv_b + ssm_b].view(sdt).unflatten(1, ok)
        return kvbridge.LayerState(conv, ssm)  # axes BCW (channel-major), BHPS

    return _Built(g, int(spec.block_size), view)


def _check_state_dtypes(where: str, cache_config: CacheConfig, conv_dt: str, ssm_dt: str) -> None:
    for what, dt, cfg in (("conv", conv_dt, "mamba_cache_dtype"), ("ssm", ssm_dt, "mamba_ssm_cache_dtype")):
        want = str(getattr(cache_config, cfg, "auto") or "auto")
        if want != "auto" and _torch_dtype_name(want) != dt:
            raise VLLMConfigError(f"{where}: the {what} state is {dt} in vLLM's spec, cache_config.{cfg}={want!r}")
        try:
            dtype_size(dt)
        except Exception:  # noqa: BLE001
            raise VLLMConfigError(f"{where}: unsupported {what} state dtype {dt}") from None


def _refuse_conv_shape(where: str, conv_shape: tuple[int, ...], channels: int, k1: int, tp: int, heads: int,
                       m: MambaSpec, ngroups: int) -> NoReturn:
    if len(conv_shape) == 2 and conv_shape[1] == channels and conv_shape[0] >= k1:
        raise VLLMConfigError(f"{where}: the conv state is stored {conv_shape} = (window, channels) (vLLM's "
                              "default 'SD' layout), where one rank's channels of a head are not contiguous; "
                              "start both engines with VLLM_SSM_CONV_STATE_LAYOUT=DS (vLLM's NixlConnector "
                              "needs it too)")
    if len(conv_shape) == 2 and conv_shape[0] == channels and conv_shape[1] > k1:
        raise VLLMConfigError(f"{where}: the conv state keeps {conv_shape[1]} steps (conv_kernel-1 plus "
                              "speculative tokens); kvbridge moves conv_kernel-1 steps only")
    raise VLLMConfigError(f"{where}: vLLM's conv state per rank is {conv_shape}; the model's config at tp={tp} "
                          f"gives ({channels}, {k1}) = ({heads} heads x {m.head_dim} + 2 x {ngroups} groups x "
                          f"{m.d_state}, conv_kernel-1)")


# one builder per kvbridge group kind (vLLM spec kind)
_BUILDERS = {"full_attention": _attention_group, "sliding_window": _attention_group, "mla": _mla_group,
             "mamba": _mamba_group}


def _kv_shape(spec: KVCacheSpec) -> tuple[object, ...]:
    return (type(spec).__name__, getattr(spec, "num_kv_heads", None), getattr(spec, "head_size", None),
            getattr(spec, "head_size_v", None), str(getattr(spec, "dtype", "")), getattr(spec, "sliding_window", None),
            getattr(spec, "block_size", None))


def _split_drafts(ctx: _Ctx, vg: KVCacheGroup, where: str) -> list[tuple[list[str], KVCacheSpec]]:
    """vLLM group ``vg``'s layers as [(layer names, spec)]: one part, or two when draft layers have another KV
    shape than the target layers they share the group with (vLLM puts layers of one kind and any shape in
    one group, a ``UniformTypeKVCacheSpecs``): the target's part, then the draft's."""
    names = list(vg.layer_names)
    per_layer = getattr(vg.kv_cache_spec, "kv_cache_specs", None) or {}
    spec = layer_spec(vg)
    if not per_layer:
        return [(names, spec)]
    target = [n for n in names if ctx.layer(n) in ctx.kind_of]
    shapes = {_kv_shape(per_layer[n]) for n in target}
    if len(shapes) != 1:
        return [(names, per_layer[target[0]] if target else spec)]
    (shape,) = shapes
    own = [n for n in names if n not in target and _kv_shape(per_layer[n]) != shape]
    if not own:
        return [(names, per_layer[target[0]])]
    if len({_kv_shape(per_layer[n]) for n in own}) != 1:
        raise VLLMConfigError(f"{where}: the draft model's layers {own[:4]} have several KV shapes in one vLLM "
                              "group; kvbridge moves draft layers of one shape per group")
    return [([n for n in names if n not in own], per_layer[target[0]]), (own, per_layer[own[0]])]


def _translate_group(ctx: _Ctx, i: int, vg: KVCacheGroup) -> list[_Built]:
    """kvbridge's groups for vLLM group ``i``: ``g{i}``, and ``g{i}-draft`` for draft layers of another shape
    (same block ids)."""
    spec = layer_spec(vg)
    where = f"vLLM KV-cache group {i} ({type(spec).__name__}, layers {list(vg.layer_names)[:3]}...)"
    kind = spec_kind(spec, where)
    out = []
    for part, (names, pspec) in enumerate(_split_drafts(ctx, vg, where)):
        layers, hg = _model_layers(ctx, names, pspec, kind, where)
        b = _BUILDERS[kind](ctx, f"g{i}" + (DRAFT_GROUP_SUFFIX if part else ""), layers, pspec, hg, kind, where)
        b.layer_names = tuple(names)
        out.append(b)
    return out


def _memory_layout(cache_config: CacheConfig, kv_cache_config: KVCacheConfig) -> kvbridge.MemoryLayout:
    layout = str(getattr(cache_config, "kv_cache_layout", "") or getattr(kv_cache_config, "kv_cache_layout", "") or "")
    try:
        return kvbridge.MemoryLayout.parse(layout.rsplit(".", 1)[-1])
    except Exception:  # noqa: BLE001 - informative only: the tensors say where the bytes are
        return kvbridge.MemoryLayout()


def _pp_layers(num_layers: int, pp: int) -> tuple[tuple[int, int], ...] | None:
    try:
        from vllm.distributed.utils import get_pp_indices
        return tuple(tuple(get_pp_indices(num_layers, r, pp)) for r in range(pp))
    except Exception:  # noqa: BLE001
        return None


def _layer_memory(ctx: _Ctx, built: list[_Built], engine: kvbridge.EngineLayout, kv_caches: dict[str, Tensor],
                  rank: tuple[int, int]) -> dict[int, LayerMemory]:
    """{model layer: LayerKV / LayerState} for the tensors of ``register_kv_caches``."""
    by_name = {n: b for b in built for n in b.layer_names}
    layers: dict[int, LayerMemory] = {}
    for lname, t in kv_caches.items():
        if lname not in by_name:
            continue  # a layer vLLM does not transfer (no group)
        li = ctx.layer(lname)
        if li in layers:
            raise VLLMConfigError(f"two vLLM layers map to model layer {li}: {lname!r}")
        if tuple(t.shape)[0] < engine.num_blocks:
            raise VLLMConfigError(f"layer {lname!r}: tensor has {tuple(t.shape)[0]} blocks, KVCacheConfig.num_blocks="
                                  f"{engine.num_blocks}")
        layers[li] = by_name[lname].view(lname, t)
    missing = [x for b in built for x in engine.stage_layers(b.group, rank[0]) if x not in layers]
    if missing:
        raise VLLMConfigError(f"register_kv_caches got no tensor for layers {missing[:8]} of this stage")
    return layers


def _check_block_granular(ctx: _Ctx) -> None:
    sizes = {int(layer_spec(vg).block_size) for vg in ctx.vgroups if not is_mamba(vg)}
    if ctx.content == "kv_blocks" and len(sizes) > 1:
        raise VLLMConfigError("the CPU backend form moves whole blocks: all KV-cache groups need one block size")


def engine_from_vllm(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, kv_caches: dict[str, Tensor],
                     rank: tuple[int, int]) -> tuple[kvbridge.EngineLayout, list[str], dict[int, LayerMemory]]:
    """kvbridge's :class:`~kvbridge.EngineLayout`, group names and per-layer memory description of one vLLM
    worker, from what vLLM gives a connector: the model's Hugging Face config (kvbridge's importer), TP/PP,
    the ``KVCacheConfig`` groups and specs (block size per group) and the ``register_kv_caches`` tensors,
    cross-checked; :class:`VLLMConfigError` names what disagrees.

    One kvbridge group per vLLM KV-cache group (``g0``, ``g1``, ... in vLLM's order, with the layers of the
    whole model), so block-id lists map one to one; draft layers whose KV shape differs from the target
    layers of their vLLM group get their own kvbridge group ``g{i}-draft`` on that group's block ids
    (:func:`block_sources`). Returns ``(engine, group_names, {layer: LayerKV})``, ``group_names[i]`` the
    kvbridge group of vLLM group ``i``'s target layers.
    """
    if kv_cache_config is None:
        raise VLLMConfigError("the connector got no KVCacheConfig (vLLM >= 0.32 passes one to the constructor)")
    cc = vllm_config.cache_config
    hf_model = from_hf_config(_hf_dict(vllm_config.model_config.hf_config))
    vgroups = list(kv_cache_config.kv_cache_groups)
    ctx = _context(vllm_config, hf_model, vgroups)
    per_vgroup = [_translate_group(ctx, i, vg) for i, vg in enumerate(vgroups)]
    built = [b for bs in per_vgroup for b in bs]
    _check_block_granular(ctx)
    # draft-model layers (speculative decoding) extend the model past the config's layers (PP 1)
    num_layers = max([hf_model.num_layers] + [x + 1 for b in built for x in b.group.layers])
    model = kvbridge.ModelSpec(hf_model.name, num_layers, tuple(b.group for b in built))
    engine = kvbridge.EngineLayout(model, tp=ctx.tp, pp=ctx.pp, block_size=int(cc.block_size),
                                   memory=_memory_layout(cc, kv_cache_config),
                                   pp_layers=_pp_layers(hf_model.num_layers, ctx.pp) if ctx.pp > 1 else None,
                                   num_blocks=int(kv_cache_config.num_blocks),
                                   group_block_sizes=tuple((b.group.name, b.block_size) for b in built))
    return engine, [bs[0].group.name for bs in per_vgroup], _layer_memory(ctx, built, engine, kv_caches, rank)


def _context(vllm_config: VllmConfig, hf_model: kvbridge.ModelSpec, vgroups: list[KVCacheGroup]) -> _Ctx:
    """The translation's context: the model, its layer -> group map, TP/PP, the KV content form, vLLM's groups
    and the speculative-decoding facts the groups depend on."""
    pc = vllm_config.parallel_config
    return _Ctx(hf_model, {x: g for g in hf_model.groups for x in g.layers}, pc.tensor_parallel_size,
                pc.pipeline_parallel_size, kv_content_form(vllm_config), vgroups, vllm_config.cache_config,
                speculative=speculative_fingerprint(vllm_config) is not None,
                draft_kv_heads=_draft_kv_heads(vllm_config))


def _draft_kv_heads(vllm_config: VllmConfig) -> int | None:
    """The draft model's KV heads as its config says (``num_key_value_heads``), or None."""
    sc = getattr(vllm_config, "speculative_config", None)
    hf = getattr(getattr(sc, "draft_model_config", None), "hf_config", None) if sc is not None else None
    if hf is None:
        return None
    n = hf.get("num_key_value_heads") if isinstance(hf, dict) else getattr(hf, "num_key_value_heads", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def token_granule(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, engine: kvbridge.EngineLayout) -> int:
    """Tokens per kvbridge "token": the attention block size in vLLM's CPU backend form (whole blocks move),
    else 1."""
    if kv_content_form(vllm_config) == "kv_blocks" and any(g.kind not in ("mla", "mamba")
                                                           for g in engine.model.groups):
        return next(int(layer_spec(vg).block_size) for vg in kv_cache_config.kv_cache_groups if not is_mamba(vg))
    return 1
