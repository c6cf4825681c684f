"""The prefill's lease machine (``runtime/lease.py``) without sockets: hypothesis drives random
interleavings of register / acquire / stage (an acquire) / Done (ok or failed) / decline (abort) /
heartbeat / expect (vLLM ``n > 1``: more reads for a lease) / expiry from several readers, honest and not, and
checks:

* a lease never ends while a pin on it is held and not timed out;
* a lease is FREED only when at least as many claims as it expects (``reads``) exist, all settled;
* every lease ends once its readers stop (released or timed out), within bounded time;
* a message from a reader that does not hold the pin it names (or for another attempt, or with a
  readers count that disagrees) changes nothing at all;
* a refused acquire creates no pin.

Plus the identity table: a handshake claiming a live reader's identity with another agent does not
rebind it, and a flood of made-up identities never evicts a reader that holds a pin.
"""
from __future__ import annotations

import copy
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.errors import IllegalTransition
from kvbridge.runtime.lease import TERMINAL as LEASE_TERMINAL
from kvbridge.runtime.lease import (
    TRANSITIONS,
    LeaseEnded,
    LeaseEvent,
    LeaseGranted,
    LeaseRefused,
    LeaseState,
    LeaseTable,
    Outcome,
    PinEnded,
    ReaderTable,
    pin_bound_s,
)
from kvbridge.runtime.machine import step
from kvbridge.runtime.protocol import Code

ENGINES = ["dA", "dB"]
RANKS = [(0, 0), (0, 1)]
READS = ["r1", "r2"]
REQS = ["q0", "q1"]


READERS = [(e, r) for e in ENGINES for r in RANKS]


def snapshot(t: LeaseTable):
    # t._ended (the ended (request, attempt) pairs, "expired" vs "not registered") has no public view
    return copy.deepcopy((t.leases, {r: t.pins_held(r) for r in READERS}, dict(t._ended)))


op = st.one_of(
    st.tuples(st.just("register"), st.sampled_from(REQS), st.integers(1, 3), st.integers(1, 3)),
    st.tuples(st.just("expect"), st.sampled_from(REQS), st.integers(1, 3), st.integers(0, 4)),
    st.tuples(st.just("acquire"), st.sampled_from(REQS), st.integers(1, 3), st.sampled_from(ENGINES),
              st.sampled_from(RANKS), st.sampled_from(READS), st.integers(0, 2)),
    st.tuples(st.just("release"), st.sampled_from(REQS), st.integers(1, 3), st.sampled_from(ENGINES),
              st.sampled_from(RANKS), st.sampled_from(READS), st.integers(1, 2), st.booleans()),
    st.tuples(st.just("decline"), st.sampled_from(REQS), st.integers(1, 3), st.sampled_from(ENGINES),
              st.sampled_from(RANKS), st.sampled_from(READS), st.integers(1, 2), st.booleans()),
    st.tuples(st.just("heartbeat"), st.sampled_from(REQS), st.integers(1, 3), st.sampled_from(ENGINES),
              st.sampled_from(RANKS), st.sampled_from(READS)),
    st.tuples(st.just("release_held"), st.integers(0, 7), st.booleans()),  # an honest holder's Done
    st.tuples(st.just("release_held"), st.integers(0, 7), st.booleans()),
    st.tuples(st.just("advance"), st.floats(0.0, 3.0)),
)


def check_heap(t: LeaseTable) -> None:
    """``tick`` looks only at due heap entries: every live lease has one current entry, due no later than
    the first time the lease can change (a pin's or its own deadline), and next_deadline() is no later."""
    entries = {}
    for w, _, lease in t._heap:  # the deadline heap itself (no public view of its entries)
        if lease.wake == w and t.get(lease.req_id) is lease:
            entries[lease.req_id] = w
    first = float("inf")
    for rid, lease in t.leases.items():
        due = min(p.deadline for p in lease.pins.values()) if lease.pins else lease.deadline
        assert entries.get(rid) == lease.wake <= due, (rid, lease.wake, due)
        first = min(first, due)
    assert t.next_deadline() <= first


def pins_of(t: LeaseTable) -> set:
    return {(lease.req_id, lease.attempt, key) for lease in t.leases.values() for key in lease.pins}


def pins_before_of(before: dict) -> set:
    return {key for lease in before.values() for key in lease.pins}


def settled_before(before: dict, rid: str, att: int, eng: str, rank, read: str) -> bool:
    lease = before.get(rid)
    if lease is None or lease.attempt != att:
        return False
    claim = lease.claims.get((eng, read))
    return claim is not None and rank in claim.settled


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=60), st.floats(0.5, 3.0), st.floats(1.0, 6.0),
       st.one_of(st.none(), st.floats(0.3, 8.0)))
