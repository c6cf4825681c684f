"""Command-line interface: ``kvbridge models | plan | verify | demo | bench``."""
from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from .errors import KVBridgeError
from .layout import LAYOUT_PRESETS, EngineLayout, MemoryLayout

console = Console(width=None if sys.stdout.isatty() else 160)


def _engine(args, side: str, model, num_blocks: int = 64) -> EngineLayout:
    g = lambda k: getattr(args, f"{side}_{k}")  # noqa: E731
    il = getattr(args, f"{side}_cp_interleave", None) or getattr(args, "cp_interleave", None) or 1
    return EngineLayout(model, tp=g("tp"), pp=g("pp"), block_size=g("block_size"),
                        memory=MemoryLayout.parse(g("layout")), num_blocks=num_blocks, role=side,
                        mamba_blocks_per_request=g("mamba_blocks"), pcp=getattr(args, f"{side}_pcp", 1) or 1,
                        dcp=getattr(args, f"{side}_dcp", 1) or 1, cp_interleave=il)


def _add_topology(p: argparse.ArgumentParser, default_model: str, ptp=4, dtp=2) -> None:
    p.add_argument("--model", default=default_model, help="preset name (kvbridge models) or path to a HF config.json")
    for side, tp in (("prefill", ptp), ("decode", dtp)):
        p.add_argument(f"--{side}-tp", type=int, default=tp)
        p.add_argument(f"--{side}-pp", type=int, default=1)
        p.add_argument(f"--{side}-block-size", type=int, default=16)
        p.add_argument(f"--{side}-layout", default="flash_attn_hnd",
                       help=f"memory layout: a preset {sorted(LAYOUT_PRESETS)} or an axis order over LKBTHD")
        p.add_argument(f"--{side}-mamba-blocks", type=int, default=None,
                       help="kernel blocks a Mamba state slot spans (default: exactly the state size)")
        p.add_argument(f"--{side}-pcp", type=int, default=1,
                       help="prefill context parallel size (vLLM --prefill-context-parallel-size)")
        p.add_argument(f"--{side}-dcp", type=int, default=1,
                       help="decode context parallel size (vLLM --decode-context-parallel-size)")
        p.add_argument(f"--{side}-cp-interleave", type=int, default=None,
                       help="tokens per DCP rank turn (vLLM --cp-kv-cache-interleave-size; default --cp-interleave)")
    p.add_argument(
        "--cp-interleave",
        type=int,
        default=1,
        help="both sides' cp_kv_cache_interleave_size (vLLM's default 1; its NIXL connector uses the block size)",
    )


def cmd_models(args) -> int:
    from .models import list_presets, preset
    t = Table(title="model presets")
    for c in ("name", "layers", "groups", "description"):
        t.add_column(c)
    for name, desc in list_presets():
        m = preset(name)
        groups = "; ".join(
            f"{g.name}: {g.kind} x{len(g.layers)}" + (f" heads={g.num_heads}" if g.num_heads else "") +
            (f" dim={g.head_dim}" if g.head_dim else "") for g in m.groups)
        t.add_row(name, str(m.num_layers), groups, desc)
    console.print(t)
    return 0


def _fmt_layers(ls: tuple[int, ...]) -> str:
    if not ls:
        return "-"
    if len(ls) <= 4:
        return ",".join(map(str, ls))
    return f"{len(ls)} in {ls[0]}..{ls[-1]}"


