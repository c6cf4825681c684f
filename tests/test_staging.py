"""Staged reads: a packed stream that does not match the decode's lowering, stage requests waiting for
staging space (or refused and read directly), many segments per request, parked stage requests of
aborted requests, stage requests that cannot be queued, packing that fails on the prefill.

Every test drives real rank processes (:mod:`kvbridge.testing.procs`, one process per rank, NIXL/UCX
over host memory) or in-process ranks, checks moved bytes against the oracle (``verify``), and bounds
every wait with an explicit deadline (no pytest-timeout plugin); helpers in ``_helpers.py``, the shared
prefill/decode ``pair`` fixture (one per module) in ``conftest.py``.
"""
from __future__ import annotations

import time

import pytest
import zmq
from _helpers import Jobs, hold, inproc_decode, layout, parked_stage_requests, served, until

from kvbridge.errors import TransferTimeout
from kvbridge.lower import LoweredPlan
from kvbridge.plan import plan_transfer
from kvbridge.runtime.decode import DecodeRank
from kvbridge.runtime.prefill import PrefillRank
from kvbridge.testing.engine import buffer_of, default_memory
from kvbridge.testing.oracle import SENTINEL
from kvbridge.testing.procs import verify_rank
from kvbridge.transport.nixl import nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")]


def test_staged_reply_that_does_not_match_our_lowering_fails_the_request():
    """A prefill whose packed stream does not match this decode rank's lowering (another release,
    another run order) fails the request with a clear reason instead of scattering bytes to the wrong
    places; the prefill is told, nothing is left in flight."""
    from kvbridge.runtime.protocol import Staged
    pl, dl = layout("prefill", 1, 128), layout("decode", 1, 128)
    jobs = Jobs(dl, seed=10)
    jobs.engine("pw", pl)
    pre = PrefillRank(pl, (0, 0), memory=default_memory(pl, (0, 0)), engine_id="pw")
    try:
        with served(pre) as lock, inproc_decode(dl, "dw", transfer_mode="staged") as dec:
            dec.handshake("pw", {(0, 0): f"127.0.0.1:{pre.port}"})
            (j,) = jobs.make("pw", 1, lengths=[40])
            e = hold(pre, lock, j)
            with lock:  # fault injection: the prefill's stage handler (PrefillRank._stage) answers a wrong stream
                pre._stage = lambda msg, envelope: iter([Staged(msg.req_id, pre.staging_addr, 64, 0, 64, True)])
            dec.start(j.read(e))
            done, failed = dec.wait(5)
            assert not done and "lower differently" in str(failed[j.rid])
            s = dec.stats()
            assert s["inflight"] == 0 and s["live_handles"] == 0 and dec.slots.bytes_used == 0
    finally:
        pre.close()


def _room_for_one(engine_id: str, decode_tp: int, seed: int, slack: int, wait_s: float):
    """A TP1 prefill whose staging buffer holds one 64-token request (plus ``slack`` bytes), and two such
    requests: ``(pl, dl, jobs, js, pre, one)`` (``one``: the request's packed bytes)."""
    pl, dl = layout("prefill", 1, 64), layout("decode", decode_tp, 64)
    jobs = Jobs(dl, seed=seed)
    jobs.engine(engine_id, pl)
    js = jobs.make(engine_id, 2, lengths=[64, 64], prefix_p=0.0)
    one = LoweredPlan(plan_transfer(pl, dl), (0, 0)).descriptors(64, js[0].req.prefill_blocks,
                                                                  js[0].req.decode_blocks)[0].total_bytes
    pre = PrefillRank(pl, (0, 0), memory=default_memory(pl, (0, 0)), engine_id=engine_id,
                      staging_bytes=one + slack, stage_wait_s=wait_s, staging_peer_share=1.0)
    return pl, dl, jobs, js, pre, one


