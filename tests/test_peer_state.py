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


class FakeSock:
    def __init__(self, endpoint, full=False):
        self.endpoint, self.full, self.closed, self.sent, self.monitor_off = endpoint, full, 0, [], 0

    def send_multipart(self, frames, flags=0):
        assert flags == zmq.NOBLOCK  # never blocks the caller
        if self.full:
            raise zmq.Again()
        self.sent.append(frames)

    def disable_monitor(self):
        self.monitor_off += 1

    def close(self, linger=None):
        self.closed += 1


class FakeMon:
    def __init__(self):
        self.closed, self.events = 0, []

    def close(self, linger=None):
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
    socks, mons = {}, {}

    def open_sock(ep):
        socks[ep], mons[ep] = FakeSock(ep), FakeMon()
        return socks[ep], mons[ep]

    peer.connected(remote(agents), prepped if prepped is not None else {p: f"prep{p}" for p in agents}, open_sock)
    return peer, socks, mons


def test_connected_opens_one_socket_and_monitor_per_side_rank():
    peer, socks, mons = live_peer()
    assert peer.state is S.LIVE and peer.live and not peer.connecting
    assert set(peer.socks) == {(0, 0), (0, 1)} and set(peer.monitors) == {(0, 0), (0, 1)}
    assert peer.socks[(0, 0)].endpoint == "h:0" and peer.stage_socks is peer.socks
    assert peer.agents == {(0, 0): "a0", (0, 1): "a1"} and peer.summary()["agents"] == peer.agents


@pytest.mark.parametrize("how", ["live", "lost"])
def test_close_releases_everything_exactly_once(how):
    peer, socks, mons = live_peer()
    if how == "lost":
        peer.lose(E.DISCONNECTED, not_before=5.0)
        assert peer.state is S.LOST and peer.not_before == 5.0 and peer.socks  # kept until reaped
    peer.queue(peer.outbox, (0, 0), ("r", 1, "r"))
    t = FakeTransport()
    peer.close(t, keep_agents={"a1"})  # a1 is used by another live peer: kept
    peer.close(t)                      # again: nothing twice
    assert peer.state is S.RETIRED and peer.closes == 1
    assert all(s.closed == 1 and s.monitor_off == 1 for s in socks.values())
    assert all(m.closed == 1 for m in mons.values())
    assert sorted(t.unprepared) == ["prep(0, 0)", "prep(0, 1)"] and t.removed == ["a0"]
    assert not peer.socks and not peer.monitors and not peer.prepped and not peer.outbox
    with pytest.raises(IllegalTransition):
        peer.fire(E.CLOSE)


def test_dead_agent_is_not_named_and_send_is_dropped_after_close():
    peer, socks, _ = live_peer()
    peer.gone.add((0, 1))
    assert peer.agent((0, 0)) == "a0" and peer.agent((0, 1)) is None
    peer.send((0, 0), [b"x"])
    assert socks["h:0"].sent == [[b"x"]]
    peer.close(FakeTransport())
    peer.send((0, 0), [b"y"])  # no socket any more: dropped, no error
    assert socks["h:0"].sent == [[b"x"]] and peer.agent((0, 0)) is None


def test_gone_agent_is_removed_once_and_not_again_on_close():
    peer, _, _ = live_peer()
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
    peer, socks, _ = live_peer()
    socks["h:0"].full = True
    peer.send((0, 0), [b"a"])
    assert peer.unsent == [((0, 0), [b"a"])] and not socks["h:0"].sent
    peer.retry_unsent()
    assert peer.unsent == [((0, 0), [b"a"])]  # still full: kept
    socks["h:0"].full = False
    peer.retry_unsent()
    assert not peer.unsent and socks["h:0"].sent == [[b"a"]]


def test_disconnect_is_a_monitor_event_code_not_text():
    peer, _, mons = live_peer()
    events = {id(mons["h:0"]): [zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED], id(mons["h:1"]): [zmq.EVENT_CONNECTED]}

    def recv(mon):
        q = events[id(mon)]
        return q.pop(0) if q else None

    assert peer.disconnected((0, 0), recv) is True and not events[id(mons["h:0"])]  # drained
    assert peer.disconnected((0, 1), recv) is False
    assert peer.disconnected((9, 9), recv) is False  # no monitor for that rank


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
