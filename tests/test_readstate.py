"""Every cell of the read state machine's transition table (``runtime/readstate.py``), without sockets:
each (state, event) pair either moves to the state the table names or raises IllegalTransition naming
both; terminal states accept nothing; every live state can fail, time out and be aborted."""
from __future__ import annotations

import itertools

import pytest

from kvbridge.errors import IllegalTransition
from kvbridge.runtime.readstate import AWAITING_REPLY, TERMINAL, TRANSITIONS, ReadEvent, ReadState, ReadStateCell


@pytest.mark.parametrize("state, event", list(itertools.product(ReadState, ReadEvent)))
def test_every_cell(state, event):
    m = ReadStateCell(state)
    want = TRANSITIONS[state].get(event)
    if want is None:
        with pytest.raises(IllegalTransition, match=f"{event.name}.*{state.name}"):
            m.fire(event)
        assert m.state is state  # an illegal event changes nothing
    else:
        assert m.fire(event) is want and m.state is want


def test_shape_of_the_table():
    assert TERMINAL == {ReadState.DONE, ReadState.FAILED, ReadState.CANCELLED}
    for s in set(ReadState) - TERMINAL:
        t = TRANSITIONS[s]
        assert t[ReadEvent.ABORT] is ReadState.CANCELLED
        for e in (ReadEvent.REFUSED, ReadEvent.NIXL_ERROR, ReadEvent.PROTOCOL_ERROR, ReadEvent.DISCONNECT,
                  ReadEvent.TIMEOUT):
            assert t[e] is ReadState.FAILED
    assert AWAITING_REPLY <= set(ReadState) - TERMINAL
    # the happy paths reach DONE
    for path in ([ReadEvent.GRANTED, ReadEvent.COMPLETED],
                 [ReadEvent.STAGE_SEGMENT, ReadEvent.STAGE_SEGMENT, ReadEvent.STAGE_LAST, ReadEvent.COMPLETED],
                 [ReadEvent.STAGE_FULL, ReadEvent.COMPLETED]):
        m = ReadStateCell(ReadState.ACQUIRING if path[0] is ReadEvent.GRANTED else ReadState.STAGE_REQUESTED)
        for e in path:
            m.fire(e)
        assert m.state is ReadState.DONE and m.terminal


def test_a_reads_progress_is_what_its_heartbeats_carry():
    """``RankRead.progress()`` (sent with every heartbeat of a pinned read): bytes of finished transfers
    and bytes posted (or queued) and not finished; a cancelled transfer counts for neither."""
    from types import SimpleNamespace

    import numpy as np

    from kvbridge.runtime.readmachine import RankRead, ReadContext
    from kvbridge.runtime.readstate import Abort, Granted, Heartbeat, Post, PostSegment, Segment, Sent, Tick, XferDone
    from kvbridge.runtime.slots import SlotAllocator

    ctx = ReadContext(stage_timeout_s=5.0, transfer_timeout_s=20.0, register_grace_s=1.0,
                      slots=SlotAllocator(1 << 20), staging_addr=1 << 30)
    # staged: two segments of 100 and 200 B
    lowered = SimpleNamespace(total_bytes=300, count=3, dst=np.array([1000, 2000, 3000]),
                              nbytes=np.array([100, 100, 100]))
    rr = RankRead((0, 0), ReadState.STAGE_REQUESTED, 0.0, ctx, lower=lambda: lowered, request="m", slot_key="k")
    assert rr.progress() == (0, 0)
    assert isinstance(rr.handle(Segment(300, 0, 100, 7000, False, 9.0), 0.1)[-1], PostSegment)
    assert rr.progress() == (0, 100)
    rr.handle(Segment(300, 100, 200, 7100, True, 9.0), 0.2)
    assert rr.progress() == (0, 300)
    rr.handle(XferDone(0), 0.3)
    assert rr.progress() == (100, 200)
    # a pinned read heartbeats a third of its ttl after asking: the loop sends progress() with it
    assert any(isinstance(a, Heartbeat) for a in rr.handle(Tick(queued_locally=True), 3.1))
    # direct: one transfer of the work's bytes, in flight until it completes; cancelled counts nothing
    work = SimpleNamespace(count=3, total_bytes=4096)
    d = RankRead((0, 0), ReadState.ACQUIRING, 0.0, ctx, work=work)
    d.handle(Sent(), 0.0)
    assert isinstance(d.handle(Granted(9.0), 0.1)[0], Post) and d.progress() == (0, 4096)
    d.handle(Abort(), 0.2)
    assert d.progress() == (0, 0)
    d2 = RankRead((0, 0), ReadState.ACQUIRING, 0.0, ctx, work=work)
    d2.handle(Sent(), 0.0)
    d2.handle(Granted(9.0), 0.1)
    d2.handle(XferDone(0), 0.5)
    assert d2.progress() == (4096, 0)