def test_lease_machine_properties(ops, lease_s, pin_s, pin_idle_s):
    t = LeaseTable(lease_s=lease_s, pin_s=pin_s, pin_idle_s=pin_idle_s)
    now = 0.0
    ended: dict[tuple[str, int], LeaseState] = {}
    settle_at: dict[str, float] = {}  # request id -> last effective release or decline

    def check_ends(effects, before, released_key=None, live=None):
        """Every lease that ended here had no pin held past ``now`` (except the one just released); one
        FREED had as many claims as it expected, every one settled."""
        for e in effects:
            if isinstance(e, LeaseEnded) and e.state is not LeaseState.REPLACED:
                lease = before.get(e.req_id)
                assert lease is not None and lease.attempt == e.attempt
                for key, pin in lease.pins.items():
                    assert key == released_key or pin.deadline <= now, (e, key, pin, now)
                ended[(e.req_id, e.attempt)] = e.state
                if e.state is LeaseState.FREED and live is not None:
                    gone = live[e.req_id]  # the lease object as the event left it
                    assert len(gone.claims) >= gone.reads == lease.reads, (e, gone.claims, gone.reads)
                    assert all(gone.claim_settled(k) for k in gone.claims)

    for o in ops:
        kind = o[0]
        before = copy.deepcopy(t.leases)
        live = dict(t.leases)
        all_pins_before = pins_of(t)
        effects, outcome = [], Outcome.UNKNOWN
        if kind == "register":
            _, rid, att, reads = o
            effects = t.register(rid, None, att, now, reads=reads)
            assert all(isinstance(e, (PinEnded, LeaseEnded)) for e in effects)
            ended.update({(e.req_id, e.attempt): e.state for e in effects if isinstance(e, LeaseEnded)})
            ended.pop((rid, att), None)  # registered again: live
            assert t.get(rid).state is LeaseState.RESERVED and t.get(rid).reads == reads
        elif kind == "expect":
            _, rid, att, reads = o
            lease = t.get(rid)
            snap = snapshot(t)
            if reads < 1:
                with pytest.raises(ValueError):
                    t.expect(rid, att, reads, now)
                assert snapshot(t) == snap
                continue
            ok = t.expect(rid, att, reads, now)
            assert ok == (lease is not None and lease.attempt == att)
            if not ok:
                assert snapshot(t) == snap  # no live lease of that attempt: nothing changes
            else:  # only ever raised; never ends or unpins anything
                assert lease.reads == max(reads, before[rid].reads) and set(lease.pins) == set(before[rid].pins)
        elif kind == "acquire":
            _, rid, att, eng, rank, read, readers = o
            snap = snapshot(t)
            got = t.acquire(rid, att, (eng, rank), read, readers, now)
            lease = t.get(rid)
            if lease is None or lease.attempt != att:
                want = Code.LEASE_EXPIRED if (rid, att) in ended or lease else Code.NOT_REGISTERED
                assert isinstance(got, LeaseRefused) and got.code is want
            elif readers < 1:
                assert isinstance(got, LeaseRefused) and got.code is Code.BAD_REQUEST
            elif settled_before(before, rid, att, eng, rank, read):  # this rank settled: never pins it again
                assert isinstance(got, LeaseRefused) and got.code in (Code.DONE, Code.BAD_REQUEST)
            if isinstance(got, LeaseRefused):
                assert snapshot(t) == snap  # a refused acquire creates no pin, changes nothing
            else:
                assert isinstance(got, LeaseGranted) and got.ttl_s > 0
                assert ((eng, rank), read) in t.get(rid).pins
        elif kind == "release_held":
            held = sorted((lease.req_id, lease.attempt, key, lease.claims[(key[0][0], key[1])].readers)
                          for lease in t.leases.values() for key in lease.pins)
            if not held:
                continue
            rid, att, (reader, read), readers = held[o[1] % len(held)]
            outcome, effects = t.release(rid, att, reader, read, readers, o[2], now)
            assert outcome is Outcome.RELEASED and (reader, read) not in getattr(t.get(rid), "pins", {})
            check_ends(effects, before, (reader, read), live)
        elif kind == "release":
            _, rid, att, eng, rank, read, readers, ok = o
            lease = t.get(rid)
            holds = lease is not None and lease.attempt == att and ((eng, rank), read) in lease.pins
            snap = snapshot(t)
            outcome, effects = t.release(rid, att, (eng, rank), read, readers, ok, now)
            if not holds:  # a Done from a non-holder has no effect at all
                assert outcome in (Outcome.UNKNOWN, Outcome.STALE, Outcome.NOT_HOLDER) and not effects
                assert snapshot(t) == snap
            elif readers != lease.claims[(eng, read)].readers:
                assert outcome is Outcome.BAD_COUNT and snapshot(t) == snap
            else:
                assert outcome is Outcome.RELEASED
                check_ends(effects, before, ((eng, rank), read), live)
        elif kind == "decline":
            _, rid, att, eng, rank, read, readers, ok = o
            snap = snapshot(t)
            outcome, effects = t.decline(rid, att, (eng, rank), read, readers, ok, now)
            lease = before.get(rid)
            claim = lease.claims.get((eng, read)) if lease is not None else None
            if lease is None:
                want = Outcome.UNKNOWN
            elif lease.attempt != att:
                want = Outcome.STALE
            elif ((eng, rank), read) in lease.pins:
                want = Outcome.HOLDER
            elif claim is not None and claim.readers != readers:
                want = Outcome.BAD_COUNT
            elif claim is None and len(lease.claims) >= t.max_reads:
                want = Outcome.BAD_COUNT
            elif claim is not None and rank in claim.settled:
                want = Outcome.DUPLICATE  # a part settles once
            else:
                want = Outcome.DECLINED
            assert outcome is want, (outcome, want)
            if not outcome.effective:
                assert not effects and snapshot(t) == snap
            check_ends(effects, before, live=live)
        elif kind == "heartbeat":
            _, rid, att, eng, rank, read = o
            lease = t.get(rid)
            pins_before = copy.deepcopy(lease.pins) if lease is not None else None
            got = t.heartbeat(rid, att, (eng, rank), read, now)
            if lease is not None:  # never creates or drops a pin
                assert set(lease.pins) == set(pins_before)
            if isinstance(got, LeaseRefused):
                assert got.code in (Code.NOT_REGISTERED, Code.LEASE_EXPIRED, Code.DONE)
            if settled_before(before, rid, att, eng, rank, read) and ((eng, rank), read) not in pins_before_of(before):
                assert isinstance(got, LeaseRefused) and got.code is Code.DONE  # settled: no more heartbeats
        else:
            now += o[1]
            effects = t.tick(now)
            check_ends(effects, before, live=live)
        if kind == "register":
            settle_at.pop(o[1], None)
        elif kind in ("release", "release_held", "decline") and outcome.effective:
            settle_at[o[1] if kind != "release_held" else rid] = now
        for lease in t.leases.values():  # a live lease's state says whether it is pinned
            assert lease.state is (LeaseState.PINNED if lease.pins else LeaseState.RESERVED)
            # rule 2: heartbeats and expect never hold it past max(lease_s, pin_s) after registration; only a
            # release or decline gives the claim's other ranks lease_s more
            assert lease.deadline <= max(lease.hold_until, settle_at.get(lease.req_id, -1.0) + lease_s) + 1e-9
            assert lease.hold_until == lease.registered_at + max(lease_s, pin_s)
            if kind == "advance":  # nothing due is left after a tick (rules 2 and 5)
                assert lease.pins or lease.deadline > now, (lease, now)
                assert all(p.deadline > now for p in lease.pins.values())
        assert sum(len(lease.pins) for lease in t.leases.values()) == sum(t.pins_held(r) for r in READERS)
        check_heap(t)
        # every pin that ended was reported once (the IO layer gives its staging slot back on it); a pin
        # of a lease still live ends only by its holder's release or by timing out
        ended_pins = [(e.req_id, e.pin) for e in effects if isinstance(e, PinEnded)]
        gone = {(rid, key) for rid, _, key in all_pins_before - pins_of(t)}
        assert len(ended_pins) == len(set(ended_pins)) and set(ended_pins) == gone, (ended_pins, gone)

    # the readers stop: every lease ends within max(lease_s, pin cap) of the last event
    before = copy.deepcopy(t.leases)
    now += max(lease_s, pin_s) + 1e-6
    check_ends(t.tick(now), before)
    assert not t.leases and not t._pins_of  # no reader's count left behind, not even a 0 (no public view)


