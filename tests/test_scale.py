"""A decode rank among many prefill engines: a burst of new engines all connect (and again after they all
restart), the side channel's file descriptors grow with engines (three sockets each) plus one TCP
connection per prefill rank, a channel that would exhaust the process's descriptors fails typed first,
an idle peer is released and handshaken again on its next read, and a handshake's bound does not count
its time in the queue. Real prefill ranks over NIXL (one process hosting many engines:
``kvbridge.testing.prefill_host``); sizes are small so it runs in seconds (``benchmarks/scale.py``
measures the real sizes)."""
from __future__ import annotations

import multiprocessing as mp
import time
from concurrent.futures import Future

import pytest
import zmq
from _helpers import Cluster, Jobs, inproc_decode, layout, publish, until
from test_connect import _settle
from test_peer_state import FakeTransport, remote

from kvbridge.errors import HandshakeError
from kvbridge.runtime.metrics import Metrics
from kvbridge.runtime.peer import Peer, PeerState, SideChannel
from kvbridge.runtime.peers import PeerTable
from kvbridge.runtime.poller import ChannelPoller
from kvbridge.testing.prefill_host import PrefillHost, open_fds
from kvbridge.testing.procs import verify_rank
from kvbridge.testing.standins import StandIns, install_idle, wide_context
from kvbridge.transport.nixl import nixl_available

nixl = pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")


def _all_live(dec, ids, timeout):
    until(lambda: (dec.poll(), all(e in dec.remotes for e in ids) or not dec.peers.connecting())[1], timeout,
          "every engine of the burst handshaken")
    return sorted(e for e in ids if e in dec.remotes)


@nixl
@pytest.mark.nixl
def test_burst_of_new_prefill_engines_all_connect_and_again_after_all_restart():
    """Eight TP2 prefill engines appear at once (one host process); a decode rank connects to all of them
    in one go: every one is live, none failed, each held by one side channel (three ZMQ sockets); then
    all of them restart at once (a new process, new ports, the same ids): all are live again."""
    pl, dl = layout("prefill", 2, 16), layout("decode", 1, 16)
    ids = [f"burst{i}" for i in range(8)]
    with inproc_decode(dl, "dBurst", connect_timeout_s=30.0) as dec:
        for generation in (1, 2):
            with PrefillHost(pl, ids) as host:
                for eid in ids:
                    dec.connect(eid, host.endpoints[eid])
                assert _all_live(dec, ids, 120) == ids
                assert dec.metrics.failed_handshakes == 0 and dec.metrics.handshakes == len(ids) * generation
                assert dec.peers.channels == len(ids)
                assert all(len(p.socks) == 2 and p.channel is not None for p in dec.remotes.values())


def _routers(n: int, conn) -> None:
    """Child process: ``n`` ROUTER sockets standing in for prefill ranks; sends their ports, waits."""
    ctx = zmq.Context.instance()
    ctx.set(zmq.MAX_SOCKETS, 8192)
    socks = [ctx.socket(zmq.ROUTER) for _ in range(n)]
    conn.send([s.bind_to_random_port("tcp://127.0.0.1") for s in socks])
    conn.recv()


def test_file_descriptors_grow_with_engines_plus_one_connection_per_rank():
    """16 engines x 8 ranks (a TP1 decode meeting TP8 engines): 16 side channels hold 16 x 3 ZMQ
    sockets and 16 x (8 + 3) file descriptors at most (three mailboxes per channel, one TCP connection per
    rank); the per-rank DEALER and monitor of before held three sockets and five descriptors per rank."""
    engines, ranks = 16, 8
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_routers, args=(engines * ranks, child), daemon=True)
    proc.start()
    try:
        ports = parent.recv()
        zctx = zmq.Context.instance()
        SideChannel(zctx, {(0, 0): f"127.0.0.1:{ports[0]}"}).close()  # the context's own threads start once
        time.sleep(0.2)
        before = open_fds()
        chans = [SideChannel(zctx, {(0, r): f"127.0.0.1:{ports[e * ranks + r]}" for r in range(ranks)})
                 for e in range(engines)]
        want = engines * ranks  # the TCP connections are made in ZMQ's I/O thread: wait for them
        until(lambda: open_fds() - before >= want + engines * SideChannel.FDS, 10, "connections made")
        grown = open_fds() - before
        assert want <= grown <= engines * (ranks + SideChannel.FDS), grown
        for ch in chans:
            ch.close()
        until(lambda: open_fds() - before <= 0, 10, "every descriptor released")
    finally:
        parent.send("stop")
        proc.join(10)
        proc.kill()


