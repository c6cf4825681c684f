"""The prefill peer's lifecycle (``runtime/peer.py``) without sockets or NIXL: every cell of the
transition table, and that closing a peer releases everything it owns (sockets, monitors, prepared
lists, NIXL agents, a late handshake result) exactly once."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import zmq

from kvbridge.errors import IllegalTransition
from kvbridge.runtime.peer import TERMINAL, TRANSITIONS, Peer, PeerEvent, PeerState, next_state

S, E = PeerState, PeerEvent

EXPECTED = {
    (S.CONNECTING, E.CONNECTED): S.LIVE,
    (S.CONNECTING, E.HANDSHAKE_FAILED): S.LOST,
    (S.CONNECTING, E.HANDSHAKE_TIMEOUT): S.LOST,
    (S.CONNECTING, E.CLOSE): S.RETIRED,
    (S.LIVE, E.DISCONNECTED): S.LOST,
    (S.LIVE, E.RESTARTED): S.LOST,
    (S.LIVE, E.CLOSE): S.RETIRED,
    (S.LOST, E.DISCONNECTED): S.LOST,
    (S.LOST, E.RESTARTED): S.LOST,
    (S.LOST, E.CLOSE): S.RETIRED,
}


@pytest.mark.parametrize("state", list(S))
@pytest.mark.parametrize("event", list(E))
def test_every_cell_of_the_table(state, event):
    """Each (state, event): the expected next state, or IllegalTransition naming both."""
    peer = Peer("p", {(0, 0): "h:1"})
    peer.state = state
    want = EXPECTED.get((state, event))
    if want is None:
        with pytest.raises(IllegalTransition, match=f"{event.name}.*{state.name}"):
            peer.fire(event)
        assert peer.state is state  # an illegal event changes nothing
    else:
        assert peer.fire(event) is want and peer.state is want
        assert next_state(state, event) is want


def test_table_shape():
    assert set(TRANSITIONS) == set(S)
    assert {(s, e): t for s, row in TRANSITIONS.items() for e, t in row.items()} == EXPECTED
    assert TERMINAL == {S.RETIRED}
    # RETIRED is reachable from every other state, and only through CLOSE
    assert all(TRANSITIONS[s].get(E.CLOSE) is S.RETIRED for s in S if s is not S.RETIRED)
    assert all(t is not S.RETIRED or e is E.CLOSE for row in TRANSITIONS.values() for e, t in row.items())


class FakeChannel:
    """A side channel without sockets (the real one: test_connect.py, test_faults.py)."""

    def __init__(self, endpoints):
        self.endpoints, self.full, self.closed, self.sent, self.down = dict(endpoints), False, 0, [], set()
        self.buffered = False

    def send(self, prank, frames, flags=0):
        assert flags == zmq.NOBLOCK  # never blocks the caller
        if self.full:
            raise zmq.Again()
        self.sent.append((prank, frames))

    def disconnected(self, prank):
        if prank in self.down:
            self.down.discard(prank)
            return True
        return False

    def close(self):
        self.closed += 1


class FakeTransport:
    def __init__(self):
        self.removed, self.unprepared = [], []

    def remove_peer(self, agent):
        self.removed.append(agent)

    def unprepare(self, prep):
        self.unprepared.append(prep)


def remote(agents, side=None):
    agents = dict(agents)
    return SimpleNamespace(agents=agents, side_ranks=tuple(side if side is not None else sorted(agents)),
                           readers={p: 1 for p in agents}, digests={}, modes={}, lowered=None,
                           summary=lambda: {"agents": agents})


def live_peer(agents=None, prepped=None):
    agents = agents or {(0, 0): "a0", (0, 1): "a1"}
    peer = Peer("p", {p: f"h:{i}" for i, p in enumerate(agents)})
    channels = []

    def open_channel(endpoints):
        channels.append(FakeChannel(endpoints))
        return channels[-1]

    peer.connected(remote(agents), prepped if prepped is not None else {p: f"prep{p}" for p in agents}, open_channel)
    return peer, channels[0]


def test_connected_opens_one_side_channel_to_every_side_rank():
    peer, ch = live_peer()
    assert peer.state is S.LIVE and peer.live and not peer.connecting
    assert ch.endpoints == {(0, 0): "h:0", (0, 1): "h:1"} and peer.channel is ch
    assert set(peer.socks) == {(0, 0), (0, 1)} and peer.stage_socks is peer.socks
    peer.socks[(0, 1)].send_multipart([b"x"], zmq.NOBLOCK)
    assert ch.sent == [((0, 1), [b"x"])]
    assert peer.agents == {(0, 0): "a0", (0, 1): "a1"} and peer.summary()["agents"] == peer.agents


@pytest.mark.parametrize("how", ["live", "lost"])
def test_close_releases_everything_exactly_once(how):
    peer, ch = live_peer()
    if how == "lost":
        peer.lose(E.DISCONNECTED, not_before=5.0)
        assert peer.state is S.LOST and peer.not_before == 5.0 and peer.socks  # kept until reaped
    peer.queue(peer.outbox, (0, 0), ("r", 1, "r"))
    t = FakeTransport()
    peer.close(t, keep_agents={"a1"})  # a1 is used by another live peer: kept
    peer.close(t)                      # again: nothing twice
    assert peer.state is S.RETIRED and peer.closes == 1
    assert ch.closed == 1
    assert sorted(t.unprepared) == ["prep(0, 0)", "prep(0, 1)"] and t.removed == ["a0"]
    assert not peer.socks and peer.channel is None and not peer.prepped and not peer.outbox
    with pytest.raises(IllegalTransition):
        peer.fire(E.CLOSE)


def test_dead_agent_is_not_named_and_send_is_dropped_after_close():
    peer, ch = live_peer()
    peer.gone.add((0, 1))
    assert peer.agent((0, 0)) == "a0" and peer.agent((0, 1)) is None
    peer.send((0, 0), [b"x"])
    assert ch.sent == [((0, 0), [b"x"])]
    peer.close(FakeTransport())
    peer.send((0, 0), [b"y"])  # no socket any more: dropped, no error
    assert ch.sent == [((0, 0), [b"x"])] and peer.agent((0, 0)) is None


def test_gone_agent_is_removed_once_and_not_again_on_close():
    peer, _ = live_peer()
    peer.lose(E.DISCONNECTED, 0.0)
    t = FakeTransport()
    assert peer.agent_gone((0, 1)) == "a1" and peer.agent((0, 1)) is None and peer.agent((0, 0)) == "a0"
    assert not t.removed  # not yet: the dead rank's reads are released first
    peer.remove_agent((0, 1), t)
    peer.remove_agent((0, 1), t)
    assert t.removed == ["a1"]
    peer.close(t)
    assert t.removed == ["a1", "a0"]


def test_full_socket_keeps_frames_until_retry():
    peer, ch = live_peer()
    ch.full = True
    peer.send((0, 0), [b"a"])
    assert peer.unsent == [((0, 0), [b"a"])] and not ch.sent
    peer.retry_unsent()
    assert peer.unsent == [((0, 0), [b"a"])]  # still full: kept
    ch.full = False
    peer.retry_unsent()
    assert not peer.unsent and ch.sent == [((0, 0), [b"a"])]


def test_disconnect_is_a_monitor_event_per_rank_not_text():
    peer, ch = live_peer()
    ch.down.add((0, 0))
    assert peer.disconnected((0, 0)) is True and peer.disconnected((0, 0)) is False  # reported once
    assert peer.disconnected((0, 1)) is False
    assert peer.disconnected((9, 9)) is False  # not a rank of this peer


def test_side_channel_routes_each_ranks_replies_and_reports_its_disconnect():
    """The real channel: one ROUTER to two prefill ranks (ROUTER sockets standing in for them); each
    rank's replies reach that rank's end whatever the order they arrive in; a rank's process going
    away is reported for that rank only (the endpoint in the ZMQ monitor event)."""
    import time

    from kvbridge.runtime.peer import SideChannel
    ctx = zmq.Context.instance()
    servers, eps = {}, {}
    for p in ((0, 0), (0, 1)):
        s = servers[p] = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        eps[p] = f"127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}"
    ch = SideChannel(ctx, eps)
    try:
        for p in eps:
            ch.send(p, [b"ask", repr(p).encode()], zmq.NOBLOCK)  # queued at once, before TCP connects
        who = {}
        for p, s in servers.items():
            assert s.poll(5000)
            who[p], *frames = s.recv_multipart()
            assert frames == [b"ask", repr(p).encode()]
        servers[(0, 0)].send_multipart([who[(0, 0)], b"reply", b"(0, 0)"])
        deadline = time.monotonic() + 5
        while not ch.buffered and time.monotonic() < deadline:  # asking (0, 1) takes (0, 0)'s reply off the socket
            with pytest.raises(zmq.Again):
                ch.recv((0, 1), zmq.NOBLOCK)
            time.sleep(0.01)
        assert ch.buffered  # (a waiter must not sleep on the socket now)
        servers[(0, 1)].send_multipart([who[(0, 1)], b"reply", b"(0, 1)"])
        time.sleep(0.2)
        assert ch.recv((0, 1), zmq.NOBLOCK) == [b"reply", b"(0, 1)"]
        assert ch.recv((0, 0), zmq.NOBLOCK) == [b"reply", b"(0, 0)"]
        assert not ch.buffered
        with pytest.raises(zmq.Again):
            ch.recv((0, 0), zmq.NOBLOCK)
        servers.pop((0, 1)).close(0)
        deadline = time.monotonic() + 5
        while not ch.disconnected((0, 1)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert time.monotonic() < deadline and not ch.disconnected((0, 0))
    finally:
        ch.close()
        for s in servers.values():
            s.close(0)


def test_abandoned_handshake_result_is_released_when_it_returns():
    """CONNECTING -> HANDSHAKE_TIMEOUT (LOST) -> CLOSE while the handshake thread still runs: nothing to
    release yet; once it returns, its agents and lists are released exactly once."""
    fut: Future = Future()
    peer = Peer("p", {(0, 0): "h:0"}, started=0.0, bound_s=1.0, future=fut, pending=["r"])
    peer.lose(E.HANDSHAKE_TIMEOUT, 0.0, "slow")
    assert peer.state is S.LOST and peer.error == "slow" and not peer.settled
    t = FakeTransport()
    peer.close(t)
    assert peer.state is S.RETIRED and not t.removed and not peer.settled and not peer.pending
    fut.set_result((remote({(0, 0): "late"}), {(0, 0): "late-prep"}))
    peer.close(t)
    peer.close(t)
    assert t.removed == ["late"] and t.unprepared == ["late-prep"] and peer.settled


def test_failed_handshake_has_nothing_to_release():
    fut: Future = Future()
    fut.set_exception(OSError("refused"))
    peer = Peer("p", {(0, 0): "h:0"}, future=fut)
    peer.lose(E.HANDSHAKE_FAILED, 0.0, "refused")
    t = FakeTransport()
    peer.close(t)
    assert peer.state is S.RETIRED and peer.settled and not t.removed and not t.unprepared


def test_handshake_result_is_only_read_from_a_handshaken_peer():
    peer = Peer("p", {(0, 0): "h:0"})
    with pytest.raises(IllegalTransition, match="no handshake result"):
        _ = peer.agents
    assert peer.agent((0, 0)) is None


def test_replace_is_the_one_policy_for_an_engine_ids_current_peer():
    """PeerTable.replace: none -> nothing; CONNECTING -> abandoned, its queued reads handed over; LIVE ->
    the caller's forget(engine id, why); then the engine id's LOST peers are reaped at once (their reads
    dropped through the caller), other engines' lost peers wait."""
    from kvbridge.runtime.metrics import Metrics
    from kvbridge.runtime.peers import PeerTable
    t = FakeTransport()
    table = PeerTable(zmq.Context.instance(), t, Metrics(), lambda: None, "d", 5.0, 1.0, 3600.0, 16)
    forgotten, dropped = [], []

    def forget(eid, why):
        forgotten.append((eid, why))
        table.drop_live(eid)

    def replace(eid):
        return table.replace(eid, "why", forget, lambda p: True, dropped.append)
    assert replace("none") == [] and not forgotten
    fut: Future = Future()
    connecting = table.current["c"] = Peer("c", {(0, 0): "h:0"}, future=fut, pending=["r1", "r2"])
    assert replace("c") == ["r1", "r2"] and connecting.state is S.RETIRED and "c" not in table.current
    assert connecting in table.old  # its thread still runs: released when it returns
    live, _ch = live_peer()
    table.current["p"] = live
    lost_p, _ = live_peer()
    lost_p.lose(E.DISCONNECTED, not_before=0.0)
    lost_q, _ = live_peer()
    lost_q.engine_id = "q"
    lost_q.lose(E.DISCONNECTED, not_before=0.0)
    table.old += [lost_p, lost_q]
    assert replace("p") == [] and forgotten == [("p", "why")] and live.state is S.RETIRED
    assert lost_p.state is S.RETIRED and dropped == [lost_p]  # forced: its reads dropped now
    assert lost_q.state is S.LOST and lost_q in table.old  # another engine's, still in use: kept
    fut.set_result((remote({(0, 0): "late"}), {}))
    table.reap(None, lambda p: True, dropped.append)
    assert connecting not in table.old and "late" in t.removed


