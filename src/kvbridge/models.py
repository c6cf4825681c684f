"""Model descriptions: built-in presets and an importer for Hugging Face ``config.json`` files.

Every :class:`ModelSpec` here is built by :func:`_build_spec` from a per-layer list of cache kinds,
so a preset and the import of the matching ``config.json`` produce identical groups (same names,
order, layers, heads and dims). Groups are ordered by their first layer. Group names:

* ``"full"`` / ``"sliding"``: full / sliding-window attention (``"attn"`` for the attention layers of
  a Mamba hybrid, ``"sliding"`` if those use a window);
* ``"mla"``: multi-head latent attention (one latent vector of ``kv_lora_rank + qk_rope_head_dim``);
* ``"mamba"``: Mamba state (Mamba-2: heads x head_dim; Mamba-1: d_inner channels, head_dim 1).

Facts not modelled (they do not change the group shapes): the KV-cache dtype is the model's compute
dtype (``torch_dtype``/``dtype``), not a quantized KV-cache scheme from ``quantization_config``;
Gemma-4's ``attention_k_eq_v`` is ignored (K and V are both cached).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Final, Mapping, Sequence

from .errors import ConfigImportError, LayoutError
from .layout import DTYPE_SIZES, CacheGroup, MambaSpec, ModelSpec

FULL: Final = "full_attention"
SLIDING: Final = "sliding_window"
MLA: Final = "mla"
MAMBA: Final = "mamba"


# --------------------------------------------------------------------------------------------------
# Shared builder
# --------------------------------------------------------------------------------------------------

def _build_spec(name: str, kinds: Sequence[str | None], *, dtype: str = "bfloat16",
                num_kv_heads: int | None = None, head_dim: int = 0,
                sliding_window: int | None = None,
                full_kv_heads: int | None = None, full_head_dim: int | None = None,
                mla_dim: int = 0, mamba: MambaSpec | None = None) -> ModelSpec:
    """Build a ModelSpec from one cache kind per layer (``None``: the layer caches nothing).

    ``full_kv_heads``/``full_head_dim`` override the attention shape of full-attention layers
    (Gemma-4 global layers); they default to ``num_kv_heads``/``head_dim``.
    """
    hybrid = MAMBA in kinds
    layers: dict[str, list[int]] = {}
    for i, k in enumerate(kinds):
        if k is not None:
            layers.setdefault(k, []).append(i)
    groups: list[CacheGroup] = []
    for kind, ls in layers.items():
        lt = tuple(ls)
        if kind == FULL:
            groups.append(CacheGroup("attn" if hybrid else "full", FULL, lt, dtype,
                                     num_heads=full_kv_heads or num_kv_heads,
                                     head_dim=full_head_dim or head_dim))
        elif kind == SLIDING:
            groups.append(CacheGroup("sliding", SLIDING, lt, dtype, num_heads=num_kv_heads,
                                     head_dim=head_dim, sliding_window=sliding_window))
        elif kind == MLA:
            groups.append(CacheGroup("mla", MLA, lt, dtype, num_heads=None, head_dim=mla_dim))
        elif kind == MAMBA:
            groups.append(CacheGroup("mamba", MAMBA, lt, dtype, mamba=mamba))
        else:  # pragma: no cover - internal misuse
            raise LayoutError(f"internal: unknown layer kind {kind!r}")
    groups.sort(key=lambda g: g.layers[0])
    return ModelSpec(name, len(kinds), tuple(groups))


def _every_nth_full(num_layers: int, period: int) -> list[str]:
    """Gemma-3 style: ``period - 1`` sliding layers, then one full layer ((i+1) % period == 0)."""
    return [FULL if (i + 1) % period == 0 else SLIDING for i in range(num_layers)]


def _alternating(num_layers: int) -> list[str]:
    """Sliding at even layers, full at odd layers (gpt-oss, Gemma-2)."""
    return [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]


def _at(num_layers: int, special: set[int] | Sequence[int], special_kind: str, other_kind: str) -> list[str]:
    s = set(special)
    return [special_kind if i in s else other_kind for i in range(num_layers)]


# --------------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------------

def _nemotron_h_56b() -> ModelSpec:
    # hybrid_override_pattern of nvidia/Nemotron-H-56B-Base-8K (118 layers: 54 M, 10 *, 54 -).
    pattern = ("M-M-M-M*-" + "M-M-M-M-M*-" * 9 + "M-M-M-M-M-")
    kinds = [{"M": MAMBA, "*": FULL, "-": None}[c] for c in pattern]
    return _build_spec("nemotron-h-56b", kinds, num_kv_heads=8, head_dim=128,
                       mamba=MambaSpec(num_heads=256, head_dim=64, d_state=256, conv_kernel=4,
                                       n_groups=8, ssm_dtype="float32"))


_PRESET_TABLE: dict[str, tuple[str, Callable[[], ModelSpec]]] = {
    "llama-3.1-8b": (
        "Llama 3.1 8B: 32 full-attention layers, 8 KV heads x 128, bf16",
        lambda: _build_spec("llama-3.1-8b", [FULL] * 32, num_kv_heads=8, head_dim=128)),
    "llama-3.1-70b": (
        "Llama 3.1 70B: 80 full-attention layers, 8 KV heads x 128, bf16",
        lambda: _build_spec("llama-3.1-70b", [FULL] * 80, num_kv_heads=8, head_dim=128)),
    "qwen3-32b": (
        "Qwen3 32B: 64 full-attention layers, 8 KV heads x 128, bf16",
        lambda: _build_spec("qwen3-32b", [FULL] * 64, num_kv_heads=8, head_dim=128)),
    "deepseek-v3": (
        "DeepSeek-V3: 61 MLA layers, latent 512+64=576 per token, bf16 (MTP layer not included)",
        lambda: _build_spec("deepseek-v3", [MLA] * 61, mla_dim=512 + 64)),
    "gemma-3-27b": (
        "Gemma 3 27B: 62 layers, 5 sliding (window 1024) then 1 full, 16 KV heads x 128, bf16",
        lambda: _build_spec("gemma-3-27b", _every_nth_full(62, 6), num_kv_heads=16, head_dim=128,
                            sliding_window=1024)),
    "gemma-4-31b": (
        "Gemma 4 31B: 60 layers; sliding 16 KV heads x 256 (window 1024), full 4 KV heads x 512, bf16",
        lambda: _build_spec("gemma-4-31b", _every_nth_full(60, 6), num_kv_heads=16, head_dim=256,
                            sliding_window=1024, full_kv_heads=4, full_head_dim=512)),
    "gemma-4-mini": (
        "Small Gemma-4-style demo model: 6 layers, full at 2,5 (2 KV heads x 64), sliding 8 x 32 (window 64)",
        lambda: _build_spec("gemma-4-mini", _at(6, {2, 5}, FULL, SLIDING), num_kv_heads=8, head_dim=32,
                            sliding_window=64, full_kv_heads=2, full_head_dim=64)),
    "gpt-oss-120b": (
        "gpt-oss 120B: 36 layers, sliding (window 128) at even / full at odd, 8 KV heads x 64, bf16",
        lambda: _build_spec("gpt-oss-120b", _alternating(36), num_kv_heads=8, head_dim=64,
                            sliding_window=128)),
    "nemotron-h-56b": (
        "Nemotron-H 56B: 118 layers, 54 Mamba-2 (256 heads x 64, state 256, 8 groups), 10 attention (8 x 128)",
        _nemotron_h_56b),
    "jamba-1.5-mini": (
        "Jamba 1.5 Mini: 32 layers, attention (8 KV heads x 128) at i%8==4, Mamba-1 (d_inner 8192, state 16)",
        lambda: _build_spec("jamba-1.5-mini", [FULL if i % 8 == 4 else MAMBA for i in range(32)],
                            num_kv_heads=8, head_dim=128,
                            mamba=MambaSpec(num_heads=8192, head_dim=1, d_state=16, conv_kernel=4,
                                            n_groups=0))),
    "tiny-dense": (
        "Tiny test model: 4 full-attention layers, 4 KV heads x 16, bf16",
        lambda: _build_spec("tiny-dense", [FULL] * 4, num_kv_heads=4, head_dim=16)),
    "tiny-mla": (
        "Tiny test model: 3 MLA layers, latent 24, bf16",
        lambda: _build_spec("tiny-mla", [MLA] * 3, mla_dim=24)),
    "tiny-hybrid": (
        "Tiny test model: 6 layers, attention (2 KV heads x 16) at 2,5, Mamba-2 (8 heads x 4, 2 groups) elsewhere",
        lambda: _build_spec("tiny-hybrid", _at(6, {2, 5}, FULL, MAMBA), num_kv_heads=2, head_dim=16,
                            mamba=MambaSpec(num_heads=8, head_dim=4, d_state=8, conv_kernel=4, n_groups=2,
                                            ssm_dtype="float32"))),
}

PRESETS: dict[str, Callable[[], ModelSpec]] = {k: v[1] for k, v in _PRESET_TABLE.items()}


def list_presets() -> list[tuple[str, str]]:
    """``(name, one-line description)`` of every preset."""
    return [(k, v[0]) for k, v in _PRESET_TABLE.items()]


def preset(name: str) -> ModelSpec:
    """The preset model ``name``; :class:`LayoutError` listing the valid names if unknown."""
    try:
        factory = PRESETS[name]
    except (KeyError, TypeError):
        raise LayoutError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}") from None
    return factory()


# --------------------------------------------------------------------------------------------------
# Hugging Face config.json import
# --------------------------------------------------------------------------------------------------

_NESTED_KEYS = ("text_config", "llm_config", "language_config")
_LAYER_TYPES = {"full_attention": FULL, "sliding_attention": SLIDING}
_NEMOTRON_CHARS = {"M": MAMBA, "*": FULL, "-": None, "E": None}


def _fail(where: str, msg: str) -> ConfigImportError:
    return ConfigImportError(f"{where}: {msg}")


def _get_int(cfg: Mapping[str, Any], key: str, where: str, *, what: str = "") -> int:
    v = cfg.get(key)
    if v is None:
        raise _fail(where, f"missing key {key!r}{what}; add it to the config or use a preset "
                           f"(kvbridge.models.list_presets())")
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _fail(where, f"key {key!r} must be a non-negative integer, got {v!r}")
    return v


def _opt_int(cfg: Mapping[str, Any], key: str, where: str) -> int | None:
    return None if cfg.get(key) is None else _get_int(cfg, key, where)


def _load(path_or_dict: Any) -> tuple[dict[str, Any], Path | None]:
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict), None
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise ConfigImportError(f"from_hf_config needs a path to a config.json or a dict, "
                                f"got {type(path_or_dict).__name__}")
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigImportError(f"cannot read Hugging Face config {str(path)!r}: {e.strerror or e}; "
                                f"pass the path of an existing config.json") from None
    try:
        cfg = json.loads(text)  # accepts the non-standard Infinity/NaN literals some configs carry
    except json.JSONDecodeError as e:
        raise ConfigImportError(f"{str(path)!r} is not valid JSON ({e}); pass a Hugging Face config.json") from None
    if not isinstance(cfg, dict):
        raise ConfigImportError(f"{str(path)!r} must hold a JSON object, got {type(cfg).__name__}")
    return cfg, path


def _default_name(cfg: Mapping[str, Any], path: Path | None) -> str:
    if path is not None:
        if path.stem != "config":
            return path.stem
        if cfg.get("_name_or_path"):
            return str(cfg["_name_or_path"])
        if path.parent.name:
            return path.parent.name
    if cfg.get("_name_or_path"):
        return str(cfg["_name_or_path"])
    return str(cfg.get("model_type") or "model")


def _dtype(text: Mapping[str, Any], top: Mapping[str, Any], where: str) -> str:
    for c in (text, top):
        for key in ("torch_dtype", "dtype"):
            v = c.get(key)
            if v is None:
                continue
            d = str(v).removeprefix("torch.")
            if d not in DTYPE_SIZES:
                raise _fail(where, f"unsupported {key}={v!r}; expected one of {sorted(DTYPE_SIZES)} "
                                   f"(edit the config or use a preset)")
            return d
    return "bfloat16"


def _attn_shape(cfg: Mapping[str, Any], where: str) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of the attention layers."""
    q = _get_int(cfg, "num_attention_heads", where)
    if q < 1:
        raise _fail(where, f"num_attention_heads must be >= 1, got {q}")
    kv = _opt_int(cfg, "num_key_value_heads", where) or q
    hd = _opt_int(cfg, "head_dim", where) or _opt_int(cfg, "attention_head_dim", where)
    if not hd:
        hidden = _get_int(cfg, "hidden_size", where, what=" (needed for head_dim = hidden_size // "
                                                          "num_attention_heads when 'head_dim' is absent)")
        if hidden % q:
            raise _fail(where, f"no 'head_dim' and hidden_size={hidden} is not a multiple of "
                               f"num_attention_heads={q}; add 'head_dim' to the config")
        hd = hidden // q
    return kv, hd