def test_a_transfer_in_flight_has_its_bytes_at_the_slowest_rate_beyond_transfer_timeout_s():
    """NIXL reports no bytes until a transfer ends: a direct read of 4,096 B at 100 B/s accepted may take
    ``transfer_timeout_s`` (20 s) + 40.96 s from its post before the decode calls it stuck."""
    from types import SimpleNamespace

    from kvbridge.errors import TransferTimeout
    from kvbridge.runtime.readmachine import RankRead, ReadContext
    from kvbridge.runtime.readstate import Fail, Granted, Sent, Tick
    from kvbridge.runtime.slots import SlotAllocator

    ctx = ReadContext(5.0, 20.0, 1.0, SlotAllocator(0), 0, min_read_rate=100.0)
    rr = RankRead((0, 0), ReadState.ACQUIRING, 0.0, ctx, work=SimpleNamespace(count=1, total_bytes=4096))
    rr.handle(Sent(), 0.0)
    rr.handle(Granted(1000.0), 0.1)
    assert not any(isinstance(a, Fail) for a in rr.handle(Tick(posted_latest=0.1), 60.0))
    fails = [a for a in rr.handle(Tick(posted_latest=0.1), 61.2) if isinstance(a, Fail)]
    assert fails and fails[0].kind is TransferTimeout and rr.state is ReadState.FAILED


def test_one_wire_code_vocabulary_on_both_sides():
    """The prefill answers protocol.Code members; the decode's machine compares the strings it decodes with
    the same members (a member equals and hashes as its wire string); an unknown code is a RemoteError."""
    from types import SimpleNamespace

    from kvbridge.errors import LeaseExpired, RemoteError
    from kvbridge.runtime.lease import LeaseTable
    from kvbridge.runtime.protocol import REFUSALS, Code
    from kvbridge.runtime.readmachine import RankRead, ReadContext
    from kvbridge.runtime.readstate import Fail, Refused, Restarted, Sent
    from kvbridge.runtime.slots import SlotAllocator

    assert {str(c) for c in REFUSALS} <= {c.value for c in Code} and "done" in REFUSALS
    assert Code.parse("lease_expired") is Code.LEASE_EXPIRED and Code.parse("nope") is None
    got = LeaseTable().acquire("q", 1, ("dA", (0, 0)), "x", 1, 0.0)
    assert got.code is Code.NOT_REGISTERED
    ctx = ReadContext(5.0, 20.0, 0.0, SlotAllocator(0), 0)

    def refused(code):
        rr = RankRead((0, 0), ReadState.ACQUIRING, 0.0, ctx, work=SimpleNamespace(count=1, total_bytes=8))
        rr.handle(Sent(), 0.0)
        return rr.handle(Refused(code, "why"), 0.1)
    assert isinstance(refused(str(Code.RESTARTED))[0], Restarted)
    for code, kind in ((Code.LEASE_EXPIRED, LeaseExpired), (Code.DONE, LeaseExpired), ("nope", RemoteError)):
        fails = [a for a in refused(str(code)) if isinstance(a, Fail)]
        assert fails and fails[0].kind is kind, code


