"""What the read machine (``RankRead.handle(event, now) -> actions``, ``runtime/readmachine.py``; its table in
``readstate.py``) promises, checked one rule at a time and then by hypothesis over random event sequences
with random clocks:

* every state change is a cell of ``TRANSITIONS``; a terminal read stays as it is and asks for nothing
  (only ``LetGo`` of a pin granted too late); a failing event there raises ``IllegalTransition``;
* a read is DONE only after a pin (a grant, or a staged answer), with every transfer finished and within
  the pin the prefill granted; it fails once (one ``Fail``, only on the way to FAILED), an abort fails nothing;
* the pin counts from when the request (or heartbeat) went out, never from the answer; a refreshed pin
  never ends earlier; heartbeats only for a pinned read;
* the timeout of each waiting state is the documented one: ``stage_timeout_s`` from the last answer while
  waiting for the prefill (ACQUIRING, STAGE_REQUESTED, STAGING with every announced segment read),
  ``transfer_timeout_s`` plus the bytes in flight at ``min_read_rate`` while reading, from the latest of its
  own progress, the peer's progress and the last post; a local post queue stops that clock;
* no action names a transfer the machine did not post; segments of the packed stream land at their offset
  in our staging slot and scatter exactly the runs they cover, each run once; a segment not on run
  boundaries is a protocol error;
* a tick before ``wake_at`` does nothing.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.errors import IllegalTransition, LeaseExpired, PeerDisconnected, RemoteError, TransferTimeout
from kvbridge.runtime.readmachine import REFUSALS, RankRead, ReadContext
from kvbridge.runtime.readstate import (
    TERMINAL,
    TRANSITIONS,
    Abort,
    AlignRetry,
    Ask,
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
from kvbridge.staging import offsets, segment_bounds

S, E = ReadState, ReadEvent
BASE = 1 << 30
P = (0, 0)


def ctx(stage=5.0, transfer=20.0, grace=1.0, rate=100.0, staging=1 << 20):
    return ReadContext(stage_timeout_s=stage, transfer_timeout_s=transfer, register_grace_s=grace,
                       slots=SlotAllocator(staging), staging_addr=BASE, min_read_rate=rate)


def lowering(lengths):
    lengths = np.asarray(lengths, np.int64)
    return SimpleNamespace(total_bytes=int(lengths.sum()), count=int(lengths.size),
                           dst=np.arange(lengths.size, dtype=np.int64) * 4096, nbytes=lengths)


def direct(c, nbytes=400, t0=0.0):
    rr = RankRead(P, S.ACQUIRING, t0, c, work=SimpleNamespace(count=1, total_bytes=nbytes))
    rr.handle(Sent(), t0)
    return rr


def staged(c, lengths=(100, 100, 200), t0=0.0):
    d = lowering(lengths)
    return RankRead(P, S.STAGE_REQUESTED, t0, c, lower=lambda: d, request="stage", slot_key="k")


def fails(actions):
    return [a for a in actions if isinstance(a, Fail)]


# ---- the timeout of each waiting state, one by one ------------------------------------------------------
def _in(state, c):
    """A read in ``state`` at time 1.0 (its last progress), heartbeats out of the way (a long pin)."""
    if state is S.ACQUIRING:
        return direct(c, t0=1.0)
    if state is S.POSTED:
        rr = direct(c)
        rr.handle(Granted(1e6), 1.0)
        return rr
    rr = staged(c, t0=1.0 if state is S.STAGE_REQUESTED else 0.0)
    if state is S.STAGE_REQUESTED:
        return rr
    rr.handle(Segment(400, 0, 100, 7000, False, 1e6), 1.0)  # STAGING, one segment of 100 B in flight
    if state is S.SCATTERING:
        rr.handle(Segment(400, 100, 300, 7100, True, 1e6), 1.0)
    return rr


@pytest.mark.parametrize("state, limit", [
    (S.ACQUIRING, 5.0), (S.STAGE_REQUESTED, 5.0),
    (S.STAGING, 20.0 + 100 / 100.0),     # a segment in flight: reading, its bytes at min_read_rate
    (S.POSTED, 20.0 + 400 / 100.0),      # the direct read's bytes in flight
    (S.SCATTERING, 20.0 + 400 / 100.0),
])
def test_the_timeout_of_each_waiting_state_is_the_documented_one(state, limit):
    rr = _in(state, ctx())
    assert rr.state is state
    assert not fails(rr.handle(Tick(), 1.0 + limit))           # at the limit: still fine
    (f,) = fails(rr.handle(Tick(), 1.0 + limit + 1e-3))        # just past it: timed out, typed
    assert f.kind is TransferTimeout and rr.state is S.FAILED
    want = "stage_timeout_s" if limit == 5.0 else "transfer_timeout_s"
    assert want in f.text


def test_staging_between_segments_waits_for_the_prefill_on_stage_timeout_s():
    """Every announced segment is read: the read waits for the prefill's next announcement (a frozen prefill
    shows up here), so ``stage_timeout_s`` applies from the last answer, not the transfer timeout."""
    rr = _in(S.STAGING, ctx())
    rr.handle(XferDone(0), 2.0)
    rr.handle(ScatterDone(0), 2.0)
    assert rr.state is S.STAGING and not fails(rr.handle(Tick(peer_progress=6.5, posted_latest=6.5), 7.0))
    (f,) = fails(rr.handle(Tick(peer_progress=7.0, posted_latest=7.0), 7.01))  # peer progress does not count
    assert f.kind is TransferTimeout and "stage_timeout_s" in f.text


def test_a_terminal_read_is_not_marked_asked_and_released_pins_clear_both_flags():
    rr = direct(ctx())
    rr.handle(Abort(), 0.1)
    rr.asked = False  # (notify_failed consults `asked` of failed reads: a late Sent must not set it)
    rr.handle(Sent(), 0.2)
    assert not rr.asked
    live = direct(ctx())
    assert live.asked
    live.handle(PinsReleased(), 0.1)
    assert not live.asked and not live.pinned


def test_a_no_room_answer_pins_and_a_late_one_is_let_go_once():
    """A StageFailed that is not a refusal ("full": no staging room) comes with a pin; arriving for a read
    that ended meanwhile, that pin is let go. A refusal pins nothing."""
    rr = staged(ctx())
    rr.handle(Abort(), 0.1)
    assert rr.handle(StageFailed("full", "no room", False, 5.0), 0.2) == [LetGo()]
    assert rr.handle(StageFailed("lease_expired", "gone", True, 0.0), 0.2) == []
    # a read that fell back to direct reads sends its own Done: a later segment is not let go again
    fb = staged(ctx())
    fb.handle(StageFailed("full", "no room", False, 5.0), 0.1)
    assert fb.state is S.POSTED and fb.pinned and fb.pin_deadline == pytest.approx(5.0)
    assert fb.handle(Segment(400, 0, 100, 7000, False, 5.0), 0.2) == []


def test_a_refusal_after_the_first_segment_keeps_the_pin():
    """The first segment pinned the lease; a later error answer (even a refusal) does not forget that pin:
    the read's failure must still release it."""
    rr = _in(S.STAGING, ctx())
    assert rr.pinned
    acts = rr.handle(StageFailed("lease_expired", "gone", True, 0.0), 1.5)
    assert fails(acts) and rr.state is S.FAILED and rr.pinned