def _window(cfg: Mapping[str, Any], where: str) -> int:
    w = cfg.get("sliding_window")
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise _fail(where, f"sliding-window layers need a positive integer 'sliding_window', got {w!r}")
    return w


def _mamba_key_error(where: str, key: str, model: str) -> ConfigImportError:
    return _fail(where, f"missing key {key!r} needed for the {model} Mamba state shape; add it or use a preset")


def from_hf_config(path_or_dict: Any, name: str | None = None) -> ModelSpec:
    """Turn a Hugging Face ``config.json`` (path, directory holding one, or dict) into a ModelSpec.

    Raises :class:`ConfigImportError` naming the missing/unsupported key when the cache layout cannot
    be derived.
    """
    top, path = _load(path_or_dict)
    name = name or _default_name(top, path)
    where = f"config {str(path) if path else name!r}"
    text = top
    for key in _NESTED_KEYS:
        if isinstance(top.get(key), Mapping):
            text = dict(top[key])
            break
    dtype = _dtype(text, top, where)
    num_layers = _get_int(text, "num_hidden_layers", where)
    if num_layers < 1:
        raise _fail(where, f"num_hidden_layers must be >= 1, got {num_layers}")
    model_type = str(text.get("model_type") or top.get("model_type") or "")

    if text.get("num_kv_shared_layers"):
        raise _fail(where, f"num_kv_shared_layers={text['num_kv_shared_layers']} (layers reusing another "
                           f"layer's KV cache) is not supported; describe the model with a ModelSpec")
    if text.get("attention_chunk_size"):
        raise _fail(where, "attention_chunk_size (chunked local attention, e.g. Llama 4) is not supported; "
                           "describe the model with a ModelSpec")

    if text.get("hybrid_override_pattern") is not None:
        return _nemotron_h(name, text, num_layers, where, dtype)
    if text.get("attn_layer_period") is not None or text.get("attn_layer_offset") is not None:
        return _jamba(name, text, num_layers, where, dtype)
    if text.get("kv_lora_rank") is not None:
        return _mla(name, text, num_layers, where, dtype)
    _refuse_other_state_space(text, model_type, where)

    # --- Attention models -------------------------------------------------------------------------
    kv, hd = _attn_shape(text, where)
    kinds = _attention_kinds(text, num_layers, model_type, where)
    window = _window(text, where) if SLIDING in kinds else None
    return _build_spec(name, kinds, dtype=dtype, num_kv_heads=kv, head_dim=hd, sliding_window=window,
                       full_kv_heads=_opt_int(text, "num_global_key_value_heads", where),
                       full_head_dim=_opt_int(text, "global_head_dim", where))