def test_idle_and_surplus_peers_are_released_least_recently_used_first():
    from kvbridge.runtime.metrics import Metrics
    from kvbridge.runtime.peers import PeerTable
    t = FakeTransport()
    table = PeerTable(zmq.Context.instance(), t, Metrics(), lambda: None, "d", 5.0, 1.0, 100.0, 2)
    peers = {}
    for eid, used in (("a", 10.0), ("b", 30.0), ("c", 20.0), ("busy", 0.0)):
        p, _ = live_peer({(0, 0): f"{eid}0"})
        p.engine_id, p.used = eid, used
        peers[eid] = table.current[eid] = p
    # 4 live, max 2: the two least recently used that no read references go ("busy" is in use)
    assert table.evict_idle(50.0, lambda p: p.engine_id == "busy") == ["a", "c"]
    assert set(table.current) == {"b", "busy"} and table.evicted == {"a", "c"} and table.metrics.evicted_peers == 2
    assert peers["a"].state is S.RETIRED and "a0" in t.removed
    assert table.evict_idle(50.5, lambda p: False) == []  # looked again too soon
    # idle past peer_idle_s (100 s): released whatever the count
    assert table.evict_idle(131.0, lambda p: False) == ["busy", "b"] and not table.current


def test_reads_waiting_for_the_handshake_change_only_through_the_peer():
    """Peer.pending is a read-only view: queue_pending refuses a second read of the same key, take_pending
    hands them all over in order and leaves none; close drops what is left."""
    peer = Peer("p", {(0, 0): "h:0"})
    a, b = SimpleNamespace(key="a"), SimpleNamespace(key="b")
    assert peer.queue_pending(a) and peer.queue_pending(b) and not peer.queue_pending(SimpleNamespace(key="a"))
    assert peer.pending == (a, b) and isinstance(peer.pending, tuple) and peer.waiting == 2
    assert peer.take_pending() == [a, b] and peer.pending == () and peer.waiting == 0
    assert peer.queue_pending(a)
    peer.close(FakeTransport())
    assert peer.pending == ()


