"""The lease protocol under concurrency, retries and several readers, over NIXL (issue 20, point 1).

In-process prefill ranks served from a thread (``served``) and in-process decode ranks, talking over
real ZMQ side channels and NIXL/UCX; every read is checked byte for byte against the oracle:

* an acquire that reaches the prefill before the request is registered is refused ``not_registered``,
  retried by the decode, and read exactly; the refused try sends nothing that frees anything;
* two decode engines read the same request: one finishes (and aborts another read of the same request)
  while the other has its pin but has not read yet; the prefill, which refills blocks the moment it frees
  them (as an engine reuses them), keeps them until the last pin is released: the other's bytes are exact;
* vLLM ``n = 2``: two reads of one prefill request in one decode engine (distinct read ids);
* a forged GetMeta claiming a live reader's identity with another agent is refused; that reader's Done
  still frees its lease at once;
* 4,200 made-up identities do not evict a reader holding a pin;
* an aborted (never started) request's blocks are freed at once, unless another reader holds a pin;
* heartbeats keep a queued request's lease far past ``lease_s``; a dead decode's pins end on the
  ``lease_s`` scale.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import pytest
import zmq
from _helpers import Jobs, hold, inproc_decode, layout, until

from kvbridge.errors import HandshakeError, LeaseExpired, NotRegistered
from kvbridge.runtime import protocol
from kvbridge.runtime.decode import fetch_meta
from kvbridge.runtime.prefill import PrefillRank
from kvbridge.testing.engine import default_memory
from kvbridge.testing.procs import fill_rank, verify_rank
from kvbridge.transport.nixl import nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")]


@contextlib.contextmanager
def reusing_prefill(pl, engine_id: str, jobs: Jobs, **kw):
    """An in-process prefill rank served from a thread that behaves like an engine reusing memory: the
    moment a lease is freed or expires, its blocks are refilled with another request's bytes."""
    import threading
    pre = PrefillRank(pl, (0, 0), engine_id, memory=default_memory(pl, (0, 0)), **kw)
    lock, stop = threading.Lock(), threading.Event()
    ended: dict[str, float] = {}
    by_rid: dict = {}

    def loop():
        while not stop.is_set():
            with lock:
                pre.serve_once()
                got = pre.take_freed()
                for rid in got["freed"] + got["expired"]:
                    ended[rid] = time.monotonic()
                    j = by_rid.get(rid)
                    if j is not None:  # reuse: another request's bytes in the freed blocks
                        fill_rank(pre, j.num + 100_000, j.req.num_tokens, j.req.prefill_blocks)
            time.sleep(2e-4)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield pre, lock, ended, by_rid
    finally:
        stop.set()
        t.join(5)
        pre.close()


def _poll_until(dec, pred, timeout: float, what: str):
    done, failed = [], {}

    def step():
        d, f = dec.poll()
        done.extend(d)
        failed.update(f)
        return pred(done, failed)
    until(step, timeout, what, 0.001)
    return done, failed