def _parse_endpoints(text: str) -> dict:
    """``"0,0=host:port;0,1=host:port"`` -> {(0, 0): "host:port", ...}."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        rank, sep, ep = item.partition("=")
        try:
            key = tuple(int(x) for x in rank.split(","))
        except ValueError:
            key = ()
        if not sep or len(key) != 2 or ":" not in ep:
            raise KVBridgeError(f"--endpoints item {item!r}: expected PP,TP=HOST:PORT (items separated by ';')")
        out[key] = ep
    return out


def probe_links(prefill: EngineLayout, decode: EngineLayout, endpoints: dict | None = None,
                engine_id: str = "prefill-0", transfer_mode: str = "auto") -> dict:
    """Measure every (decode rank, prefill rank) link of the plan: against live prefill ``endpoints`` (the
    decode ranks run in this process), or, when None, a local pair of engines started here (one process
    per rank). Returns {decode rank: DecodeRank.links() of the engine}."""
    if endpoints is None:
        from .testing.procs import EngineProcs
        P = D = None
        try:
            P = EngineProcs.start("prefill", prefill, engine_id)
            D = EngineProcs.start("decode", decode, "probe-decode", transfer_mode=transfer_mode)
            D.call_all("handshake", engine_id, P.endpoints())
            return {r: st["links"].get(engine_id, {}) for r, st in D.call_all("stats").items()}
        finally:
            for procs in (D, P):
                if procs is not None:
                    procs.stop()
    from .runtime.decode import DecodeRank
    from .testing.engine import default_memory
    out = {}
    for r in decode.ranks():
        d = DecodeRank(decode, r, "probe-decode", memory=default_memory(decode, r), transfer_mode=transfer_mode)
        try:
            d.handshake(engine_id, endpoints)
            out[r] = d.links().get(engine_id, {})
        finally:
            d.close()
    return out


def _print_links(links: dict, as_json: bool) -> None:
    from .modes import TRANSFER_MODES
    if as_json:
        print(json.dumps({str(d): v for d, v in links.items()}, indent=1, default=str))
        return
    t = Table(title="links per (decode rank, prefill rank): the path chosen at handshake and each path's "
                    "measured READ, or the prefill's WRITE for push (GB/s, us per descriptor) and local copies "
                    "(us per MB)")
    for c in ("decode", "prefill", "chosen", "path", "GB/s", "us/desc", "copies us/MB", "source", "probe"):
        t.add_column(c, justify="right" if c in ("GB/s", "us/desc", "copies us/MB") else "left")
    warnings = []
    for d, per in sorted(links.items()):
        for p, link in sorted(per.items()):
            order = [m for m in TRANSFER_MODES if m in link["paths"]]
            for i, (path, f) in enumerate((m, link["paths"][m]) for m in order):
                t.add_row(str(d) if i == 0 else "", p if i == 0 else "", link["chosen"] if i == 0 else "", path,
                          f"{f['gbps']:.3g}", f"{f['us_per_desc']:.3g}", f"{f['copy_us_per_mb']:.3g}",
                          ("at most (timed out)" if f.get("bound") else "measured") if f["measured"] else "cost model",
                          f"{link['probe_wall_ms']:.1f} ms (+{link['probe_connect_ms']:.0f} ms connecting), "
                          f"{link['probe_bytes'] / 2**20:.1f} MiB" if i == 0 else "")
            if link.get("warning"):
                warnings.append(link["warning"])
    console.print(t)
    for w in warnings:
        console.print(f"[yellow]{w}[/yellow]")


def cmd_plan(args) -> int:
    from .cost import choose_modes
    from .models import load_model
    from .plan import plan_to_json, plan_transfer
    model = load_model(args.model)
    prefill, decode = _engine(args, "prefill", model), _engine(args, "decode", model)
    plan = plan_transfer(prefill, decode)
    if args.probe or args.endpoints:
        eps = _parse_endpoints(args.endpoints) if args.endpoints else None
        _print_links(probe_links(prefill, decode, eps, args.prefill_engine_id, args.transfer_mode), args.json)
        return 0
    if args.json:
        print(json.dumps(plan_to_json(plan), indent=1))
        return 0
    doc = plan_to_json(plan)
    cp = "tokens" in (doc["reads"][0] if doc["reads"] else {})
    rank_note = "ranks as (pp, pcp_rank*tp + tp_rank)" if max(prefill.pcp, decode.pcp) > 1 else "ranks as (pp, tp)"
    t = Table(title=f"{model.name}: prefill {_short(prefill, False)} -> decode {_short(decode, False)} "
                    f"(decode/prefill {rank_note}; heads and layers are global indices"
                    + ("; tokens: the read's share of the token axis, k/n x i = DCP rank k of n, i tokens a turn"
                       if cp else "") + ")")
    cols = ("decode", "prefill", "group", "layers", "heads") + (("tokens",) if cp else ()) + (
        "B/token", f"B/block({decode.block_size})", "B/request")
    for c in cols:
        t.add_column(c, justify="right" if c.startswith("B/") else "left", no_wrap=True)
    for r, jr in zip(plan.reads, doc["reads"]):
        bpt = jr["bytes_per_token"]
        tok = (("&".join(str(s) for s in r.tokens) or "all") + f" ({jr['token_fraction']:.0%})",) if cp else ()
        t.add_row(f"{r.decode}", f"{r.prefill}", r.group, _fmt_layers(plan.group_layers(r)),
                  "latent" if jr["heads"] is None and model.group(r.group).kind == "mla" else
                  (f"{jr['heads'][0]}:{jr['heads'][1]}" if jr["heads"] else "-"), *tok,
                  str(bpt) if bpt is not None else "", str(bpt * decode.block_size) if bpt is not None else "",
                  str(jr["bytes_per_request"] or ""))
    console.print(t)
    if cp:
        rt = Table(title="token share per rank (context parallelism): which tokens each rank stores")
        for c in ("engine", "rank", "tp_rank", "pcp_rank", "dcp_rank", "tokens stored"):
            rt.add_column(c)
        for e in (prefill, decode):
            for pp_r, r in e.ranks():
                s = e.token_share(next(g for g in model.groups if g.per_token), r) if any(
                    g.per_token for g in model.groups) else None
                rt.add_row(e.role, f"({pp_r}, {r})", str(e.tp_rank(r)), str(e.pcp_rank(r)), str(e.dcp_rank(r)),
                           "all (replica)" if s is None else
                           f"t // {s.interleave} % {s.size} == {s.rank} ({1 / s.size:.0%}; scheduler block = "
                           f"{e.block_size} x {s.size} tokens)")
        console.print(rt)
    modes = choose_modes(plan)
    from .cost import CostModel
    mt = Table(title="transfer mode per (decode rank, prefill rank), chosen by the cost model for shuffled blocks "
                     f"({CostModel.load().source}); auto mode re-decides per request from its block ids")
    for c in ("decode", "prefill", "runs/block", "bytes/run", "mode", "why"):
        mt.add_column(c)
    for m in modes:
        mt.add_row(str(m.decode), str(m.prefill), f"{m.runs_per_block:.1f}", str(m.bytes_per_run), m.mode, m.why)
    console.print(mt)
    if args.draw:
        from .draw import draw_plan
        draw_plan(plan, args.draw)
        console.print(f"plan drawn to {args.draw}")
    return 0


def cmd_verify(args) -> int:
    from rich.progress import Progress

    from .models import load_model
    from .plan import plan_transfer
    from .testing.verify import verify
    cases = []
    if args.sweep:
        from .testing.sweep import cp_sweep_cases, sweep_cases
        cases = sweep_cases(quick=not args.full) + cp_sweep_cases()
    else:
        model = load_model(args.model)
        cases = [(_engine(args, "prefill", model, args.num_blocks), _engine(args, "decode", model, args.num_blocks))]
    t = Table(title="oracle verification (every decode byte checked)")
    for c in (
        "model",
        "prefill",
        "decode",
        "requests",
        "bytes",
        "descriptors",
        "amplification",
        "mismatched",
        "result",
    ):
        t.add_column(c)
    failed = rejected = 0
    tot_moved = tot_needed = tot_mismatch = tot_checked = 0
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("verifying", total=len(cases))
        for prefill, decode in cases:
            try:
                plan_transfer(prefill, decode)
                res = verify(prefill, decode, num_requests=args.requests, seed=args.seed)
            except KVBridgeError:
                rejected += 1
                if not args.sweep:
                    raise
                prog.advance(task)
                continue
            ok = res.ok
            failed += not ok
            tot_moved += res.bytes_moved
            tot_needed += res.bytes_needed
            tot_mismatch += res.mismatched_bytes
            tot_checked += res.checked_bytes
            if not args.sweep or not ok or args.verbose:
                t.add_row(prefill.model.name, _short(prefill), _short(decode), str(res.requests), str(res.bytes_moved),
                          str(res.descriptors), f"{res.amplification:.3f}", str(res.mismatched_bytes),
                          "[green]PASS" if ok else "[red]FAIL " + "; ".join(res.errors))
            prog.advance(task)
    if args.sweep:
        t.add_row("all", f"{len(cases) - rejected} cases", "", "", f"{tot_moved:,}", "",
                  f"{tot_moved / max(tot_needed, 1):.3f}", f"{tot_mismatch} of {tot_checked:,}",
                  "[green]PASS" if not failed else f"[red]{failed} FAILED")
    console.print(t)
    if rejected:
        console.print(f"{rejected} topologies rejected by the planner with a LayoutError (not counted)")
    return 1 if failed else 0


def _short(e: EngineLayout, memory: bool = True) -> str:
    cp = (f" pcp{e.pcp}" if e.pcp > 1 else "") + (f" dcp{e.dcp}x{e.cp_interleave}" if e.dcp > 1 else "")
    return f"tp{e.tp}{cp} pp{e.pp} bs{e.block_size}" + (f" {e.memory}" if memory else "")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvbridge", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("models", help="list model presets").set_defaults(fn=cmd_models)

    p = sub.add_parser("plan", help="print which prefill rank supplies what to each decode rank")
    _add_topology(p, "llama-3.1-70b", 8, 2)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--draw", metavar="FILE.svg", help="draw the plan as an SVG picture")
    p.add_argument("--probe", action="store_true",
                   help="start a local pair of engines (one process per rank) and measure every link: chosen path, "
                        "GB/s and us per descriptor per path, and a warning per degraded link")
    p.add_argument("--endpoints", metavar="PP,TP=HOST:PORT;...",
                   help="probe a live prefill engine at these side-channel endpoints instead (decode ranks run here)")
    p.add_argument("--prefill-engine-id", default="prefill-0", help="engine id of the prefill engine probed")
    from .modes import TRANSFER_MODES
    p.add_argument("--transfer-mode", choices=TRANSFER_MODES, default="auto",
                   help="the decode ranks' transfer_mode while probing (a forced path is shown as chosen)")
    p.set_defaults(fn=cmd_plan)

    v = sub.add_parser("verify", help="move bytes in-process with the reference transport, check each byte")
    _add_topology(v, "gemma-4-mini")
    v.add_argument("--sweep", action="store_true", help="every preset x a grid of topologies, layouts, block sizes")
    v.add_argument("--full", action="store_true", help="with --sweep: the large grid")
    v.add_argument("--requests", type=int, default=4)
    v.add_argument("--num-blocks", type=int, default=64)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--verbose", action="store_true")
    v.set_defaults(fn=cmd_verify)

    from .testing.demo import add_demo_parser
    add_demo_parser(sub, _add_topology, _engine)
    bench = _load_benchmarks()
    if bench is not None:
        bench.add_bench_parser(sub)
    return ap


def _load_benchmarks():
    """``benchmarks/bench.py`` of the source checkout (benchmarks are not part of the package)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"
    if not path.is_file():
        return None
    if "bench" in sys.modules:
        return sys.modules["bench"]
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KVBridgeError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