def test_requeue_waits_on_the_connecting_peer_or_begins_one_within_the_rehandshake_bound():
    """PeerTable.requeue: a connecting peer of the engine id takes the reads (the old peer untouched);
    otherwise the old peer is lost, the engine id replaced (its lost peers reaped) and a new peer begun to
    the endpoints last given, bounded by min(connect_timeout_s, rehandshake_timeout_s), keeping why."""
    from threading import Event

    from kvbridge.runtime.metrics import Metrics
    from kvbridge.runtime.peers import REHANDSHAKE, PeerTable
    gate = Event()
    t = FakeTransport()
    table = PeerTable(zmq.Context.instance(), t, Metrics(),
                      lambda: SimpleNamespace(background=lambda *a: gate.wait(5)), "d", 5.0, 1.0, 3600.0, 16)
    forgotten, dropped = [], []

    def forget(eid, why):
        forgotten.append((eid, why))
        table.drop_live(eid)
    try:
        old, _ = live_peer()
        table.current["p"] = old
        table.endpoints["p"] = {(0, 0): "h:9"}
        a, b = SimpleNamespace(key="a"), SimpleNamespace(key="b")
        cur = table.requeue(old, [a], E.RESTARTED, "restarted", forget, lambda p: False, dropped.append)
        assert cur is table.current["p"] and cur.connecting and cur.pending == (a,) and cur.why == "restarted"
        assert cur.bound_s == 1.0 and cur.endpoints == {(0, 0): "h:9"}
        assert old.state is S.RETIRED and dropped == [old] and not forgotten  # lost, then reaped (forced)
        assert table.requeue(old, [b], E.DISCONNECTED, "gone", forget, lambda p: False, dropped.append) is cur
        assert cur.pending == (a, b) and cur.why == "restarted"
        # a live current peer of the engine id, not the old one: forgotten (its reads fail) for the re-handshake
        old_q, _ = live_peer()
        old_q.engine_id = "q"
        live_q, _ = live_peer()
        live_q.engine_id = "q"
        table.current["q"] = live_q
        cur_q = table.requeue(old_q, [a], E.DISCONNECTED, "gone", forget, lambda p: False, dropped.append)
        assert forgotten == [("q", REHANDSHAKE)] and live_q.state is S.RETIRED and old_q.state is S.RETIRED
        assert cur_q.connecting and cur_q.pending == (a,) and cur_q.why == "gone"
    finally:
        gate.set()
        table.close_old()
        if table.pool is not None:
            table.pool.shutdown(wait=True)