def test_a_pin_running_out_mid_read_fails_it_and_a_released_pin_sends_no_heartbeat():
    """However alive the read looks (its transfer still in our post queue), it fails once the pin the
    prefill granted has run out: the blocks may be reused. A read whose pin was released heartbeats no more."""
    rr = direct(ctx())
    rr.handle(Granted(10.0), 0.1)
    (f,) = fails(rr.handle(Tick(queued_locally=True), 10.5))
    assert f.kind is LeaseExpired and "ran out" in f.text and rr.state is S.FAILED
    quiet = direct(ctx())
    quiet.handle(Granted(10.0), 0.1)
    quiet.handle(PinsReleased(), 0.2)
    assert Heartbeat() not in quiet.handle(Tick(queued_locally=True), 5.0)


def test_the_pin_counts_from_the_request_not_the_answer():
    c = ctx()
    rr = direct(c)                       # asked at 0.0
    rr.handle(Granted(10.0), 3.0)        # answered at 3.0: the pin holds until 10.0, not 13.0
    assert rr.pin_deadline == pytest.approx(10.0)
    s = staged(c)
    s.handle(Segment(400, 0, 100, 7000, False, 10.0), 3.0)
    assert s.pin_deadline == pytest.approx(10.0)
    rr.handle(Tick(queued_locally=True), 4.0)   # heartbeat out at 4.0 (a third of the ttl passed)
    assert rr.refresh_sent == 4.0
    rr.handle(Refreshed(10.0), 6.0)             # answered at 6.0: holds 10 s from 4.0
    assert rr.pin_deadline == pytest.approx(14.0)
    rr.handle(Refreshed(1.0), 6.5)              # a shorter answer never ends the pin earlier
    assert rr.pin_deadline == pytest.approx(14.0)