def _nemotron_h(name: str, text: Mapping[str, Any], num_layers: int, where: str, dtype: str) -> ModelSpec:
    """Nemotron-H: ``hybrid_override_pattern``, one character per layer, Mamba-2 state."""
    pat = text["hybrid_override_pattern"]
    if not isinstance(pat, str) or len(pat) != num_layers:
        raise _fail(where, f"hybrid_override_pattern must be a string of num_hidden_layers={num_layers} "
                           f"characters, got {len(pat) if isinstance(pat, str) else pat!r}")
    bad = sorted(set(pat) - set(_NEMOTRON_CHARS))
    if bad:
        raise _fail(where, f"hybrid_override_pattern has unsupported layer codes {bad}; supported: "
                           f"'M' Mamba-2, '*' attention, '-' MLP, 'E' MoE")
    kinds: list[str | None] = [_NEMOTRON_CHARS[c] for c in pat]
    mamba = None
    if MAMBA in kinds:
        for k in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "conv_kernel", "n_groups"):
            if text.get(k) is None:
                raise _mamba_key_error(where, k, "Nemotron-H (Mamba-2)")
        mamba = MambaSpec(num_heads=_get_int(text, "mamba_num_heads", where),
                          head_dim=_get_int(text, "mamba_head_dim", where),
                          d_state=_get_int(text, "ssm_state_size", where),
                          conv_kernel=_get_int(text, "conv_kernel", where),
                          n_groups=_get_int(text, "n_groups", where),
                          ssm_dtype=_ssm_dtype(text, where))
    return _hybrid(name, kinds, text, where, dtype, mamba)