def test_a_side_channel_that_would_exhaust_descriptors_fails_typed_first():
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    table = PeerTable(zmq.Context.instance(), None, Metrics(), lambda: None, "dX", 5.0, 1.0, 3600.0, 1024)  # type: ignore[arg-type,return-value]
    table.check_budget("pBig", 8)  # room now
    t = FakeTransport()
    table.transport = t
    peer = Peer("pBig", {(0, r): f"127.0.0.1:{r + 1}" for r in range(8)})
    made = remote({(0, r): f"a{r}" for r in range(8)})
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 260, hard))
    try:
        with pytest.raises(HandshakeError, match=r"no file descriptors left.*'pBig' \(8 ranks.*ulimit -n"):
            table.check_budget("pBig", 8)
        with pytest.raises(HandshakeError, match="no file descriptors left"):  # what the handshake made goes
            table.install(peer, made, {(0, 0): "prep"})
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert peer.state is PeerState.CONNECTING and "pBig" not in table.current and table.channels == 0
    assert t.unprepared == ["prep"] and sorted(t.removed) == [f"a{r}" for r in range(8)]


@nixl
@pytest.mark.nixl
def test_idle_peer_is_released_and_handshaken_again_on_its_next_read():
    """peer_idle_s = 0.5: after its reads, the engine's peer is released (its NIXL agents removed, its
    side channel closed); a later read of the same engine, with no connect() call, handshakes again
    behind the scenes and its bytes are exact."""
    pl, dl = layout("prefill", 2, 256), layout("decode", 1, 256)
    jobs = Jobs(dl, seed=71)
    jobs.engine("pIdle", pl)
    with Cluster() as c:
        (P,) = c.start_many([("prefill", pl, "pIdle")])
        first, second = jobs.make("pIdle", 3), jobs.make("pIdle", 3, tag="s")
        publish(P, first + second)
        with inproc_decode(dl, "dIdle", peer_idle_s=0.5) as dec:
            agents0 = len(dec.transport.peers)
            dec.connect("pIdle", P.endpoints())
            for j in first:
                dec.start(j.read())
            done, failed = _settle(dec, {j.rid for j in first})
            assert not failed and done == {j.rid for j in first}, failed
            assert len(dec.transport.peers) == agents0 + 2 and dec.peers.channels == 1
            until(lambda: (dec.poll(), "pIdle" not in dec.peers.current)[1], 10, "the idle peer released")
            assert dec.metrics.evicted_peers == 1 and "pIdle" in dec.peers.evicted
            assert len(dec.transport.peers) == agents0 and dec.peers.channels == 0
            for j in second:  # no connect(): the read brings the engine back
                dec.start(j.read())
            assert dec.peers.get("pIdle").state is PeerState.CONNECTING
            done, failed = _settle(dec, {j.rid for j in second})
            assert not failed and done == {j.rid for j in second}, failed
            assert dec.metrics.handshakes == 2 and "pIdle" in dec.remotes
            assert verify_rank(dec, [(j.num, j.read()) for j in first + second])["mismatched_bytes"] == 0


class _Gate:
    """A handshaker whose handshakes wait for ``go`` (what they return is never used here)."""

    def __init__(self):
        self.go: Future = Future()

    def background(self, engine_id, endpoints, phase):
        self.go.result(timeout=30)
        raise HandshakeError(f"{engine_id}: done waiting")