def test_a_late_answer_counts_from_the_heartbeat_it_answers_not_a_later_one():
    """Heartbeat 1 (at 3.0) is answered only after heartbeat 2 went out (6.0): the answer (ttl 6, the
    prefill's pin then ends at 9.0) must not extend the decode's pin from 6.0 to 12.0."""
    rr = direct(ctx())
    rr.handle(Granted(9.0), 0.0)                          # asked at 0.0: pinned until 9.0
    assert Heartbeat() in rr.handle(Tick(queued_locally=True), 3.0)
    assert Heartbeat() in rr.handle(Tick(queued_locally=True), 6.0)
    rr.handle(Refreshed(6.0), 6.5)                        # answers the heartbeat of 3.0
    assert rr.pin_deadline == pytest.approx(9.0)
    rr.handle(Refreshed(6.0), 6.6)                        # answers the heartbeat of 6.0
    assert rr.pin_deadline == pytest.approx(12.0)
    rr.handle(Refreshed(60.0), 6.7)                       # an answer nothing is waiting for: from 6.0 again
    assert rr.pin_deadline == pytest.approx(66.0)


def test_a_grant_with_no_time_left_fails_staged_or_direct():
    rr = direct(ctx())
    (f,) = fails(rr.handle(Granted(0.0), 0.1))
    assert f.kind is LeaseExpired
    s = staged(ctx())
    (f,) = fails(s.handle(Segment(400, 0, 100, 7000, False, 0.0), 0.1))
    assert f.kind is LeaseExpired and s.state is S.FAILED
    fb = staged(ctx())  # "no room" with no pin time: not a fallback under a pin
    assert fails(fb.handle(StageFailed("full", "no room", False, 0.0), 0.1)) and fb.state is S.FAILED


def test_an_expired_stage_error_is_a_refusal_and_a_bad_total_a_protocol_error():
    rr = staged(ctx())
    (f,) = fails(rr.handle(StageFailed("", "expired", True, 5.0), 0.1))
    assert f.kind is LeaseExpired and rr.state is S.FAILED
    bad = staged(ctx())
    (f,) = fails(bad.handle(Segment(999, 0, 100, 7000, False, 5.0), 0.1))
    assert f.kind is RemoteError and bad.state is S.FAILED


def test_register_grace_counts_from_the_first_request():
    rr = direct(ctx(grace=1.0))
    t = 0.0
    while rr.state is S.ACQUIRING and t < 5.0:
        acts = rr.handle(Refused("not_registered", "not yet"), t)
        if fails(acts):
            break
        (retry,) = [a for a in acts if isinstance(a, Retry)]
        t = retry.at
        assert rr.handle(Tick(), t) == [Ask(stage=False)]
        rr.handle(Sent(), t)
    assert rr.state is S.FAILED and 1.0 <= t < 1.2


def test_an_answer_racing_a_scheduled_retry_is_not_taken():
    """Refused "not registered yet": nothing is held and the read asks again at its retry time. A refusal
    (or grant) of the earlier ask arriving meanwhile changes nothing (a grant is let go): the retry's
    answer decides."""
    rr = direct(ctx())
    rr.handle(Refused("not_registered", "not yet"), 0.0)
    at = rr.retry_at
    assert rr.handle(Refused("lease_expired", "gone"), 0.001) == [] and rr.state is S.ACQUIRING
    assert rr.handle(Granted(5.0), 0.002) == [LetGo()] and not rr.pinned and rr.retry_at == at
    assert rr.handle(Tick(), at) == [Ask(stage=False)]


def test_a_retry_is_sent_at_its_time_and_aligned_earlier_only():
    rr = direct(ctx())
    (retry,) = [a for a in rr.handle(Refused("not_registered", "not yet"), 0.0) if isinstance(a, Retry)]
    rr.handle(AlignRetry(retry.at + 1.0), 0.0)  # another read asks later: ours keeps its time
    assert rr.retry_at == retry.at
    assert rr.handle(Tick(), retry.at) == [Ask(stage=False)]