def test_declines_and_failures_never_free_under_another_readers_pin():
    """Issue 20's corruption: decode engine A is mid-read; engine B (a hedge) finishes, aborts or fails
    on the same request. None of B's messages frees the lease while A's pin is held; A's release does."""
    t = LeaseTable(lease_s=5, pin_s=60)
    t.register("q", None, 7, 0.0)
    a, b = ("dA", (0, 0)), ("dB", (0, 0))
    assert isinstance(t.acquire("q", 7, a, "x", 1, 0.1), LeaseGranted)
    assert isinstance(t.acquire("q", 7, b, "y", 1, 0.2), LeaseGranted)
    assert t.release("q", 7, b, "y", 1, True, 0.3)[0] is Outcome.RELEASED     # B finished
    assert t.decline("q", 7, b, "z", 1, False, 0.4)[0] is Outcome.DECLINED    # B aborted another read
    assert t.release("q", 7, b, "x", 1, False, 0.5)[0] is Outcome.NOT_HOLDER  # B names A's read id
    assert t.decline("q", 7, a, "x", 1, False, 0.6)[0] is Outcome.HOLDER      # A must release, not decline
    assert t.get("q").state is LeaseState.PINNED and t.get("q").holders == {a}
    outcome, effects = t.release("q", 7, a, "x", 1, True, 0.7)
    assert outcome is Outcome.RELEASED and LeaseEnded("q", 7, LeaseState.FREED) in effects
    assert t.acquire("q", 7, a, "x", 1, 0.8).code is Code.LEASE_EXPIRED


def test_early_acquire_is_refused_as_not_registered_and_leaves_nothing():
    t = LeaseTable(lease_s=5)
    r = t.acquire("q", 3, ("dA", (0, 0)), "x", 1, 0.0)
    assert isinstance(r, LeaseRefused) and r.code is Code.NOT_REGISTERED and not t.leases
    # the refused reader sends nothing; the registration comes; the retried acquire pins
    t.register("q", None, 3, 0.01)
    assert isinstance(t.acquire("q", 3, ("dA", (0, 0)), "x", 1, 0.02), LeaseGranted)
    # another attempt than the live one, or an ended one, is "expired"; an unknown id "not registered"
    assert t.acquire("q", 4, ("dA", (0, 0)), "x", 1, 0.03).code is Code.LEASE_EXPIRED
    assert t.acquire("p", 4, ("dA", (0, 0)), "x", 1, 0.03).code is Code.NOT_REGISTERED
    t.register("q", None, 5, 0.04)  # re-registered: attempt 3 is over
    assert t.acquire("q", 3, ("dA", (0, 0)), "x", 1, 0.05).code is Code.LEASE_EXPIRED


def test_two_ranks_of_one_decode_engine_share_a_claim():
    """Decode TP2 reads one prefill rank: rank 0 releasing does not free before rank 1 has read."""
    t = LeaseTable(lease_s=1, pin_s=60)
    t.register("q", None, 1, 0.0)
    r0, r1 = ("dA", (0, 0)), ("dA", (0, 1))
    t.acquire("q", 1, r0, "x", 2, 0.1)
    assert t.release("q", 1, r0, "x", 2, True, 0.9)[1] == [PinEnded("q", (r0, "x"))]
    # rank 1 arrives after the registration's lease_s: the release pushed the deadline
    assert isinstance(t.acquire("q", 1, r1, "x", 2, 1.5), LeaseGranted)
    _, effects = t.release("q", 1, r1, "x", 2, True, 1.6)
    assert effects[-1] == LeaseEnded("q", 1, LeaseState.FREED)


def test_vllm_n2_two_reads_in_one_engine():
    t = LeaseTable(lease_s=5, pin_s=60)
    t.register("q", None, 1, 0.0)
    r = ("dA", (0, 0))
    t.acquire("q", 1, r, "child-0", 1, 0.1)
    t.acquire("q", 1, r, "child-1", 1, 0.1)
    assert t.pins_held(r) == 2
    assert not any(isinstance(e, LeaseEnded) for e in t.release("q", 1, r, "child-0", 1, True, 0.2)[1])
    assert t.get("q").state is LeaseState.PINNED
    assert t.release("q", 1, r, "child-1", 1, True, 0.3)[1][-1].state is LeaseState.FREED


