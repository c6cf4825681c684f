"""The push path (the prefill WRITEs packed segments into the decode's staging slot; the decode posts no
READ) over the in-process loopback transport: an abort while a WRITE is in flight holds the decode's slot
until the prefill's last answer (or its pin bound), a failed WRITE is a typed answer, and no lease, pin,
slot or handle is left behind."""
from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from _helpers import Jobs, hold, layout, served, until

from kvbridge.errors import RemoteError, TransferError
from kvbridge.modes import TransferPath
from kvbridge.runtime import readloop
from kvbridge.runtime.decode import DecodeRank
from kvbridge.runtime.prefill import PrefillRank
from kvbridge.testing.engine import buffer_of, default_memory
from kvbridge.testing.oracle import SENTINEL
from kvbridge.testing.procs import verify_rank
from kvbridge.transport.loopback import LoopbackRegistry, LoopbackTransport

_n = itertools.count()


class GatedLoopback(LoopbackTransport):
    """A prefill transport whose WRITEs posted while ``gating`` is set stay in flight (``check`` answers
    PROC, ``settle`` None) until ``gate`` opens; then the bytes land (late) and the WRITE completes.
    ``fail_writes``: the WRITEs numbered so (0 first) fail, when posted (``"post"``) or when checked."""

    def __init__(self, name: str, reg: LoopbackRegistry):
        super().__init__(name, reg)
        self.gate, self.gating = threading.Event(), False
        self.held: dict[int, tuple] = {}
        self.landed = 0
        self.writes = 0
        self.fail_writes: dict[int, str] = {}
        self.failing: set[int] = set()

    def write(self, peer, local, remote, nbytes, notif=b"", remote_device=None, local_device=None):
        i, self.writes = self.writes, self.writes + 1
        how = self.fail_writes.get(i)
        if how == "post":
            raise TransferError("WRITE refused (test)", peer=peer)
        if how == "check":
            h = next(self._ids)
            self.track(h)
            self.failing.add(h)
            return h
        if not self.gating:
            return super().write(peer, local, remote, nbytes, notif)
        h = next(self._ids)
        self.track(h)
        self.held[h] = (peer, np.array(local), np.array(remote), np.array(nbytes))
        return h

    def _land(self, h: int) -> None:
        peer, local, remote, nbytes = self.held.pop(h)
        self.untrack(self._copy(peer, remote, local, nbytes, b"", write=True))
        self.landed += 1

    def check(self, h):
        if h in self.failing:
            raise TransferError("WRITE failed (test)", peer="decode")
        if h in self.held:
            if not self.gate.is_set():
                return "PROC"
            self._land(h)
        return super().check(h)

    def settle(self, h, timeout_s=0.0):
        if h in self.failing:
            return False
        if h in self.held:
            if not self.gate.is_set():
                return None
            self._land(h)
        return super().settle(h, timeout_s)

    def release(self, h):
        self.failing.discard(h)
        super().release(h)


class PushPair:
    """One prefill rank (gated transport) served from a thread and one decode rank forced to push."""

    def __init__(self, lock, pre: PrefillRank, dec: DecodeRank, jobs: Jobs):
        self.lock, self.pre, self.dec, self.jobs = lock, pre, dec, jobs

    def pstats(self) -> dict:
        with self.lock:
            return self.pre.stats()

    def extent(self, rid: str) -> tuple[int, int]:
        return self.dec.slots.used[(rid, (0, 0))]


def push_pair(test, pin_s: float = 60.0, **decode_kw):
    reg, k = LoopbackRegistry(), next(_n)
    pl, dl = layout("prefill", 1, 128), layout("decode", 1, 128)
    jobs = Jobs(dl, seed=3)
    jobs.engine("pg", pl)
    pre = PrefillRank(pl, (0, 0), memory=default_memory(pl, (0, 0)), engine_id="pg",
                      transport=GatedLoopback(f"pg{k}", reg), pin_s=pin_s)
    dec = None
    try:
        with served(pre) as lock:
            dec = DecodeRank(dl, (0, 0), memory=default_memory(dl, (0, 0)), engine_id="dg", transfer_mode="push",
                             transport=LoopbackTransport(f"dg{k}", reg), **decode_kw)
            buffer_of(dec.mem).fill(SENTINEL)
            dec.handshake("pg", {(0, 0): f"127.0.0.1:{pre.port}"})
            assert dec.remotes["pg"].modes[(0, 0)] is TransferPath.PUSH  # a member (== "push"), not a bare str
            with lock:
                assert not pre.stats()["push_probes"]
                pre.transport.writes = 0  # (the handshake's push probe WRITEs are not the test's to number)
            test(PushPair(lock, pre, dec, jobs))
            pre.transport.gate.set()  # whatever is still held lands now; then nothing may be left
            until(lambda: (dec.poll(), not (dec.inflight or dec.reads.push_holds or dec.reads.zombies)
                           and not PushPair(lock, pre, dec, jobs).pstats()["pushing"])[1],
                  10, "every push to settle")
            s = PushPair(lock, pre, dec, jobs).pstats()
            assert s["pins"] == 0 and s["leases"] == 0 and s["staging_used"] == 0, s
            assert dec.slots.bytes_used == 0 and not dec.reads.push_holds and dec.stats()["live_handles"] == 0
            with lock:
                assert pre.transport.live_handles() == 0
    finally:
        if dec is not None:
            dec.close()
        pre.close()
    return pre, dec


