"""Link-aware transfer paths: the choice from measured figures (pin bound, per request size, moving
estimate), the degraded-link warning, the delaying transport, and, through real NIXL between processes,
every path byte-exact and the choice flipping when one path is made slow."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvbridge.cost import LinkFigures, PathFigures, choose_path, flip_points
from kvbridge.modes import TRANSFER_MODES, TransferPath, parse_mode
from kvbridge.runtime.config import ConfigError, DecodeConfig
from kvbridge.runtime.probe import link_warning
from kvbridge.transport.delayed import DelayedTransport, LinkDelay, parse_delays
from kvbridge.transport.nixl import nixl_available

D, S, H, P = TransferPath.DIRECT, TransferPath.STAGED, TransferPath.HOST, TransferPath.PUSH


def h100_like() -> LinkFigures:
    """The figures of the H100 VM without CUDA IPC: VRAM READs at 0.56 GB/s and 32 us per descriptor,
    DRAM READs at 4.6 GB/s, device copies ~1 TB/s, host<->device ~25 GB/s."""
    d2d, h2d = 1000.0, 25.0
    return LinkFigures({D: PathFigures(32.0, 0.56, 0.0, True), S: PathFigures(32.0, 0.56, 2e3 / d2d, True, 40.0),
                        H: PathFigures(5.0, 4.6, 2e3 / d2d + 2e3 / h2d, True, 80.0)}, device="cuda:0")


def test_choice_follows_the_measured_figures_and_flips_with_request_size():
    link = h100_like()
    # a large request with many runs: host staging (one READ of host memory at 4.6 GB/s)
    path, pred = choose_path(link, runs=30_000, nbytes=1 << 30)
    assert path is H and pred[H] < pred[S] < pred[D]
    # a tiny request with one run: direct (no copies, one descriptor)
    assert choose_path(link, runs=1, nbytes=256)[0] is D
    flips = flip_points(link, runs_per_byte=1 / 4096)
    assert [p for _, p in flips][0] is D and flips[-1][1] is H
    assert all(a[0] < b[0] for a, b in zip(flips, flips[1:]))
    # allowed paths only (a pair without host staging)
    assert choose_path(link, 30_000, 1 << 30, allowed={D, S})[0] is S


def test_a_path_predicted_past_the_pin_bound_is_never_chosen_when_another_fits():
    # the pin holds pin_s + bytes at min_read_rate (1.0 + 0.5 s for 1 GiB here): only the paths that fit count
    link = LinkFigures({D: PathFigures(1.0, 1.0), H: PathFigures(1.0, 4.0, 1e3)}, pin_s=1.0,
                       min_read_rate=(1 << 30) / 0.5)
    assert link.pin_bound_s(1 << 30) == pytest.approx(1.5)
    nbytes = 1 << 30  # direct: ~1.07 s; host: 0.27 s wire + 1.07 s copies = 1.34 s: both fit
    assert choose_path(link, 10, nbytes)[0] is D
    link.paths[D] = PathFigures(1.0, 0.5)  # direct now 2.1 s > pin bound; host 1.34 s fits
    assert choose_path(link, 10, nbytes)[0] is H
    link.paths[H] = PathFigures(1.0, 4.0, 1e4)  # host 10.9 s: neither fits -> the fastest
    path, pred = choose_path(link, 10, nbytes)
    assert path is D and all(t / 1e6 > link.pin_bound_s(nbytes) for t in pred.values())


def test_completed_transfers_move_the_estimate_and_it_stays_bounded():
    f = PathFigures(per_desc_us=10.0, gbps=10.0)
    f.observe(1, 4096, 0.5)  # a small transfer (its fixed costs dominate) does not move it
    assert f.factor == 1.0 and f.observed == 0
    raw = f.raw_us(100, 10 << 20)
    f.observe(100, 10 << 20, raw * 4 / 1e6)  # first one: the ratio itself
    assert f.factor == pytest.approx(4.0) and f.observed == 1
    f.observe(100, 10 << 20, raw / 1e6)  # moves 20 % of the way back
    assert f.factor == pytest.approx(0.8 * 4.0 + 0.2 * 1.0)
    for _ in range(200):
        f.observe(100, 10 << 20, 1e6)  # absurdly slow: bounded
    assert f.factor <= 50.0 and math.isfinite(f.effective_gbps) and f.effective_gbps > 0
    f.observe(100, 10 << 20, float("nan"))  # ignored
    assert f.observed == 202


def test_a_small_reads_fixed_cost_is_learned_from_reads_that_ran_alone():
    """Reads too small for the correction teach the path's fixed cost (``overhead_us``): the first read of a
    path is not counted (lazy connection), the next sets it, a lower one drops it at once, a higher one
    raises it a quarter of the way (queueing only adds), and a read that overlapped others is not counted."""
    f = PathFigures(per_desc_us=2.0, gbps=10.0)
    raw = f.raw_us(64, 2 << 20)
    assert raw < 2000.0
    f.observe(64, 2 << 20, (raw + 30_000) / 1e6)  # the first: lazy connection costs, not counted
    assert f.overhead_seen == 1 and f.overhead_us == 0.0 and not f.overhead_known
    f.observe(64, 2 << 20, (raw + 3000) / 1e6)
    assert f.overhead_us == pytest.approx(3000.0) and f.overhead_known
    f.observe(64, 2 << 20, (raw + 1000) / 1e6)  # lower: at once
    assert f.overhead_us == pytest.approx(1000.0)
    f.observe(64, 2 << 20, (raw + 5000) / 1e6)  # higher: a quarter of the way
    assert f.overhead_us == pytest.approx(2000.0)
    f.observe(64, 2 << 20, (raw + 90_000) / 1e6, fixed=False)  # it queued behind other reads: not counted
    assert f.overhead_us == pytest.approx(2000.0) and f.overhead_seen == 4
    assert f.factor == 1.0 and f.observed == 0  # small reads never move the bandwidth correction
    assert f.to_json()["overhead_us"] == 2000.0


def test_a_small_request_reads_direct_until_staging_measured_cheaper():
    """A 2 MiB request in 64 descriptors on the CPU VM's probed figures (a run of this session): by the READ
    and copy figures alone staging looked cheaper (one descriptor instead of 64), and auto staged every such
    request at 2-3x direct's latency. A staged path's fixed cost not measured yet is a direct read's plus
    ``STAGED_OVERHEAD_US``, so direct is chosen; once staged reads measure their own fixed cost it decides."""
    from kvbridge.cost import STAGED_OVERHEAD_US
    link = LinkFigures({D: PathFigures(2.962, 8.397, 0.0, True), S: PathFigures(2.962, 8.397, 51.259, True, 20.0)})
    runs, nbytes = 64, 2 << 20
    bare = {p: link.paths[p].predict_us(1 if p is S else runs, nbytes) for p in (D, S)}
    assert bare[S] < bare[D]  # what the copy figures alone said
    path, pred = choose_path(link, runs, nbytes)
    assert path is D and pred[S] - pred[D] == pytest.approx(STAGED_OVERHEAD_US - (bare[D] - bare[S]), rel=0.05)
    for f, fixed_us in ((link.paths[D], 900.0), (link.paths[S], 3000.0)):  # what this VM measured
        for _ in range(3):
            f.observe(runs if f is link.paths[D] else 1, nbytes,
                      (f.raw_us(runs if f is link.paths[D] else 1, nbytes) + fixed_us) / 1e6)
    assert link.overhead_us(D) == pytest.approx(900.0) and link.overhead_us(S) == pytest.approx(3000.0)
    assert choose_path(link, runs, nbytes)[0] is D
    # an unmeasured staged path follows direct's measured fixed cost plus the prior
    fresh = LinkFigures({D: link.paths[D], S: PathFigures(2.962, 8.397, 51.259, True, 20.0)})
    assert fresh.overhead_us(S) == pytest.approx(900.0 + STAGED_OVERHEAD_US)
    # thousands of small runs (a head-sliced pair): staging wins even at its measured fixed cost
    assert choose_path(link, 30_000, 16 << 20)[0] is S


def test_the_choice_flips_when_a_path_slows_down_in_service():
    link = h100_like()
    assert choose_path(link, 30_000, 1 << 30)[0] is H
    for _ in range(20):  # host transfers turn out 20x slower than probed
        link.paths[H].observe(1, 1 << 30, 20 * link.paths[H].raw_us(1, 1 << 30) / 1e6)
    assert choose_path(link, 30_000, 1 << 30)[0] is S


def test_modes_are_one_enum():
    assert TRANSFER_MODES == ("auto", "direct", "staged", "host", "push")
    assert parse_mode(TransferPath.HOST) == "host" and TransferPath("staged") is S and S == "staged"
    assert parse_mode("push") is P and DecodeConfig.from_mapping({"transfer_mode": "push"}).transfer_mode == "push"
    with pytest.raises(ValueError, match="transfer_mode must be one of auto, direct, staged, host, push, got 'fast'"):
        parse_mode("fast")
    with pytest.raises(ConfigError, match="transfer_mode must be one of auto, direct, staged, host, push"):
        DecodeConfig.from_mapping({"transfer_mode": "pull"})
    assert DecodeConfig.from_mapping({"transfer_mode": "host", "probe_ms": "0"}).probe_ms == 0.0
    with pytest.raises(ConfigError, match="probe_bytes must be >= 0"):
        DecodeConfig(probe_bytes=-1)


def test_degraded_link_warning_names_the_path_the_figures_and_the_causes():
    text = link_warning(h100_like(), "decode rank (0, 0) <- prefill rank (0, 1)")
    assert text is not None
    for want in ("decode rank (0, 0) <- prefill rank (0, 1)", "device path", "0.56 GB/s", "4.6 GB/s",
                 "CUDA IPC", "PID namespace", "expandable", "TCP", "UCX_TLS", "transfer_mode"):
        assert want in text, want
    # a healthy GPU link: no warning
    ok = h100_like()
    ok.paths[D].gbps = ok.paths[S].gbps = 40.0
    assert link_warning(ok, "x") is None
    # below the floor with no host path to compare (GPU memory)
    floor = LinkFigures({D: PathFigures(30.0, 0.3, measured=True)}, device="cuda:0")
    assert "below the floor" in (link_warning(floor, "x") or "")
    # host memory on both sides: a few-fold gap (noise, untouched pages) is not a transport problem
    cpu = LinkFigures({D: PathFigures(3.0, 7.0, measured=True), H: PathFigures(2.0, 38.0, measured=True)})
    assert link_warning(cpu, "x") is None
    cpu.paths[D].gbps = 0.5  # 76x slower: named
    assert "device path (direct)" in (link_warning(cpu, "x") or "")
    # unmeasured figures never warn
    assert link_warning(LinkFigures({D: PathFigures(30.0, 0.1)}, device="cuda:0"), "x") is None


def test_link_figures_serialise_for_stats():
    j = h100_like().to_json()
    assert set(j["paths"]) == {"direct", "staged", "host"}
    assert j["paths"]["host"]["gbps"] == 4.6 and j["paths"]["direct"]["us_per_desc"] == 32.0
    json.dumps(j)


def test_delay_specs_are_checked():
    assert parse_delays("device:read:5:2, host:read:1,*:write:3") == [
        LinkDelay("device", "read", 0.005, 0.002), LinkDelay("host", "read", 0.001, 0.0),
        LinkDelay("*", "write", 0.003, 0.0)]
    for bad, match in (("device:read", "KIND:OP:FIXED_MS"), ("gpu:read:1", "kind must be one of"),
                       ("device:send:1", "op must be one of"), ("device:read:x", "must be numbers"),
                       ("device:read:-1", ">= 0")):
        with pytest.raises(ValueError, match=match):
            parse_delays(bad)


def test_delayed_transport_holds_back_the_kind_it_names():
    """Through the loopback transport (real copies between two agents of one process)."""
    from kvbridge.transport.loopback import LoopbackRegistry, LoopbackTransport
    reg = LoopbackRegistry()
    a, b = LoopbackTransport("a", reg), LoopbackTransport("b", reg)
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, np.uint8)
    sa, da = a.register(src), b.register(dst)
    peer = b.add_peer(a.metadata())
    slow = DelayedTransport(b, [LinkDelay("host", "read", fixed_s=3600.0)])
    one = np.ones(1, np.int64)
    h = slow.read(peer, one * sa, one * da, one * 4096)  # device kind: not delayed
    assert slow.check(h) == "DONE" and slow.settle(h, 0.1) is True
    slow.release(h)
    h = slow.read(peer, one * sa, one * da, one * 4096, local_device="cpu")  # host kind: held back
    assert slow.check(h) == "PROC" and slow.settle(h, 0.01) is None
    assert bytes(dst[:4096]) == bytes(src[:4096])  # the bytes moved; only the answer waits
    slow.release(h)
    assert b.live_handles() == 0
    # one direction: WRITEs held back, READs not
    writes = DelayedTransport(b, [LinkDelay("*", "write", fixed_s=3600.0)])
    h = writes.read(peer, one * sa, one * da, one * 4096, local_device="cpu")
    assert writes.check(h) == "DONE" and writes.settle(h, 0.1) is True
    writes.release(h)
    dst[:] = 0
    h = writes.write(peer, one * da, one * sa, one * 4096)  # b's dst -> a's src
    assert writes.check(h) == "PROC" and writes.settle(h, 0.01) is None
    assert not src[:4096].any()
    writes.release(h)
    assert b.live_handles() == 0


@pytest.mark.parametrize("slow,want_push", [("*:read:20:5000", True), ("*:write:2:500", False)])
def test_the_push_probe_measures_the_write_and_auto_follows_it(monkeypatch, slow, want_push):
    """In process (loopback agents; ``KVBRIDGE_DELAY_LINK`` wraps both ranks' transports, each rule inert
    in the other direction): with every READ of the decode slow, the push probe measures the prefill's
    WRITEs fast and ``auto`` pushes every request, byte-exact; with the prefill's WRITEs slow the probe
    measures push slow and ``auto`` never pushes. Slow READs cost 20 ms + 5 s per MiB: ``auto``
    learns a push's fixed cost from the reads (the prefill's turn, the round trip), and on a loaded CI
    machine that once exceeded a 2 ms + 500 ms/MiB direct READ of the 17-token request (2 of 3 pushed)."""
    from _helpers import Jobs, hold, layout, served

    from kvbridge.runtime.decode import DecodeRank
    from kvbridge.runtime.prefill import PrefillRank
    from kvbridge.testing.engine import buffer_of, default_memory
    from kvbridge.testing.oracle import SENTINEL
    from kvbridge.testing.procs import verify_rank
    from kvbridge.transport.delayed import DelayedTransport
    from kvbridge.transport.loopback import LoopbackRegistry, LoopbackTransport
    monkeypatch.setenv("KVBRIDGE_DELAY_LINK", slow)
    reg = LoopbackRegistry()
    pl, dl = layout("prefill", 1, 128), layout("decode", 1, 128)
    jobs = Jobs(dl, seed=7)
    jobs.engine("pp", pl)
    pre = PrefillRank(pl, (0, 0), memory=default_memory(pl, (0, 0)), engine_id="pp",
                      transport=LoopbackTransport("pp-t", reg))
    dec = None
    try:
        with served(pre) as lock:
            # a probe budget of 200 ms (default 50): this test machine runs many processes on two cores
            dec = DecodeRank(dl, (0, 0), memory=default_memory(dl, (0, 0)), engine_id="dp", transfer_mode="auto",
                             transport=LoopbackTransport("dp-t", reg), probe_ms=200.0)
            assert isinstance(dec.transport, DelayedTransport) and isinstance(pre.transport, DelayedTransport)
            buffer_of(dec.mem).fill(SENTINEL)
            dec.handshake("pp", {(0, 0): f"127.0.0.1:{pre.port}"})
            link = dec.remotes["pp"].remote.links[(0, 0)]
            print(json.dumps(link.to_json(), indent=1))  # (shown when the test fails)
            push = link.paths[P]
            assert link.source == "probe" and push.measured  # the WRITE, timed by the push probe
            if want_push:
                assert dec.remotes["pp"].modes[(0, 0)] == "push"
                assert push.gbps > 10 * max(f.gbps for p, f in link.paths.items() if p is not P and f.measured)
            else:
                assert dec.remotes["pp"].modes[(0, 0)] != "push"
                assert push.gbps * 10 < max(f.gbps for p, f in link.paths.items() if p is not P and f.measured)
            moved = []
            for j in jobs.make("pp", 3, lengths=[40, 64, 17]):
                hold(pre, lock, j)
                dec.start(j.read())
                done, failed = dec.wait(30)
                assert done == [j.rid] and not failed, failed
                moved.append((j.num, j.read()))
            assert verify_rank(dec, moved)["mismatched_bytes"] == 0
            assert dec.metrics.pushed_transfers == (3 if want_push else 0)
            with lock:
                assert not pre.stats()["push_probes"] and pre.transport.live_handles() == 0
    finally:
        if dec is not None:
            dec.close()
        pre.close()


# ---- through real NIXL between processes --------------------------------------------------------
nixl = pytest.mark.skipif(not nixl_available(), reason="nixl not installed")


def _eng(model, tp, bs=16, layout="flash_attn_hnd"):
    from kvbridge.layout import EngineLayout, MemoryLayout
    from kvbridge.models import preset
    return EngineLayout(preset(model), tp=tp, block_size=bs, memory=MemoryLayout.parse(layout))


# the oracle's pairs: TP4 -> TP2 with different block sizes, dense GQA, MLA, SWA+FA
ORACLE = {
    "tp4->tp2 blocks 16->32": lambda: (_eng("tiny-dense", 4, 16), _eng("tiny-dense", 2, 32, "flash_attn")),
    "dense gqa P2->D1": lambda: (_eng("gemma-4-mini", 2), _eng("gemma-4-mini", 1, layout="flashinfer")),
    "mla P2->D1": lambda: (_eng("tiny-mla", 2), _eng("tiny-mla", 1, layout="cross_layer")),
    "swa+fa P4->D2": lambda: (_eng("gemma-4-mini", 4), _eng("gemma-4-mini", 2, layout="flashinfer")),
}


def _check(res, path: str) -> None:
    assert not res.failed and not res.start_errors, (res.failed, res.start_errors)
    assert res.mismatched_bytes == 0 and res.bytes_moved == res.bytes_needed
    assert res.prefill_freed == res.requests and res.leaked_handles == 0 and res.ok
    if path.startswith("direct"):
        assert res.staged_transfers == 0
    elif path == "staged":
        assert res.staged_transfers > 0 and res.host_staged_transfers == 0 and res.direct_transfers == 0
    elif path == "host":
        assert res.host_staged_transfers == res.staged_transfers > 0 and res.direct_transfers == 0
    elif path == "push":  # every transfer WRITTEN by the prefill: the decode posted no READ
        assert res.pushed_transfers == res.staged_transfers > 0 and res.direct_transfers == 0
        assert res.host_staged_transfers == 0


@pytest.mark.nixl
@nixl
@pytest.mark.parametrize("path", ["direct", "direct-optimistic", "staged", "host", "push"])
@pytest.mark.parametrize("case", list(ORACLE))
def test_every_path_is_byte_exact_between_processes(case, path):
    """``direct-optimistic``: READs posted beside their acquire (``optimistic_reads``); ``direct``: the
    default (posted once the pin is granted)."""
    from kvbridge.testing.demo import run_demo
    prefill, decode = ORACLE[case]()
    opts: dict[str, object] = {"probe_ms": 200.0}  # (a busy test machine: see the next test)
    if path != "direct":
        opts["optimistic_reads"] = path == "direct-optimistic"
    res = run_demo(prefill, decode, num_requests=4, max_tokens=300, seed=11, show_progress=False,
                   transfer_mode=path.split("-")[0], decode_options=opts)
    _check(res, path)
    path = path.split("-")[0]
    for per in res.links.values():  # a forced path is what every pair reports as chosen, with measured figures
        for link in per["prefill-0"].values():
            assert link["chosen"] == path and link["source"] == "probe"
            # forced direct: no staging buffers on the decode rank, so direct is the only path it offers
            assert set(link["paths"]) == ({"direct"} if path == "direct" else {"direct", "staged", "host", "push"})


@pytest.mark.nixl
@nixl
@pytest.mark.parametrize("slow,want", [("device:read:2:500,*:write:2:500", "host"), ("host:read:2:500", "not host"),
                                       ("*:read:20:5000", "push"), ("*:write:2:500", "not push")])
def test_a_slow_path_flips_the_choice_stays_exact_and_is_named(monkeypatch, tmp_path, slow, want):
    """``KVBRIDGE_DELAY_LINK`` (set for both engines' processes: READ rules slow the decode ranks' READs,
    WRITE rules the prefill ranks' WRITEs) makes one memory kind or one direction slow (2 ms + 500 ms per
    MiB, ~0.002 GB/s, far below any noise of a busy machine; every READ slow: 20 ms + 5 s per MiB, as a push's
    fixed cost is learned from the reads, and on a loaded machine it has exceeded a slowed small direct
    READ's 2 ms + 500 ms/MiB). Device READs and pushes slow: every pair
    moves over host staging and the warning names the device path. Host READs slow: none does, and
    nothing warns. Every READ slow: the push probe measured the WRITEs fast and every pair pushes. Every
    WRITE slow: the push probe measured them slow and no pair pushes."""
    from kvbridge.testing.demo import run_demo
    monkeypatch.setenv("KVBRIDGE_DELAY_LINK", slow)
    prefill, decode = ORACLE["swa+fa P4->D2"]()
    # a probe budget of 200 ms (default 50): this test machine runs many processes on two cores
    res = run_demo(prefill, decode, num_requests=4, max_tokens=300, seed=5, show_progress=False,
                   transfer_mode="auto", metrics_dir=str(tmp_path), decode_options={"probe_ms": 200.0})
    _check(res, "auto")
    links = [link for per in res.links.values() for link in per["prefill-0"].values()]
    print(json.dumps(links, indent=1))  # (shown when the test fails)
    assert links and all(link["source"] == "probe" for link in links)
    # every pair offers push and measured it with the push probe (a WRITE, timed round trip)
    assert all(link["paths"]["push"]["measured"] for link in links)
    if want == "host":
        assert res.host_staged_transfers == res.staged_transfers > 0 and res.direct_transfers == 0
        for link in links:
            assert link["chosen"] == "host"
            if link["paths"]["direct"]["measured"]:
                assert link["paths"]["host"]["gbps"] > 10 * link["paths"]["direct"]["gbps"]
            if link["warning"] or link["paths"]["host"]["measured"]:  # (an unmeasured host path compares nothing)
                assert "device path" in link["warning"] and "CUDA IPC" in link["warning"]
        assert any(link["warning"] for link in links)
        prom = (tmp_path / "decode.prom").read_text()
        degraded = [line for line in prom.splitlines() if line.startswith("kvbridge_link_degraded{")]
        assert len(degraded) == len(links) and any(line.endswith(" 1") for line in degraded)
        assert 'engine="decode-0",peer="prefill-0",pp="0",prefill="(0, 0)",tp="0"' in degraded[0]
        assert 'path="host"' in prom and "kvbridge_link_chosen" in prom and "kvbridge_link_us_per_desc" in prom
        warned = sum(1 for link in links if link["warning"])  # (a re-handshake would warn its new links again)
        assert sum(int(line.rsplit(" ", 1)[1]) for line in prom.splitlines()
                   if line.startswith("kvbridge_degraded_links_total{")) >= warned > 0
    elif want == "not host":
        assert res.host_staged_transfers == 0
        for link in links:
            assert link["chosen"] != "host" and link["warning"] == ""
            if link["paths"]["host"]["measured"]:
                assert link["paths"]["host"]["gbps"] < link["paths"]["direct"]["gbps"]
    elif want == "push":  # every transfer WRITTEN by the prefill, byte-exact (_check)
        assert res.pushed_transfers == res.staged_transfers > 0 and res.direct_transfers == 0
        assert res.host_staged_transfers == 0
        for link in links:
            assert link["chosen"] == "push"
            pulls = [f["gbps"] for p, f in link["paths"].items() if p != "push" and f["measured"]]
            assert pulls and link["paths"]["push"]["gbps"] > 10 * max(pulls)
    else:
        assert res.pushed_transfers == 0
        for link in links:
            assert link["chosen"] != "push"
            assert link["paths"]["push"]["gbps"] * 10 < link["paths"]["direct"]["gbps"]


@pytest.mark.nixl
@nixl
def test_plan_probe_measures_a_local_pair(capsys):
    from kvbridge.cli import main
    assert main(["plan", "--model", "tiny-dense", "--prefill-tp", "2", "--decode-tp", "1", "--probe", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    links = out["(0, 0)"]
    assert set(links) == {"(0, 0)", "(0, 1)"}
    for link in links.values():
        assert link["chosen"] in ("direct", "staged", "host", "push") and link["source"] == "probe"
        assert link["probe_ms"] > 0 and 0 < link["probe_bytes"] <= 64 << 20  # (times are not asserted)
        for f in link["paths"].values():
            assert f["measured"] and f["gbps"] > 0 and f["us_per_desc"] > 0


@pytest.mark.nixl
@nixl
def test_plan_probe_against_live_endpoints(capsys):
    """``--endpoints``: the decode ranks run in this process and probe a prefill engine already serving."""
    from kvbridge.cli import main
    from kvbridge.testing.procs import EngineProcs
    P = EngineProcs.start("prefill", _eng("tiny-dense", 2), "live-p")
    try:
        eps = ";".join(f"{r[0]},{r[1]}={ep}" for r, ep in P.endpoints().items())
        assert main(["plan", "--model", "tiny-dense", "--prefill-tp", "2", "--decode-tp", "1", "--endpoints", eps,
                     "--prefill-engine-id", "live-p", "--transfer-mode", "host", "--json"]) == 0
    finally:
        P.stop()
    links = json.loads(capsys.readouterr().out)["(0, 0)"]
    assert set(links) == {"(0, 0)", "(0, 1)"}
    assert all(link["chosen"] == "host" and link["paths"]["host"]["measured"] for link in links.values())


def test_plan_probe_endpoints_are_checked(capsys):
    from kvbridge.cli import main
    assert main(["plan", "--model", "tiny-dense", "--endpoints", "0,0=nowhere"]) == 2
    assert "expected PP,TP=HOST:PORT" in capsys.readouterr().err


def test_chosen_paths_are_transfer_path_members():
    """The cost model's choices are :class:`TransferPath` members (each ``==`` its string), never bare strings."""
    from kvbridge.cost import CostModel, PairShape, model_link, pick, request_modes

    m = CostModel.load()
    shapes = {(0, 0): PairShape(64.0, 0.0, float(1 << 20), 0.0, 0.0), (0, 1): PairShape(1.0, 0.0, 64.0, 0.0, 0.0)}
    picked = pick(m, 64.0, float(1 << 20))
    assert type(picked) is TransferPath and picked in PATHS_OF_PICK
    for links in (None, {p: model_link(m) for p in shapes}):
        got = request_modes(m, shapes, 4.0, 0.0, lambda p: p == (0, 0), links)
        assert got[(0, 1)] is TransferPath.DIRECT  # no staging on that pair
        assert all(type(v) is TransferPath for v in got.values()), got


PATHS_OF_PICK = (TransferPath.DIRECT, TransferPath.STAGED)