def test_an_empty_fallback_reads_nothing_and_notifies_at_the_end():
    rr = RankRead(P, S.STAGE_REQUESTED, 0.0, ctx(), lower=lambda: lowering([]), request="s", slot_key="k")
    acts = rr.handle(StageFailed("full", "no room", False, 5.0), 0.1)
    assert not [a for a in acts if isinstance(a, Post)] and rr.notify_at_end and rr.state is S.POSTED
    rr.handle(Tick(), 0.2)
    assert rr.state is S.DONE


# ---- segments of the packed stream ------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=24), st.integers(1, 200), st.booleans())
def test_segments_cover_the_stream_exactly_once(lengths, segment_bytes, host):
    """The prefill cuts the packed stream with ``segment_bounds`` (prefill.py); each segment lands at its
    offset in our staging slot and scatters exactly its runs: together every run once, nothing else."""
    c = ReadContext(5.0, 20.0, 1.0, SlotAllocator(1 << 16), BASE, host_staging_addr=1 << 40)
    d = lowering(lengths)
    rr = RankRead(P, S.STAGE_REQUESTED, 0.0, c, lower=lambda: d, slot_key="k",
                  request=SimpleNamespace(path="host" if host else "staged"))
    bounds = segment_bounds(d.nbytes, segment_bytes)
    starts = offsets(d.nbytes)
    covered = np.zeros(d.count, np.int64)
    posted = []
    for i, (a, b) in enumerate(bounds):
        off, n = int(starts[a]), int(d.nbytes[a:b].sum())
        acts = rr.handle(Segment(d.total_bytes, off, n, 7000 + off, i == len(bounds) - 1, 10.0), 0.1)
        (seg,) = [x for x in acts if isinstance(x, PostSegment)]
        base = (1 << 40) if host else BASE
        assert seg.local == base + rr.staging.slot + off and seg.transfer.slot == rr.staging.slot + off
        assert seg.addr == 7000 + off and seg.host is host and seg.transfer.nbytes == n
        runs, nb = seg.transfer.runs
        assert (runs.a, runs.b) == (a, b) and int(np.sum(nb)) == n
        covered[runs.a:runs.b] += 1
        posted.append(seg.transfer)
    assert covered.tolist() == [1] * d.count and rr.state is S.SCATTERING
    assert rr.reads == posted
    for i in range(len(posted)):
        assert rr.handle(XferDone(i), 0.2) == [Scatter(posted[i])]
        rr.handle(ScatterDone(i), 0.2)
    rr.handle(Tick(), 0.3)
    assert rr.state is S.DONE


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=2, max_size=12), st.data())
def test_a_segment_off_the_run_boundaries_is_a_protocol_error(lengths, data):
    d = lowering(lengths)
    starts = offsets(d.nbytes).tolist()
    ends = set((np.asarray(starts) + d.nbytes).tolist())
    off = data.draw(st.integers(0, d.total_bytes - 1))
    n = data.draw(st.integers(1, d.total_bytes - off))
    rr = RankRead(P, S.STAGE_REQUESTED, 0.0, ctx(), lower=lambda: d, request="s", slot_key="k")
    acts = rr.handle(Segment(d.total_bytes, off, n, 7000, False, 10.0), 0.1)
    aligned = off in starts and off + n in ends
    assert bool(fails(acts)) is not aligned, (off, n, starts)
    if not aligned:
        assert fails(acts)[0].kind is RemoteError and rr.state is S.FAILED
        assert not [a for a in acts if isinstance(a, PostSegment)]


