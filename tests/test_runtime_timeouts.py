"""Timeouts measure the peer, not the local queue; counters are true (issue 20, points 3 and 6).

Real prefill rank processes over NIXL and an in-process decode rank; bytes checked against the oracle.
"""
from __future__ import annotations

import threading
import time

import pytest
from _helpers import (
    Cluster,
    Jobs,
    blocks_for,
    expected_traffic,
    inproc_decode,
    layout,
    publish,
    until,
    wait_freed,
)

from kvbridge.errors import LeaseExpired
from kvbridge.runtime.readstate import ReadState
from kvbridge.testing.procs import verify_rank
from kvbridge.transport.nixl import nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")]


def test_a_long_local_post_queue_does_not_fail_healthy_requests():
    """32 healthy requests, ``transfer_timeout_s`` 2 s. The decode's post thread is busy for 3 s (as
    behind one long post) after every pin was granted: the reads wait in our own queue longer than the
    timeout, and all 32 still finish, byte-exact (a read's deadline runs from when it was posted, or
    from the peer's last progress, never from the grant)."""
    n = 32
    pl = layout("prefill", 2, blocks_for([64] * n, 16))
    dl = layout("decode", 1, blocks_for([64] * n, 16))
    jobs = Jobs(dl, seed=51)
    jobs.engine("pT", pl)
    with Cluster() as c:
        (P,) = c.start_many([("prefill", pl, "pT")])
        js = jobs.make("pT", n, lengths=[64] * n, prefix_p=0.0)
        publish(P, js)
        # every read through the (held) post thread: a small read is otherwise posted inline when it is idle
        with inproc_decode(dl, "dT", transfer_timeout_s=2.0, stage_timeout_s=30.0, inline_post_bytes=0) as dec:
            dec.handshake("pT", P.endpoints())
            gate = threading.Event()
            dec.transport._pool.submit(gate.wait, 30)  # fault injection: the (single) post thread is taken
            try:
                for j in js:
                    dec.start(j.read())

                def granted():
                    dec.poll()
                    return all(rr.state is ReadState.POSTED for f in dec.inflight.values() for rr in f.ranks.values())
                until(granted, 20, "every pin to be granted", 0.001)
                t0 = time.monotonic()
                while time.monotonic() - t0 < 3.0:  # longer than transfer_timeout_s, polling all along
                    d, f = dec.poll()
                    assert not d and not f, (d, f)
                    time.sleep(0.01)
            finally:
                gate.set()
            done, failed = dec.wait(60)
            print(f"local queue: {len(done)} of {n} finished after their reads waited 3 s in our post queue "
                  f"(transfer_timeout_s 2 s); {len(failed)} failed")
            assert not failed and sorted(done) == sorted(j.rid for j in js), failed
            assert verify_rank(dec, [(j.num, j.read()) for j in js])["mismatched_bytes"] == 0
            wait_freed(P, {j.rid for j in js})


def test_counters_match_a_known_run():
    """A known run on one decode rank: 6 requests read, 2 that fail at once (no lease attempt), one of
    them started again and failing again (a retry: still one failed request), 1 refused by the prefill
    (a wrong attempt), 1 aborted in flight and 1 released before it started. The counters say exactly
    that; transfers, bytes and descriptors are those of the lowering, each read counted once; the
    prefill frees 6 + 1 + 1 leases and counts the refusal; quantiles come from the histogram."""
    pl = layout("prefill", 1, blocks_for([40] * 12, 16))
    dl = layout("decode", 1, blocks_for([40] * 12, 16))
    jobs = Jobs(dl, seed=52)
    jobs.engine("pM", pl)
    with Cluster() as c:
        (P,) = c.start_many([("prefill", pl, "pM")])
        ok = jobs.make("pM", 6, lengths=[40] * 6, prefix_p=0.0)
        bad = jobs.make("pM", 2, lengths=[40] * 2, prefix_p=0.0, tag="noatt")
        (wrong,) = jobs.make("pM", 1, lengths=[40], prefix_p=0.0, tag="wrong")
        (ab,) = jobs.make("pM", 1, lengths=[40], prefix_p=0.0, tag="abort")
        (rel,) = jobs.make("pM", 1, lengths=[40], prefix_p=0.0, tag="rel")
        publish(P, ok + [wrong, ab, rel])
        with inproc_decode(dl, "dM", register_grace_s=0.2) as dec:
            dec.handshake("pM", P.endpoints())
            for j in ok:
                dec.start(j.read())
            for j in bad:
                dec.start(j.read(attempt=0))
            dec.start(bad[0].read(attempt=0))  # the engine retries one of them: fails again
            dec.start(wrong.read(attempt=wrong.attempt ^ 0x55))
            dec.start(ab.read())
            dec.abort(ab.rid)
            dec.release(rel.read())
            done, failed = {}, {}
            t_end = time.monotonic() + 30
            while (len(done) < 6 or len(failed) < 3) and time.monotonic() < t_end:
                d, f = dec.poll()
                done.update(dict.fromkeys(d))
                failed |= f
            assert sorted(done) == sorted(j.rid for j in ok), failed
            assert set(failed) == {bad[0].rid, bad[1].rid, wrong.rid}
            assert all(isinstance(x, LeaseExpired) for x in failed.values())
            m = dec.metrics
            want = expected_traffic(pl, dl, ok)
            print(f"counters: {m.finished_requests} finished, {m.failed_requests} failed "
                  f"({m.retried_failures} retried failures), {m.aborted_requests} aborted, {m.transfers} transfers")
            assert (m.finished_requests, m.failed_requests, m.retried_failures, m.aborted_requests) == (6, 3, 1, 2)
            # transfers posted: the reads' own, plus (optimistic reads) the wrong attempt's READ posted beside
            # its acquire before the refusal (never counted in bytes or descriptors: it did not complete)
            early = expected_traffic(pl, dl, [wrong])["transfers"] if dec.config.optimistic_reads else 0
            assert (m.transfers, m.transfer_bytes, m.descriptors) == (
                want["transfers"] + early, want["transfer_bytes"], want["descriptors"])
            assert m.optimistic_reads == (want["transfers"] + early if dec.config.optimistic_reads else 0)
            assert m.transfer_hist.count == 6 and sum(m.transfer_hist.counts) == 6
            js = m.to_json()
            assert 0 < js["transfer_seconds_p50"] <= js["transfer_seconds_p90"]
            assert js["transfer_seconds_count"] == 6
            wait_freed(P, {j.rid for j in ok} | {rel.rid})
            until(lambda: P.call_all("stats")[(0, 0)]["leases"] == 1, 10, "the aborted request's lease to go")
            pm = P.call_all("stats")[(0, 0)]["metrics"]
            assert pm["freed_requests"] == 8 and pm["refused_reads"] == 1 and pm["stale_messages"] == 1
            assert pm["forged_messages"] == 0 and pm["unknown_notifications"] == 0
