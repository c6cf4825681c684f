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

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.runtime.lease import Granted, LeaseEnded, LeaseState, LeaseTable, Outcome, PinEnded, ReaderTable, Refusal, Refused

ENGINES = ["dA", "dB"]
RANKS = [(0, 0), (0, 1)]
READS = ["r1", "r2"]
REQS = ["q0", "q1"]


def snapshot(t: LeaseTable):
    return copy.deepcopy((t.leases, t._pins_of, dict(t._ended)))


op = st.one_of(
    st.tuples(st.just("register"), st.sampled_from(REQS), st.integers(1, 3), st.integers(1, 3)),
    st.tuples(st.just("expect"), st.sampled_from(REQS), st.integers(1, 3), st.integers(0, 4)),
    st.tuples(st.just("acquire"), st.sampled_from(REQS), st.integers(1, 3), st.sampled_from(ENGINES),
              st.sampled_from(RANKS), st.sampled_from(READS), st.integers(1, 2)),
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


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=60), st.floats(0.5, 3.0), st.floats(1.0, 6.0))
def test_lease_machine_properties(ops, lease_s, pin_s):
    t = LeaseTable(lease_s=lease_s, pin_s=pin_s)
    now = 0.0
    ended: dict[tuple[str, int], LeaseState] = {}

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
            if isinstance(got, Refused):
                assert snapshot(t) == snap  # a refused acquire creates no pin, changes nothing
                lease = t.get(rid)
                if lease is None or lease.attempt != att:
                    want = Refusal.LEASE_EXPIRED if (rid, att) in ended or lease else Refusal.NOT_REGISTERED
                    assert got.code is want
            else:
                assert isinstance(got, Granted) and got.ttl_s > 0
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
            elif outcome is Outcome.RELEASED:
                check_ends(effects, before, ((eng, rank), read), live)
            else:
                assert outcome is Outcome.BAD_COUNT and snapshot(t) == snap
        elif kind == "decline":
            _, rid, att, eng, rank, read, readers, ok = o
            snap = snapshot(t)
            outcome, effects = t.decline(rid, att, (eng, rank), read, readers, ok, now)
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
            if isinstance(got, Refused):
                assert got.code in (Refusal.NOT_REGISTERED, Refusal.LEASE_EXPIRED, Refusal.DONE)
        else:
            now += o[1]
            effects = t.tick(now)
            check_ends(effects, before, live=live)
        for lease in t.leases.values():  # a live lease's state says whether it is pinned
            assert lease.state is (LeaseState.PINNED if lease.pins else LeaseState.RESERVED)
        assert sum(len(lease.pins) for lease in t.leases.values()) == sum(t._pins_of.values())

    # the readers stop: every lease ends within max(lease_s, pin cap) of the last event
    before = copy.deepcopy(t.leases)
    now += max(lease_s, pin_s) + 1e-6
    check_ends(t.tick(now), before)
    assert not t.leases and not t._pins_of


def test_declines_and_failures_never_free_under_another_readers_pin():
    """Issue 20's corruption: decode engine A is mid-read; engine B (a hedge) finishes, aborts or fails
    on the same request. None of B's messages frees the lease while A's pin is held; A's release does."""
    t = LeaseTable(lease_s=5, pin_s=60)
    t.register("q", None, 7, 0.0)
    a, b = ("dA", (0, 0)), ("dB", (0, 0))
    assert isinstance(t.acquire("q", 7, a, "x", 1, 0.1), Granted)
    assert isinstance(t.acquire("q", 7, b, "y", 1, 0.2), Granted)
    assert t.release("q", 7, b, "y", 1, True, 0.3)[0] is Outcome.RELEASED     # B finished
    assert t.decline("q", 7, b, "z", 1, False, 0.4)[0] is Outcome.DECLINED    # B aborted another read
    assert t.release("q", 7, b, "x", 1, False, 0.5)[0] is Outcome.NOT_HOLDER  # B names A's read id
    assert t.decline("q", 7, a, "x", 1, False, 0.6)[0] is Outcome.HOLDER      # A must release, not decline
    assert t.get("q").state is LeaseState.PINNED and t.get("q").holders == {a}
    outcome, effects = t.release("q", 7, a, "x", 1, True, 0.7)
    assert outcome is Outcome.RELEASED and LeaseEnded("q", 7, LeaseState.FREED) in effects
    assert t.acquire("q", 7, a, "x", 1, 0.8).code is Refusal.LEASE_EXPIRED


