"""Each bound the lease machine (``runtime/lease.py``) promises, one example per bound: a pin's idle time
(``pin_idle_s``), its stall time (``pin_s`` plus the bytes in flight at ``min_read_rate``, from its last
progress), its absolute bound (``pin_s`` plus the lease's bytes at ``min_read_rate``, from its creation);
the deadline of an unpinned lease (``lease_s`` after registration, after a release or decline, after an
``expect``; queued heartbeats capped at ``max(lease_s, pin_s)`` after registration); the attempt check of
every message; what a rank that settled its part may still do; ``expect``/``reads`` for vLLM ``n > 1``.
A deadline is due at its time (``tick(deadline)`` ends it)."""
from __future__ import annotations

import copy

import pytest

from kvbridge.runtime.lease import LeaseEnded, LeaseGranted, LeaseRefused, LeaseState, LeaseTable, Outcome, PinEnded
from kvbridge.runtime.protocol import Code

R0, R1 = ("dA", (0, 0)), ("dA", (0, 1))


def snap(t: LeaseTable):
    # t._ended (the ended (request, attempt) pairs) has no public view
    return copy.deepcopy((t.leases, {r: t.pins_held(r) for r in (R0, R1)}, dict(t._ended)))


def ended(effects) -> bool:
    return any(isinstance(e, LeaseEnded) for e in effects)


# ---- a pin's three bounds ----------------------------------------------------------------------------------
def test_the_idle_bound_is_pin_idle_s_and_due_at_its_time():
    t = LeaseTable(lease_s=100.0, pin_s=50.0, pin_idle_s=3.0)
    t.register("q", None, 1, 0.0)
    assert t.acquire("q", 1, R0, "x", 1, 0.0).ttl_s == 3.0
    assert t.heartbeat("q", 1, R0, "x", 2.0).ttl_s == 3.0  # refreshed: 3 s from now
    assert not t.tick(4.999)
    assert t.tick(5.0)[0] == PinEnded("q", (R0, "x"))


def test_the_stall_bound_counts_bytes_in_flight_from_the_last_progress():
    """``pin_s + inflight / min_read_rate`` after the last heartbeat reporting more bytes done; a report of
    the same bytes done is not progress; ``inflight`` counts at most the bytes not reported done."""
    t = LeaseTable(lease_s=1e4, pin_s=2.0, min_read_rate=1.0)
    t.register("q", None, 1, 0.0, nbytes=1000)
    assert t.acquire("q", 1, R0, "x", 1, 0.0).ttl_s == 2.0            # stall: 0 + 2
    assert t.heartbeat("q", 1, R0, "x", 1.0, (10, 5)).ttl_s == 7.0     # progress at 1: 1 + 2 + 5
    assert t.heartbeat("q", 1, R0, "x", 1.5, (10, 5)).ttl_s == 6.5     # same bytes: still from 1
    assert t.heartbeat("q", 1, R0, "x", 1.6, (10, 0)).ttl_s == pytest.approx(6.4)  # never earlier
    assert t.heartbeat("q", 1, R0, "x", 2.0, (20, 10 ** 6)).ttl_s == 2.0 + 980     # capped at 980 not done
    assert t.get("q").pins[(R0, "x")].inflight == 980
    assert not t.tick(983.99) and t.tick(984.0)[0] == PinEnded("q", (R0, "x"))


def test_the_absolute_bound_holds_whatever_the_progress():
    """``pin_s + nbytes / min_read_rate`` after the pin's creation: a reader reporting progress every second
    is released at 2 + 10 s, not later."""
    t = LeaseTable(lease_s=1e4, pin_s=2.0, min_read_rate=1.0)
    t.register("q", None, 1, 0.0, nbytes=10)
    t.acquire("q", 1, R0, "x", 1, 0.0)
    for k in range(1, 12):
        got = t.heartbeat("q", 1, R0, "x", float(k), (min(k, 9), 1))
        assert isinstance(got, LeaseGranted) and got.ttl_s <= 12.0 - k + 1e-9
        assert not t.tick(k + 0.5)
    assert t.get("q").pins[(R0, "x")].deadline == 12.0
    assert t.tick(12.0)[0] == PinEnded("q", (R0, "x"))


# ---- an unpinned lease's deadline ----------------------------------------------------------------------------
def test_queued_heartbeats_hold_a_lease_at_most_max_lease_s_pin_s_after_registration():
    t = LeaseTable(lease_s=1.0, pin_s=3.0)
    t.register("q", None, 1, 0.0)
    assert t.heartbeat("q", 1, R0, "x", 0.5).ttl_s == 1.0   # lease_s from now
    assert t.heartbeat("q", 1, R0, "x", 2.5).ttl_s == 0.5   # capped at 0 + max(1, 3)
    assert not t.tick(2.99) and t.tick(3.0)[-1] == LeaseEnded("q", 1, LeaseState.EXPIRED)


def test_a_release_gives_the_claims_other_ranks_lease_s_to_come():
    t = LeaseTable(lease_s=1.0, pin_s=100.0, pin_idle_s=100.0)
    t.register("q", None, 1, 0.0)
    t.acquire("q", 1, R0, "x", 2, 0.0)
    assert not ended(t.release("q", 1, R0, "x", 2, True, 5.0)[1])
    assert not t.tick(5.9) and t.get("q").state is LeaseState.RESERVED
    assert t.tick(6.0)[-1] == LeaseEnded("q", 1, LeaseState.EXPIRED)


