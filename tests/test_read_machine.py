"""The read of one (request, prefill rank) as a sans-IO machine (:class:`RankRead` in
``runtime/readmachine.py``, its vocabulary in ``readstate.py``), driven only through
``handle(event, now) -> actions``, without sockets or NIXL: every live cell of the transition table is
reached by the event that causes it, terminal states take no failing event, and the machine's own
decisions (retries, heartbeats, pins, deadlines, staging fallback, one lowering per read) come back as
actions."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import (
    IllegalTransition,
    LeaseExpired,
    NotRegistered,
    PeerDisconnected,
    PeerRestarted,
    ReadFailure,
    RemoteError,
    TransferFailed,
    TransferTimeout,
)
from kvbridge.runtime.readmachine import RankRead, ReadContext
from kvbridge.runtime.readstate import (
    TERMINAL,
    TRANSITIONS,
    Abort,
    AlignRetry,
    Ask,
    Check,
    Checked,
    Count,
    Fail,
    Failed,
    Granted,
    Heartbeat,
    LetGo,
    Notify,
    PinsReleased,
    Post,
    PostSegment,
    ReadEvent,
    ReadState,
    Refreshed,
    Refused,
    Restarted,
    Retry,
    Scatter,
    ScatterDone,
    ScatterFailed,
    Segment,
    Sent,
    StageFailed,
    Tick,
    XferDone,
    XferFailed,
)
from kvbridge.runtime.slots import SlotAllocator

S, E = ReadState, ReadEvent
P = (0, 1)
WORK = SimpleNamespace(count=3, total_bytes=300)  # a direct rank's work item (opaque to the machine)
FALLBACK = SimpleNamespace(count=3, total_bytes=300, nonempty=True)  # a staged rank's direct read, staging full
TTL = 10.0


def lowered():
    return SimpleNamespace(total_bytes=300, count=3, dst=np.array([1000, 2000, 3000]), nbytes=np.array([100, 100, 100]))


def ctx(staging=1 << 20):
    return ReadContext(stage_timeout_s=5.0, transfer_timeout_s=20.0, register_grace_s=1.0,
                       slots=SlotAllocator(staging), staging_addr=1 << 30)


def machine(state, c=None, lower=None, direct=None):
    """A fresh read driven into ``state`` through handle() alone (``direct``: a staged rank's direct read
    should its staging be full; default :data:`FALLBACK`)."""
    c = c or ctx()
    if state is S.ACQUIRING:
        rr = RankRead(P, S.ACQUIRING, 0.0, c, work=WORK)
        rr.handle(Sent(), 0.0)
    elif state is S.STAGE_REQUESTED:
        rr = RankRead(P, S.STAGE_REQUESTED, 0.0, c, lower=lower or lowered, request="stage-msg", slot_key=("k", P),
                      direct=direct or (lambda: FALLBACK))
    elif state is S.POSTED:
        rr = machine(S.ACQUIRING, c)
        assert isinstance(rr.handle(Granted(TTL), 0.1)[0], Post)
    elif state is S.STAGING:
        rr = machine(S.STAGE_REQUESTED, c)
        rr.handle(Segment(300, 0, 100, 7000, False, TTL), 0.1)
    elif state is S.SCATTERING:
        rr = machine(S.STAGING, c)
        rr.handle(Segment(300, 100, 200, 7100, True, TTL), 0.2)
    elif state is S.DONE:
        rr = machine(S.POSTED, c)
        rr.handle(XferDone(0), 0.3)
        rr.handle(Tick(), 0.3)
    elif state is S.FAILED:
        rr = machine(S.ACQUIRING, c)
        rr.handle(Refused("lease_expired", "gone"), 0.1)
    else:
        rr = machine(S.ACQUIRING, c)
        rr.handle(Abort(), 0.1)
    assert rr.state is state
    return rr


def cause(state, event):
    """The events (and time) that make a read in ``state`` take table event ``event``."""
    staged = state in (S.STAGE_REQUESTED, S.STAGING)
    return {
        E.GRANTED: ([Granted(TTL)], 0.2),
        E.CHECKED: ([XferDone(0), Checked(True)], 0.2),  # (an optimistic read: its READ ended, its tag found)
        E.REFUSED: ([StageFailed("lease_expired", "gone", True, 0.0)] if staged
                    else [Refused("lease_expired", "gone")] if state is S.ACQUIRING
                    else [Failed(E.REFUSED, LeaseExpired, "refused")], 0.2),
        E.STAGE_SEGMENT: ([Segment(300, 100, 100, 7100, False, TTL)] if state is S.STAGING
                          else [Segment(300, 0, 100, 7000, False, TTL)], 0.2),
        E.STAGE_LAST: ([Segment(300, 100, 200, 7100, True, TTL)] if state is S.STAGING
                       else [Segment(300, 0, 300, 7000, True, TTL)], 0.2),
        E.STAGE_FULL: ([StageFailed("full", "no room", False, TTL)], 0.2),
        E.COMPLETED: ([XferDone(0), Tick()] if state is S.POSTED
                      else [XferDone(0), XferDone(1), ScatterDone(0), ScatterDone(1), Tick()], 0.3),
        E.NIXL_ERROR: ([XferFailed("transport failed")], 0.2),
        E.PROTOCOL_ERROR: ([Segment(999, 0, 100, 7000, False, TTL)] if state is S.STAGE_REQUESTED
                           else [Segment(300, 150, 10, 7000, False, TTL)] if state is S.STAGING
                           else [ScatterFailed("bug")], 0.2),
        E.DISCONNECT: ([Failed(E.DISCONNECT, PeerDisconnected, "agent went away")], 0.2),
        E.TIMEOUT: ([Tick()], 1000.0),
        E.ABORT: ([Abort()], 0.2),
    }[event]


LIVE_CELLS = [(s, e) for s in S if s not in TERMINAL for e in TRANSITIONS[s]]
KINDS = {E.REFUSED: LeaseExpired, E.NIXL_ERROR: TransferFailed, E.DISCONNECT: PeerDisconnected}


@pytest.mark.parametrize("state, event", LIVE_CELLS, ids=[f"{s.name}-{e.name}" for s, e in LIVE_CELLS])
def test_every_live_cell_through_handle(state, event):
    rr = optimistic() if event is E.CHECKED else machine(state)
    events, now = cause(state, event)
    actions = []
    for ev in events:
        actions += rr.handle(ev, now)
    assert rr.state is TRANSITIONS[state][event]
    fails = [a for a in actions if isinstance(a, Fail)]
    if TRANSITIONS[state][event] is S.FAILED:  # exactly one failure, of the right kind
        assert len(fails) == 1
        kind = fails[0].kind
        if event in KINDS:
            assert kind is KINDS[event]
        elif event is E.TIMEOUT:
            assert kind in (TransferTimeout, LeaseExpired)
        else:
            assert kind in (RemoteError, ReadFailure)
    else:
        assert not fails
    if event is E.GRANTED:
        assert [type(a) for a in actions] == [Post] and actions[0].transfer.work is WORK and rr.pinned
    if event is E.STAGE_FULL:  # read directly, under the pin, through the prepared lists
        posts = [a for a in actions if isinstance(a, Post)]
        assert posts and posts[0].transfer.work is FALLBACK and rr.pinned and rr.pin_deadline == pytest.approx(TTL)
    if event in (E.STAGE_SEGMENT, E.STAGE_LAST) and state is S.STAGE_REQUESTED:
        seg = [a for a in actions if isinstance(a, PostSegment)]
        assert len(seg) == 1 and seg[0].local == (1 << 30) + rr.staging.slot and rr.notify_at_end
    if event is E.COMPLETED and state is S.SCATTERING:
        assert sum(isinstance(a, Scatter) for a in actions) == 2


@pytest.mark.parametrize("state", sorted(TERMINAL, key=lambda s: s.name))
@pytest.mark.parametrize("ev", [XferFailed("x"), ScatterFailed("x"), Failed(E.DISCONNECT, PeerDisconnected, "x")],
                         ids=["nixl", "scatter", "disconnect"])
def test_terminal_states_take_no_failing_event(state, ev):
    rr = machine(state)
    with pytest.raises(IllegalTransition):
        rr.handle(ev, 1.0)
    assert rr.state is state
    assert rr.handle(Tick(), 1e6) == [] and rr.handle(Abort(), 1.0) == [] and rr.state is state


@pytest.mark.parametrize("state", sorted(TERMINAL, key=lambda s: s.name))
def test_late_grant_or_staging_for_an_ended_read_is_let_go(state):
    rr = machine(state)
    assert rr.handle(Granted(TTL), 1.0) == [LetGo()]
    assert rr.handle(Segment(300, 0, 100, 7000, False, TTL), 1.0) == [LetGo()]
    assert rr.handle(StageFailed("lease_expired", "x", True, 0.0), 1.0) == []  # a refusal pins nothing


@pytest.mark.parametrize("ev", [Abort(), XferFailed("x"), Failed(E.DISCONNECT, PeerDisconnected, "x")],
                         ids=["abort", "nixl", "disconnect"])
def test_an_ended_read_cancels_its_unfinished_direct_reads_once(ev):
    rr = machine(S.POSTED)
    acts = rr.handle(ev, 0.5)
    assert acts[0] == Count("cancelled_reads") and rr.reads[0].cancelled and rr.terminal
    done = machine(S.DONE)
    assert done.handle(Abort(), 0.5) == [] and not done.reads[0].cancelled  # finished: nothing to cancel


@pytest.mark.parametrize("state", [s for s in S if s not in TERMINAL])
@pytest.mark.parametrize("pinned_heartbeat", [False, True])
def test_no_tick_before_wake_at_can_act(state, pinned_heartbeat):
    """The loop skips ticks before ``wake_at``: a tick at any earlier time returns nothing and changes
    nothing; an event other than a tick asks for a tick at the next poll."""
    rr = machine(state)
    if pinned_heartbeat and rr.pinned:
        rr.handle(Tick(queued_locally=True), rr.refresh_at)  # heartbeat sent: the next one is later
    before = rr.handle(Tick(queued_locally=True), 0.5)
    wake = rr.wake_at
    assert wake > 0.5 or before, (rr, wake)
    for t in np.linspace(0.5, min(wake, 1e4), 7)[:-1]:
        for tick in (Tick(), Tick(queued_locally=True), Tick(peer_progress=t, posted_latest=t)):
            assert rr.handle(tick, float(t)) == [] and rr.state is state
    rr.handle(Sent(), 1.0)
    assert rr.wake_at == 0.0
    rr.handle(Abort(), 1.0)
    rr.handle(Tick(), 2.0)
    assert rr.wake_at == float("inf")


def test_nothing_to_read_is_pinned_then_released_at_once():
    rr = RankRead(P, S.ACQUIRING, 0.0, ctx(), work=None)
    assert rr.handle(Granted(TTL), 0.1) == [Notify()] and rr.state is S.DONE and not rr.pinned


def test_granted_without_time_fails():
    rr = machine(S.ACQUIRING)
    (a,) = rr.handle(Granted(0.0), 0.1)
    assert isinstance(a, Fail) and a.kind is LeaseExpired and rr.state is S.FAILED


def test_not_registered_retries_within_grace_then_fails_typed():
    rr = machine(S.ACQUIRING)
    acts = rr.handle(Refused("not_registered", "no lease yet"), 0.01)
    assert acts[0] == Count("register_retries") and isinstance(acts[1], Retry) and rr.state is S.ACQUIRING
    assert not rr.asked and rr.retry_at == acts[1].at > 0.01
    assert rr.handle(Granted(TTL), 0.012) == [LetGo()]  # a grant racing a scheduled retry is not used
    rr.handle(AlignRetry(0.011), 0.0)  # another reader of the request retries earlier: together
    assert rr.retry_at == 0.011
    assert rr.handle(Tick(), 0.0105) == []  # nothing is sent, no deadline runs before the retry
    assert rr.handle(Tick(), 0.011) == [Ask(stage=False)] and rr.retry_at is None and rr.sent_at == 0.011
    rr.handle(Sent(), 0.011)
    (a,) = rr.handle(Refused("not_registered", "still none"), 1.5)  # past register_grace_s (1 s)
    assert isinstance(a, Fail) and a.kind is NotRegistered and "register_grace_s" in a.text


def test_staged_not_registered_resends_the_stage_request():
    rr = machine(S.STAGE_REQUESTED)
    acts = rr.handle(StageFailed("not_registered", "no lease yet", False, 0.0), 0.01)
    assert isinstance(acts[-1], Retry)
    assert rr.handle(Tick(), acts[-1].at) == [Ask(stage=True)] and rr.request == "stage-msg"


def test_restarted_refusal_is_the_loops_decision():
    rr = machine(S.ACQUIRING)
    assert rr.handle(Refused("restarted", "new process"), 0.1) == [Restarted("new process")]
    assert rr.state is S.ACQUIRING  # the loop re-queues (Abort) or fails it (Failed REFUSED)


def test_pin_heartbeats_and_refresh():
    rr = machine(S.POSTED)  # request sent at 0.0, granted 10 s: heartbeat due at 10/3
    assert rr.pin_deadline == pytest.approx(TTL) and rr.refresh_at == pytest.approx(TTL / 3)
    assert Heartbeat() not in rr.handle(Tick(queued_locally=True), 3.0)
    assert Heartbeat() in rr.handle(Tick(queued_locally=True), 3.5) and rr.refresh_sent == 3.5
    rr.handle(Refreshed(TTL), 3.6)  # answered: the pin holds 10 s from when the heartbeat went out
    assert rr.pin_deadline == pytest.approx(13.5) and rr.refresh_at == pytest.approx(3.5 + TTL / 3)


def test_read_that_ends_after_its_pin_is_not_trusted():
    rr = machine(S.POSTED)
    rr.handle(XferDone(0), 11.0)
    acts = rr.handle(Tick(), 11.0)
    assert acts[0] == Heartbeat()  # (the pin was due a heartbeat too)
    (a,) = acts[1:]
    assert isinstance(a, Fail) and a.kind is LeaseExpired and "not trusted" in a.text and rr.state is S.FAILED


def test_local_queue_stops_the_clock_peer_progress_restarts_it():
    rr = machine(S.POSTED, ReadContext(5.0, 2.0, 1.0, SlotAllocator(0), 0))
    rr.handle(Refreshed(1e6), 0.2)  # (keep the pin out of the way)
    assert rr.handle(Tick(queued_locally=True), 9.0) == []  # 9 s queued here: not the peer's fault
    assert not [a for a in rr.handle(Tick(posted_latest=8.0), 9.0) if isinstance(a, Fail)]  # posted 1 s ago
    assert not [a for a in rr.handle(Tick(peer_progress=8.5, posted_latest=1.0), 9.0) if isinstance(a, Fail)]
    (a,) = [a for a in rr.handle(Tick(peer_progress=1.0, posted_latest=1.0), 9.0) if isinstance(a, Fail)]
    assert a.kind is TransferTimeout and "transfer_timeout_s=2" in a.text


def test_staging_full_falls_back_to_a_direct_read_through_the_prepared_lists():
    """Our staging has no room for the first segment: this rank's part is read directly, under the pin,
    as a direct rank's work item (its DirectRead over the prepared lists, made only now); nothing is
    lowered for it. A rank with nothing to read directly posts nothing and reports at the end."""
    calls, made = [], []

    def lower():
        calls.append(1)
        return lowered()

    def direct():
        made.append(1)
        return FALLBACK

    rr = machine(S.STAGE_REQUESTED, ctx(staging=0), lower=lower, direct=direct)  # our staging has no room
    acts = rr.handle(Segment(300, 0, 100, 7000, False, TTL), 0.1)
    assert Count("staging_fallbacks") in acts and rr.state is S.POSTED and rr.path == "direct"
    (post,) = [a for a in acts if isinstance(a, Post)]
    assert post.transfer.work is FALLBACK and made == [1]
    assert len(calls) == 1  # (the segment's size was checked against the one lowering)
    assert rr.handle(Segment(300, 100, 200, 7100, True, TTL), 0.2) == []  # further segments: ignored
    empty = machine(S.STAGE_REQUESTED, ctx(staging=0),
                    direct=lambda: SimpleNamespace(count=0, total_bytes=0, nonempty=False))
    acts = empty.handle(Segment(300, 0, 100, 7000, False, TTL), 0.1)
    assert not [a for a in acts if isinstance(a, Post)] and empty.notify_at_end


def test_empty_stage_completes_and_notifies_at_end():
    rr = machine(S.STAGE_REQUESTED)
    assert rr.handle(Segment(0, 0, 0, 0, True, TTL), 0.1) == [] and rr.state is S.SCATTERING and rr.notify_at_end
    assert rr.handle(Tick(), 0.2) == [] and rr.state is S.DONE and rr.pinned
    rr.handle(PinsReleased(), 0.2)
    assert not rr.pinned and not rr.asked


def test_staged_segments_must_follow_run_boundaries():
    rr = machine(S.STAGING)
    (a,) = [a for a in rr.handle(Segment(300, 100, 150, 7100, True, TTL), 0.2) if isinstance(a, Fail)]
    assert a.kind is RemoteError and "run boundaries" in a.text


@pytest.mark.parametrize("a, b", list(itertools.permutations([0, 1])))
def test_scattering_completes_only_when_every_segment_is_read_and_scattered(a, b):
    rr = machine(S.SCATTERING)
    rr.handle(XferDone(a), 0.3)
    rr.handle(ScatterDone(a), 0.3)
    rr.handle(XferDone(b), 0.3)
    assert rr.handle(Tick(), 0.3) == [] and rr.state is S.SCATTERING  # b read, not scattered yet
    rr.handle(ScatterDone(b), 0.3)
    rr.handle(Tick(), 0.3)
    assert rr.state is S.DONE


# ---- optimistic direct reads (DecodeConfig.optimistic_reads): the READ is posted beside the acquire ----
def optimistic(c=None):
    """An optimistic direct read just started: its acquire sent, its READ posted (no Done on it)."""
    c = c or ReadContext(stage_timeout_s=5.0, transfer_timeout_s=20.0, register_grace_s=1.0,
                         slots=SlotAllocator(1 << 20), staging_addr=1 << 30, optimistic=True)
    rr = RankRead(P, S.ACQUIRING, 0.0, c, work=WORK)
    acts = rr.handle(Sent(), 0.0)
    assert acts[0] == Count("optimistic_reads") and isinstance(acts[1], Post) and len(acts) == 2
    assert acts[1].transfer.work is WORK and acts[1].notify is False  # its Done is sent only for a granted pin
    assert rr.reads == [acts[1].transfer] and rr.notify_at_end and not rr.pinned and rr.state is S.ACQUIRING
    assert rr.asked
    return rr


def test_sent_posts_nothing_unless_optimistic():
    rr = RankRead(P, S.ACQUIRING, 0.0, ctx(), work=WORK)
    assert rr.handle(Sent(), 0.0) == [] and not rr.reads  # the default: posted once granted
    assert machine(S.STAGE_REQUESTED).handle(Sent(), 0.0) == []
    c = ReadContext(5.0, 20.0, 1.0, SlotAllocator(1 << 20), 1 << 30, optimistic=True)
    staged = RankRead(P, S.STAGE_REQUESTED, 0.0, c, lower=lowered, request="stage-msg", slot_key=("k", P))
    assert staged.handle(Sent(), 0.0) == [] and not staged.reads  # staged paths are unchanged
    empty = RankRead(P, S.ACQUIRING, 0.0, c, work=None)  # nothing to read: pinned, then released
    assert empty.handle(Sent(), 0.0) == [] and empty.handle(Granted(TTL), 0.1) == [Notify()]
    rr = optimistic()
    assert rr.handle(Sent(), 0.0) == [] and len(rr.reads) == 1  # posted once (a re-sent acquire posts nothing)


def test_optimistic_transfer_done_before_the_grant_waits_for_it():
    rr = optimistic()
    assert rr.handle(XferDone(0), 0.01) == [Check()]  # (the loop checks the lease's tag: see below)
    for t in (0.02, 1.0, 2.0):  # every byte is here, but no pin: not done
        rr.handle(Tick(), t)
        assert rr.state is S.ACQUIRING and not rr.pinned
    assert rr.handle(Granted(TTL), 2.5) == []  # no second READ
    assert rr.state is S.POSTED and rr.pinned and rr.pin_deadline == pytest.approx(TTL)
    assert rr.handle(Tick(), 2.5) == [] and rr.state is S.DONE
    assert rr.notify_at_end and rr.pinned  # the loop sends Done at completion: only for this granted pin
    assert rr.progress() == (300, 0)


def test_optimistic_transfer_done_after_the_grant():
    rr = optimistic()
    assert rr.handle(Granted(TTL), 0.01) == [] and rr.state is S.POSTED and len(rr.reads) == 1
    rr.handle(Tick(), 0.02)
    assert rr.state is S.POSTED  # the bytes are not all here
    assert rr.progress() == (0, 300)
    rr.handle(XferDone(0), 0.03)
    rr.handle(Tick(), 0.03)
    assert rr.state is S.DONE


def test_optimistic_pin_deadline_and_heartbeats_unchanged_once_granted():
    rr = optimistic()
    rr.handle(Granted(TTL), 0.01)
    assert rr.refresh_at == pytest.approx(TTL / 3)
    assert Heartbeat() in rr.handle(Tick(queued_locally=True), 3.5)
    late = optimistic()
    late.handle(Granted(1.0), 0.01)  # the pin holds until 1.0 (from when the acquire went out)
    late.handle(XferDone(0), 1.2)
    a = late.handle(Tick(), 1.2)[-1]  # the bytes arrived after the pin ran out: not trusted
    assert isinstance(a, Fail) and a.kind is LeaseExpired and late.state is S.FAILED


@pytest.mark.parametrize("settle, first_settles", [
    ("done", "before the refusal"), ("done", "before the grant"), ("done", "after the grant"),
    ("failed", "before the grant"), ("failed", "after the grant")])  # (failed before: the next test)
def test_optimistic_not_registered_discards_then_reads_again_once_settled_and_granted(settle, first_settles):
    """Refused "not registered": the optimistic bytes are discarded; a fresh READ into the same blocks is
    posted only once the pin is granted AND the first READ has settled (completed or failed): never two
    READs in flight into the same blocks."""
    rr = optimistic()
    first = rr.reads[0]
    ended = XferDone(0) if settle == "done" else XferFailed("stale read failed", 0)
    if first_settles == "before the refusal":  # (a completed READ asks for the tag check; its answer is not here)
        assert rr.handle(ended, 0.005) == ([Check()] if settle == "done" else [])
    acts = rr.handle(Refused("not_registered", "no lease yet"), 0.01)
    assert acts[:1] == [Count("register_retries")] and isinstance(acts[1], Retry)
    assert Count("discarded_reads") in acts and first.discard and not first.cancelled and rr.state is S.ACQUIRING
    if first_settles == "before the grant":
        assert rr.handle(ended, 0.012) == []  # settled, not granted: nothing posted yet
    assert rr.handle(Tick(), acts[1].at) == [Ask(stage=False)]
    rr.handle(Sent(), acts[1].at)
    acts = rr.handle(Granted(TTL), 0.05)
    assert rr.state is S.POSTED and rr.pinned
    if first_settles == "after the grant":
        assert acts == []  # the first READ may still write the blocks: wait for it
        for t in (0.06, 0.5):
            rr.handle(Tick(), t)
            assert rr.state is S.POSTED  # discarded bytes never complete a read
        acts = rr.handle(ended, 0.6)
    (post,) = acts
    assert isinstance(post, Post) and post.transfer is not first and post.transfer.work is WORK
    assert post.notify is False and not post.transfer.discard and rr.reads == [first, post.transfer]
    assert rr.progress() == (0, 300)  # discarded bytes are not progress
    rr.handle(Tick(), 0.7)
    assert rr.state is S.POSTED
    rr.handle(XferDone(1), 0.8)
    rr.handle(Tick(), 0.8)
    assert rr.state is S.DONE and rr.notify_at_end and rr.pinned and rr.progress() == (300, 0)


def test_optimistic_failed_read_before_any_answer_waits_for_the_answer():
    """An optimistic READ that fails before any answer is discarded (nothing was trusted yet; a restarted
    prefill may answer "restarted"): the acquire's answer decides. Granted: one fresh READ into the same
    blocks, and if that fails too the read fails typed; refused: the refusal's typed failure."""
    rr = optimistic()
    acts = rr.handle(XferFailed("transport failed", 0), 0.01)
    assert acts == [Count("discarded_reads")] and rr.state is S.ACQUIRING and rr.holds_nothing
    acts = rr.handle(Granted(5.0), 0.02)
    assert rr.state is S.POSTED and isinstance(acts[-1], Post) and len(rr.reads) == 2 and not rr.holds_nothing
    acts = rr.handle(XferFailed("transport failed again", 1), 0.03)
    assert isinstance(acts[-1], Fail) and acts[-1].kind is TransferFailed and rr.state is S.FAILED
    rr = optimistic()
    rr.handle(XferFailed("transport failed", 0), 0.01)
    acts = rr.handle(Refused("lease_expired", "expired"), 0.02)
    assert isinstance(acts[-1], Fail) and acts[-1].kind is LeaseExpired and rr.state is S.FAILED