def test_early_acquire_is_refused_as_not_registered_and_leaves_nothing():
    t = LeaseTable(lease_s=5)
    r = t.acquire("q", 3, ("dA", (0, 0)), "x", 1, 0.0)
    assert isinstance(r, Refused) and r.code is Refusal.NOT_REGISTERED and not t.leases
    # the refused reader sends nothing; the registration comes; the retried acquire pins
    t.register("q", None, 3, 0.01)
    assert isinstance(t.acquire("q", 3, ("dA", (0, 0)), "x", 1, 0.02), Granted)
    # another attempt than the live one, or an ended one, is "expired"; an unknown id "not registered"
    assert t.acquire("q", 4, ("dA", (0, 0)), "x", 1, 0.03).code is Refusal.LEASE_EXPIRED
    assert t.acquire("p", 4, ("dA", (0, 0)), "x", 1, 0.03).code is Refusal.NOT_REGISTERED
    t.register("q", None, 5, 0.04)  # re-registered: attempt 3 is over
    assert t.acquire("q", 3, ("dA", (0, 0)), "x", 1, 0.05).code is Refusal.LEASE_EXPIRED


def test_two_ranks_of_one_decode_engine_share_a_claim():
    """Decode TP2 reads one prefill rank: rank 0 releasing does not free before rank 1 has read."""
    t = LeaseTable(lease_s=1, pin_s=60)
    t.register("q", None, 1, 0.0)
    r0, r1 = ("dA", (0, 0)), ("dA", (0, 1))
    t.acquire("q", 1, r0, "x", 2, 0.1)
    assert t.release("q", 1, r0, "x", 2, True, 0.9)[1] == [PinEnded("q", (r0, "x"))]
    # rank 1 arrives after the registration's lease_s: the release pushed the deadline
    assert isinstance(t.acquire("q", 1, r1, "x", 2, 1.5), Granted)
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
    assert isinstance(t.acquire("0_p", 9, r, "1_d", 1, 3.0), Granted)
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
        assert isinstance(t.heartbeat("q", 1, r, "x", k * 0.5), Granted)
        assert not t.tick(k * 0.5 + 0.4)
    # heartbeats stop (decode died): the pin ends pin_idle_s (= lease_s) later, not pin_s
    effects = t.tick(4.5 + 1.0)
    assert LeaseEnded("q", 1, LeaseState.EXPIRED) in effects and not t.leases


def test_heartbeat_of_a_queued_request_extends_its_lease_without_pinning():
    t = LeaseTable(lease_s=1.0, pin_s=10.0)
    t.register("q", None, 1, 0.0)
    r = ("dA", (0, 0))
    for k in range(1, 7):
        assert isinstance(t.heartbeat("q", 1, r, "x", k * 0.5), Granted)
        assert not t.tick(k * 0.5 + 0.9)
    assert not t.get("q").pins  # queued: extended, never pinned
    assert isinstance(t.acquire("q", 1, r, "x", 1, 3.2), Granted)  # read 3x lease_s after registration
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
    assert rt.bind(("dX", (0, 0)), "evil", 1.0, lambda r: pins.get(r, 0)) is Refusal.IDENTITY_IN_USE
    assert rt.agent_of(("dX", (0, 0))) == "dX-d0t0"
    assert rt.bind(("dX", (0, 0)), "dX-d0t0", 2.0, lambda r: pins.get(r, 0)) is None  # same agent: refresh
    # idle long enough and no pin: a restarted decode may rebind with another agent name
    want = Refusal.IDENTITY_IN_USE if pinned else None
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