def _jamba(name: str, text: Mapping[str, Any], num_layers: int, where: str, dtype: str) -> ModelSpec:
    """Jamba: ``attn_layer_period`` / ``attn_layer_offset`` attention layers, Mamba-1 elsewhere."""
    period = _get_int(text, "attn_layer_period", where)
    offset = _get_int(text, "attn_layer_offset", where)
    if period < 1:
        raise _fail(where, f"attn_layer_period must be >= 1, got {period}")
    kinds: list[str | None] = [FULL if i % period == offset else MAMBA for i in range(num_layers)]
    mamba = None
    if MAMBA in kinds:
        for k in ("mamba_d_state", "mamba_d_conv", "mamba_expand", "hidden_size"):
            if text.get(k) is None:
                raise _mamba_key_error(where, k, "Jamba (Mamba-1)")
        mamba = MambaSpec(num_heads=_get_int(text, "mamba_expand", where) * _get_int(text, "hidden_size", where),
                          head_dim=1, d_state=_get_int(text, "mamba_d_state", where),
                          conv_kernel=_get_int(text, "mamba_d_conv", where), n_groups=0,
                          ssm_dtype=_ssm_dtype(text, where))
    return _hybrid(name, kinds, text, where, dtype, mamba)


def _mla(name: str, text: Mapping[str, Any], num_layers: int, where: str, dtype: str) -> ModelSpec:
    """MLA (DeepSeek-V2/V3, Kimi-K2, ...): one latent of ``kv_lora_rank + qk_rope_head_dim`` per token."""
    if text.get("index_topk") is not None:
        raise _fail(where, "index_topk (DeepSeek sparse-attention indexer cache) is not supported; "
                           "describe the model with a ModelSpec")
    rank = _get_int(text, "kv_lora_rank", where)
    rope = _get_int(text, "qk_rope_head_dim", where, what=" (MLA caches kv_lora_rank + qk_rope_head_dim)")
    # num_nextn_predict_layers (MTP) are not part of num_hidden_layers and are ignored.
    return _build_spec(name, [MLA] * num_layers, dtype=dtype, mla_dim=rank + rope)


