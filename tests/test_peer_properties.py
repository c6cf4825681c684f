"""What the peer (``runtime/peer.py``) promises, without sockets or NIXL: every state change follows its
table (an illegal one raises ``IllegalTransition`` and changes nothing, ``connected()`` checks before it
opens anything); ``close`` releases everything the peer owns exactly once (the side channel, each prepared
list, each NIXL agent not kept for another peer, a late handshake result), whatever came before; a lost peer
is reaped no earlier than the latest ``not_before`` it was given and keeps the first reason; a rank's
progress only moves forward; the batches it hands out leave it empty."""
from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.errors import IllegalTransition
from kvbridge.runtime.peer import TRANSITIONS, Peer, PeerEvent, PeerState

S, E = PeerState, PeerEvent
RANKS = [(0, 0), (0, 1), (1, 0)]


class Channel:
    def __init__(self, endpoints):
        self.endpoints, self.closed, self.buffered = dict(endpoints), 0, False

    def close(self):
        self.closed += 1


class Transport:
    def __init__(self):
        self.removed, self.unprepared = Counter(), Counter()

    def remove_peer(self, agent):
        self.removed[agent] += 1

    def unprepare(self, prep):
        self.unprepared[prep] += 1


def remote(tag):
    agents = {p: f"{tag}{p[0]}{p[1]}" for p in RANKS}
    return SimpleNamespace(agents=agents, side_ranks=tuple(RANKS), readers={p: 1 for p in RANKS},
                           summary=lambda: {})


def test_connected_checks_the_transition_before_it_opens_anything():
    opened = []
    peer = Peer("p", {p: "h:1" for p in RANKS})
    peer.fire(E.HANDSHAKE_FAILED)  # LOST
    with pytest.raises(IllegalTransition):
        peer.connected(remote("a"), {}, lambda eps: opened.append(eps) or Channel(eps))
    assert not opened and peer.state is S.LOST and peer.channel is None
    # opening the channel fails: still CONNECTING, owning nothing
    fresh = Peer("q", {p: "h:1" for p in RANKS})

    def broken(eps):
        raise OSError("no route")
    with pytest.raises(OSError):
        fresh.connected(remote("b"), {RANKS[0]: "prep"}, broken)
    assert fresh.state is S.CONNECTING and fresh.remote is None and not fresh.prepped


def test_a_lost_peer_keeps_its_latest_reap_time_and_a_reason_given():
    peer = Peer("p", {p: "h:1" for p in RANKS})
    peer.connected(remote("a"), {}, Channel)
    peer.lose(E.DISCONNECTED, 10.0, "agent went away")
    peer.lose(E.RESTARTED, 4.0)  # another rank reports it too, earlier: neither moves
    assert peer.state is S.LOST and peer.not_before == 10.0 and peer.error == "agent went away"
    peer.lose(E.DISCONNECTED, 12.0)
    assert peer.not_before == 12.0


def test_progress_only_moves_forward_and_batches_leave_the_peer_empty():
    peer = Peer("p", {(0, 0): "h:1"})
    assert peer.progress_of((0, 0)) == float("-inf")
    peer.record_progress((0, 0), 5.0)
    peer.record_progress((0, 0), 3.0)  # a late report of an older completion
    assert peer.progress_of((0, 0)) == 5.0
    peer.queue(peer.outbox, (0, 0), ("r", 1, "k"))
    peer.queue(peer.heartbeats, (0, 1), ("r", 1, "k"))
    assert peer.take_outbox() == {(0, 0): [("r", 1, "k")]} and peer.take_outbox() == {}
    assert peer.take_heartbeats() == {(0, 1): [("r", 1, "k")]} and peer.take_heartbeats() == {}
    peer.queue(peer.heartbeats, (0, 1), ("r", 1, "k"))
    peer.close(Transport())
    assert peer.heartbeats == {} and peer.outbox == {} and peer.unsent == []


def test_a_late_handshake_result_keeps_the_agents_another_peer_uses():
    fut: Future = Future()
    peer = Peer("p", {(0, 0): "h:1"}, future=fut)
    t = Transport()
    peer.close(t)
    fut.set_result((remote("a"), {(0, 0): "prep"}))
    peer.close(t, keep_agents={"a00"})
    assert "a00" not in t.removed and t.removed == Counter({"a01": 1, "a10": 1})
    assert t.unprepared == Counter({"prep": 1})