def test_vllm_n2_siblings_share_one_lease_until_every_read():
    """vLLM n=2 on both sides: the prefill keeps one lease for its two children (``expect`` raises it to two
    reads); the decode's two children read it one after the other. The first one's Done does not free it (the
    second has not even acquired yet); the second's does. A Done from a non-holder, and a decline of the same
    read twice, count for nothing."""
    t = LeaseTable(lease_s=5, pin_s=60)
    t.register("0_p", None, 9, 0.0)
    assert t.expect("0_p", 9, 2, 0.01) and t.get("0_p").reads == 2
    assert not t.expect("0_p", 8, 3, 0.01) and t.get("0_p").reads == 2  # another attempt: nothing
    assert t.expect("0_p", 9, 1, 0.01) and t.get("0_p").reads == 2     # never lowered
    r = ("dA", (0, 0))
    t.acquire("0_p", 9, r, "0_d", 1, 0.1)
    outcome, effects = t.release("0_p", 9, r, "0_d", 1, True, 0.2)
    assert outcome is Outcome.RELEASED and not any(isinstance(e, LeaseEnded) for e in effects)
    assert t.release("0_p", 9, ("dB", (0, 0)), "1_d", 1, True, 0.25)[0] is Outcome.NOT_HOLDER
    assert t.get("0_p").state is LeaseState.RESERVED  # unpinned, still held for the second read
    assert isinstance(t.acquire("0_p", 9, r, "1_d", 1, 3.0), LeaseGranted)
    assert t.release("0_p", 9, r, "1_d", 1, True, 3.1)[1][-1] == LeaseEnded("0_p", 9, LeaseState.FREED)
    # a second read that never comes: the lease expires lease_s after the first read's Done
    t.register("0_q", None, 3, 10.0, reads=2)
    t.acquire("0_q", 3, r, "0_e", 1, 10.1)
    t.release("0_q", 3, r, "0_e", 1, True, 10.2)
    assert not t.tick(15.1) and t.tick(15.3)[-1] == LeaseEnded("0_q", 3, LeaseState.EXPIRED)
    # an aborted decode child declines: that settles its read
    t.register("0_s", None, 4, 20.0, reads=2)
    t.acquire("0_s", 4, r, "0_f", 1, 20.1)
    assert t.decline("0_s", 4, r, "1_f", 1, False, 20.2)[0] is Outcome.DECLINED
    assert t.release("0_s", 4, r, "0_f", 1, True, 20.3)[1][-1].state is LeaseState.FREED
    # more reads than a lease takes claims count as max_reads; fewer than one is refused
    small = LeaseTable(lease_s=5, max_reads=2)
    small.register("0_t", None, 5, 0.0, reads=7)
    assert small.get("0_t").reads == 2
    with pytest.raises(ValueError):
        small.register("0_u", None, 5, 0.0, reads=0)


def test_a_dead_readers_pin_ends_on_pin_idle_scale_and_heartbeats_keep_it():
    t = LeaseTable(lease_s=1.0, pin_s=100.0)
    t.register("q", None, 1, 0.0)
    r = ("dA", (0, 0))
    t.acquire("q", 1, r, "x", 1, 0.0)
    for k in range(1, 10):  # a live decode refreshes its pin every 0.5 s: held far past lease_s
        assert isinstance(t.heartbeat("q", 1, r, "x", k * 0.5), LeaseGranted)
        assert not t.tick(k * 0.5 + 0.4)
    # heartbeats stop (decode died): the pin ends pin_idle_s (= lease_s) later, not pin_s
    effects = t.tick(4.5 + 1.0)
    assert LeaseEnded("q", 1, LeaseState.EXPIRED) in effects and not t.leases


def test_heartbeat_of_a_queued_request_extends_its_lease_without_pinning():
    t = LeaseTable(lease_s=1.0, pin_s=10.0)
    t.register("q", None, 1, 0.0)
    r = ("dA", (0, 0))
    for k in range(1, 7):
        assert isinstance(t.heartbeat("q", 1, r, "x", k * 0.5), LeaseGranted)
        assert not t.tick(k * 0.5 + 0.9)
    assert not t.get("q").pins  # queued: extended, never pinned
    assert isinstance(t.acquire("q", 1, r, "x", 1, 3.2), LeaseGranted)  # read 3x lease_s after registration
    # the cap: heartbeats never hold an unpinned lease past pin_s after its registration
    t.register("z", None, 2, 0.0)
    for k in range(1, 40):
        t.heartbeat("z", 2, r, "y", k * 0.5)
        t.tick(k * 0.5)
    assert t.get("z") is None


def test_abort_before_read_frees_only_if_nobody_holds_a_pin():
    t = LeaseTable(lease_s=5, pin_s=60)
    t.register("q", None, 1, 0.0)
    a, b = ("dA", (0, 0)), ("dB", (0, 0))
    assert t.decline("q", 1, a, "x", 1, False, 0.1)[1][-1] == LeaseEnded("q", 1, LeaseState.FREED)
    t.register("p", None, 2, 0.0)
    t.acquire("p", 2, b, "y", 1, 0.1)
    outcome, effects = t.decline("p", 2, a, "x", 1, False, 0.2)
    assert outcome is Outcome.DECLINED and not effects  # B still reads
    assert t.release("p", 2, b, "y", 1, True, 0.3)[1][-1].state is LeaseState.FREED


@pytest.mark.parametrize("pinned", [True, False])
def test_reader_identity_is_not_rebound_by_another_agent(pinned):
    pins = {("dX", (0, 0)): 1 if pinned else 0}
    rt = ReaderTable(cap=4096, idle_s=60.0)
    assert rt.bind(("dX", (0, 0)), "dX-d0t0", 0.0, lambda r: pins.get(r, 0)) is None
    assert rt.bind(("dX", (0, 0)), "evil", 1.0, lambda r: pins.get(r, 0)) is Code.IDENTITY_IN_USE
    assert rt.agent_of(("dX", (0, 0))) == "dX-d0t0"
    assert rt.bind(("dX", (0, 0)), "dX-d0t0", 2.0, lambda r: pins.get(r, 0)) is None  # same agent: refresh
    # idle long enough and no pin: a restarted decode may rebind with another agent name
    want = Code.IDENTITY_IN_USE if pinned else None
    assert rt.bind(("dX", (0, 0)), "dX-new", 100.0, lambda r: pins.get(r, 0)) is want


def test_reader_table_flood_never_evicts_a_live_reader():
    rt = ReaderTable(cap=4096, idle_s=60.0)
    live = ("dX", (0, 0))
    pins = {live: 1}
    rt.bind(live, "dX-d0t0", 0.0, lambda r: pins.get(r, 0))
    refused = sum(rt.bind((f"fake{i}", (0, 0)), f"a{i}", 1.0 + i * 1e-4, lambda r: pins.get(r, 0)) is not None
                  for i in range(4200))
    assert live in rt and rt.agent_of(live) == "dX-d0t0" and len(rt) == 4096 and refused == 4200 - 4095
    # much later, idle fakes make room; the pinned reader stays
    assert rt.bind(("new", (0, 0)), "n", 1000.0, lambda r: pins.get(r, 0)) is None and live in rt