# ---- the machine under random events and clocks ------------------------------------------------------------
CODES = ["not_registered", "lease_expired", "done", "restarted", "busy"]
ev_op = st.one_of(
    st.tuples(st.just("sent")),
    st.tuples(st.just("granted"), st.sampled_from([0.0, 0.5, 3.0, 40.0])),
    st.tuples(st.just("refreshed"), st.sampled_from([0.5, 3.0, 40.0])),
    st.tuples(st.just("refused"), st.sampled_from(CODES)),
    st.tuples(st.just("segment")), st.tuples(st.just("segment")),
    st.tuples(st.just("bad_segment"), st.integers(1, 7)),
    st.tuples(st.just("stage_failed"), st.sampled_from(CODES + ["full", ""]), st.booleans(),
              st.sampled_from([0.0, 3.0, 40.0])),
    st.tuples(st.just("align"), st.floats(-0.1, 0.2)),
    st.tuples(st.just("xfer_done"), st.integers(0, 7)), st.tuples(st.just("xfer_done"), st.integers(0, 7)),
    st.tuples(st.just("scatter_done"), st.integers(0, 7)), st.tuples(st.just("scatter_done"), st.integers(0, 7)),
    st.tuples(st.just("xfer_failed")), st.tuples(st.just("scatter_failed")),
    st.tuples(st.just("failed"), st.sampled_from([E.DISCONNECT, E.REFUSED])),
    st.tuples(st.just("abort")), st.tuples(st.just("pins_released")),
    st.tuples(st.just("tick"), st.floats(0.0, 12.0), st.booleans(), st.floats(-10.0, 0.0), st.floats(-10.0, 0.0)),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0), st.just(False), st.just(-1e9), st.just(-1e9)),
)
FAILING = ("xfer_failed", "scatter_failed", "failed")


class Model:
    """What the docstrings promise about one read, kept apart from the machine."""

    def __init__(self, rr: RankRead):
        self.progress = 0.0          # last progress: the request, an accepted answer, a completed transfer
        self.pin = float("inf")      # the pin's end as granted (from when the request/heartbeat went out)
        self.pinned_once = False
        self.failed = 0
        self.posted: list = []
        self.beats: list[float] = []  # heartbeats out and unanswered, oldest first
        self.base = 0.0               # the send time the last answer counted from


def _event(o, rr: RankRead, now: float, segs: list, d):
    kind = o[0]
    if kind == "sent":
        return Sent()
    if kind == "granted":
        return Granted(o[1])
    if kind == "refreshed":
        return Refreshed(o[1])
    if kind == "refused":
        return Refused(o[1], "why")
    if kind == "segment":
        if not d.count:
            return Segment(0, 0, 0, 0, True, 10.0)
        i = sum(1 for t in rr.reads if t.runs is not None)
        a, b = segs[min(i, len(segs) - 1)]
        off = int(offsets(d.nbytes)[a])
        return Segment(d.total_bytes, off, int(d.nbytes[a:b].sum()), 9000 + off, b == d.count, 10.0)
    if kind == "bad_segment":
        return Segment(d.total_bytes, o[1] % max(1, d.total_bytes), 1, 9000, False, 10.0)
    if kind == "stage_failed":
        return StageFailed(o[1], "why", o[2], o[3])
    if kind == "align":
        return AlignRetry(now + o[1])
    if kind in ("xfer_done", "scatter_done"):
        if not rr.reads or rr.terminal:  # (a failed read's transfers are the loop's zombies, not events)
            return None
        i = o[1] % len(rr.reads)
        t = rr.reads[i]
        if kind == "xfer_done":
            return None if t.done or t.cancelled else XferDone(i)
        return ScatterDone(i) if t.done and t.runs is not None and not t.scattered else None
    if kind == "xfer_failed":
        return XferFailed("transport")
    if kind == "scatter_failed":
        return ScatterFailed("bug")
    if kind == "failed":
        return Failed(o[1], PeerDisconnected if o[1] is E.DISCONNECT else LeaseExpired, "loop")
    if kind == "abort":
        return Abort()
    if kind == "pins_released":
        return PinsReleased()
    return Tick(peer_progress=now + o[3], queued_locally=o[2], posted_latest=now + o[4])


# events whose apply() result the read loop ignores (it assumes they fail nothing)
DROPPED_RESULT = (Sent, Refreshed, PinsReleased, AlignRetry, Abort)


def _expect_tick(rr: RankRead, m: Model, ev: Tick, now: float, c: ReadContext):
    """The documented outcome of a tick of a live read with no retry pending: (state, failure kind or None)."""
    finished = all(t.finished for t in rr.reads)
    if finished and rr.state in (S.POSTED, S.SCATTERING):
        return (S.DONE, None) if now <= m.pin else (S.FAILED, LeaseExpired)
    waiting = rr.state in (S.ACQUIRING, S.STAGE_REQUESTED) or (rr.state is S.STAGING and finished)
    if waiting:
        limit, ref = c.stage_timeout_s, m.progress
    else:
        limit = c.transfer_timeout_s + rr.progress()[1] / c.min_read_rate
        ref = now if ev.queued_locally else max(m.progress, ev.peer_progress, ev.posted_latest)
    if now - ref > limit:
        return S.FAILED, TransferTimeout
    if now > m.pin:
        return S.FAILED, LeaseExpired
    return rr.state, None


