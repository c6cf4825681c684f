"""Speculative decoding and the KV-cache spec kinds vLLM 0.33 hands a connector.

* Every ``KVCacheSpec`` class vLLM 0.33 defines is supported or refused by name (a new one fails here).
* A draft model's layers (EAGLE, DeepSeek MTP: ``model.layers.{num_hidden_layers + i}``, the target's spec)
  travel with the target's, byte-exact over NIXL on vLLM's own tensors.
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
from kvbridge.integrations.vllm.translate import prefill_backoff, spec_kind  # noqa: E402


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