# ---- random lifecycles ----------------------------------------------------------------------------------
peer_op = st.one_of(
    st.tuples(st.just("fire"), st.sampled_from(list(E))),
    st.tuples(st.just("lose"), st.sampled_from([e for e in E if e is not E.CLOSE]), st.floats(0.0, 10.0),
              st.sampled_from(["", "why"])),
    st.tuples(st.just("connected")), st.tuples(st.just("connected")),
    st.tuples(st.just("close"), st.sets(st.sampled_from(["a00", "a01", "late10"]), max_size=2)),
    st.tuples(st.just("gone"), st.sampled_from(RANKS)),
    st.tuples(st.just("remove"), st.sampled_from(RANKS)),
    st.tuples(st.just("progress"), st.sampled_from(RANKS), st.floats(0.0, 10.0)),
    st.tuples(st.just("queue"), st.sampled_from(RANKS), st.booleans()),
    st.tuples(st.just("take"), st.booleans()),
    st.tuples(st.just("late")),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(peer_op, min_size=1, max_size=30), st.booleans())
def test_peer_lifecycle_properties(ops, background):
    fut: Future | None = Future() if background else None
    peer = Peer("p", {p: f"h:{i}" for i, p in enumerate(RANKS)}, future=fut)
    t = Transport()
    channels: list[Channel] = []
    owned_preps: set = set()
    adopted = False
    not_before, progress, error = 0.0, {}, ""

    def open_channel(eps):
        channels.append(Channel(eps))
        return channels[-1]

    for o in ops:
        before, kind = peer.state, o[0]
        removed_before = set(t.removed)
        if kind in ("fire", "lose", "connected"):
            event = o[1] if kind != "connected" else E.CONNECTED
            if kind == "fire" and event is E.CLOSE:
                continue  # (close() is the way to CLOSE: checked below)
            want = TRANSITIONS[before].get(event)
            preps = {p: f"prep{p}" for p in RANKS}
            result = (remote("a"), preps)
            if kind == "connected" and fut is not None:  # the handshake's thread returned: its result
                if not fut.done():
                    fut.set_result(result)
                result = fut.result()
            try:
                if kind == "fire":
                    peer.fire(event)
                elif kind == "lose":
                    peer.lose(event, o[2], o[3])
                else:
                    opened = len(channels)
                    peer.connected(result[0], result[1], open_channel)
                    owned_preps |= set(result[1].values())
                    adopted = True
            except IllegalTransition:
                assert want is None and peer.state is before, (before, event)
                assert kind != "connected" or len(channels) == opened  # nothing opened
                continue
            assert want is not None and peer.state is want, (before, event, peer.state)
            if kind == "lose":
                not_before, error = max(not_before, o[2]), o[3] or error
        elif kind == "close":
            peer.close(t, keep_agents=o[1])
            assert peer.state is S.RETIRED
            assert not ((set(t.removed) - removed_before) & o[1])  # never an agent kept for another peer
        elif kind == "gone":
            peer.agent_gone(o[1])
            assert peer.agent(o[1]) is None
        elif kind == "remove":
            peer.remove_agent(o[1], t)
        elif kind == "progress":
            peer.record_progress(o[1], o[2])
            progress[o[1]] = max(progress.get(o[1], float("-inf")), o[2])
        elif kind == "queue" and peer.state is not S.RETIRED:  # (nothing queues on a retired peer)
            peer.queue(peer.outbox if o[2] else peer.heartbeats, o[1], ("r", 1, "k"))
        elif kind == "take":
            (peer.take_outbox if o[1] else peer.take_heartbeats)()
            assert not (peer.outbox if o[1] else peer.heartbeats)
        elif kind == "late" and fut is not None and not fut.done():
            fut.set_result((remote("late"), {(0, 0): "late-prep"}))
            if peer.state is S.RETIRED:
                peer.close(t)
        # never anything twice; each channel closed at most once
        assert all(n == 1 for n in t.removed.values()), t.removed
        assert all(n == 1 for n in t.unprepared.values()), t.unprepared
        assert all(c.closed <= 1 for c in channels) and len(channels) <= 1
        assert peer.not_before == not_before and peer.error == error
        assert all(peer.progress_of(p) == v for p, v in progress.items())
        if peer.state is S.RETIRED:  # everything it owned is released
            assert peer.closes == 1 and peer.channel is None and not peer.socks and not peer.prepped
            assert not peer.outbox and not peer.heartbeats and not peer.unsent and not peer.pending
            assert all(peer.agent(p) is None for p in RANKS)
            assert all(c.closed == 1 for c in channels) and set(t.unprepared) >= owned_preps
        else:
            assert peer.closes == 0 and all(c.closed == 0 for c in channels)
            assert not (set(t.unprepared) & owned_preps)
    # a handshake result nobody adopted is released once it returns, whenever the peer was closed
    peer.close(t)
    if fut is not None and not fut.done():
        fut.set_result((remote("late"), {(0, 0): "late-prep"}))
        peer.close(t)
    if fut is not None and not adopted:
        remote_, preps = fut.result()
        assert all(t.unprepared[p] == 1 for p in preps.values())
    assert all(n == 1 for n in t.removed.values()) and all(n == 1 for n in t.unprepared.values())
