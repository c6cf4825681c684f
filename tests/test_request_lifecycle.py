"""Request lifecycle: abort, lease expiry, late reads, full prefix hits, requests settled without
posting; in-process ranks release everything they took (load, 1,000 requests in flight:
tests/test_faults.py).

Every test drives real rank processes (:mod:`kvbridge.testing.procs`, one process per rank, NIXL/UCX
over host memory) or in-process ranks, checks moved bytes against the oracle (``verify``), and bounds
every wait with an explicit deadline (no pytest-timeout plugin); helpers in ``_helpers.py``, the shared
prefill/decode ``pair`` fixture (one per module) in ``conftest.py``.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from _helpers import Jobs, collect, hold, inproc_decode, layout, needed_bytes, publish, served, until, wait_freed

from kvbridge.errors import LeaseExpired
from kvbridge.lower import GroupBlocks
from kvbridge.runtime.config import DecodeConfig
from kvbridge.runtime.decode import DecodeRank
from kvbridge.runtime.prefill import PrefillRank
from kvbridge.testing.engine import buffer_of, default_memory
from kvbridge.testing.oracle import SENTINEL
from kvbridge.testing.procs import verify_rank
from kvbridge.transport.nixl import nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")]


def test_abort_frees_prefill_blocks(pair):
    # never started: the decode tells the prefill it will not read
    j = pair.jobs.make("pm", 1, tag="ab")[0]
    publish(pair.P, [j])
    pair.D.call_all("abort", j.rid, readers_of=j.read())
    wait_freed(pair.P, {j.rid})
    # in flight: abort right after posting; its blocks are then read again in full (oracle stays exact)
    big = pair.jobs.make("pm", 1, lengths=[64], prefix_p=0.0, tag="abf")[0]
    exp = publish(pair.P, [big])
    D = next(iter(pair.D.workers.values()))
    # start and abort in one call: with no poll in between the read is surely still in flight (two
    # calls raced: a small read can complete between them)
    assert D.call("start_abort", big.read(exp[big.rid])) is True
    wait_freed(pair.P, {big.rid})
    s = D.call("stats")
    assert s["inflight"] == 0 and s["live_handles"] == 0 and s["metrics"]["aborted_requests"] >= 2
    fin, failed = collect(pair.D, 5)
    assert big.rid not in fin and big.rid not in failed, failed  # an aborted request is not reported
    pair.roundtrip([big.renamed(big.rid + "-again")])
    assert pair.verify()["mismatched_bytes"] == 0


def test_unread_requests_expire_on_prefill(pair):
    jobs = pair.jobs.make("pm", 3, tag="exp")
    before = {r: s["metrics"]["expired_requests"] for r, s in pair.P.call_all("stats").items()}
    t0 = time.monotonic()
    publish(pair.P, jobs, lease_s=0.5)
    seen = wait_freed(pair.P, {j.rid for j in jobs}, timeout=5, key="expired")
    assert time.monotonic() >= t0 + 0.5
    for r, s in pair.P.call_all("stats").items():
        assert s["metrics"]["expired_requests"] == before[r] + 3
        assert not (seen[r]["freed"] & {j.rid for j in jobs})


def test_late_read_is_refused_without_posting(pair):
    D = next(iter(pair.D.workers.values()))
    j = pair.jobs.make("pm", 1, tag="late")[0]
    before = D.call("stats")
    D.call("start", j.read(0))  # no lease attempt: refused at once, nothing asked or posted
    done, failed = D.call("wait", 5.0)
    assert j.rid in failed and isinstance(failed[j.rid], LeaseExpired) and j.rid not in done
    assert "attempt" in str(failed[j.rid])
    after = D.call("stats")
    assert after["metrics"]["transfers"] == before["metrics"]["transfers"]
    assert after["nixl"]["handles_created"] == before["nixl"]["handles_created"]
    assert after["metrics"]["failed_requests"] == before["metrics"]["failed_requests"] + 1
    # the prefill's lease ran out (its clock alone decides): its refusal fails the read. Pinned reads post
    # nothing; an optimistic read (the default) posted its READ beside the acquire: at most its own blocks
    # were written, and a read of them under a live lease makes them exact again
    j2 = pair.jobs.make("pm", 1, tag="late")[0]
    publish(pair.P, [j2], lease_s=0.2)
    wait_freed(pair.P, {j2.rid}, timeout=5, key="expired")
    optimistic = DecodeConfig().optimistic_reads  # (the pair's decode runs the default config)
    D.call("start", j2.read())
    failed = D.call("wait", 5.0)[1]
    assert isinstance(failed.get(j2.rid), LeaseExpired), failed
    created = D.call("stats")["nixl"]["handles_created"] - before["nixl"]["handles_created"]
    mismatched = pair.verify()["mismatched_bytes"]
    if not optimistic:
        assert created == 0 and mismatched == 0  # nothing was posted, nothing written
    else:
        assert created <= len(pair.P.workers) and mismatched <= needed_bytes(pair.pl, pair.dl, [j2])
        pair.roundtrip([j2.renamed(j2.rid + "-again")])
        assert pair.verify()["mismatched_bytes"] == 0


def test_full_prefix_hit_moves_nothing_and_frees_prefill(pair):
    """The decode already holds every block (prefix-cache hit): no read is posted, the request
    finishes, and each prefill rank is told to free its blocks."""
    D = next(iter(pair.D.workers.values()))
    hit = pair.jobs.make("pm", 1, lengths=[8], prefix_p=0.0, tag="hit")[0]
    hit = replace(hit, req=replace(hit.req, decode_blocks={"full": GroupBlocks(np.empty(0, dtype=np.int64), 2)}))
    exp = publish(pair.P, [hit])
    before = D.call("stats")
    D.call("start", hit.read(exp[hit.rid]))
    done, failed = D.call("wait", 5.0)
    assert hit.rid in done and not failed
    after = D.call("stats")
    assert after["metrics"]["transfers"] == before["metrics"]["transfers"]
    assert after["nixl"]["handles_created"] == before["nixl"]["handles_created"]
    assert after["metrics"]["finished_requests"] == before["metrics"]["finished_requests"] + 1
    wait_freed(pair.P, {hit.rid})
    assert pair.verify()["mismatched_bytes"] == 0


def test_take_reports_requests_settled_without_posting(pair):
    D = next(iter(pair.D.workers.values()))
    late = pair.jobs.make("pm", 1, tag="take-late")[0]
    D.call("start", late.read(0))
    # a full prefix hit: the decode already has every block, nothing to read
    hit = pair.jobs.make("pm", 1, lengths=[8], prefix_p=0.0, tag="take-hit")[0]
    hit_req = replace(hit.req, decode_blocks={"full": GroupBlocks(np.empty(0, dtype=np.int64), 2)})
    hit = replace(hit, req=hit_req)
    exp = publish(pair.P, [hit])
    D.call("start", hit.read(exp[hit.rid]))
    got_done, got_failed = [], {}
    try:
        def settled():
            d, f = D.call("take")
            got_done.extend(d)
            got_failed.update(f)
            return late.rid in got_failed and hit.rid in got_done
        until(settled, 3.0, "take to report both requests")
    finally:
        D.call("wait", 1.0)  # drain whatever 'take' did not report, for the next tests


def test_inprocess_ranks_release_everything():
    """Prefill and decode ranks in this process (two NIXL agents): bytes verify, and after close the
    transport counters balance: handles, peers, registered regions."""
    pl, dl = layout("prefill", 1, 128), layout("decode", 1, 128)
    jobs = Jobs(dl, seed=5)
    jobs.engine("pi", pl)
    pre = PrefillRank(pl, (0, 0), memory=default_memory(pl, (0, 0)), engine_id="pi")
    dec = None
    try:
        with served(pre) as lock:
            # direct: one READ per request (auto may pick a staged path, or push, which posts none here)
            dec = DecodeRank(dl, (0, 0), memory=default_memory(dl, (0, 0)), engine_id="di", transfer_mode="direct")
            buffer_of(dec.mem).fill(SENTINEL)
            dec.handshake("pi", {(0, 0): f"127.0.0.1:{pre.port}"})
            probe_handles = dec.transport.stats.handles_created  # the link probe's reads, at handshake
            assert dec.prober.buffers > 0 and probe_handles > 0
            js = jobs.make("pi", 8)
            for j in js:
                e = hold(pre, lock, j)
                dec.start(j.read(e))
            done, failed = dec.wait(20)
            assert set(done) == {j.rid for j in js} and not failed
            assert verify_rank(dec, [(j.num, j.read()) for j in js])["mismatched_bytes"] == 0
            freed = set()

            def all_freed():
                dec.poll()  # (a read completed on its lease's tag lets its late grant go: runtime/tags.py)
                with lock:
                    freed.update(pre.take_freed()["freed"])
                return freed >= {j.rid for j in js}

            until(all_freed, 10, "in-process prefill to free")
            assert dec.stats()["live_handles"] == 0
    finally:
        if dec is not None:
            dec.close()
        pre.close()
    for rank in (pre, dec):  # the KV buffer, the device and host staging buffers, the decode's probe buffers
        t, s = rank.transport, rank.transport.stats
        probe = rank.prober.buffers if rank is dec else 0
        # (+1: the prefill's lease tags, the decode's tag-check buffer)
        regions = 1 + bool(rank.staging.size) + bool(rank.host_staging.size) + probe + 1
        assert s.regions_registered == s.regions_deregistered == regions, (s, regions)
        assert s.handles_created == s.handles_released and s.peers_added == s.peers_removed, s
        assert t.live_handles() == 0
    # one READ per request, and a lease-tag READ for each that ended before its grant (runtime/tags.py)
    assert dec.transport.stats.handles_created == probe_handles + 8 + dec.metrics.tag_checks


@pytest.mark.parametrize("optimistic", [True, False])
def test_a_failed_read_is_reported_only_once_its_read_settled(pair, optimistic):
    """A read refused (its lease ran out) while its optimistic READ is still running is reported failed only
    once that READ has ended, so the engine never reuses or recomputes into blocks a late write could still
    land in; pinned, nothing was posted and the refusal is reported at once. Nothing leaks either way."""
    from kvbridge.transport.delayed import DelayedTransport, LinkDelay
    from kvbridge.transport.nixl import NixlTransport

    hold_s = 0.6
    transport = DelayedTransport(NixlTransport(f"dz{int(optimistic)}-d0t0"), [LinkDelay("device", "read", hold_s)])
    j = pair.jobs.make("pm", 1, tag=f"held{int(optimistic)}")[0]
    publish(pair.P, [j], lease_s=0.2)
    wait_freed(pair.P, {j.rid}, timeout=5, key="expired")
    with inproc_decode(pair.dl, f"dz{int(optimistic)}", transport=transport, optimistic_reads=optimistic,
                       probe_ms=0) as dec:
        dec.handshake("pm", pair.P.endpoints())
        t0 = time.monotonic()
        dec.start(j.read())
        failed: dict = {}
        while not failed and time.monotonic() < t0 + 10:
            failed = dec.poll()[1]
            held = dec.stats()["held_failures"]
            time.sleep(0.005)
        took = time.monotonic() - t0
        print(f"optimistic={optimistic}: refused read reported after {took:.3f} s (READ held {hold_s} s); "
              f"{dec.metrics.transfers} READs posted")
        assert list(failed) == [j.rid] and isinstance(failed[j.rid], LeaseExpired), failed
        if optimistic:
            assert dec.metrics.transfers >= 1 and took >= hold_s * 0.9, took
        else:
            assert dec.metrics.transfers == 0 and took < hold_s, took
        assert held == 0
        until(lambda: dec.poll() is not None and dec.stats()["live_handles"] == 0
              and dec.stats()["parked_reads"] == 0, 5, "the read's handles to be released")


def test_an_optimistic_read_completes_on_the_lease_tag_while_the_prefill_does_not_serve():
    """The prefill's serving thread does not run (a busy engine starving it): each decode's optimistic READ
    ends, a READ of its lease's tag (runtime/tags.py) finds the lease live, and the read completes with no
    answer from the prefill; the bytes verify. Once the prefill serves again the late grants are let go
    and every lease is freed. A lease that ended before its read has no tag: that read waits for the
    prefill's answer and fails typed."""
    pl, dl = layout("prefill", 1, 128), layout("decode", 1, 128)
    jobs = Jobs(dl, seed=7)
    jobs.engine("pt", pl)
    pre = PrefillRank(pl, (0, 0), memory=default_memory(pl, (0, 0)), engine_id="pt")
    dec = None
    try:
        with served(pre):  # the handshake needs the prefill's answer
            dec = DecodeRank(dl, (0, 0), memory=default_memory(dl, (0, 0)), engine_id="dt", transfer_mode="direct",
                             tag_checks=True)
            buffer_of(dec.mem).fill(SENTINEL)
            dec.handshake("pt", {(0, 0): f"127.0.0.1:{pre.port}"})
        idle = threading.Lock()  # nobody serves the prefill from here
        js = jobs.make("pt", 3)
        for j in js:
            dec.start(j.read(hold(pre, idle, j)))
        done: set = set()
        deadline = time.monotonic() + 20
        while len(done) < 3 and time.monotonic() < deadline:
            got, failed = dec.wait(max(0.0, deadline - time.monotonic()))
            assert not failed, failed
            done.update(got)
        assert done == {j.rid for j in js}
        assert dec.metrics.checked_reads == 3 and dec.metrics.tag_checks == 3
        assert verify_rank(dec, [(j.num, j.read()) for j in js])["mismatched_bytes"] == 0
        assert set(pre.leases) == {j.rid for j in js} and len(pre.tags) == 3  # nothing answered: all held
        freed: set = set()
        with served(pre) as lock:
            def all_freed():
                dec.poll()  # (the decode's loop lets the late grants go)
                with lock:
                    freed.update(pre.take_freed()["freed"])
                return freed >= {j.rid for j in js}
            until(all_freed, 10, "the prefill to free the checked reads' leases (their grants let go)")
            assert len(pre.tags) == 0 and not pre.tags.words.any()
            late = jobs.make("pt", 1)[0]
            e = hold(pre, lock, late, lease_s=0.05)
            until(lambda: late.rid not in pre.leases, 5, "the lease to expire")
        dec.start(late.read(e))
        t0 = time.monotonic()
        while time.monotonic() < t0 + 0.5:  # its READ ends, its tag is gone: it waits for the prefill
            got, failed = dec.poll()
            assert not got and not failed
            time.sleep(0.01)
        assert dec.metrics.tag_checks == 4 and dec.metrics.checked_reads == 3
        with served(pre):
            failed = {}
            until(lambda: failed.update(dec.poll()[1]) or failed, 10, "the refusal")
        assert isinstance(failed[late.rid], LeaseExpired), failed
        until(lambda: dec.poll() is not None and dec.stats()["live_handles"] == 0, 5, "handles released")
    finally:
        if dec is not None:
            dec.close()
        pre.close()