@pytest.mark.parametrize("code, kind", [("lease_expired", LeaseExpired), ("done", LeaseExpired),
                                        ("unknown_reader", RemoteError), ("bad_request", RemoteError)])
@pytest.mark.parametrize("after_retry", [False, True])
def test_optimistic_other_refusals_fail_typed_and_cancel_the_transfer_in_flight(code, kind, after_retry):
    rr = optimistic()
    if after_retry:  # refused "not registered" first (bytes discarded), then for good
        acts = rr.handle(Refused("not_registered", "no lease yet"), 0.01)
        rr.handle(Tick(), acts[1].at)
    acts = rr.handle(Refused(code, "no"), 0.1)
    assert acts[0] == Count("cancelled_reads") and isinstance(acts[-1], Fail) and acts[-1].kind is kind
    # cancelled (never posted if the post thread had not reached it); the loop parks its handle until it
    # settles (release_reads), so the blocks are not handed back while the READ may still write them
    assert rr.reads[0].cancelled and not rr.reads[0].done and rr.state is S.FAILED and not rr.pinned
    assert rr.progress() == (0, 0)


def test_optimistic_not_registered_past_the_grace_fails_and_cancels():
    rr = optimistic()
    (cancel, fail) = rr.handle(Refused("not_registered", "none"), 1.5)  # past register_grace_s (1 s)
    assert cancel == Count("cancelled_reads") and fail.kind is NotRegistered and rr.reads[0].cancelled