# ---- how long a pin holds: idle, stall, bound; progress carried by heartbeats --------------------------
MiB = 1 << 20


def test_a_progressing_read_holds_past_pin_s_up_to_its_bound():
    """The old fixed cap (``pin_s`` from the pin's creation) no longer ends a read whose heartbeats report
    bytes read; its bound, ``pin_s`` plus the request's bytes at ``min_read_rate``, still does."""
    t = LeaseTable(lease_s=2.0, pin_s=10.0, min_read_rate=MiB)
    t.register("q", None, 1, 0.0, nbytes=100 * MiB)  # bound: 10 + 100 s after the pin
    r = ("dA", (0, 0))
    assert isinstance(t.acquire("q", 1, r, "x", 1, 0.0), LeaseGranted)
    now, effects = 0.0, []
    while not effects and now < 200.0:  # 0.5 MiB read every second: slower than the slowest rate accepted
        got = t.heartbeat("q", 1, r, "x", now, (int(now * MiB / 2), MiB // 2))
        assert isinstance(got, LeaseGranted) and got.ttl_s >= 1.0, now
        now += 1.0
        effects = t.tick(now)
    assert now == 110.0 and LeaseEnded("q", 1, LeaseState.EXPIRED) in effects and not t.leases
    assert pin_bound_s(100 * MiB, 10.0, MiB) == 110.0
    # at the slowest rate accepted, the whole request is read and released within the bound
    t.register("p", None, 2, 200.0, nbytes=100 * MiB)
    t.acquire("p", 2, r, "y", 1, 200.0)
    for k in range(1, 101):
        assert isinstance(t.heartbeat("p", 2, r, "y", 200.0 + k, (k * MiB, MiB)), LeaseGranted)
        assert not t.tick(200.0 + k + 0.5)
    assert t.release("p", 2, r, "y", 1, True, 300.9)[1][-1] == LeaseEnded("p", 2, LeaseState.FREED)


def test_a_silent_reader_releases_within_pin_idle_s_however_large_the_request():
    t = LeaseTable(lease_s=2.0, pin_s=10.0, min_read_rate=1.0)
    t.register("q", None, 1, 0.0, nbytes=10 ** 9)  # a bound of ~32 years
    r = ("dA", (0, 0))
    t.acquire("q", 1, r, "x", 1, 0.0)
    t.heartbeat("q", 1, r, "x", 5.0, (100, 10 ** 8))  # progress, a huge transfer in flight
    assert not t.tick(6.99)
    assert LeaseEnded("q", 1, LeaseState.EXPIRED) in t.tick(7.0)  # 2 s after its last heartbeat


def test_a_live_reader_that_stops_progressing_releases_after_pin_s_plus_its_transfer():
    """Heartbeats keep coming but the bytes done stop rising: the pin ends ``pin_s`` after the last
    progress, plus the bytes it reported in flight at the slowest rate (a posted transfer reports no
    bytes until it ends); a report of fewer bytes done is not progress."""
    t = LeaseTable(lease_s=2.0, pin_s=10.0, min_read_rate=MiB)
    t.register("q", None, 1, 0.0, nbytes=1000 * MiB)
    r = ("dA", (0, 0))
    t.acquire("q", 1, r, "x", 1, 0.0)
    t.heartbeat("q", 1, r, "x", 1.0, (50 * MiB, 5 * MiB))  # progress at 1 s, 5 MiB in flight: 1 + 10 + 5
    now, ended = 1.0, None
    while ended is None and now < 30:
        now = round(now + 0.5, 6)
        t.heartbeat("q", 1, r, "x", now, (40 * MiB, 5 * MiB))  # fewer bytes done: not progress
        if t.tick(now):
            ended = now
    assert ended == 16.0
    # a direct read is one transfer: its whole size in flight holds it, no byte reported until it ends
    t.register("d", None, 2, 100.0, nbytes=30 * MiB)
    t.acquire("d", 2, r, "y", 1, 100.0)
    for k in range(1, 40):
        got = t.heartbeat("d", 2, r, "y", 100.0 + k, (0, 30 * MiB))
        assert isinstance(got, LeaseGranted), k  # 40 s > pin_s: held for its 30 MiB at 1 MiB/s
        assert not t.tick(100.0 + k)
    # inflight counts at most the bytes not yet reported done (a reader cannot claim more)
    t.register("c", None, 3, 200.0, nbytes=4 * MiB)
    t.acquire("c", 3, r, "z", 1, 200.0)
    t.heartbeat("c", 3, r, "z", 201.0, (3 * MiB, 10 ** 12))
    assert t.get("c").pins[(r, "z")].inflight == MiB
    assert t.get("c").pins[(r, "z")].deadline == 201.0 + 2.0  # idle first; stall would be 201 + 10 + 1


def test_a_granted_time_is_honoured_and_never_shortened():
    """A pin's deadline never moves earlier: a later report of less in flight does not revoke time the
    prefill already answered."""
    t = LeaseTable(lease_s=50.0, pin_s=10.0, min_read_rate=MiB)
    t.register("q", None, 1, 0.0, nbytes=100 * MiB)
    r = ("dA", (0, 0))
    t.acquire("q", 1, r, "x", 1, 0.0)
    got = t.heartbeat("q", 1, r, "x", 1.0, (0, 40 * MiB))  # stall: 0 + 10 + 40 = 50 s
    assert got.ttl_s == 49.0
    got2 = t.heartbeat("q", 1, r, "x", 2.0, (0, 0))  # nothing in flight any more: stall would be 10 s
    assert got2.ttl_s == 48.0 and not t.tick(49.9) and t.tick(50.0)


def test_min_read_rate_and_nbytes_are_checked():
    with pytest.raises(ValueError, match="min_read_rate"):
        LeaseTable(min_read_rate=0)
    with pytest.raises(ValueError, match="bytes"):
        LeaseTable().register("q", None, 1, 0.0, nbytes=-1)


pin_op = st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(ENGINES), st.sampled_from(READS)),
    st.tuples(st.just("heartbeat"), st.sampled_from(ENGINES), st.sampled_from(READS),
              st.one_of(st.none(), st.tuples(st.integers(0, 12), st.integers(0, 12)))),
    st.tuples(st.just("release"), st.sampled_from(ENGINES), st.sampled_from(READS)),
    st.tuples(st.just("advance"), st.floats(0.0, 4.0)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(pin_op, min_size=1, max_size=50), st.floats(0.5, 3.0), st.floats(1.0, 6.0),
       st.floats(0.5, 4.0), st.integers(0, 10))
def test_pin_bounds_against_a_model(ops, idle_s, pin_s, rate, nbytes):
    """An independent model of each pin's deadline (idle, stall, bound; never earlier than granted):
    every answered ttl, and every pin's end, is exactly the model's."""
    t = LeaseTable(lease_s=idle_s, pin_s=pin_s, min_read_rate=rate)
    t.register("q", None, 1, 0.0, nbytes=nbytes, reads=64)
    now = 0.0
    model: dict = {}  # (reader, read) -> dict(pinned, refreshed, progress_at, done, inflight, deadline)

    def due(m):
        stall = m["progress_at"] + pin_s + m["inflight"] / rate
        return max(m["deadline"], min(m["refreshed"] + idle_s, stall, m["pinned"] + pin_s + nbytes / rate))

    settled = set()
    for o in ops:
        if t.get("q") is None:
            break
        if o[0] == "advance":
            now += o[1]
            effects = t.tick(now)
            gone = {e.pin for e in effects if isinstance(e, PinEnded)}
            assert gone == {k for k, m in model.items() if m["deadline"] <= now}, (gone, model, now)
            for k in gone:
                del model[k]
                settled.add(k)
            continue
        key = ((o[1], (0, 0)), o[2])
        if o[0] == "acquire":
            got = t.acquire("q", 1, key[0], key[1], 1, now)
            if key in settled:
                assert isinstance(got, LeaseRefused) and got.code is Code.DONE  # a settled rank never re-pins
                continue
            m = model.setdefault(key, dict(pinned=now, refreshed=now, progress_at=now, done=0, inflight=0,
                                           deadline=now))
            m["refreshed"] = now
        elif o[0] == "heartbeat":
            got = t.heartbeat("q", 1, key[0], key[1], now, o[3])
            m = model.get(key)
            if m is None:
                if key in settled:
                    assert isinstance(got, LeaseRefused) and got.code is Code.DONE
                continue
            m["refreshed"] = now
            if o[3] is not None:
                done = min(o[3][0], nbytes) if nbytes else o[3][0]
                if done > m["done"]:
                    m["done"], m["progress_at"] = done, now
                m["inflight"] = min(o[3][1], max(0, nbytes - m["done"]))
        else:
            outcome, _ = t.release("q", 1, key[0], key[1], 1, True, now)
            assert (outcome is Outcome.RELEASED) == (key in model)
            if model.pop(key, None) is not None:
                settled.add(key)
            continue
        m["deadline"] = due(m)
        assert isinstance(got, LeaseGranted) and abs(got.ttl_s - max(0.0, m["deadline"] - now)) < 1e-9
        pin = t.get("q").pins[key]
        assert pin.deadline == m["deadline"]
        assert pin.deadline <= pin.pinned_at + pin_bound_s(nbytes, pin_s, rate) + 1e-9  # bound


def test_tick_looks_only_at_leases_due(monkeypatch):
    """10,000 live leases, 3 of them due: a tick times out those 3 and looks at no other (no scan that
    grows with the table); heartbeats that push deadlines later add no heap entry."""
    t = LeaseTable(lease_s=100.0, pin_s=200.0)
    r = ("dA", (0, 0))
    for i in range(10_000):
        t.register(f"q{i}", None, 1, 0.0, lease_s=1.0 if i in (4, 500, 5000) else 100.0)
        if i % 2:
            t.acquire(f"q{i}", 1, r, "x", 1, 0.0)
    for i in range(1, 10_000, 2):
        t.heartbeat(f"q{i}", 1, r, "x", 0.5)
    assert len(t._heap) == 10_000
    seen = []
    real = t._time_out  # a spy on the per-lease timeout (no public count of the leases a tick looked at)
    monkeypatch.setattr(t, "_time_out", lambda lease, now: seen.append(lease.req_id) or real(lease, now))
    effects = t.tick(1.0)
    assert sorted(seen) == ["q4", "q500", "q5000"] and len(t.leases) == 9_997
    assert {e.req_id for e in effects} == {"q4", "q500", "q5000"}
    seen.clear()
    assert not t.tick(2.0) and not seen and t.next_deadline() == 100.0


# ---- the lease's transition table ----------------------------------------------------------------------
@pytest.mark.parametrize("state, event", list(itertools.product(LeaseState, LeaseEvent)))
def test_every_cell_of_the_lease_table(state, event):
    """Each (state, event) pair moves where :data:`TRANSITIONS` says, or raises IllegalTransition naming
    the lease, the event and the state (``machine.step``, shared with the read and the peer)."""
    want = TRANSITIONS[state].get(event)
    if want is None:
        with pytest.raises(IllegalTransition, match=f"lease.*{event.name}.*{state.name}"):
            step(TRANSITIONS, state, event, "lease")
    else:
        assert step(TRANSITIONS, state, event, "lease") is want


def test_shape_of_the_lease_table():
    assert LEASE_TERMINAL == {LeaseState.FREED, LeaseState.EXPIRED, LeaseState.REPLACED}
    assert set(TRANSITIONS) == set(LeaseState)
    # only an unpinned lease is freed or expires; a pinned one is only replaced (its pins end with it)
    assert set(TRANSITIONS[LeaseState.PINNED].values()) == {LeaseState.PINNED, LeaseState.RESERVED,
                                                           LeaseState.REPLACED}
    assert TRANSITIONS[LeaseState.RESERVED][LeaseEvent.FREE] is LeaseState.FREED
    # the machines share one step
    from kvbridge.runtime import peer, readstate
    assert readstate.step is step and peer.step is step


def test_every_state_change_of_the_table_is_a_cell(monkeypatch):
    """Drive a lease through pin, unpin, re-pin, replacement, expiry and freeing, recording each state
    change: every one is a cell of TRANSITIONS (the table is the lease's whole lifecycle)."""
    import kvbridge.runtime.lease as lease_mod
    seen = []
    real = lease_mod.step

    def spy(table, state, event, machine):
        nxt = real(table, state, event, machine)
        seen.append((state, event, nxt))
        return nxt
    monkeypatch.setattr(lease_mod, "step", spy)
    t = LeaseTable(lease_s=1.0, pin_s=5.0)
    r = ("dA", (0, 0))
    t.register("q", None, 1, 0.0)
    t.acquire("q", 1, r, "x", 1, 0.0)
    t.acquire("q", 1, ("dB", (0, 0)), "y", 1, 0.0)
    t.release("q", 1, ("dB", (0, 0)), "y", 1, True, 0.1)
    t.register("q", None, 2, 0.2)                      # replaced while pinned
    t.acquire("q", 2, r, "x", 1, 0.3)
    t.release("q", 1, r, "x", 1, True, 0.3)            # another attempt: nothing
    t.release("q", 2, r, "x", 1, True, 0.4)            # freed
    t.register("z", None, 3, 1.0)
    t.tick(2.5)                                        # expired unpinned
    L, V = LeaseState, LeaseEvent
    assert seen == [(L.RESERVED, V.PIN, L.PINNED), (L.PINNED, V.PIN, L.PINNED), (L.PINNED, V.REPLACE, L.REPLACED),
                    (L.RESERVED, V.PIN, L.PINNED), (L.PINNED, V.UNPIN, L.RESERVED), (L.RESERVED, V.FREE, L.FREED),
                    (L.RESERVED, V.EXPIRE, L.EXPIRED)]
    assert all(TRANSITIONS[a][e] is b for a, e, b in seen)


# ---- one rule each: what a one-line slip in the lease machine would break ------------------------------
def test_a_lease_takes_at_most_max_reads_claims_and_readers_at_least_one():
    t = LeaseTable(lease_s=5.0, max_reads=2)
    t.register("q", None, 1, 0.0, reads=2)
    r = ("dA", (0, 0))
    assert t.acquire("q", 1, r, "x", 0, 0.0).code is Code.BAD_REQUEST  # readers < 1
    assert isinstance(t.acquire("q", 1, r, "x", 1, 0.0), LeaseGranted)
    assert isinstance(t.acquire("q", 1, r, "y", 1, 0.0), LeaseGranted)
    third = t.acquire("q", 1, r, "z", 1, 0.0)
    assert isinstance(third, LeaseRefused) and third.code is Code.BAD_REQUEST and "at most 2" in third.message
    assert t.decline("q", 1, ("dB", (0, 0)), "z", 1, False, 0.1)[0] is Outcome.BAD_COUNT
    assert set(t.get("q").claims) == {("dA", "x"), ("dA", "y")}


def test_expect_never_shortens_a_deadline():
    """A release pushes an unpinned lease's deadline ``lease_s`` on (past the heartbeat cap): a later
    ``expect`` (another vLLM sibling) must not pull it back."""
    t = LeaseTable(lease_s=1.0, pin_s=2.0)
    t.register("q", None, 1, 0.0, reads=2)  # heartbeats hold it at most until 2.0
    r = ("dA", (0, 0))
    t.acquire("q", 1, r, "x", 1, 0.0)
    for k in range(1, 10):
        t.heartbeat("q", 1, r, "x", k * 0.5)
    t.release("q", 1, r, "x", 1, True, 5.0)  # deadline 6.0
    assert t.expect("q", 1, 3, 5.1)
    assert not t.tick(5.9) and t.get("q").reads == 3
    assert t.tick(6.0)[-1] == LeaseEnded("q", 1, LeaseState.EXPIRED)


def test_a_timed_out_pin_settles_its_rank_as_failed():
    """The pin of a reader that went silent ends; its part of the claim settles (failed): the lease ends
    then (not at its own later deadline), and that reader may not pin the read again."""
    t = LeaseTable(lease_s=1.0, pin_s=10.0)
    t.register("q", None, 1, 0.0, lease_s=100.0)
    r = ("dA", (0, 0))
    t.acquire("q", 1, r, "x", 1, 0.0)
    effects = t.tick(1.0)
    assert effects == [PinEnded("q", (r, "x")), LeaseEnded("q", 1, LeaseState.EXPIRED)]
    # with another read still expected, the lease lives on, and the timed-out reader is done with "x"
    t.register("p", None, 2, 10.0, lease_s=100.0, reads=2)
    t.acquire("p", 2, r, "x", 1, 10.0)
    assert t.tick(11.0) == [PinEnded("p", (r, "x"))]
    assert t.acquire("p", 2, r, "x", 1, 11.5).code is Code.DONE
    assert t.heartbeat("p", 2, r, "x", 11.5).code is Code.DONE


def test_a_failed_part_settles_its_claim_when_no_pin_of_it_is_held():
    """Decode TP3 reading one prefill rank: rank 0 read it, rank 1 failed, rank 2 never came. The read
    failed: its claim is settled (nobody will complete it), so the lease is freed, not held to expiry."""
    t = LeaseTable(lease_s=5.0)
    t.register("q", None, 1, 0.0)
    r0, r1 = ("dA", (0, 0)), ("dA", (0, 1))
    t.acquire("q", 1, r0, "x", 3, 0.0)
    t.acquire("q", 1, r1, "x", 3, 0.0)
    assert not any(isinstance(e, LeaseEnded) for e in t.release("q", 1, r0, "x", 3, True, 0.1)[1])
    assert t.release("q", 1, r1, "x", 3, False, 0.2)[1][-1] == LeaseEnded("q", 1, LeaseState.FREED)
    # all ranks ok but one not yet: not settled
    t.register("p", None, 2, 1.0)
    t.acquire("p", 2, r0, "y", 2, 1.0)
    assert not any(isinstance(e, LeaseEnded) for e in t.release("p", 2, r0, "y", 2, True, 1.1)[1])
    assert t.get("p").state is LeaseState.RESERVED


def test_a_release_that_brings_a_deadline_earlier_is_scheduled():
    """A lease pinned for long (``pin_idle_s`` 100 s) is released with another read still expected: it
    now expires ``lease_s`` after that release, not when the pin would have."""
    t = LeaseTable(lease_s=1.0, pin_s=200.0, pin_idle_s=100.0)
    t.register("q", None, 1, 0.0, reads=2)
    r = ("dA", (0, 0))
    t.acquire("q", 1, r, "x", 1, 0.0)
    assert not t.tick(1.5)  # its first heap entry (the registration's deadline) finds the pin
    t.release("q", 1, r, "x", 1, True, 2.0)
    assert t.next_deadline() <= 3.0
    assert t.tick(3.0)[-1] == LeaseEnded("q", 1, LeaseState.EXPIRED)


def test_progress_past_the_leases_bytes_is_not_progress():
    """Bytes done are counted up to the lease's bytes on this rank: reports beyond it do not move the
    pin's last progress (a confused or hostile reader cannot stretch its stall time that way)."""
    t = LeaseTable(lease_s=5.0, pin_s=2.0, min_read_rate=1.0)
    t.register("q", None, 1, 0.0, nbytes=4)
    r = ("dA", (0, 0))
    t.acquire("q", 1, r, "x", 1, 0.0)
    t.heartbeat("q", 1, r, "x", 1.0, (5, 0))  # progress at 1.0 (counted as 4)
    t.heartbeat("q", 1, r, "x", 2.0, (6, 0))  # no more progress
    pin = t.get("q").pins[(r, "x")]
    assert (pin.done, pin.progress_at) == (4, 1.0)
    assert not t.tick(2.9) and t.tick(3.0)  # pin_s after 1.0: stalled


def test_a_replaced_lease_ends_its_pins_and_a_failed_release_settles_as_failed():
    t = LeaseTable(lease_s=5.0)
    r0, r1 = ("dA", (0, 0)), ("dA", (0, 1))
    t.register("q", None, 1, 0.0)
    t.acquire("q", 1, r0, "x", 1, 0.0)
    effects = t.register("q", None, 2, 0.1, reads=2)
    assert effects == [PinEnded("q", (r0, "x")), LeaseEnded("q", 1, LeaseState.REPLACED)]
    assert t.pins_held(r0) == 0 and t.get("q").state is LeaseState.RESERVED
    t.acquire("q", 2, r0, "y", 2, 0.2)
    t.release("q", 2, r0, "y", 2, False, 0.3)
    assert t.get("q").claims[("dA", "y")].settled == {(0, 0): False}
    assert t.acquire("q", 2, r1, "y", 2, 0.4).code is Code.DONE  # the read failed: settled for its ranks


def test_a_dead_readers_pin_ends_on_lease_s_by_default_not_pin_s():
    t = LeaseTable(lease_s=1.0, pin_s=50.0)
    assert t.pin_idle_s == 1.0
    t.register("q", None, 1, 0.0, lease_s=100.0)
    t.acquire("q", 1, ("dA", (0, 0)), "x", 1, 0.0)
    assert t.tick(1.0)[0] == PinEnded("q", (("dA", (0, 0)), "x"))


def test_what_a_rank_that_settled_may_still_do():
    """Decode TP2 reads one prefill rank (a claim of 2 ranks). Rank 0 settles (released ok); until rank 1
    comes the claim is open, yet rank 0 may not pin that read again, settle it again (release or
    decline), or heartbeat it; it may pin another read. A Done naming a wrong readers count changes
    nothing."""
    t = LeaseTable(lease_s=5.0)
    t.register("q", None, 1, 0.0, reads=2)
    r0, r1 = ("dA", (0, 0)), ("dA", (0, 1))
    t.acquire("q", 1, r0, "x", 2, 0.0)
    assert t.release("q", 1, r0, "x", 2, True, 0.1)[0] is Outcome.RELEASED
    assert not t.get("q").claim_settled(("dA", "x"))
    assert t.acquire("q", 1, r0, "x", 2, 0.2).code is Code.DONE
    assert t.heartbeat("q", 1, r0, "x", 0.2).code is Code.DONE
    assert t.release("q", 1, r0, "x", 2, True, 0.2)[0] is Outcome.NOT_HOLDER
    assert t.decline("q", 1, r0, "x", 2, True, 0.2)[0] is Outcome.DUPLICATE
    assert t.get("q").claims[("dA", "x")].settled == {(0, 0): True}
    assert isinstance(t.acquire("q", 1, r0, "y", 1, 0.3), LeaseGranted)  # another read: fine
    # rank 1 names a readers count that disagrees: ignored; with the right one it settles the claim
    t.acquire("q", 1, r1, "x", 2, 0.4)
    snap = snapshot(t)
    assert t.release("q", 1, r1, "x", 1, True, 0.5) == (Outcome.BAD_COUNT, [])
    assert t.decline("q", 1, ("dA", (0, 2)), "x", 3, True, 0.5) == (Outcome.BAD_COUNT, [])
    assert snapshot(t) == snap
    assert t.release("q", 1, r1, "x", 2, True, 0.6)[0] is Outcome.RELEASED
    assert t.get("q").claim_settled(("dA", "x"))


def test_a_decline_gives_the_others_lease_s_to_come():
    t = LeaseTable(lease_s=1.0)
    t.register("q", None, 1, 0.0, reads=2)
    assert t.decline("q", 1, ("dA", (0, 0)), "x", 1, True, 0.9)[0] is Outcome.DECLINED
    assert not t.tick(1.5) and t.get("q") is not None
    assert t.tick(1.9)[-1] == LeaseEnded("q", 1, LeaseState.EXPIRED)