def _disjoint(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] + a[1] <= b[0] or b[0] + b[1] <= a[0]


def test_abort_during_push_holds_the_slot_until_the_prefill_answers():
    """The decode aborts a read whose WRITE is in flight: its slot is held (a second read gets another
    one and moves byte-exact beside it), the prefill keeps its own slot until the WRITE settled, then
    answers; only that answer frees the decode's slot. The late WRITE lands in the held slot, never in
    the second read's, and no lease, pin, slot or handle is left."""
    def test(t: PushPair):
        dec, pre = t.dec, t.pre
        a, b = t.jobs.make("pg", 2, lengths=[64, 60])
        for j in (a, b):
            hold(pre, t.lock, j)
        pre.transport.gating = True
        dec.start(a.read())
        until(lambda: (dec.poll(), t.pstats()["pushing"])[1], 10, "the prefill to post its WRITE")
        held = t.extent(a.rid)
        dec.abort(a.rid)
        assert len(dec.reads.push_holds) == 1 and dec.metrics.push_holds == 1
        assert dec.slots.bytes_used == held[1]  # not freed: a WRITE may still land there
        # the prefill hears the abort (Done, failed): the pin ends, the lease is freed, the slot stays
        until(lambda: (dec.poll(), t.pstats()["pins"] == 0 and t.pstats()["leases"] == 1)[1], 10,
              "the prefill to end the aborted read's pin")
        assert t.pstats()["pushing"] == 1 and t.pstats()["staging_used"] > 0
        pre.transport.gating = False
        dec.start(b.read())
        assert _disjoint(t.extent(b.rid), held)
        done, failed = dec.wait(10)
        assert done == [b.rid] and not failed, failed
        assert verify_rank(dec, [(b.num, b.read())])["mismatched_bytes"] == 0
        assert len(dec.reads.push_holds) == 1 and dec.slots.bytes_used == held[1]  # still no answer for a
        pre.transport.gate.set()  # the late WRITE lands (in the held slot); the prefill answers; the hold ends
        until(lambda: (dec.poll(), not dec.reads.push_holds)[1], 10, "the prefill's last answer")
        assert pre.transport.landed == 1 and dec.slots.bytes_used == 0
        assert verify_rank(dec, [(b.num, b.read())])["mismatched_bytes"] == 0
    pre, dec = push_pair(test)
    assert dec.metrics.pushed_transfers == 1 and dec.metrics.aborted_requests == 1  # (counted at its first answer)
    assert pre.metrics.freed_requests == 2


def test_push_hold_ends_at_the_pin_bound_when_the_prefill_never_answers(monkeypatch):
    """No answer ever comes for the aborted read (its WRITE never ends): the decode's slot is freed once
    the prefill's pin bound (pin_s plus the bytes at min_read_rate, from when the stage request went out)
    plus the margin has passed: by then the prefill posts no WRITE of it."""
    monkeypatch.setattr(readloop, "PUSH_HOLD_MARGIN_S", 0.5)

    def test(t: PushPair):
        dec, pre = t.dec, t.pre
        (a,) = t.jobs.make("pg", 1, lengths=[64])
        hold(pre, t.lock, a)
        pre.transport.gating = True
        dec.start(a.read())
        until(lambda: (dec.poll(), t.pstats()["pushing"])[1], 10, "the prefill to post its WRITE")
        dec.abort(a.rid)
        assert dec.reads.push_holds and dec.busy  # (polled until the hold ends)
        assert dec.remotes["pg"].remote.links[(0, 0)].pin_s == 2.0  # (the bound the hold waits for)
        until(lambda: (dec.poll(), not dec.reads.push_holds)[1], 15, "the hold to end at the pin bound")
        assert dec.slots.bytes_used == 0 and pre.transport.landed == 0
    push_pair(test, pin_s=2.0)