def test_optimistic_restarted_is_the_loops_decision_then_cancels():
    rr = optimistic()
    assert rr.handle(Refused("restarted", "new process"), 0.1) == [Restarted("new process")]
    acts = rr.handle(Failed(E.REFUSED, PeerRestarted, "new process"), 0.1)  # the loop could not re-queue it
    assert acts[0] == Count("cancelled_reads") and acts[-1].kind is PeerRestarted and rr.reads[0].cancelled


@pytest.mark.parametrize("granted", [False, True])
@pytest.mark.parametrize("how", ["abort", "timeout", "disconnect"])
def test_optimistic_abort_timeout_disconnect_like_a_posted_read(how, granted):
    rr = optimistic()
    now = 0.1
    if granted:
        rr.handle(Granted(TTL), now)
    if how == "abort":
        acts = rr.handle(Abort(), now)
        assert acts == [Count("cancelled_reads")] and rr.state is S.CANCELLED
    elif how == "timeout":  # no answer within stage_timeout_s (5 s), or no progress in transfer_timeout_s
        now = 30.0 if granted else 5.5
        acts = rr.handle(Tick(), now)
        assert acts[-1].kind is TransferTimeout and rr.state is S.FAILED
    else:
        acts = rr.handle(Failed(E.DISCONNECT, PeerDisconnected, "gone"), now)
        assert acts[-1].kind is PeerDisconnected and rr.state is S.FAILED
    assert Count("cancelled_reads") in acts and rr.reads[0].cancelled
    assert rr.handle(Granted(TTL), now + 1) == [LetGo()]  # a grant arriving after it ended is let go


