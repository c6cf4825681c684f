"""Speculative decoding and the KV-cache spec kinds vLLM 0.33 hands a connector.

* Every ``KVCacheSpec`` class vLLM 0.33 defines is supported or refused by name (a new one fails here).
* A draft model's layers (EAGLE, DeepSeek MTP: ``model.layers.{num_hidden_layers + i}``, the target's spec)
  travel with the target's, byte-exact over NIXL on vLLM's own tensors.
* A separate draft model's layers (``method: "draft_model"``: vLLM names them
  ``draft_model.model.layers.{i}``) are numbered after the target's; with the target's KV shape they join the
  target's group, with another shape (vLLM still keeps them in the target's group, a
  ``UniformTypeKVCacheSpecs``) they get their own kvbridge group on the same block ids, byte-exact across TP and
  block-size changes.
* A decode whose speculative config differs from the prefill's is refused at the request's first read with
  :class:`SpeculativeConfigMismatch` (failed_recving), and a multi-module MTP prefill keeps its lookahead
  window off the KV it hands over, as vLLM's NixlConnector does.

The engines' speculative config is ``worker_harness.DraftConfig``: the fields of vLLM's
``SpeculativeConfig`` that the connector reads (vLLM's own needs the draft model's weights and a GPU)."""
from __future__ import annotations

import tempfile

import pytest

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("vllm.v1.core.kv_cache_planning")

import vllm.v1.kv_cache_interface as kci  # noqa: E402
from sched_utils import make_vllm_config  # noqa: E402
from worker_harness import DraftConfig, Side, deepseek_like, llama, plan_and_allocate, with_draft_layers  # noqa: E402

from kvbridge.integrations.vllm import (  # noqa: E402
    REFUSED_SPECS,
    SPEC_KINDS,
    VLLMConfigError,
    engine_from_vllm,
    speculative_fingerprint,
)
from kvbridge.integrations.vllm.translate import block_sources, layer_index, prefill_backoff, spec_kind  # noqa: E402


def _all_spec_classes():
    seen, todo = set(), [kci.KVCacheSpec]
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo.extend(c.__subclasses__())
    return sorted((c for c in seen if c.__module__ == kci.__name__), key=lambda c: c.__name__)


def test_every_kv_cache_spec_class_of_vllm_is_supported_or_refused_by_name():
    classes = _all_spec_classes()
    assert len(classes) >= 15  # vLLM 0.33 defines 17
    names = {c.__name__ for c in classes}
    unclassified = names - set(SPEC_KINDS) - set(REFUSED_SPECS)
    assert not unclassified, f"classify these vLLM KV-cache specs (SPEC_KINDS or REFUSED_SPECS): {sorted(unclassified)}"
    assert not set(SPEC_KINDS) & set(REFUSED_SPECS)
    for c in classes:
        spec = object.__new__(c)  # the kind is decided by the class, not the field values
        if c.__name__ in SPEC_KINDS:
            assert spec_kind(spec) == SPEC_KINDS[c.__name__]
        else:
            with pytest.raises(VLLMConfigError, match=f"cannot move {c.__name__} caches"):
                spec_kind(spec)


def _engine(model, side, spec, rank=(0, 0)):
    cfg = make_vllm_config(tempfile.mkdtemp(), model.hf, block_size=side.block_size, max_model_len=512)
    cfg.parallel_config.tensor_parallel_size = side.tp
    cfg.speculative_config = spec
    kvc, kv = plan_and_allocate(cfg, model, side, rank)
    return cfg, kvc, kv


def test_draft_layers_join_the_targets_group_and_are_described():
    model = with_draft_layers(llama(2), 1)
    cfg, kvc, kv = _engine(model, Side(2, 1, 16), DraftConfig())
    assert any("layers.2." in n for g in kvc.kv_cache_groups for n in g.layer_names)  # vLLM grouped the draft layer
    engine, names, layers = engine_from_vllm(cfg, kvc, kv, (0, 1))
    assert sorted(layers) == [0, 1, 2] and engine.model.num_layers == 3
    (g,) = engine.model.groups
    assert g.layers == (0, 1, 2)