@pytest.mark.parametrize("mode", ["direct", "direct-optimistic", "staged", "host"])
def test_early_acquire_is_retried_not_freed(mode):
    """The decode asks before the prefill registered the request (the router was faster than the
    prefill engine's step): refused ``not_registered``, asked again, read exactly once registered. The
    prefill frees the lease once, on the read's Done; no Done was ever ignored or taken from a refused
    try; a request never registered fails ``NotRegistered`` within ``register_grace_s``.
    ``direct-optimistic``: the READ went out beside the first acquire and read the blocks before the
    request was written and registered (another request's bytes): those bytes are discarded and read
    again once granted."""
    mode, opt = mode.removesuffix("-optimistic"), mode.endswith("-optimistic")
    pl, dl = layout("prefill", 1, 96), layout("decode", 1, 96)
    jobs = Jobs(dl, seed=41)
    jobs.engine("pE", pl)
    js = jobs.make("pE", 3, lengths=[40, 64, 17], prefix_p=0.0)
    (never,) = jobs.make("pE", 1, lengths=[8], prefix_p=0.0, tag="never")
    with reusing_prefill(pl, "pE", jobs) as (pre, lock, ended, by_rid), \
            inproc_decode(dl, "dE", transfer_mode=mode, register_grace_s=3.0, stage_timeout_s=30.0,
                          optimistic_reads=opt) as dec:
        by_rid.update({j.rid: j for j in js})
        with lock:  # `never`'s bytes are in its blocks, never registered: only an optimistic READ copies them
            fill_rank(pre, never.num, never.req.num_tokens, never.req.prefill_blocks)
        dec.handshake("pE", {(0, 0): f"127.0.0.1:{pre.port}"})
        for j in js + [never]:
            dec.start(j.read())
        _poll_until(dec, lambda d, f: pre.metrics.not_registered >= len(js) + 1, 10, "refusals")
        time.sleep(0.3)  # several refusals and retries go by
        t_reg = time.monotonic()
        for j in js:
            hold(pre, lock, j)
        done, failed = _poll_until(dec, lambda d, f: len(d) + len(f) == len(js) + 1, 15, "the reads")
        assert sorted(done) == sorted(j.rid for j in js), failed
        assert isinstance(failed[never.rid], NotRegistered) and never.rid not in done
        # optimistic: `never` failed, but its READ went out before the refusal and wrote its blocks (as a
        # read that fails after posting may): its own bytes there, nothing anywhere else
        written = js + [never] if opt else js
        assert verify_rank(dec, [(j.num, j.read()) for j in written])["mismatched_bytes"] == 0
        until(lambda: set(ended) >= {j.rid for j in js}, 10, "the leases to be freed")
        with lock:
            m = pre.metrics
            print(f"early acquire ({mode}): {m.not_registered} not-registered refusals, {dec.metrics.register_retries} "
                  f"retries; read {max(ended.values()) - t_reg:.3f} s after registration")
            assert m.freed_requests == len(js) and m.expired_requests == 0
            assert m.forged_messages == 0 and m.ignored_notifications == 0 and m.stale_messages == 0
            assert m.unknown_notifications == 0  # the refused tries sent no Done at all
            assert not pre.leases and pre.slots.bytes_used == 0
        assert dec.metrics.failed_requests == 1  # `never`, once, however many retries it took
        if opt:  # every read went out before its grant and was discarded (the first answer: not registered)
            assert dec.metrics.optimistic_reads == len(js) + 1 and dec.metrics.discarded_reads == len(js) + 1
        else:
            assert dec.metrics.optimistic_reads == 0 and dec.metrics.discarded_reads == 0
        assert dec.stats()["live_handles"] == 0 and dec.slots.bytes_used == 0


def test_optimistic_read_of_an_expired_lease_fails_typed_and_leaks_nothing():
    """optimistic_reads: the READ goes out beside the acquire of a request whose lease has expired (its
    blocks refilled with another request's bytes): refused ``lease_expired``, the read fails
    ``LeaseExpired`` (its READ settled and released, never reported done), nothing is sent that the
    prefill would have to ignore, and a read of a live request beside it is exact."""
    pl, dl = layout("prefill", 1, 96), layout("decode", 1, 96)
    jobs = Jobs(dl, seed=43)
    jobs.engine("pX", pl)
    gone, live = jobs.make("pX", 2, lengths=[48, 33], prefix_p=0.0)
    with reusing_prefill(pl, "pX", jobs) as (pre, lock, ended, by_rid), \
            inproc_decode(dl, "dX", optimistic_reads=True) as dec:
        by_rid.update({gone.rid: gone, live.rid: live})
        dec.handshake("pX", {(0, 0): f"127.0.0.1:{pre.port}"})
        hold(pre, lock, gone, lease_s=0.05)
        until(lambda: gone.rid in ended, 10, "the lease to expire (and its blocks to be refilled)")
        hold(pre, lock, live)
        dec.start(gone.read())
        dec.start(live.read())
        done, failed = _poll_until(dec, lambda d, f: len(d) + len(f) == 2, 15, "the reads")
        assert done == [live.rid] and isinstance(failed.get(gone.rid), LeaseExpired), (done, failed)
        assert dec.metrics.optimistic_reads == 2 and dec.metrics.discarded_reads == 0
        # `gone`'s blocks hold what its READ found there (the refill, request gone.num + 100000), or nothing
        # if the refusal came before the post thread reached it; nothing else was written
        exact = [verify_rank(dec, [(live.num, live.read())] + extra)["mismatched_bytes"]
                 for extra in ([(gone.num + 100_000, gone.read())], [])]
        print(f"optimistic read of an expired lease: mismatches with / without its READ's bytes {exact}")
        assert 0 in exact, exact
        until(lambda: dec.stats()["parked_reads"] == 0 and dec.stats()["live_handles"] == 0, 10, "READs settled")
        with lock:
            m = pre.metrics
            assert m.ignored_notifications == 0 and m.unknown_notifications == 0 and m.forged_messages == 0
        until(lambda: live.rid in ended, 10, "the live lease to be freed on its Done")