def _update_model(rr: RankRead, m: Model, ev, prev: ReadState, retry_before, now: float, acts: list,
                  refresh_sent: float, sent_at: float, pinned_before: bool) -> None:
    live = prev not in TERMINAL
    if isinstance(ev, XferDone):
        m.progress = now
    elif isinstance(ev, Granted) and prev is S.ACQUIRING and retry_before is None:
        m.progress, m.pinned_once = now, True
        m.pin = sent_at + ev.ttl_s
        m.beats, m.base = [], sent_at
    elif isinstance(ev, Refused) and prev is S.ACQUIRING and retry_before is None and rr.retry_at is not None:
        m.progress = now
    elif isinstance(ev, (Segment, StageFailed)) and prev in (S.STAGE_REQUESTED, S.STAGING) and retry_before is None:
        m.progress = now
        if rr.retry_at is not None:
            return
        m.pinned_once = m.pinned_once or isinstance(ev, Segment) or rr.pinned
        if prev is S.STAGE_REQUESTED and rr.state in (S.STAGING, S.SCATTERING, S.POSTED):
            m.pin = now + 1e9 if isinstance(ev, Segment) and ev.total == 0 else sent_at + ev.ttl_s
            m.beats, m.base = [], sent_at
    elif isinstance(ev, Refreshed) and pinned_before and live:
        # an answer counts from the oldest heartbeat still unanswered (never from a later send)
        m.base = m.beats.pop(0) if m.beats else m.base
        m.pin = max(m.pin, m.base + ev.ttl_s)
    elif isinstance(ev, Tick) and retry_before is not None and now >= retry_before:
        pass  # a retry went out: the next answer counts from it (rr.sent_at)
    if any(isinstance(a, Heartbeat) for a in acts) and len(m.beats) < 16:
        m.beats.append(now)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ev_op, min_size=1, max_size=40), st.booleans(), st.lists(st.integers(1, 50), min_size=0, max_size=6),
       st.integers(1, 120), st.floats(1.0, 6.0), st.floats(2.0, 10.0), st.sampled_from([10.0, 1000.0]),
       st.sampled_from([0, 1 << 16]))