def test_expect_gives_the_new_sibling_lease_s_to_come():
    t = LeaseTable(lease_s=1.0, pin_s=5.0)
    t.register("q", None, 1, 0.0)
    assert t.expect("q", 1, 2, 0.9)
    assert not t.tick(1.5) and t.get("q").reads == 2
    assert t.tick(1.9)[-1] == LeaseEnded("q", 1, LeaseState.EXPIRED)


# ---- the attempt check of every message -----------------------------------------------------------------
def test_every_message_for_another_attempt_changes_nothing():
    """Attempt 2 is live and pinned by R0; every message naming attempt 1 (a stale or guessed one) is
    refused or ignored and changes nothing at all."""
    t = LeaseTable(lease_s=5.0)
    t.register("q", None, 1, 0.0)
    t.register("q", None, 2, 0.1)
    assert isinstance(t.acquire("q", 2, R0, "x", 1, 0.2), LeaseGranted)
    before = snap(t)
    assert t.acquire("q", 1, R0, "x", 1, 0.3).code is Code.LEASE_EXPIRED
    assert t.acquire("q", 3, R1, "y", 1, 0.3).code is Code.LEASE_EXPIRED   # not registered, another live
    assert t.heartbeat("q", 1, R0, "x", 0.3).code is Code.LEASE_EXPIRED
    assert t.heartbeat("q", 3, R0, "x", 0.3, (5, 5)).code is Code.LEASE_EXPIRED
    assert t.release("q", 1, R0, "x", 1, True, 0.3) == (Outcome.STALE, [])
    assert t.decline("q", 1, R1, "y", 1, True, 0.3) == (Outcome.STALE, [])
    assert not t.expect("q", 1, 5, 0.3)
    assert snap(t) == before
    assert t.release("q", 2, R0, "x", 1, True, 0.4)[1][-1] == LeaseEnded("q", 2, LeaseState.FREED)


# ---- what a rank that settled may still do ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["released", "declined", "timed_out"])
def test_a_settled_rank_may_not_pin_or_heartbeat_that_read_again(how):
    t = LeaseTable(lease_s=1.0, pin_s=100.0)
    t.register("q", None, 1, 0.0, reads=2, lease_s=100.0)
    if how == "declined":
        assert t.decline("q", 1, R0, "x", 2, True, 0.0)[0] is Outcome.DECLINED
    else:
        t.acquire("q", 1, R0, "x", 2, 0.0)
        if how == "released":
            t.release("q", 1, R0, "x", 2, True, 0.5)
        else:
            assert t.tick(1.0) == [PinEnded("q", (R0, "x"))]
    before = snap(t)
    got = t.acquire("q", 1, R0, "x", 2, 1.5)
    assert isinstance(got, LeaseRefused) and got.code is Code.DONE
    assert t.heartbeat("q", 1, R0, "x", 1.5).code is Code.DONE
    assert t.decline("q", 1, R0, "x", 2, True, 1.5)[0] is Outcome.DUPLICATE
    assert t.release("q", 1, R0, "x", 2, True, 1.5)[0] is Outcome.NOT_HOLDER
    assert snap(t) == before
    # other reads, and the claim's other rank, are fine
    assert isinstance(t.acquire("q", 1, R0, "y", 1, 1.6), LeaseGranted)
    if how != "timed_out":  # (a timed-out part settled its claim as failed: the read is over for every rank)
        assert isinstance(t.acquire("q", 1, R1, "x", 2, 1.6), LeaseGranted)


# ---- vLLM n > 1: expect / reads ------------------------------------------------------------------------------
def test_a_lease_expecting_n_reads_is_freed_by_the_nth_settled_claim_only():
    t = LeaseTable(lease_s=5.0)
    t.register("q", None, 1, 0.0, reads=3)
    for i, rid in enumerate(["a", "b"]):
        t.acquire("q", 1, R0, rid, 1, 0.1 * i)
        assert not ended(t.release("q", 1, R0, rid, 1, True, 0.1 * i + 0.05)[1])
    assert t.get("q").state is LeaseState.RESERVED and len(t.get("q").claims) == 2
    assert t.decline("q", 1, R0, "c", 1, False, 0.5)[1][-1] == LeaseEnded("q", 1, LeaseState.FREED)
    # expect raises the count of a live lease only (never lowers it, never for another attempt)
    t.register("p", None, 4, 1.0)
    assert t.expect("p", 4, 2, 1.0) and not t.expect("p", 3, 9, 1.0) and t.expect("p", 4, 1, 1.0)
    assert t.get("p").reads == 2
    t.acquire("p", 4, R0, "a", 1, 1.1)
    assert not ended(t.release("p", 4, R0, "a", 1, True, 1.2)[1])
    assert t.release("p", 4, R1, "b", 1, True, 1.2)[0] is Outcome.NOT_HOLDER
    t.acquire("p", 4, R1, "b", 1, 1.3)
    assert t.release("p", 4, R1, "b", 1, True, 1.4)[1][-1] == LeaseEnded("p", 4, LeaseState.FREED)