@pytest.mark.parametrize("mode", ["direct", "staged", "host", "push"])
@pytest.mark.parametrize("other", ["finishes", "aborts"])
def test_two_decode_engines_read_one_request(mode, other):
    """Decode engine dA holds its pin on a request (granted, not read yet: it has not polled); decode
    engine dB, a router retry or hedge with the same parameters, reads it and finishes, or aborts a
    read of it, and also declines a second read id. The prefill, which refills blocks as soon as it
    frees them, must keep them: dA then reads every byte exactly, and only dA's Done frees the lease."""
    pl, dl = layout("prefill", 1, 96), layout("decode", 1, 96)
    jobs = Jobs(dl, seed=42)
    jobs.engine("pH", pl)
    (j,) = jobs.make("pH", 1, lengths=[64], prefix_p=0.0)
    with reusing_prefill(pl, "pH", jobs) as (pre, lock, ended, by_rid), \
            inproc_decode(dl, "dA", transfer_mode=mode) as da, inproc_decode(dl, "dB", transfer_mode=mode) as db:
        by_rid[j.rid] = j
        ep = {(0, 0): f"127.0.0.1:{pre.port}"}
        da.handshake("pH", ep)
        db.handshake("pH", ep)
        hold(pre, lock, j)
        da.start(j.read())
        da.flush()  # the acquire/stage request goes out; dA does not poll: its pin is granted, nothing read

        def pinned_by_a():
            with lock:
                lease = pre.leases.get(j.rid)
                return lease is not None and ("dA", (0, 0)) in lease.holders
        until(pinned_by_a, 10, "dA's pin")
        if other == "finishes":
            db.start(j.read())
            done, failed = db.wait(20)
            assert done == [j.rid] and not failed, failed
            assert verify_rank(db, [(j.num, j.read())])["mismatched_bytes"] == 0
        else:
            db.start(j.read())
            db.abort(j.rid)  # aborted mid-read (or before the pin came: released when it arrives)
        db.release(_with_read_id(j.read(), "hedge-2"))  # dB declines a second read of it, never started
        t0 = time.monotonic()
        while time.monotonic() < t0 + 0.3:  # B's Done / release / decline reach the prefill (a read that
            db.poll()                      # completed on its lease's tag releases its pin when it takes the grant)
            time.sleep(0.01)
        with lock:
            lease = pre.leases.get(j.rid)
            assert lease is not None and j.rid not in ended, "freed under dA's pin"
            assert lease.holders == {("dA", (0, 0))}
        done, failed = da.wait(20)
        assert done == [j.rid] and not failed, failed
        ver = verify_rank(da, [(j.num, j.read())])
        print(f"two readers ({mode}, dB {other}): dA read {ver['needed_bytes']} B, {ver['mismatched_bytes']} wrong")
        assert ver["mismatched_bytes"] == 0
        until(lambda: j.rid in ended, 10, "dA's Done to free the lease")
        with lock:
            assert pre.metrics.freed_requests == 1 and not pre.leases and pre.slots.bytes_used == 0
        if mode == "push":  # dB's aborted push keeps its slot until the prefill's last answer (a late WRITE)
            until(lambda: (db.poll(), db.slots.bytes_used == 0)[1], 10, "dB's push hold to end on the last answer")
        for d in (da, db):
            assert d.stats()["live_handles"] == 0 and d.slots.bytes_used == 0