def test_handshake_bound_counts_from_its_thread_not_from_the_queue():
    """One handshake thread, bound 0.2 s: the first handshake runs past its bound (timed out); the one
    queued behind it has waited longer than 0.2 s but is not failed for that; it runs once the thread is
    free (its own bound then counts)."""
    gate = _Gate()
    table = PeerTable(zmq.Context.instance(), None, Metrics(), lambda: gate, "dQ", 0.2, 0.2, 3600.0, 1024, threads=1)  # type: ignore[arg-type,return-value]
    a = table.begin("pA", {(0, 0): "h:1"}, [])
    b = table.begin("pB", {(0, 0): "h:2"}, [])
    until(lambda: a.running is not None, 5, "the first handshake running")
    time.sleep(0.3)
    out = table.advance(time.monotonic())
    assert [r.peer.engine_id for r in out] == ["pA"] and a.state is PeerState.LOST and "no handshake within" in a.error
    assert b.state is PeerState.CONNECTING and b.running is None  # queued 0.3 s > 0.2 s: not failed
    gate.go.set_result(None)
    until(lambda: b.future.done(), 5, "the queued handshake ran")
    (r,) = table.advance(time.monotonic())
    assert r.peer is b and "done waiting" in b.error  # its own outcome, not a queue timeout
    table.close_old()


@nixl
@pytest.mark.nixl
def test_a_link_is_probed_once_not_once_per_engine():
    """Two prefill engines on one host (one process): the handshake with the first measures the link
    (probe READs through NIXL); the second engine behind the same link is not probed again."""
    pl, dl = layout("prefill", 1, 16), layout("decode", 1, 16)
    with PrefillHost(pl, ["pL0", "pL1"]) as host, inproc_decode(dl, "dLink") as dec:
        if not dec.prober.enabled:
            pytest.skip("no link probe on this decode rank")
        dec.handshake("pL0", host.endpoints["pL0"])
        probed = dec.transport.stats.handles_created
        assert probed > 0  # the first engine's link was measured
        dec.handshake("pL1", host.endpoints["pL1"])
        assert dec.transport.stats.handles_created == probed and sorted(dec.remotes) == ["pL0", "pL1"]


def _quiet(dec, polls: int = 50, timeout: float = 60.0) -> None:
    """Poll until ``polls`` polls in a row visit no side channel (ZMQ announces each new TCP connection on
    its socket's descriptor once; after that an idle channel stays silent)."""
    streak, deadline = 0, time.monotonic() + timeout
    while streak < polls:
        assert time.monotonic() < deadline, f"side channels still announcing something: {dec.peers.work}"
        before = dec.peers.work.channels
        dec.poll()
        streak = streak + 1 if dec.peers.work.channels == before else 0
        time.sleep(1e-3)


def _work_per_poll(dec, k: int = 200) -> dict:
    """What ``k`` polls of an idle decode visited, per poll (peers.work: channels drained, peers flushed,
    handshakes looked at)."""
    _quiet(dec)
    before = dec.peers.work.snapshot()
    for _ in range(k):
        dec.poll()
    after = dec.peers.work.snapshot()
    assert after["polls"] - before["polls"] == k
    return {key: (after[key] - before[key]) / k for key in after if key != "polls"}