@pytest.mark.parametrize("where", ["first", "later"])
def test_a_failed_write_is_a_typed_answer(where):
    """A WRITE that fails: on the first segment the prefill answers a typed error while the pin holds and
    the decode reads the request directly (byte-exact); on a later segment the read fails typed
    (RemoteError naming the WRITE). Either way the prefill answers only once nothing is in flight, and
    nothing leaks."""
    def test(t: PushPair):
        dec, pre = t.dec, t.pre
        (a,) = t.jobs.make("pg", 1, lengths=[64])
        hold(pre, t.lock, a)
        pre.transport.fail_writes = {0: "post"} if where == "first" else {2: "check"}
        dec.start(a.read())
        done, failed = dec.wait(10)
        assert pre.metrics.failed_pushes == 1
        if where == "first":
            assert done == [a.rid] and not failed, failed
            assert dec.metrics.staging_fallbacks == 1 and dec.metrics.pushed_transfers == 0
            assert verify_rank(dec, [(a.num, a.read())])["mismatched_bytes"] == 0
        else:
            assert not done and isinstance(failed[a.rid], RemoteError), failed
            assert "could not WRITE" in str(failed[a.rid])
            assert dec.metrics.pushed_transfers == 1  # two segments landed and were scattered first
        until(lambda: (dec.poll(), t.pstats()["leases"] == 0)[1], 10, "the prefill to free the lease")
    push_pair(test, stage_segment_bytes=4096)


def test_a_readers_push_agent_is_added_once_and_removed_when_it_is_evicted():
    """The prefill adds a reader's agent (from its handshake's metadata) at its first push and keeps it
    for the next; a reader evicted from the full reader table takes its agent with it."""
    reg, k = LoopbackRegistry(), next(_n)
    pl, dl = layout("prefill", 1, 128), layout("decode", 1, 128)
    jobs = Jobs(dl, seed=5)
    jobs.engine("pe", pl)
    pre = PrefillRank(pl, (0, 0), memory=default_memory(pl, (0, 0)), engine_id="pe",
                      transport=LoopbackTransport(f"pe{k}", reg), max_readers=1, reader_idle_s=1e-3)
    decs = []
    try:
        with served(pre) as lock:
            for name in ("e1", "e2"):
                dec = DecodeRank(dl, (0, 0), memory=default_memory(dl, (0, 0)), engine_id=name, transfer_mode="push",
                                 transport=LoopbackTransport(f"{name}-{k}", reg))
                decs.append(dec)
                buffer_of(dec.mem).fill(SENTINEL)
                dec.handshake("pe", {(0, 0): f"127.0.0.1:{pre.port}"})  # e2's evicts e1 (idle, no pin)
                with lock:
                    assert pre.transport.peers <= {dec.transport.agent_name}  # e1's agent went with it
                moved = []
                for j in jobs.make("pe", 2, lengths=[40, 64]):
                    hold(pre, lock, j)
                    dec.start(j.read())
                    done, failed = dec.wait(10)
                    assert done == [j.rid] and not failed, failed
                    moved.append((j.num, j.read()))
                    assert verify_rank(dec, moved)["mismatched_bytes"] == 0  # (every byte of this rank's memory)
                until(lambda: pre.stats()["pins"] == 0, 10, "the reads' Done")
                with lock:
                    assert pre.transport.peers == {dec.transport.agent_name} and pre.stats()["push_peers"] == 1
                assert dec.metrics.pushed_transfers == 2
            with lock:
                assert pre.transport.stats.peers_added == 2 and pre.transport.stats.peers_removed == 1
    finally:
        for dec in decs:
            dec.close()
        pre.close()