def test_a_separate_draft_models_layers_are_numbered_after_the_targets():
    """vLLM's DraftModelProposer loads the draft as ``draft_model.model.layers.{i}``, counting from 0 like the
    target: its layers become model layers 2.. of a 2-layer target, in the target's group (same KV shape)."""
    model = with_draft_layers(llama(2), 2, kind="draft_model")
    cfg, kvc, kv = _engine(model, Side(1, 1, 16), DraftConfig(method="draft_model"))
    assert "draft_model.model.layers.0.self_attn.attn" in kv
    engine, names, layers = engine_from_vllm(cfg, kvc, kv, (0, 0))
    assert names == ["g0"] and sorted(layers) == [0, 1, 2, 3] and engine.model.num_layers == 4
    (g,) = engine.model.groups
    assert g.layers == (0, 1, 2, 3)
    # each model layer is described by its own tensor (not the target's layer with the same number)
    assert layers[2].tensor.data_ptr() == kv["draft_model.model.layers.0.self_attn.attn"].data_ptr()
    assert layers[0].tensor.data_ptr() == kv["model.layers.0.self_attn.attn"].data_ptr()
    assert layer_index("draft_model.model.layers.1.self_attn.attn", 2) == 3
    with pytest.raises(ValueError, match="draft model's layer"):
        layer_index("draft_model.model.layers.1.self_attn.attn")


@pytest.mark.parametrize("tp,shape,heads", [(2, ("full", 4, 64), 4), (2, ("full", 1, 128), 1)])
def test_a_draft_model_of_another_kv_shape_gets_its_own_group_on_the_same_block_ids(tp, shape, heads):
    """A draft with 4 KV heads (or 1 KV head of size 128, replicated at TP 2) next to a target with 2 of size
    64: vLLM keeps them in one group (one block table, per-layer specs); kvbridge describes the draft layer
    as its own group ``g0-draft`` with the draft's heads, fed the same block ids."""
    model = with_draft_layers(llama(2), 1, shape=shape, kind="draft_model")
    spec = DraftConfig(method="draft_model", hf_config={"num_key_value_heads": heads})
    cfg, kvc, kv = _engine(model, Side(tp, 1, 16), spec, rank=(0, 1))
    (vg,) = kvc.kv_cache_groups
    assert type(vg.kv_cache_spec).__name__ == "UniformTypeKVCacheSpecs"  # what vLLM does with such a draft
    engine, names, layers = engine_from_vllm(cfg, kvc, kv, (0, 1))
    assert names == ["g0"]
    g0, gd = engine.model.groups
    assert (g0.name, g0.layers, g0.num_heads, g0.head_dim) == ("g0", (0, 1), 2, 64)
    assert (gd.name, gd.layers, gd.num_heads, gd.head_dim) == ("g0-draft", (2,), heads, shape[2])
    assert block_sources(names, engine.model.groups) == {"g0": 0, "g0-draft": 0}
    # without the draft config's KV heads, 1 head per rank at TP 2 is ambiguous: refused by name
    if shape[1] == 1:
        cfg.speculative_config = DraftConfig(method="draft_model")
        with pytest.raises(VLLMConfigError, match="1 KV head per rank at tp=2"):
            engine_from_vllm(cfg, kvc, kv, (0, 1))


@pytest.mark.parametrize("kind", ["eagle", "draft_model"])
def test_draft_layers_with_pipeline_parallelism_are_refused_by_name(kind):
    """PP 2: the draft's layers live on the last stage; kvbridge moves draft KV at PP 1 only (typed)."""
    model = with_draft_layers(llama(2), 1, kind=kind)
    cfg = make_vllm_config(tempfile.mkdtemp(), model.hf, block_size=16, max_model_len=512)
    cfg.speculative_config = DraftConfig(method=kind)
    kvc, kv = plan_and_allocate(cfg, model, Side(1, 2, 16), (1, 0))
    with pytest.raises(VLLMConfigError, match=r"draft-model layers \[2\] with pipeline parallelism"):
        engine_from_vllm(cfg, kvc, kv, (1, 0))


def test_draft_layers_without_a_speculative_config_are_refused_by_name():
    model = with_draft_layers(llama(2), 1)
    cfg, kvc, kv = _engine(model, Side(1, 1, 16), None)
    with pytest.raises(VLLMConfigError, match=r"layers \[2\] are not cached layers .* no speculative_config"):
        engine_from_vllm(cfg, kvc, kv, (0, 0))