@nixl
@pytest.mark.nixl
def test_poll_work_is_the_same_with_1_or_512_idle_peers_and_reads_stay_exact():
    """One poller: a decode rank's poll visits only side channels with something to read (or just sent
    on), peers with something to send and handshakes running. With 1 and with 512 idle peers (TP1
    stand-in prefill endpoints in another process, each a live peer with its own side channel) a poll
    visits the same: nothing. Then reads from a real prefill engine, with the 512 idle peers present,
    complete byte-exact, and no poll visits more than one channel (the busy peer's)."""
    n = 512
    pl, dl = layout("prefill", 2, 256), layout("decode", 1, 256)
    jobs = Jobs(dl, seed=83)
    jobs.engine("pBusy", pl)
    with StandIns(n) as stand, Cluster() as c:
        (P,) = c.start_many([("prefill", pl, "pBusy")])
        first, second = jobs.make("pBusy", 3), jobs.make("pBusy", 6, tag="s")
        publish(P, first + second)
        with inproc_decode(dl, "dIdlePoll") as dec:
            wide_context(dec)  # 3 ZMQ sockets per side channel: past the shared context's default 1,023
            dec.connect("pBusy", P.endpoints())
            for j in first:
                dec.start(j.read())
            done, failed = _settle(dec, {j.rid for j in first})
            assert not failed and done == {j.rid for j in first}, failed
            install_idle(dec, "idle0", {(0, 0): stand.endpoints[0]})
            one = _work_per_poll(dec)
            for i in range(1, n):
                install_idle(dec, f"idle{i}", {(0, 0): stand.endpoints[i]})
            assert len(dec.remotes) == n + 1 and len(dec.peers.poller) == n + 1 and dec.peers.channels == n + 1
            many = _work_per_poll(dec)
            assert one == many == {"channels": 0, "flushed": 0, "connecting": 0}, (one, many)
            before = dec.peers.work.snapshot()
            for j in second:
                dec.start(j.read())
            done, failed = _settle(dec, {j.rid for j in second})
            assert not failed and done == {j.rid for j in second}, failed
            after = dec.peers.work.snapshot()
            assert 0 < after["channels"] - before["channels"] <= after["polls"] - before["polls"]
            assert after["flushed"] - before["flushed"] <= 2 * (after["polls"] - before["polls"])
            assert verify_rank(dec, [(j.num, j.read()) for j in first + second])["mismatched_bytes"] == 0
            assert len(dec.remotes) == n + 1  # the idle peers are still there


def test_poller_sees_a_reply_after_a_send_and_a_disconnect_on_the_monitor():
    """ZMQ's descriptors are edge-style: a send may consume the signal of a reply, so a channel sent on
    is visited on the next poll and asked before blocking (pending); drained, an idle channel is not
    visited again; a prefill rank going away makes its monitor readable: the channel is visited and the
    disconnect handed out once."""
    ctx = zmq.Context.instance()
    prefill = ctx.socket(zmq.ROUTER)
    prefill.setsockopt(zmq.LINGER, 0)
    port = prefill.bind_to_random_port("tcp://127.0.0.1")
    poller = ChannelPoller()
    ch = SideChannel(ctx, {(0, 0): f"127.0.0.1:{port}"})
    peer = Peer("pPoll", {(0, 0): f"127.0.0.1:{port}"})
    poller.add(peer, ch)

    def visit():  # what the read loop's drain does with a ready channel
        return ch.poll_monitor(), ch.recv_any()
    try:
        # visited once when registered: ZMQ's pipes signal only once their reader has found them empty
        assert poller.ready() == [peer] and visit() == (set(), None)
        ch.send((0, 0), [b"ping"])
        assert list(poller.touched) == [ch]
        rid, ping = prefill.recv_multipart()
        assert ping == b"ping"
        assert not poller.pending() and not poller.touched  # nothing yet: asked, the descriptor is accurate
        prefill.send_multipart([rid, b"pong"])
        poller.wait(10.0)  # woken by the reply's descriptor
        until(lambda: poller.ready() == [peer], 10, "the reply announced by the descriptor")
        assert visit() == (set(), ((0, 0), [b"pong"])) and ch.recv_any() is None
        # a reply queued, then a send that may consume its signal: pending says do not block
        prefill.send_multipart([rid, b"pong2"])
        until(lambda: poller.ready() == [peer], 10, "the second reply announced")
        ch.send((0, 0), [b"ping2"])
        assert poller.pending() and poller.ready() == [peer] and visit() == (set(), ((0, 0), [b"pong2"]))
        until(lambda: not poller.ready() and not poller.ready(), 10, "an idle channel not visited")
        assert not poller.pending()
        poller.wait(0.01)  # nothing to wake it: returns after the timeout
        prefill.close(0)
        until(lambda: peer in poller.ready() and ch.poll_monitor(), 10, "the disconnect on the monitor")
        assert ch.disconnected((0, 0)) is True and ch.disconnected((0, 0)) is False
        assert poller.work.channels >= 3
    finally:
        poller.remove(ch)
        ch.close()
        poller.close()
    assert len(poller) == 0 and ch.watch is None