def _with_read_id(req, read_id: str):
    return replace(req, read_id=read_id)


def test_vllm_n2_two_reads_in_one_decode_engine():
    """vLLM ``n = 2``: two decode requests of one engine share one set of prefill params. With distinct
    read ids both read the same prefill request exactly; the lease is freed after the second."""
    pl, dl = layout("prefill", 1, 96), layout("decode", 1, 96)
    jobs = Jobs(dl, seed=43)
    jobs.engine("pN", pl)
    (j,) = jobs.make("pN", 1, lengths=[40], prefix_p=0.0)
    (k,) = jobs.make("pN", 1, lengths=[40], prefix_p=0.0, tag="child")  # the second child's own decode blocks
    with reusing_prefill(pl, "pN", jobs) as (pre, lock, ended, by_rid), inproc_decode(dl, "dN") as dec:
        by_rid[j.rid] = j
        dec.handshake("pN", {(0, 0): f"127.0.0.1:{pre.port}"})
        hold(pre, lock, j)
        first = _with_read_id(j.read(), "child-0")
        second = replace(first, read_id="child-1", decode_blocks=k.req.decode_blocks)
        dec.start(first)
        dec.start(second)
        done, failed = dec.wait(20)
        assert sorted(done) == ["child-0", "child-1"] and not failed, failed
        until(lambda: j.rid in ended, 10, "the lease to be freed")
        with lock:
            assert pre.metrics.freed_requests == 1 and pre.metrics.ignored_notifications == 0


def test_forged_getmeta_does_not_rebind_a_live_reader():
    """A GetMeta claiming the live decode rank's identity with another agent is refused
    (``identity_in_use``): the reader stays bound to its agent, and its Done frees its lease at once
    (not after ``pin_s``)."""
    pl, dl = layout("prefill", 1, 96), layout("decode", 1, 96)
    jobs = Jobs(dl, seed=44)
    jobs.engine("pG", pl)
    js = jobs.make("pG", 2, lengths=[40, 30], prefix_p=0.0)
    with reusing_prefill(pl, "pG", jobs, pin_s=120.0) as (pre, lock, ended, by_rid), inproc_decode(dl, "dG") as dec:
        ep = f"127.0.0.1:{pre.port}"
        dec.handshake("pG", {(0, 0): ep})
        hold(pre, lock, js[0])
        dec.start(js[0].read())
        dec.flush()
        until(lambda: pre.readers.agent_of(("dG", (0, 0))) and pre.table.pins_held(("dG", (0, 0))), 10, "dG's pin")
        with pytest.raises(HandshakeError, match="identity_in_use|another NIXL agent"):
            fetch_meta(zmq.Context.instance(), ep, protocol.GetMeta("dG", (0, 0), (0, 0), "evil-agent"), 5)
        assert pre.readers.agent_of(("dG", (0, 0))) == dec.transport.agent_name
        t0 = time.monotonic()
        done, failed = dec.wait(20)
        assert done == [js[0].rid] and not failed
        until(lambda: js[0].rid in ended, 5, "the real Done to free the lease")
        print(f"forged GetMeta refused; the real reader's lease freed {ended[js[0].rid] - t0:.3f} s after its read")
        # a later read still works, bytes exact
        hold(pre, lock, js[1])
        dec.start(js[1].read())
        assert dec.wait(20)[0] == [js[1].rid]
        assert verify_rank(dec, [(j.num, j.read()) for j in js])["mismatched_bytes"] == 0
        assert pre.metrics.forged_messages >= 1