def test_the_table_is_exactly_the_documented_diagram():
    """The module docstring's diagram, written out: no cell more, no cell less (a cell added to the table,
    say POSTED accepting GRANTED, would let a duplicate grant through unnoticed)."""
    S, E = ReadState, ReadEvent
    fail = {E.REFUSED: S.FAILED, E.NIXL_ERROR: S.FAILED, E.PROTOCOL_ERROR: S.FAILED, E.DISCONNECT: S.FAILED,
            E.TIMEOUT: S.FAILED, E.ABORT: S.CANCELLED}
    expected = {
        S.ACQUIRING: {E.GRANTED: S.POSTED, E.CHECKED: S.POSTED, **fail},
        S.STAGE_REQUESTED: {E.STAGE_SEGMENT: S.STAGING, E.STAGE_LAST: S.SCATTERING, E.STAGE_FULL: S.POSTED, **fail},
        S.POSTED: {E.COMPLETED: S.DONE, **fail},
        S.STAGING: {E.STAGE_SEGMENT: S.STAGING, E.STAGE_LAST: S.SCATTERING, **fail},
        S.SCATTERING: {E.COMPLETED: S.DONE, **fail},
        S.DONE: {}, S.FAILED: {}, S.CANCELLED: {},
    }
    assert TRANSITIONS == expected
    # waiting for the prefill's answer: asked, or staging with more segments to come
    assert AWAITING_REPLY == {S.ACQUIRING, S.STAGE_REQUESTED, S.STAGING}


def _rank_read_in(state, variant):
    """A RankRead in ``state`` with one transfer (a plain direct read, a staged segment, or discarded
    optimistic bytes), pinned or waiting to ask again as ``variant`` says."""
    from types import SimpleNamespace

    import numpy as np

    from kvbridge.runtime.readmachine import RankRead, ReadContext
    from kvbridge.runtime.readstate import Transfer
    from kvbridge.runtime.slots import SlotAllocator

    ctx = ReadContext(stage_timeout_s=5.0, transfer_timeout_s=20.0, register_grace_s=1.0,
                      slots=SlotAllocator(1 << 20), staging_addr=1 << 30, optimistic=variant == "optimistic")
    work = SimpleNamespace(total_bytes=300, count=3, dst=np.array([1000, 2000, 3000]),
                           nbytes=np.array([100, 100, 100]))
    rr = RankRead((0, 0), state, 0.0, ctx, work=work, lower=lambda: work, request=SimpleNamespace(),
                  slot_key=("k", (0, 0)))
    if variant == "optimistic":
        return rr  # no transfer yet: Sent posts one (ACQUIRING only)
    t = Transfer(work=work, discard=variant == "discarded",
                 runs=(work.dst, work.nbytes) if variant == "segment" else None)
    rr.reads.append(t)
    if variant == "pinned":
        rr.pinned, rr.beats = True, [0.5]
    if variant == "retrying":
        rr.retry_at = 3.0
    return rr


@pytest.mark.parametrize("variant", ["plain", "segment", "discarded", "pinned", "retrying", "optimistic"])
@pytest.mark.parametrize("state", list(ReadState))
def test_non_transitions_never_change_the_state(state, variant):
    """Every event of ``NON_TRANSITIONS``, in every state, leaves ``rr.state`` as it was (it only updates
    the read's own fields and may ask for I/O: post, scatter, count)."""
    from kvbridge.runtime.readstate import (
        NON_TRANSITIONS,
        AlignRetry,
        PinsReleased,
        Refreshed,
        ScatterDone,
        Sent,
        XferDone,
    )

    events = {XferDone: XferDone(0), ScatterDone: ScatterDone(0), Sent: Sent(), PinsReleased: PinsReleased(),
              Refreshed: Refreshed(9.0), AlignRetry: AlignRetry(1.0)}
    assert set(events) == NON_TRANSITIONS
    for cls, ev in events.items():
        if variant == "optimistic" and cls in (XferDone, ScatterDone):
            continue  # (no transfer to name)
        rr = _rank_read_in(state, variant)
        rr.handle(ev, 1.0)
        assert rr.state is state, (cls.__name__, variant)
        rr.handle(ev, 2.0)  # twice (a late or repeated report) changes nothing either
        assert rr.state is state, (cls.__name__, variant)


def test_every_event_and_action_has_its_method():
    """``RankRead.handle`` dispatches every ``readstate.Event`` type, ``ReadLoop.apply`` every ``Action``
    type (an unknown one raises instead of being dropped)."""
    import typing

    from kvbridge.runtime import readloop, readmachine, readstate

    assert set(readmachine._HANDLERS) == set(typing.get_args(readstate.Event))
    assert set(readloop._RUNNERS) == set(typing.get_args(readstate.Action))
    rr = _rank_read_in(ReadState.ACQUIRING, "plain")
    with pytest.raises(TypeError, match="not a read event"):
        rr.handle(object(), 0.0)