@pytest.mark.parametrize("wait_s", [2.0, 0.0])
def test_stage_request_waits_for_staging_space_instead_of_falling_back(wait_s):
    """The prefill's staging buffer holds one request: a second stage request waits until the first
    one's Done frees the slot (stage_wait_s > 0), or is refused at once and read directly
    (stage_wait_s = 0). Either way every byte arrives and nothing leaks."""
    pl, dl, jobs, js, pre, one = _room_for_one("ps", 1, 11, 4096, wait_s)
    dec = None
    try:
        with served(pre) as lock:
            dec = DecodeRank(
                dl,
                (0, 0),
                memory=default_memory(dl, (0, 0)),
                engine_id="ds",
                transfer_mode="staged",
                staging_bytes=4 * one,
            )
            buffer_of(dec.mem).fill(SENTINEL)
            dec.handshake("ps", {(0, 0): f"127.0.0.1:{pre.port}"})
            for j in js:
                hold(pre, lock, j)
            for j in js:
                dec.start(j.read())
            done, failed = dec.wait(20)
            assert set(done) == {j.rid for j in js} and not failed, failed
            assert verify_rank(dec, [(j.num, j.read()) for j in js])["mismatched_bytes"] == 0
            until(lambda: not pre.leases and not parked_stage_requests(pre, lock), 10, "prefill to free both requests")
            with lock:
                pm = pre.metrics
                assert pre.slots.bytes_used == 0
        dm = dec.metrics
        if wait_s:
            assert pm.stage_waits >= 1 and pm.stage_full == 0
            assert dm.staged_transfers == 2 and dm.staging_fallbacks == 0
        else:
            assert pm.stage_waits == 0 and pm.stage_full >= 1
            assert dm.staging_fallbacks >= 1 and dm.staged_transfers + dm.staging_fallbacks == 2
        assert dec.stats()["live_handles"] == 0
    finally:
        if dec is not None:
            dec.close()
        pre.close()


def test_staged_transfer_in_many_segments_is_exact():
    """Small stage segments: each request arrives as many packed segments, read and scattered as they
    come (possibly out of order); every byte lands where the oracle says, one Done per request."""
    pl, dl = layout("prefill", 1, 96), layout("decode", 2, 96)  # head slices: 2 of the prefill's 4 heads
    jobs = Jobs(dl, seed=12)
    jobs.engine("pm", pl)
    js = jobs.make("pm", 3, lengths=[64, 37, 90], prefix_p=0.5)
    pre = PrefillRank(pl, (0, 0), memory=default_memory(pl, (0, 0)), engine_id="pm")
    try:
        with served(pre) as lock, inproc_decode(dl, "dm", transfer_mode="staged", stage_segment_bytes=4096) as dec:
            dec.handshake("pm", {(0, 0): f"127.0.0.1:{pre.port}"})
            for j in js:
                hold(pre, lock, j)
                dec.start(j.read())
            done, failed = dec.wait(20)
            assert set(done) == {j.rid for j in js} and not failed, failed
            assert verify_rank(dec, [(j.num, j.read()) for j in js])["mismatched_bytes"] == 0
            m = dec.metrics
            assert m.staged_transfers == 3 and m.staging_fallbacks == 0
            assert m.transfers >= 3 + 8  # several segment reads per request
            assert m.transfer_bytes == sum(x.total_bytes for j in js for x in LoweredPlan(
                plan_transfer(pl, dl), (0, 0)).descriptors(j.req.num_tokens, j.req.prefill_blocks, j.req.decode_blocks))
            # decode rank (0, 1) reads the other heads and never comes here: the leases stay, with one
            # Done each, and the prefill's staging slots are back
            def done_here():
                with lock:
                    return pre.slots.bytes_used == 0 and all(
                        pre.leases[j.rid].done_ranks == {("dm", (0, 0))} for j in js)
            until(done_here, 10, "the prefill to get one Done per request and free its staging slots")
            assert dec.stats()["live_handles"] == 0 and dec.slots.bytes_used == 0
    finally:
        pre.close()


class _FullSocket:
    """Stands in for a stage socket whose send queue is full (zmq.Again on a non-blocking send)."""

    def __init__(self, real):
        self.real, self.sent = real, 0

    def send_multipart(self, frames, flags=0):
        self.sent += 1
        raise zmq.Again()

    def recv_multipart(self, flags=0):
        raise zmq.Again()

    def close(self, linger=None):
        self.real.close(0)