def test_flood_of_identities_does_not_evict_a_live_reader():
    """4,200 GetMeta frames with made-up identities while a reader holds a pin: the table stays at its
    bound (4,096), the newcomers past it are refused (``too_many_readers``), the live reader is never
    evicted: its read completes exactly and its Done frees the lease."""
    pl, dl = layout("prefill", 1, 96), layout("decode", 1, 96)
    jobs = Jobs(dl, seed=45)
    jobs.engine("pF", pl)
    (j,) = jobs.make("pF", 1, lengths=[48], prefix_p=0.0)
    with reusing_prefill(pl, "pF", jobs) as (pre, lock, ended, by_rid), inproc_decode(dl, "dF") as dec:
        ep = f"127.0.0.1:{pre.port}"
        dec.handshake("pF", {(0, 0): ep})
        hold(pre, lock, j)
        dec.start(j.read())
        dec.flush()
        until(lambda: pre.table.pins_held(("dF", (0, 0))), 10, "dF's pin")
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{ep}")
        codes: dict[str, int] = {}
        try:
            n, window, sent, got = 4200, 64, 0, 0
            while got < n:
                while sent < n and sent - got < window:
                    sock.send_multipart(protocol.pack(protocol.GetMeta(f"fake-{sent}", (0, 0), (0, 0), f"a{sent}")))
                    sent += 1
                assert sock.poll(10_000), "no answer to a GetMeta"
                reply = protocol.unpack(sock.recv_multipart())
                key = reply.code if isinstance(reply, protocol.ErrorReply) else "bound"
                codes[key] = codes.get(key, 0) + 1
                got += 1
        finally:
            sock.close(0)
        print(f"flood: {codes}; table {len(pre.readers)}")
        assert codes == {"bound": 4095, "too_many_readers": 4200 - 4095}
        assert len(pre.readers) == 4096 and pre.readers.agent_of(("dF", (0, 0))) == dec.transport.agent_name
        done, failed = dec.wait(20)
        assert done == [j.rid] and not failed, failed
        assert verify_rank(dec, [(j.num, j.read())])["mismatched_bytes"] == 0
        until(lambda: j.rid in ended, 5, "the live reader's Done to free the lease")


def test_release_of_a_request_not_started():
    """The engine aborts or rejects a decode request before it read: ``release`` frees the prefill's
    blocks at once, unless another reader holds a pin (then they stay until that reader is done)."""
    pl, dl = layout("prefill", 1, 96), layout("decode", 1, 96)
    jobs = Jobs(dl, seed=46)
    jobs.engine("pR", pl)
    a, b = jobs.make("pR", 2, lengths=[40, 40], prefix_p=0.0)
    with reusing_prefill(pl, "pR", jobs) as (pre, lock, ended, by_rid), \
            inproc_decode(dl, "dR") as dec, inproc_decode(dl, "dS") as other:
        by_rid.update({a.rid: a, b.rid: b})
        ep = {(0, 0): f"127.0.0.1:{pre.port}"}
        dec.handshake("pR", ep)
        other.handshake("pR", ep)
        hold(pre, lock, a)
        hold(pre, lock, b)
        t0 = time.monotonic()
        dec.release(a.read())
        until(lambda: a.rid in ended, 5, "the released request to be freed")
        print(f"release before read: freed {ended[a.rid] - t0:.3f} s later")
        assert ended[a.rid] - t0 < 1.0
        other.start(b.read())
        other.flush()
        until(lambda: pre.table.pins_held(("dS", (0, 0))), 10, "dS's pin")
        dec.release(b.read())
        time.sleep(0.3)
        assert b.rid not in ended  # dS holds a pin: not freed
        done, failed = other.wait(20)
        assert done == [b.rid] and not failed
        assert verify_rank(other, [(b.num, b.read())])["mismatched_bytes"] == 0
        until(lambda: b.rid in ended, 5, "dS's Done to free the lease")