def test_speculative_fingerprint_and_mtp_backoff():
    class _V:
        def __init__(self, spec):
            self.speculative_config = spec
            self.cache_config = type("C", (), {"cache_dtype": "auto"})()

    assert speculative_fingerprint(_V(None)) is None
    a, b = speculative_fingerprint(_V(DraftConfig(model="a"))), speculative_fingerprint(_V(DraftConfig(model="b")))
    assert a and b and a != b
    assert a == speculative_fingerprint(_V(DraftConfig(model="a", num_speculative_tokens=4)))  # same draft KV
    # multi-module MTP keeps num_speculative_tokens - 1 prompt tokens off the prefill (vLLM's rule)
    model = llama(2)
    cfg, kvc, _ = _engine(model, Side(1, 1, 16), DraftConfig(method="mtp", multi_module_mtp=True,
                                                             num_speculative_tokens=3))
    assert cfg.num_prefill_lookahead_tokens == 3 and prefill_backoff(cfg, kvc) == 2
    cfg, kvc, _ = _engine(model, Side(1, 1, 16), DraftConfig())  # EAGLE: reads one token ahead, no backoff
    assert prefill_backoff(cfg, kvc) == 0


# ---------------------------------------------------------------------- worker side, over NIXL
@pytest.mark.parametrize("name", ["eagle-llama-tp2-to-tp1", "mtp-mla-tp2-to-tp1"])
def test_draft_model_kv_travels_with_the_targets_byte_exact(name):
    """EAGLE-style (a draft attention layer after a Llama's) and DeepSeek-MTP-style (an MLA layer after the
    model's): every layer's KV, the draft's included, read byte-exact across a TP change."""
    pytest.importorskip("nixl._api")
    from worker_harness import run_pair

    base = llama(2) if name.startswith("eagle") else deepseek_like()
    model = with_draft_layers(base, 1)
    spec = DraftConfig(method="eagle" if name.startswith("eagle") else "mtp")
    r = run_pair(model, Side(2, 1, 16), Side(1, 1, 16), requests=((60, 0), (33, 1)), specs=(spec, spec))
    assert r.failed == [] and r.done == ["dec-req-1", "dec-req-2"] and r.sent == ["req-1", "req-2"]
    assert r.checked > 0 and r.bad == 0 and r.untouched_bad == 0
    # the draft layer was checked too: 3 layers' worth of values
    r2 = run_pair(base, Side(2, 1, 16), Side(1, 1, 16), requests=((60, 0), (33, 1)))
    assert r.checked == r2.checked * 3 // 2


@pytest.mark.parametrize("name", ["draft4heads-tp2-b16-to-tp1-b32", "draft1head128-tp1-to-tp2"])
def test_a_separate_draft_models_kv_travels_byte_exact_in_its_own_group(name):
    """``method: "draft_model"``, draft KV shape unlike the target's (4 KV heads, or 1 KV head of size 128
    replicated at TP 2), across a TP change and (packed form) a block-size change: every layer's values
    read byte-exact, the draft layer's included (it holds the values of its own model layer, 2)."""
    pytest.importorskip("nixl._api")
    from worker_harness import run_pair

    if name.startswith("draft4"):
        shape, heads, P, D = ("full", 4, 64), 4, Side(2, 1, 16), Side(1, 1, 32)
        ratio = (2 * 2 + 4) / (2 * 2)  # decode TP1: 2 layers x 2 heads, then 4 draft heads
    else:
        shape, heads, P, D = ("full", 1, 128), 1, Side(1, 1, 16), Side(2, 1, 16)
        ratio = (2 * 2 * 64 + 2 * 128) / (2 * 2 * 64)  # decode TP2: each rank checks its target head and the draft's
    model = with_draft_layers(llama(2), 1, shape=shape, kind="draft_model")
    spec = DraftConfig(method="draft_model", model="tiny-draft", hf_config={"num_key_value_heads": heads})
    r = run_pair(model, P, D, requests=((60, 0), (33, 1)), specs=(spec, spec))
    assert r.failed == [] and r.done == ["dec-req-1", "dec-req-2"] and r.sent == ["req-1", "req-2"]
    assert r.checked > 0 and r.bad == 0 and r.untouched_bad == 0
    r2 = run_pair(llama(2), P, D, requests=((60, 0), (33, 1)))
    assert r2.bad == 0 and r.checked == r2.checked * ratio


def test_a_decode_with_another_speculative_config_is_refused_typed():
    """Prefill with draft model "a", decode with draft model "b": each decode rank fails the read before any
    byte moves with SpeculativeConfigMismatch (failed_recving, counted by name), nothing is reported read."""
    pytest.importorskip("nixl._api")
    from worker_harness import run_pair

    model = with_draft_layers(llama(2), 1)
    r = run_pair(model, Side(1, 1, 16), Side(1, 1, 16), requests=((40, 0),),
                 specs=(DraftConfig(model="a"), DraftConfig(model="b")))
    assert r.done == [] and r.failed == ["dec-req-1"]
    assert r.stats.get("reads_failed_SpeculativeConfigMismatch") == 1
    assert r.bad == 0 and r.untouched_bad == 0