def _refuse_other_state_space(text: Mapping[str, Any], model_type: str, where: str) -> None:
    """Anything else with state-space / linear-attention layers is not understood: refused by name."""
    markers = sorted(k for k in text if k.startswith(("mamba", "ssm_", "linear_"))
                     or k in ("layers_block_type", "block_types", "attn_layer_indices"))
    if markers or "mamba" in model_type:
        raise _fail(where, f"model_type {model_type!r} has state-space/linear-attention layers "
                           f"({', '.join(markers) or model_type}) in a form this importer does not support "
                           f"(supported hybrids: Nemotron-H hybrid_override_pattern, Jamba attn_layer_period); "
                           f"use a preset or build a ModelSpec")


def _ssm_dtype(cfg: Mapping[str, Any], where: str) -> str:
    v = cfg.get("mamba_ssm_cache_dtype")
    if v is None or v == "auto":
        return "float32"
    d = str(v).removeprefix("torch.")
    if d not in DTYPE_SIZES:
        raise _fail(where, f"unsupported mamba_ssm_cache_dtype={v!r}; expected one of {sorted(DTYPE_SIZES)}")
    return d


def _hybrid(name: str, kinds: list[str | None], text: Mapping[str, Any], where: str, dtype: str,
            mamba: MambaSpec | None) -> ModelSpec:
    kv = hd = 0
    window = None
    if FULL in kinds:
        kv, hd = _attn_shape(text, where)
        if text.get("sliding_window") is not None:
            window = _window(text, where)
            kinds = [SLIDING if k == FULL else k for k in kinds]
    if not any(kinds):
        raise _fail(where, "no layer caches anything (no attention or Mamba layers)")
    return _build_spec(name, kinds, dtype=dtype, num_kv_heads=kv or None, head_dim=hd,
                       sliding_window=window, mamba=mamba)