def test_heartbeats_keep_a_queued_request_and_a_dead_decodes_pins_end_on_lease_scale():
    """``lease_s`` 1.5 s. A request queued at the decode for 3x ``lease_s`` (heartbeats every 0.1 s)
    is then read exactly. A decode that pins a request and stops (never polls again) loses its pin
    about ``lease_s`` later (not ``pin_s`` = 60 s)."""
    pl, dl = layout("prefill", 1, 96), layout("decode", 1, 96)
    jobs = Jobs(dl, seed=47)
    jobs.engine("pB", pl)
    q, z = jobs.make("pB", 2, lengths=[40, 40], prefix_p=0.0)
    with reusing_prefill(pl, "pB", jobs, lease_s=1.5, pin_s=60.0) as (pre, lock, ended, by_rid), \
            inproc_decode(dl, "dB") as dec, inproc_decode(dl, "dZ") as dead:
        by_rid.update({q.rid: q, z.rid: z})
        ep = {(0, 0): f"127.0.0.1:{pre.port}"}
        dec.handshake("pB", ep)
        dead.handshake("pB", ep)
        hold(pre, lock, q)
        t_end = time.monotonic() + 4.5
        while time.monotonic() < t_end:
            dec.heartbeat([q.read()])
            dec.poll()
            time.sleep(0.1)
        assert q.rid not in ended and dec.metrics.heartbeats >= 20
        dec.start(q.read())
        done, failed = dec.wait(20)
        assert done == [q.rid] and not failed, failed
        assert verify_rank(dec, [(q.num, q.read())])["mismatched_bytes"] == 0
        # a decode that pins and then goes silent
        hold(pre, lock, z)
        dead.start(z.read())
        dead.flush()
        until(lambda: pre.table.pins_held(("dZ", (0, 0))), 10, "dZ's pin")
        t0 = time.monotonic()
        until(lambda: z.rid in ended, 10, "the silent decode's pin to end")
        print(f"heartbeats: queued 4.5 s (lease 1.5 s) and read exactly; a silent decode's pin ended "
              f"{ended[z.rid] - t0:.2f} s after it was granted (pin_s 60 s)")
        assert ended[z.rid] - t0 < 6.0
        dead.abort(z.rid)


class _SlowReader:
    """A decode rank's side channel driven by hand (real ZMQ, the real protocol): what a reader on a slow
    link sends while its bytes trickle in, without the bytes (NIXL reports none until a transfer ends)."""

    def __init__(self, ep: str, engine: str):
        self.reader = (engine, (0, 0))
        self.agent = f"{engine}-agent"
        meta = fetch_meta(zmq.Context.instance(), ep, protocol.GetMeta(engine, (0, 0), (0, 0), self.agent), 5)
        self.incarnation = meta.metadata_sha256
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(f"tcp://{ep}")

    def ask(self, j, heartbeat=False, progress=()):
        msg = protocol.Acquire(self.reader[0], self.reader[1], 1, self.incarnation, [(j.rid, j.attempt, j.rid)],
                               self.agent, heartbeat, list(progress))
        self.sock.send_multipart(protocol.pack(msg))
        reply = protocol.unpack(self.sock.recv_multipart())
        assert isinstance(reply, protocol.Acquired)
        return reply

    def close(self):
        self.sock.close(0)