def test_side_channel_message_that_cannot_be_queued_does_not_block_and_fails_typed():
    """A stage request that ZMQ cannot queue without blocking (peer gone, queue full) does not block the
    decode loop; it is retried on every poll, and with nothing getting through the request fails after
    stage_timeout_s with a typed TransferTimeout (no read without the prefill's pin); the engine then
    releases the requests (a decline each) and the prefill frees the blocks; nothing leaks."""
    pl, dl = layout("prefill", 1, 64), layout("decode", 1, 64)
    jobs = Jobs(dl, seed=13)
    jobs.engine("pq", pl)
    js = jobs.make("pq", 2, lengths=[30, 50], prefix_p=0.0)
    pre = PrefillRank(pl, (0, 0), memory=default_memory(pl, (0, 0)), engine_id="pq")
    try:
        with served(pre) as lock, inproc_decode(dl, "dq", transfer_mode="staged", stage_timeout_s=0.5) as dec:
            dec.handshake("pq", {(0, 0): f"127.0.0.1:{pre.port}"})
            remote = dec.remotes["pq"]
            full = remote.stage_socks[(0, 0)] = _FullSocket(remote.stage_socks[(0, 0)])
            for j in js:
                hold(pre, lock, j)
                t0 = time.monotonic()
                dec.start(j.read())
                assert time.monotonic() - t0 < 1.0  # did not block on the send
            done, failed = dec.wait(20)
            assert not done and set(failed) == {j.rid for j in js}, failed
            assert all(isinstance(f, TransferTimeout) and f.prefill_rank == (0, 0) for f in failed.values())
            assert full.sent >= 4  # retried on polls
            # a failed read holds no pin and sends nothing (the engine may retry it); the engine gives up
            # with release(): a decline each, and the prefill frees both (nobody else holds a pin)
            time.sleep(0.2)
            with lock:
                assert len(pre.leases) == 2 and not any(lease.pins for lease in pre.leases.values())
            for j in js:
                dec.release(j.read())
            until(lambda: not pre.leases, 10, "the prefill to free both requests (declined)")
            assert dec.stats()["live_handles"] == 0 and dec.metrics.transfers == 0
    finally:
        pre.close()


def test_parked_stage_request_of_an_aborted_request_is_dropped():
    """Decode TP 2 reads a TP 1 prefill (two readers per request). A stage request parked for staging
    space whose decode rank aborts meanwhile must not be packed later: no slot is taken for it, its lease
    is freed (the aborting rank's pin released, no other pin held), and the other request's slot comes
    back."""
    pl, dl, jobs, js, pre, _ = _room_for_one("pa", 2, 15, 256, 30.0)
    try:
        with served(pre) as lock, inproc_decode(dl, "da", transfer_mode="staged") as dec:
            dec.handshake("pa", {(0, 0): f"127.0.0.1:{pre.port}"})
            for j in js:
                hold(pre, lock, j)
                dec.start(j.read())

            def parked():
                with lock:
                    return [p.msg.req_id for p in pre.stager.parked]
            assert until(parked, 10, "the second stage request to park") == [js[1].rid]
            dec.abort(js[1].rid)
            done, failed = dec.wait(20)
            assert done == [js[0].rid] and not failed, failed

            def settled():
                with lock:
                    # the aborting rank released its pin (the parked stage request's): the read failed on
                    # that engine and no pin of it is held, so the lease is freed without rank (0, 1)
                    return (not pre.stats()["parked_stage_requests"] and pre.slots.bytes_used == 0
                            and js[1].rid not in pre.leases and js[1].rid in pre.freed)
            until(settled, 10, "the parked request to be dropped and the first slot freed")
            time.sleep(0.2)  # a late pack would show up now
            with lock:
                assert pre.slots.bytes_used == 0 and not pre.slots.used
            assert verify_rank(dec, [(js[0].num, js[0].read())])["mismatched_bytes"] == 0
    finally:
        pre.close()


def test_stage_request_failing_while_packing_does_not_stop_the_prefill(monkeypatch):
    """Packing raises (a bug, corrupt state): the prefill answers that one stage request with an error
    and keeps serving; the decode reads that request directly; the next request is staged normally."""
    from kvbridge.runtime.memhost import KVBytes
    pl, dl = layout("prefill", 1, 64), layout("decode", 2, 64)
    jobs = Jobs(dl, seed=16)
    jobs.engine("pf", pl)
    js = jobs.make("pf", 2, lengths=[40, 40], prefix_p=0.0)
    real_pack, calls = KVBytes.pack, []

    def flaky_pack(*a, **k):  # the prefill packs through its KV memory's KVBytes
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected packing failure")
        return real_pack(*a, **k)

    monkeypatch.setattr(KVBytes, "pack", flaky_pack)
    pre = PrefillRank(pl, (0, 0), memory=default_memory(pl, (0, 0)), engine_id="pf")
    try:
        with served(pre) as lock, inproc_decode(dl, "df", transfer_mode="staged") as dec:
            dec.handshake("pf", {(0, 0): f"127.0.0.1:{pre.port}"})
            for j in js:
                hold(pre, lock, j)
                dec.start(j.read())
                done, failed = dec.wait(20)
                assert done == [j.rid] and not failed, failed
            assert verify_rank(dec, [(j.num, j.read()) for j in js])["mismatched_bytes"] == 0
            assert dec.metrics.staging_fallbacks == 1 and dec.metrics.staged_transfers == 1
            with lock:
                assert pre.metrics.failed_stage_requests == 1
    finally:
        pre.close()