# ---- checked reads (runtime/tags.py): the lease's tag, read after the READ ended, proves it live ----
def test_a_live_tag_completes_the_read_without_a_pin_and_a_late_grant_is_let_go():
    rr = optimistic()
    assert rr.handle(XferDone(0), 0.01) == [Check()]
    assert rr.handle(Checked(True), 0.02) == [Count("checked_reads")]
    assert rr.state is S.POSTED and rr.checked and not rr.pinned and not rr.holds_nothing
    assert rr.handle(Tick(), 0.02) == [] and rr.state is S.DONE
    assert rr.checked and not rr.pinned  # no Done at completion (nothing pinned): the late grant is let go
    assert rr.handle(Granted(TTL), 0.5) == [LetGo()] and not rr.pinned  # the acquire's late grant: released
    assert rr.handle(Refused("lease_expired", "gone"), 0.6) == [] and rr.state is S.DONE  # a late refusal: nothing


def test_a_missing_tag_changes_nothing_and_the_grant_decides():
    rr = optimistic()
    rr.handle(XferDone(0), 0.01)
    assert rr.handle(Checked(False), 0.02) == [] and rr.state is S.ACQUIRING and not rr.checked
    rr.handle(Tick(), 0.03)
    assert rr.state is S.ACQUIRING  # still not trusted
    assert rr.handle(Granted(TTL), 0.1) == [] and rr.state is S.POSTED and rr.pinned
    rr.handle(Tick(), 0.1)
    assert rr.state is S.DONE and rr.notify_at_end and rr.pinned  # Done at completion, for the pin
    refused = optimistic()
    refused.handle(XferDone(0), 0.01)
    refused.handle(Checked(False), 0.02)
    acts = refused.handle(Refused("lease_expired", "gone"), 0.03)
    assert isinstance(acts[-1], Fail) and acts[-1].kind is LeaseExpired and refused.state is S.FAILED


