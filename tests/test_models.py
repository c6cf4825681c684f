"""Model presets and the Hugging Face config.json importer (kvbridge.models)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.errors import ConfigImportError, LayoutError
from kvbridge.layout import CacheGroup, ModelSpec
from kvbridge.models import PRESETS, from_hf_config, list_presets, load_model, preset

DATA = Path(__file__).parent / "data" / "hf_configs"
SHARED = Path("/work/shared/models")

MISTRAL = ModelSpec("mistral-7b-v0.3", 32, (
    CacheGroup("full", "full_attention", tuple(range(32)), "bfloat16", num_heads=8, head_dim=128),))

# config file stem -> preset name (or an explicit expected spec)
EXPECTED: dict[str, str | ModelSpec] = {
    "llama-3.1-8b": "llama-3.1-8b",
    "llama-3.1-70b": "llama-3.1-70b",
    "qwen3-32b": "qwen3-32b",
    "deepseek-v3": "deepseek-v3",
    "gemma-4-31b-it-nvfp4": "gemma-4-31b",
    "gpt-oss-120b": "gpt-oss-120b",
    "nemotron-h-56b-base-8k": "nemotron-h-56b",
    "jamba-1.5-mini": "jamba-1.5-mini",
    "mistral-7b-v0.3": MISTRAL,
}


def _expected(stem: str) -> ModelSpec:
    e = EXPECTED[stem]
    return preset(e) if isinstance(e, str) else e


def _check_same(got: ModelSpec, want: ModelSpec) -> None:
    assert got.num_layers == want.num_layers
    assert got.groups == want.groups  # names, kinds, layers, heads, dims, windows, dtypes, Mamba shapes


# ---------------------------------------------------------------- presets

@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds(name):
    spec = preset(name)
    assert isinstance(spec, ModelSpec) and spec.name == name
    covered = sorted(l for g in spec.groups for l in g.layers)
    assert covered and covered[-1] < spec.num_layers


def test_list_presets_matches_presets():
    listed = list_presets()
    assert [n for n, _ in listed] == list(PRESETS)
    for _, desc in listed:
        assert desc and "\n" not in desc


def test_unknown_preset_lists_valid_names():
    with pytest.raises(LayoutError, match=r"unknown model preset 'llama-9'.*valid presets:.*llama-3\.1-8b"):
        preset("llama-9")


def test_preset_facts():
    ds = preset("deepseek-v3")
    (g,) = ds.groups
    assert (ds.num_layers, g.name, g.kind, g.num_heads, g.head_dim) == (61, "mla", "mla", None, 576)

    g3 = preset("gemma-3-27b")
    assert g3.group("full").layers == tuple(range(5, 62, 6))
    assert g3.group("sliding").sliding_window == 1024
    assert len(g3.group("sliding").layers) == 52

    oss = preset("gpt-oss-120b")
    assert oss.group("sliding").layers == tuple(range(0, 36, 2))
    assert oss.group("full").layers == tuple(range(1, 36, 2))

    jamba = preset("jamba-1.5-mini")
    assert jamba.group("attn").layers == (4, 12, 20, 28)
    assert jamba.group("mamba").mamba.num_heads == 8192

    mini = preset("gemma-4-mini")
    assert mini.group("full").layers == (2, 5)
    assert (mini.group("full").num_heads, mini.group("sliding").num_heads) == (2, 8)

    hyb = preset("tiny-hybrid")
    assert hyb.group("attn").layers == (2, 5) and hyb.group("mamba").layers == (0, 1, 3, 4)


@pytest.mark.parametrize("spec", [preset("gemma-4-31b"), from_hf_config(DATA / "gemma-4-31b-it-nvfp4.json")])
def test_gemma4_groups_have_different_head_counts(spec):
    s, f = spec.group("sliding"), spec.group("full")
    assert (s.num_heads, s.head_dim, s.sliding_window) == (16, 256, 1024)
    assert (f.num_heads, f.head_dim) == (4, 512)
    assert f.layers == tuple(range(5, 60, 6))


@pytest.mark.parametrize("spec", [preset("nemotron-h-56b"), from_hf_config(DATA / "nemotron-h-56b-base-8k.json")])
def test_nemotron_h_layers(spec):
    assert spec.num_layers == 118
    attn = spec.group("attn")
    assert list(attn.layers) == [7, 18, 29, 40, 51, 62, 73, 84, 95, 106]
    assert (attn.kind, attn.num_heads, attn.head_dim) == ("full_attention", 8, 128)
    m = spec.group("mamba")
    assert len(m.layers) == 54
    assert (m.mamba.num_heads, m.mamba.head_dim, m.mamba.d_state, m.mamba.conv_kernel, m.mamba.n_groups,
            m.mamba.ssm_dtype) == (256, 64, 256, 4, 8, "float32")
    assert m.dtype == "bfloat16"


# ---------------------------------------------------------------- real config files

def test_data_dir_has_all_configs():
    assert sorted(p.stem for p in DATA.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("stem", sorted(EXPECTED))
def test_real_config_matches_preset(stem):
    spec = from_hf_config(DATA / f"{stem}.json")
    assert spec.name == stem
    _check_same(spec, _expected(stem))


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} not present (only on the dev machine); "
                                                 f"tests/data/hf_configs copies are tested instead")
@pytest.mark.parametrize("stem", sorted(EXPECTED))
def test_shared_config_matches_preset(stem):
    f = SHARED / f"{stem}.json"
    if not f.exists():
        pytest.skip(f"{f} absent")
    _check_same(from_hf_config(f), _expected(stem))


# ---------------------------------------------------------------- importer features

def _dense(**kw):
    cfg = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 256}
    cfg.update(kw)
    return cfg


def test_defaults_kv_heads_head_dim_dtype_and_name():
    spec = from_hf_config(_dense(_name_or_path="org/m"))
    (g,) = spec.groups
    assert spec.name == "org/m"
    assert (g.name, g.num_heads, g.head_dim, g.dtype) == ("full", 8, 32, "bfloat16")
    spec = from_hf_config(_dense(num_key_value_heads=2, head_dim=64, torch_dtype="float16"), name="x")
    (g,) = spec.groups
    assert (spec.name, g.num_heads, g.head_dim, g.dtype) == ("x", 2, 64, "float16")


def test_config_json_in_directory_named_after_directory(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_dense()))
    assert from_hf_config(d).name == "my-model"
    assert from_hf_config(d / "config.json").name == "my-model"
    assert load_model(str(d / "config.json")).num_layers == 4


def test_sliding_window_without_layer_types_is_all_sliding():
    spec = from_hf_config(_dense(sliding_window=4096))
    (g,) = spec.groups
    assert (g.name, g.kind, g.sliding_window, g.layers) == ("sliding", "sliding_window", 4096, (0, 1, 2, 3))
    # Qwen-style disabled window is ignored
    (g,) = from_hf_config(_dense(sliding_window=4096, use_sliding_window=False)).groups
    assert g.kind == "full_attention"


def test_gemma3_style_pattern_and_text_config():
    cfg = {"model_type": "gemma3", "torch_dtype": "bfloat16",
           "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
                           "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376,
                           "sliding_window": 1024, "sliding_window_pattern": 6}}
    _check_same(from_hf_config(cfg, name="g3"), preset("gemma-3-27b"))


def test_layer_types_builds_groups():
    cfg = _dense(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16)
    spec = from_hf_config(cfg)
    assert spec.group("sliding").layers == (0, 2) and spec.group("full").layers == (1, 3)


def test_tiny_hybrid_roundtrip_via_nemotron_pattern():
    cfg = {"model_type": "nemotron_h", "num_hidden_layers": 6, "hybrid_override_pattern": "MM*MM*",
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 8,
           "mamba_head_dim": 4, "ssm_state_size": 8, "conv_kernel": 4, "n_groups": 2}
    _check_same(from_hf_config(cfg), preset("tiny-hybrid"))


def test_load_model():
    assert load_model("tiny-dense") == preset("tiny-dense")
    _check_same(load_model(str(DATA / "llama-3.1-8b.json")), preset("llama-3.1-8b"))
    with pytest.raises(LayoutError, match=r"unknown model 'nope'.*not a preset.*tiny-dense"):
        load_model("nope")


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("cfg, match", [
    ({"num_attention_heads": 8}, r"missing key 'num_hidden_layers'"),
    ({"num_hidden_layers": 2, "hidden_size": 64}, r"missing key 'num_attention_heads'"),
    ({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 64}, r"add 'head_dim'"),
    (_dense(layer_types=["full_attention", "linear_attention", "full_attention", "full_attention"]),
     r"unsupported entries \['linear_attention'\]"),
    (_dense(layer_types=["full_attention"]), r"layer_types must be a list of num_hidden_layers=4"),
    (_dense(layer_types=["sliding_attention"] * 4), r"positive integer 'sliding_window'"),
    (_dense(torch_dtype="int4"), r"unsupported torch_dtype='int4'"),
    ({"model_type": "deepseek_v3", "num_hidden_layers": 2, "kv_lora_rank": 512},
     r"missing key 'qk_rope_head_dim'.*kv_lora_rank \+ qk_rope_head_dim"),
    ({"model_type": "nemotron_h", "num_hidden_layers": 3, "hybrid_override_pattern": "M*X",
      "num_attention_heads": 2, "head_dim": 8}, r"unsupported layer codes \['X'\]"),
    ({"model_type": "nemotron_h", "num_hidden_layers": 4, "hybrid_override_pattern": "M*"},
     r"hybrid_override_pattern must be a string of num_hidden_layers=4"),
    ({"model_type": "nemotron_h", "num_hidden_layers": 2, "hybrid_override_pattern": "M*",
      "num_attention_heads": 2, "head_dim": 8}, r"missing key 'mamba_num_heads'"),
    ({"model_type": "jamba", "num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
      "num_attention_heads": 2, "head_dim": 8, "hidden_size": 16}, r"missing key 'mamba_d_state'"),
    (_dense(model_type="falcon_h1", mamba_d_ssm=64), r"state-space/linear-attention layers.*mamba_d_ssm"),
    (_dense(num_kv_shared_layers=2), r"num_kv_shared_layers"),
])
def test_import_errors(cfg, match):
    with pytest.raises(ConfigImportError, match=match):
        from_hf_config(cfg, name="bad")


def test_file_errors(tmp_path):
    with pytest.raises(ConfigImportError, match=r"cannot read Hugging Face config"):
        from_hf_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigImportError, match=r"is not valid JSON"):
        from_hf_config(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ConfigImportError, match=r"must hold a JSON object"):
        from_hf_config(arr)
    with pytest.raises(ConfigImportError, match=r"needs a path to a config.json or a dict"):
        from_hf_config(42)