def test_push_probes_are_bounded_and_never_block_the_prefill():
    """The prefill serves a push probe only to a reader bound at handshake that it pushes to, within its
    size bounds and one at a time per reader; a probe whose WRITE is in flight is answered once it
    completed, by a later serving turn (the rank keeps serving meanwhile)."""
    import zmq

    from kvbridge.runtime.protocol import PUSH_PROBE_MAX_BYTES, Code, PushProbe, PushProbed, pack, unpack

    def test(t: PushPair):
        dec, pre = t.dec, t.pre
        with t.lock:
            incarnation = pre.transport.metadata()
        from kvbridge.transport.nixl import metadata_digest
        me = ("dg", (0, 0), dec.transport.agent_name, metadata_digest(incarnation))
        buf, addr = dec.prober._buffer("device")
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{pre.port}")

        def ask(*ident, **kw) -> PushProbed:
            sock.send_multipart(pack(PushProbe(*ident, **kw)))
            assert sock.poll(10_000), "no answer"
            got = unpack(sock.recv_multipart())
            assert isinstance(got, PushProbed)
            return got

        try:
            assert ask(*me).ok  # empty: the round trip
            assert ask(*me, addr=addr, descs=4, nbytes=256, stride=1024).ok
            forged = ask("dg", (0, 0), "someone-else", me[3], addr=addr, descs=1, nbytes=256)
            assert not forged.ok and forged.code == Code.UNKNOWN_READER
            stranger = ask("other", (0, 0), "x", me[3], addr=addr, descs=1, nbytes=256)
            assert not stranger.ok and stranger.code == Code.UNKNOWN_READER
            for kw in ({"descs": 1, "nbytes": PUSH_PROBE_MAX_BYTES + 1}, {"descs": 2000, "nbytes": 1, "stride": 1},
                       {"descs": 2, "nbytes": 256, "stride": 8}, {"descs": 1, "nbytes": 0}):
                bad = ask(*me, addr=addr, **kw)
                assert not bad.ok and bad.code == Code.BAD_REQUEST, kw
            pre.transport.gating = True  # the next WRITE stays in flight
            sock.send_multipart(pack(PushProbe(*me, addr=addr, descs=1, nbytes=4096)))
            until(lambda: t.pstats()["push_probes"] == 1, 10, "the probe's WRITE to be posted")
            assert not sock.poll(50)  # not answered while its WRITE is in flight
            other = zmq.Context.instance().socket(zmq.DEALER)
            other.setsockopt(zmq.LINGER, 0)
            other.connect(f"tcp://127.0.0.1:{pre.port}")
            try:  # the rank keeps serving: a second probe of this reader is refused at once
                other.send_multipart(pack(PushProbe(*me, addr=addr, descs=1, nbytes=256)))
                assert other.poll(10_000)
                busy = unpack(other.recv_multipart())
                assert isinstance(busy, PushProbed) and not busy.ok and busy.code == Code.BUSY
            finally:
                other.close(0)
            buf[:4096] = 0
            pre.transport.gate.set()  # the WRITE lands; the next serving turn answers
            assert sock.poll(10_000)
            done = unpack(sock.recv_multipart())
            assert isinstance(done, PushProbed) and done.ok
            assert t.pstats()["push_probes"] == 0
            with t.lock:
                assert (np.asarray(buf[:4096]) == np.asarray(pre.staging[:4096])).all()  # the staging's bytes
        finally:
            sock.close(0)
            pre.transport.gate.clear()
            pre.transport.gating = False
    push_pair(test)


@pytest.mark.parametrize("how", ["silent", "refuses"])
def test_a_prefill_that_does_not_serve_the_push_probe_leaves_push_unmeasured(monkeypatch, how):
    """A prefill rank that never answers the push probe (or refuses it, as a rank that does not serve it
    does) costs the handshake nothing but the probe's wait: the push path keeps the device READ's
    figures, not measured, and pushes still move byte-exact."""
    from kvbridge.runtime.protocol import Code, PushProbed
    from kvbridge.runtime.stager import Stager
    monkeypatch.setattr(Stager, "push_probe", (lambda self, msg, env: None) if how == "silent" else
                        (lambda self, msg, env: PushProbed(False, Code.UNEXPECTED, "not served")))

    def test(t: PushPair):
        link = t.dec.remotes["pg"].remote.links[(0, 0)]
        assert link.source == "probe" and link.paths[TransferPath.PUSH].measured is False
        assert link.paths[TransferPath.PUSH].gbps == link.paths[TransferPath.STAGED].gbps  # (the device READ's figures)
        (a,) = t.jobs.make("pg", 1, lengths=[50])
        hold(t.pre, t.lock, a)
        t.dec.start(a.read())
        done, failed = t.dec.wait(10)
        assert done == [a.rid] and not failed, failed
        assert verify_rank(t.dec, [(a.num, a.read())])["mismatched_bytes"] == 0
        until(lambda: (t.dec.poll(), t.pstats()["leases"] == 0)[1], 10, "the prefill to free the lease")
    _, dec = push_pair(test)
    assert dec.metrics.pushed_transfers == 1