def test_a_check_is_asked_only_of_an_unanswered_optimistic_read_whose_bytes_are_all_trusted_if_live():
    assert machine(S.POSTED).handle(XferDone(0), 0.3) == []  # granted first: nothing to check
    granted = optimistic()
    granted.handle(Granted(TTL), 0.01)
    assert granted.handle(XferDone(0), 0.02) == []
    assert granted.handle(Checked(True), 0.03) == [] and not granted.checked  # (a stale answer: ignored)
    discarded = optimistic()  # refused "not registered": its bytes are not trusted, a tag proves nothing
    acts = discarded.handle(Refused("not_registered", "no lease yet"), 0.01)
    assert discarded.handle(XferDone(0), 0.02) == []
    assert discarded.handle(Checked(True), 0.03) == [] and discarded.state is S.ACQUIRING
    assert discarded.retry_at == acts[1].at
    failed = optimistic()
    failed.handle(XferFailed("transport failed", 0), 0.01)
    assert failed.handle(Checked(True), 0.02) == [] and failed.state is S.ACQUIRING  # failed bytes: never trusted
    aborted = optimistic()
    aborted.handle(XferDone(0), 0.01)
    aborted.handle(Abort(), 0.02)
    assert aborted.handle(Checked(True), 0.03) == [] and aborted.state is S.CANCELLED


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.just(("done",)), st.just(("xfail",)), st.tuples(st.just("checked"), st.booleans()),
    st.just(("granted",)), st.tuples(st.just("refused"), st.sampled_from(["not_registered", "lease_expired", "done"])),
    st.just(("tick",)), st.just(("abort",))), max_size=14), st.booleans())