def _attention_kinds(text: Mapping[str, Any], num_layers: int, model_type: str, where: str) -> list[str]:
    lt = text.get("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != num_layers:
            raise _fail(where, f"layer_types must be a list of num_hidden_layers={num_layers} entries, "
                               f"got {len(lt) if isinstance(lt, list) else lt!r}")
        bad = sorted({str(t) for t in lt} - set(_LAYER_TYPES))
        if bad:
            raise _fail(where, f"layer_types has unsupported entries {bad}; supported: {sorted(_LAYER_TYPES)}")
        return [_LAYER_TYPES[t] for t in lt]
    pattern = text.get("sliding_window_pattern", text.get("_sliding_window_pattern"))
    if pattern is None and model_type in ("gemma3", "gemma3_text") and text.get("sliding_window"):
        pattern = 6  # transformers' Gemma3 default
    if pattern is not None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise _fail(where, f"sliding_window_pattern must be a positive integer, got {pattern!r}")
        return _every_nth_full(num_layers, pattern)
    if model_type == "gemma2" and text.get("sliding_window"):
        return _alternating(num_layers)
    if text.get("sliding_window") is None or text.get("use_sliding_window") is False:
        return [FULL] * num_layers
    # Mistral/Phi-3 style: every layer uses the window; Qwen2 style: only layers >= max_window_layers.
    mwl = _opt_int(text, "max_window_layers", where) if text.get("use_sliding_window") else None
    if mwl is not None:
        return [SLIDING if i >= mwl else FULL for i in range(num_layers)]
    return [SLIDING] * num_layers


# --------------------------------------------------------------------------------------------------

def load_model(spec: str | os.PathLike[str]) -> ModelSpec:
    """A preset name, or the path of a Hugging Face config.json (or a directory holding one)."""
    if isinstance(spec, str) and spec in PRESETS:
        return preset(spec)
    if isinstance(spec, (str, os.PathLike)) and Path(spec).exists():
        return from_hf_config(spec)
    raise LayoutError(f"unknown model {str(spec)!r}: not a preset ({', '.join(PRESETS)}) "
                      f"and not an existing config.json path")


__all__ = ["PRESETS", "preset", "list_presets", "from_hf_config", "load_model"]