def test_read_machine_properties(ops, is_staged, lengths, segment_bytes, stage_s, transfer_s, rate, room):
    c = ReadContext(stage_timeout_s=stage_s, transfer_timeout_s=transfer_s, register_grace_s=0.5,
                    slots=SlotAllocator(room), staging_addr=BASE, min_read_rate=rate)
    d = lowering(lengths)
    segs = segment_bounds(d.nbytes, segment_bytes) or [(0, 0)]
    if is_staged:
        rr = RankRead(P, S.STAGE_REQUESTED, 0.0, c, lower=lambda: d, request="stage", slot_key="k")
    else:
        rr = RankRead(P, S.ACQUIRING, 0.0, c, work=SimpleNamespace(count=d.count, total_bytes=d.total_bytes)
                      if d.count else None)
    m = Model(rr)
    now, last_tick_wake = 0.0, None
    for o in ops:
        if o[0] == "tick":
            now += o[1]
        ev = _event(o, rr, now, segs, d)
        if ev is None:
            continue
        prev, retry_before, pin_before = rr.state, rr.retry_at, rr.pin_deadline
        refresh_sent, sent_at, pinned_before = rr.refresh_sent, rr.sent_at, rr.pinned
        if isinstance(ev, Tick) and retry_before is not None and now >= retry_before:
            sent_at = now
        expected = None
        if isinstance(ev, Tick) and prev not in TERMINAL and (retry_before is None):
            expected = _expect_tick(rr, m, ev, now, c)
        if prev in TERMINAL and o[0] in FAILING:
            with pytest.raises(IllegalTransition):  # a terminal state takes no failing event
                rr.handle(ev, now)
            assert rr.state is prev
            continue
        acts = rr.handle(ev, now)
        _update_model(rr, m, ev, prev, retry_before, now, acts, refresh_sent, sent_at, pinned_before)
        # every change is a cell of the table; terminal states absorb
        if rr.state is not prev:  # (nothing to read: granted and completed in one event)
            assert prev not in TERMINAL and (rr.state in TRANSITIONS[prev].values() or any(
                rr.state in TRANSITIONS[mid].values() for mid in TRANSITIONS[prev].values())), (prev, ev, rr.state)
        if prev in TERMINAL:
            assert all(isinstance(a, LetGo) for a in acts), (prev, ev, acts)
            assert not isinstance(ev, (Tick, Abort)) or acts == []
        # a tick before the wake time the last tick set does nothing
        if isinstance(ev, Tick) and last_tick_wake is not None and now < last_tick_wake:
            assert acts == [] and rr.state is prev, (now, last_tick_wake, acts)
        last_tick_wake = rr.wake_at if isinstance(ev, Tick) else None
        # one Fail, exactly on the way to FAILED; an abort or a completion fails nothing
        fl = fails(acts)
        if rr.state is S.FAILED and prev is not S.FAILED:
            assert len(fl) == 1
            m.failed += 1
        else:
            assert not fl, (prev, ev, acts)
        assert m.failed <= 1
        # the read loop drops apply()'s result for these events (readloop.py: flush, _on_acquired, abort_ranks,
        # notify_failed, _complete, _run_retry): by construction none of them fails the read
        if isinstance(ev, DROPPED_RESULT):
            assert not fl, (prev, ev, acts)
        # ReadLoop.disconnect (decode's dead agent) relies on it: a live read always fails, Fail its last action
        if isinstance(ev, Failed):
            assert rr.state is S.FAILED and acts and acts[-1] is fl[0], (prev, ev, acts)
        # DONE only under a pin, every transfer finished, within the pin
        if rr.state is S.DONE and prev is not S.DONE:
            assert m.pinned_once and all(t.finished for t in rr.reads)
            assert now <= m.pin or isinstance(ev, Granted)
        # an answer that is not this read's to take changes nothing
        if isinstance(ev, Refused) and (prev is not S.ACQUIRING or retry_before is not None):
            assert acts == [] and rr.state is prev and rr.retry_at == retry_before
        # the timeout (or pin) that applies in each waiting state
        if expected is not None:
            want_state, want_kind = expected
            assert rr.state is want_state, (prev, ev, now, rr.state, expected, m.progress, m.pin)
            if want_kind is not None:
                assert fl[0].kind is want_kind, (fl, expected)
        # the pin as granted, counted from the request or heartbeat; never earlier after a refresh
        if rr.state not in TERMINAL and (m.pinned_once or rr.pinned):
            assert rr.pin_deadline == pytest.approx(m.pin), (ev, rr.pin_deadline, m.pin)
        if isinstance(ev, Refreshed):
            assert rr.pin_deadline >= pin_before
        # heartbeats only for a pinned read; asks only for a retry that is due
        if any(isinstance(a, Heartbeat) for a in acts):
            assert pinned_before and isinstance(ev, Tick)
        if any(isinstance(a, Ask) for a in acts):
            assert isinstance(ev, Tick) and retry_before is not None and now >= retry_before
        # a pin no live read of ours uses is let go (once), and only such a pin
        let_go = LetGo() in acts
        if isinstance(ev, Granted):
            assert let_go == (prev is not S.ACQUIRING or retry_before is not None), (prev, acts)
        elif isinstance(ev, (Segment, StageFailed)) and (prev not in (S.STAGE_REQUESTED, S.STAGING)
                                                         or retry_before is not None):
            pins = isinstance(ev, Segment) or ev.code not in REFUSALS
            assert let_go == (pins and prev in TERMINAL), (prev, ev, acts)
        else:
            assert not let_go
        if any(isinstance(a, Notify) for a in acts):
            assert isinstance(ev, Granted) and rr.state is S.DONE and not rr.pinned
        # no action names a transfer the machine did not post
        for a in acts:
            if isinstance(a, (Post, PostSegment)):
                assert a.transfer not in m.posted and a.transfer is rr.reads[-1]
                m.posted.append(a.transfer)
            elif isinstance(a, Scatter):
                assert a.transfer in m.posted and a.transfer.done and a.transfer.runs is not None
        assert rr.reads == m.posted
        if isinstance(ev, PinsReleased):
            assert not rr.pinned and not rr.asked
        inflight = sum(t.size for t in rr.reads if not t.done and not t.cancelled)
        assert rr.progress() == (sum(t.size for t in rr.reads if t.done), inflight)