def test_optimistic_reads_complete_only_on_a_grant_or_a_live_tag_read_after_every_read_ended(script, ended_first):
    """Random answers, transfer ends, tag checks and ticks on an optimistic read: it is DONE only pinned or
    checked; checked only by a live tag answered while it was ACQUIRING, unanswered, with every READ ended
    and none discarded; a Check is asked only then; a read proven by its tag takes no later answer (a
    grant is let go, a refusal changes nothing)."""
    rr, now = optimistic(), 0.0
    if ended_first:  # (most scripts then reach a check)
        script = [("done",), ("checked", True), *script]
    for step in script:
        now += 0.01
        prev, ended = rr.state, bool(rr.reads) and all(t.done and not t.discard for t in rr.reads)
        provable = prev is S.ACQUIRING and rr.retry_at is None and not rr.pinned and ended
        if step[0] == "done" or step[0] == "xfail":
            live = [i for i, t in enumerate(rr.reads) if not t.done and not t.cancelled]
            if not live:
                continue
            ev = XferDone(live[-1]) if step[0] == "done" else XferFailed("x", live[-1])
        else:
            kind, arg = step[0], step[-1]
            ev = (Checked(arg) if kind == "checked" else Granted(TTL) if kind == "granted"
                  else Refused(arg, "no") if kind == "refused" else Tick() if kind == "tick" else Abort())
        was_checked = rr.checked
        acts = rr.handle(ev, now)
        if any(isinstance(a, Check) for a in acts):
            assert rr.state is S.ACQUIRING and not rr.pinned and rr.retry_at is None
            assert all(t.done and not t.discard for t in rr.reads)
        if isinstance(ev, Checked):
            assert rr.checked == (was_checked or (ev.live and provable))
            assert (rr.state is S.POSTED) == (prev is S.POSTED or (ev.live and provable)) or rr.terminal
        if was_checked and isinstance(ev, Granted):
            assert acts == [LetGo()] and not rr.pinned
        if was_checked and isinstance(ev, Refused):
            assert acts == []
        if rr.state is S.DONE and prev is not S.DONE:
            assert rr.pinned or rr.checked
            assert all(t.finished for t in rr.reads) and not all(t.discard for t in rr.reads)
            if rr.checked:
                assert all(t.done and not t.discard for t in rr.reads)