def test_a_progressing_read_outlives_pin_s_a_stalled_or_silent_one_does_not():
    """Over the real side channel (``pin_s`` 1 s, ``lease_s`` 0.6 s, ``min_read_rate`` such that each
    request's bound is ``pin_s`` + 2 s): a reader whose heartbeats report bytes read holds its pin past
    ``pin_s`` until the bound; one whose heartbeats report no bytes releases about ``pin_s`` after its
    pin; a reader that goes silent releases about ``lease_s`` after its pin. The fixed cap that failed a
    progressing read at 120 s is gone; the two releases that protect the prefill's memory stay."""
    pl, dl = layout("prefill", 1, 96), layout("decode", 1, 96)
    jobs = Jobs(dl, seed=53)
    jobs.engine("pS", pl)
    slow, stalled, silent = jobs.make("pS", 3, lengths=[64, 64, 64], prefix_p=0.0)
    probe = PrefillRank(pl, (0, 0), "probe", memory=default_memory(pl, (0, 0)))
    probe.add_request("x", slow.req.prefill_blocks)
    nbytes = probe.table.get("x").nbytes
    probe.close()
    assert nbytes > 0
    with reusing_prefill(pl, "pS", jobs, lease_s=0.6, pin_s=1.0, min_read_rate=nbytes / 2.0) as \
            (pre, lock, ended, by_rid):
        ep = f"127.0.0.1:{pre.port}"
        a, b, c = _SlowReader(ep, "dSlow"), _SlowReader(ep, "dStall"), _SlowReader(ep, "dSilent")
        try:
            for j in (slow, stalled, silent):
                hold(pre, lock, j)
            t0 = time.monotonic()
            for r, j in ((a, slow), (b, stalled), (c, silent)):
                assert r.ask(j).granted, j.rid
            checked_alive = False
            while slow.rid not in ended and time.monotonic() - t0 < 10:
                el = time.monotonic() - t0
                got = a.ask(slow, True, [(int(nbytes * el / 5), nbytes // 10)])  # 1/5 of it per second
                assert got.granted or slow.rid in ended or time.monotonic() - t0 > 2.9, (el, got.refused)
                if stalled.rid not in ended:
                    b.ask(stalled, True, [(0, 0)])
                if 1.5 < el < 2.5 and slow.rid not in ended:
                    checked_alive = True
                time.sleep(0.1)
            assert checked_alive  # past pin_s, still held
            t_slow, t_stall, t_silent = (ended[j.rid] - t0 for j in (slow, stalled, silent))
            print(f"pins ended: progressing {t_slow:.2f} s (bound 3 s), no progress {t_stall:.2f} s (pin_s 1 s), "
                  f"silent {t_silent:.2f} s (lease_s 0.6 s)")
            assert 2.9 < t_slow < 5.0
            assert 0.9 < t_stall < 2.0
            assert 0.5 < t_silent < 1.5
            with lock:
                assert pre.metrics.expired_requests == 3 and not pre.leases
        finally:
            for r in (a, b, c):
                r.close()


def test_a_real_read_slower_than_pin_s_completes_exact(monkeypatch):
    """A staged read over a slow link (``KVBRIDGE_DELAY_LINK``: every segment read answers 5 s after its
    post) from a prefill with ``pin_s`` 2 s and ``lease_s`` 1.5 s. The decode's heartbeats carry the read's
    progress (the segment's bytes in flight), so the prefill holds the pin past ``pin_s`` (up to its bound:
    ``pin_s`` + the request's bytes at ``min_read_rate``, here 8 s); the read completes byte-exact and the
    lease is freed by its Done, not expired. (Staged: a direct read's Done rides on its NIXL transfer, which
    the delay does not hold back.)"""
    monkeypatch.setenv("KVBRIDGE_DELAY_LINK", "device:read:5000")
    pl, dl = layout("prefill", 1, 96), layout("decode", 1, 96)
    jobs = Jobs(dl, seed=59)
    jobs.engine("pL", pl)
    (j,) = jobs.make("pL", 1, lengths=[64], prefix_p=0.0)
    probe = PrefillRank(pl, (0, 0), "probe", memory=default_memory(pl, (0, 0)))
    probe.add_request("x", j.req.prefill_blocks)
    nbytes = probe.table.get("x").nbytes
    probe.close()
    with reusing_prefill(pl, "pL", jobs, lease_s=1.5, pin_s=2.0, min_read_rate=nbytes / 6.0) as \
            (pre, lock, ended, by_rid), inproc_decode(dl, "dL", transfer_mode="staged") as dec:
        by_rid[j.rid] = j
        dec.handshake("pL", {(0, 0): f"127.0.0.1:{pre.port}"})
        hold(pre, lock, j)
        t0 = time.monotonic()
        dec.start(j.read())
        inflight = 0
        done, failed = [], {}
        while not done and not failed and time.monotonic() - t0 < 20:
            d, f = dec.poll()
            done += d
            failed.update(f)
            with lock:
                lease = pre.leases.get(j.rid)
                if lease is not None:
                    inflight = max([inflight, *(p.inflight for p in lease.pins.values())])
            time.sleep(0.005)
        took = time.monotonic() - t0
        assert done == [j.rid] and not failed, failed
        assert took > 4.0 and inflight > 0  # held past pin_s by the progress its heartbeats carried
        assert dec.metrics.staged_transfers == 1
        assert verify_rank(dec, [(j.num, j.read())])["mismatched_bytes"] == 0
        until(lambda: j.rid in ended, 5, "the read's Done to free the lease")
        with lock:
            assert pre.metrics.freed_requests == 1 and pre.metrics.expired_requests == 0
        print(f"a read slowed to {took:.2f} s (pin_s 2 s, lease_s 1.5 s) completed exact; the prefill saw "
              f"{inflight} B in flight in its heartbeats")
