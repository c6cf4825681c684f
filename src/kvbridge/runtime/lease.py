"""The prefill's leases as a sans-IO state machine with per-reader pins.

A *lease* holds one attempt of a request's blocks on one prefill rank. Its state changes only through
:data:`TRANSITIONS` (:func:`~kvbridge.runtime.machine.step`, as the read and the peer)::

    RESERVED ──PIN (a granted acquire or stage request)──▶ PINNED ──PIN──▶ PINNED
    PINNED ──UNPIN (its last pin released or timed out)──▶ RESERVED
    RESERVED ──FREE (every claim, at least ``reads``, settled)──▶ FREED
    RESERVED ──EXPIRE (its deadline passed, or its last pin timed out and every claim settled)──▶ EXPIRED
    RESERVED | PINNED ──REPLACE (register() of the same request id)──▶ REPLACED

FREED, EXPIRED and REPLACED are terminal. Nothing here does I/O or reads a clock: every method takes
``now`` (the prefill process's monotonic clock; durations only ever cross the wire) and returns what
happened; :class:`~kvbridge.runtime.prefill.PrefillRank` turns side-channel frames and NIXL
notifications into these calls and acts on the effects (staging slots back, ids reported freed).

Vocabulary:

* A *reader* is one decode rank, ``(decode engine id, decode rank)``, authenticated by the prefill's
  :class:`ReaderTable` (bound to the NIXL agent it named at handshake).
* A *read* is one decode-side read of the request, named by the reader (``read_id``; the decode
  engine's own request id, the same on all of its ranks). Several reads of one request may coexist:
  router retries and hedges from other decode engines, vLLM ``n > 1`` (two decode requests in one
  engine sharing one set of prefill params).
* A lease *expects* ``reads`` claims (default 1): it is not freed before that many claims exist and are
  settled. vLLM's ``n > 1`` runs ``n`` sibling requests of one prompt on the prefill *and* on the decode;
  the prefill's connector keeps one lease for the siblings (:meth:`LeaseTable.expect` raises its count
  by one per sibling) so that the decode's ``n`` children all read it, whichever of them comes last.
* A *pin* ``(reader, read_id)`` is created by a granted acquire (or stage request) and ended only by
  that reader's release (its ``Done``), or by timing out (see "How long a pin holds"). A refused acquire
  creates no pin.
* A *claim* ``(decode engine, read_id)`` gathers the ``readers`` decode ranks of that engine that
  notify this prefill rank (from the transfer plan). Each of them settles its part once: by releasing
  its pin (``ok`` or failed), or by *declining* (a rank with nothing to read here, or a request aborted
  before it read: a reader that holds no pin for the read). A claim is settled when all its ranks
  settled, or when one of them failed and no pin of the claim is held.

How long a pin holds. A pin's holder refreshes it (an acquire or heartbeat for the same pin); its
heartbeats report the read's *progress*: ``done``, the bytes it has read, and ``inflight``, the bytes of
its transfers posted and not finished. The pin ends at the earliest of three bounds, each checked by
the property test:

* *idle*: ``pin_idle_s`` (default ``lease_s``) after its last refresh: a silent or dead reader releases
  on this scale, however large the request;
* *stall*: ``pin_s + inflight / min_read_rate`` after its last progress (its creation, or a heartbeat
  reporting more bytes done than before; ``inflight`` as last reported, at most the bytes not yet
  reported done): a live reader whose read stopped moving releases, while one waiting on a posted
  transfer (NIXL reports no bytes until a transfer ends) has that transfer's bytes at the slowest rate
  accepted;
* *bound*: ``pin_s + nbytes / min_read_rate`` after its creation (:func:`pin_bound_s`, ``nbytes``: the
  lease's bytes on this rank, given at registration): no pin outlives it, progress or not.

A pin's deadline never moves earlier: the time left that a grant or heartbeat answered (``ttl_s``) is
honoured unless the holder releases the pin or the lease is re-registered.

The rules the property test (``tests/test_lease.py``) checks:

1. a lease never ends (FREED/EXPIRED) while a pin on it is held and not timed out;
2. it is FREED when no pin is held, at least ``reads`` claims exist and every claim is settled; it is
   EXPIRED when it holds no pin and its deadline passed (``lease_s`` after registration, after the last
   heartbeat of a queued request, or after the last release of a claim still waiting for other ranks);
   heartbeats of a queued request never hold it past ``max(lease_s, pin_s)`` after its registration;
3. a release of a pin the sender does not hold, a message for another attempt, a decline of a read the
   sender holds a pin for, a second settlement of the same part, or a readers count that disagrees with
   the claim's has no effect at all;
4. a reader that settled its part of a read may not pin it again (``done``), nor settle it again,
   and its heartbeats for it are refused (``done``); it may still pin and settle other reads;
5. each pin's three bounds above, and its granted time honoured;
6. a lease takes at most ``max_reads`` claims (``bad_request`` past them) and at least ``reads`` before
   it is FREED; ``expect`` only ever raises ``reads``;
7. every state change is a cell of :data:`TRANSITIONS`; a live lease is PINNED exactly when it holds a
   pin.
"""
from __future__ import annotations

import enum
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .machine import step, terminal_states
from .protocol import Code

Rank = tuple[int, int]
Reader = tuple[str, Rank]            # (decode engine id, decode rank)
PinKey = tuple[Reader, str]          # (reader, read_id)
ClaimKey = tuple[str, str]           # (decode engine id, read_id)


# claims one lease takes at most (router retries, hedges and vLLM n > 1 children together)
MAX_READS = 64
# the slowest read (bytes per second) a prefill accepts by default: a pin's bound grows by a request's
# bytes at this rate (a dense-GQA read of 2 M small descriptors over a slow link moved a few MB/s)
MIN_READ_RATE = float(1 << 20)
# the default bounds of a lease and of a pin, and of the reader table (PrefillConfig's defaults)
LEASE_S = 30.0        # a request's blocks held for readers that have not claimed them yet
PIN_S = 120.0         # a pin's longest hold from its creation (plus the request's bytes at MIN_READ_RATE)
MAX_READERS = 4096    # decode ranks remembered
READER_IDLE_S = 60.0  # a reader without a live pin or message this long may be forgotten


def pin_bound_s(nbytes: int, pin_s: float, min_read_rate: float = MIN_READ_RATE) -> float:
    """The longest a pin on a lease of ``nbytes`` (on one prefill rank) may hold, from its creation."""
    return float(pin_s) + max(0, int(nbytes)) / float(min_read_rate)


class LeaseState(enum.Enum):
    RESERVED = "reserved"
    PINNED = "pinned"
    FREED = "freed"
    EXPIRED = "expired"
    REPLACED = "replaced"


class LeaseEvent(enum.Enum):
    PIN = "pin"            # a granted acquire or stage request made a pin
    UNPIN = "unpin"        # its last pin ended (released or timed out)
    FREE = "free"          # no pin held, every claim (at least ``reads``) settled
    EXPIRE = "expire"      # no pin held and its deadline passed, or its last pin timed out and it settled
    REPLACE = "replace"    # register() of the same request id


_L, _V = LeaseState, LeaseEvent
TRANSITIONS: dict[LeaseState, dict[LeaseEvent, LeaseState]] = {
    _L.RESERVED: {_V.PIN: _L.PINNED, _V.FREE: _L.FREED, _V.EXPIRE: _L.EXPIRED, _V.REPLACE: _L.REPLACED},
    _L.PINNED: {_V.PIN: _L.PINNED, _V.UNPIN: _L.RESERVED, _V.REPLACE: _L.REPLACED},
    _L.FREED: {},
    _L.EXPIRED: {},
    _L.REPLACED: {},
}
TERMINAL = terminal_states(TRANSITIONS)
# the terminal state each ending event leads to, and back
_ENDING = {_L.FREED: _V.FREE, _L.EXPIRED: _V.EXPIRE, _L.REPLACED: _V.REPLACE}


class Outcome(enum.Enum):
    """What a release/decline (a ``Done`` notification) did."""

    RELEASED = "released"          # the sender's pin ended, its part of the claim settled
    DECLINED = "declined"          # the sender (holding no pin) settled its part of the claim
    UNKNOWN = "unknown"            # no live lease of that request id
    STALE = "stale"                # a lease of another attempt
    NOT_HOLDER = "not_holder"      # a release of a pin the sender does not hold
    HOLDER = "holder"              # a decline from a reader that holds the pin (it must release it)
    DUPLICATE = "duplicate"        # the sender's part of the claim was settled already
    BAD_COUNT = "bad_count"        # readers < 1 or disagreeing with the claim's count

    @property
    def effective(self) -> bool:
        return self in (Outcome.RELEASED, Outcome.DECLINED)


@dataclass(frozen=True)
class LeaseGranted:
    """An acquire or heartbeat was granted."""
    req_id: str
    attempt: int
    read_id: str
    ttl_s: float   # seconds the pin (or, for a heartbeat of an unpinned lease, the lease) still holds


@dataclass(frozen=True)
class LeaseRefused:
    """An acquire or heartbeat was refused: nothing changed."""
    req_id: str
    attempt: int
    read_id: str
    code: Code     # one of protocol.REFUSALS, or BAD_REQUEST
    message: str


@dataclass(frozen=True)
class PinEnded:
    """A pin ended (released or timed out): the IO layer gives its staging slot back."""
    req_id: str
    pin: PinKey


@dataclass(frozen=True)
class LeaseEnded:
    """A lease reached a terminal state: FREED/EXPIRED are reported to the engine, REPLACED is not."""
    req_id: str
    attempt: int
    state: LeaseState


Effect = PinEnded | LeaseEnded


@dataclass
class Pin:
    reader: Reader
    read_id: str
    pinned_at: float
    deadline: float        # when it times out (never moves earlier)
    refreshed_at: float    # its holder's last acquire or heartbeat
    progress_at: float     # its creation, or the last heartbeat that reported more bytes done
    done: int = 0          # bytes its holder reported read
    inflight: int = 0      # bytes its holder reported in transfers posted and not finished


@dataclass
class Claim:
    readers: int
    settled: dict[Rank, bool] = field(default_factory=dict)  # decode rank -> released ok


@dataclass
class Lease:
    """One attempt of a request's blocks on this prefill rank (see the module docstring)."""

    req_id: str
    blocks: Any
    attempt: int
    lease_s: float
    registered_at: float
    deadline: float                      # when an unpinned lease expires
    hold_until: float                    # heartbeats never push ``deadline`` past this
    nbytes: int = 0                      # bytes of its blocks on this rank (a pin's bound grows with it)
    state: LeaseState = LeaseState.RESERVED
    reads: int = 1                       # claims expected before it may be FREED (vLLM n > 1: n)
    pins: dict[PinKey, Pin] = field(default_factory=dict)
    claims: dict[ClaimKey, Claim] = field(default_factory=dict)
    staged: set[Any] = field(default_factory=set)  # IO layer: staging slot keys held for this lease
    wake: float = float("inf")           # the time of its entry in the table's deadline heap

    @property
    def pinned_at(self) -> float | None:
        return min((p.pinned_at for p in self.pins.values()), default=None)

    @property
    def done_ranks(self) -> set[Reader]:
        """Readers whose part of some claim is settled."""
        return {(eng, rank) for (eng, _), c in self.claims.items() for rank in c.settled}

    @property
    def holders(self) -> set[Reader]:
        return {p.reader for p in self.pins.values()}

    def claim_settled(self, key: ClaimKey) -> bool:
        c = self.claims[key]
        if len(c.settled) >= c.readers:
            return True
        return not all(c.settled.values()) and not any(
            (r[0], rid) == key for (r, rid) in self.pins)


class LeaseTable:
    """Every lease of one prefill rank; sans-IO (see the module docstring).

    ``lease_s``: default lease of a registration; ``pin_s``: how long a pin holds without progress (and
    the fixed part of its bound; heartbeats of a queued request never hold it longer after its
    registration); ``pin_idle_s``: a pin not refreshed for this long ends (a dead decode's pins end on
    this scale; default ``lease_s``); ``min_read_rate``: the slowest read accepted, bytes per second
    (a pin's bound is :func:`pin_bound_s` of its lease's bytes); ``max_reads``: claims per lease;
    ``ended_cap``: how many ended (request, attempt) pairs are remembered to tell "expired" from "not
    registered yet"."""

    def __init__(self, lease_s: float = LEASE_S, pin_s: float = PIN_S, pin_idle_s: float | None = None,
                 max_reads: int = MAX_READS, ended_cap: int = 1 << 16, min_read_rate: float = MIN_READ_RATE):
        self.lease_s, self.pin_s = float(lease_s), float(pin_s)
        self.pin_idle_s = float(lease_s if pin_idle_s is None else pin_idle_s)
        if not min_read_rate > 0:
            raise ValueError(f"min_read_rate must be > 0 bytes per second, got {min_read_rate!r}")
        self.min_read_rate = float(min_read_rate)
        self.max_reads, self._ended_cap = max_reads, ended_cap
        self.leases: dict[str, Lease] = {}
        self._ended: OrderedDict[tuple[str, int], LeaseState] = OrderedDict()
        self._pins_of: dict[Reader, int] = {}   # reader -> pins it holds (all leases)
        # deadlines: (time, seq, lease), at most one entry per live lease is current (``lease.wake``); a
        # deadline moved later keeps its entry (popped early, it finds nothing due and goes back in)
        self._heap: list[tuple[float, int, Lease]] = []
        self._seq = itertools.count()

    # ---- queries ---------------------------------------------------------------------------------
    def get(self, req_id: str) -> Lease | None:
        return self.leases.get(req_id)

    def pins_held(self, reader: Reader) -> int:
        return self._pins_of.get(reader, 0)

    def ttl(self, lease: Lease, now: float) -> float:
        return max(0.0, lease.deadline - now)

    def next_deadline(self) -> float:
        """A time at or before the earliest at which :meth:`tick` can end something (inf when nothing is
        held); O(1) amortised."""
        heap = self._heap
        while heap and not self._current(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else float("inf")

    # ---- events ----------------------------------------------------------------------------------
    def register(self, req_id: str, blocks: Any, attempt: int, now: float,
                 lease_s: float | None = None, reads: int = 1, nbytes: int = 0) -> list[Effect]:
        """Hold ``blocks`` (``nbytes`` bytes on this rank) for ``attempt`` of ``req_id`` until ``reads``
        claims are settled (or it expires); a live lease of the same id is REPLACED."""
        effects: list[Effect] = []
        old = self.leases.get(req_id)
        if old is not None:
            effects += self._end(old, LeaseState.REPLACED)
        ls = self.lease_s if lease_s is None else float(lease_s)
        if int(nbytes) < 0:
            raise ValueError(f"a lease holds at least 0 bytes, not {nbytes}")
        lease = self.leases[req_id] = Lease(req_id, blocks, int(attempt), ls, now, now + ls,
                                            now + max(ls, self.pin_s), nbytes=int(nbytes), reads=self._reads(reads))
        self._schedule(lease)
        self._ended.pop((req_id, int(attempt)), None)
        return effects

    def expect(self, req_id: str, attempt: int, reads: int, now: float) -> bool:
        """The live lease of ``attempt`` of ``req_id`` must now see ``reads`` claims settled before it is
        FREED (only ever raised: a lower count changes nothing). Its deadline moves to at least ``now +
        lease_s`` (the new reader gets a full lease to come). False (nothing changes) if no such lease is live:
        ended, another attempt, or not registered."""
        want = self._reads(reads)
        lease = self.leases.get(req_id)
        if lease is None or lease.attempt != attempt:
            return False
        if want > lease.reads:
            lease.reads = want
            lease.deadline = max(lease.deadline, min(now + lease.lease_s, lease.hold_until))
        return True

    def _reads(self, reads: int) -> int:
        """At least 1; more than ``max_reads`` (the claims a lease takes) counts as ``max_reads``."""
        reads = int(reads)
        if reads < 1:
            raise ValueError(f"a lease expects at least 1 read, not {reads}")
        return min(reads, self.max_reads)

    def _lookup(self, req_id: str, attempt: int, read_id: str) -> Lease | LeaseRefused:
        lease = self.leases.get(req_id)
        if lease is not None and lease.attempt == attempt:
            return lease
        if (req_id, attempt) in self._ended:
            return LeaseRefused(req_id, attempt, read_id, Code.LEASE_EXPIRED,
                           f"request {req_id!r} attempt {attempt} ended ({self._ended[(req_id, attempt)].value}); "
                           "its blocks may be reused: do not read them")
        if lease is not None:  # held under another attempt: a stale or wrong attempt, not a future one
            return LeaseRefused(req_id, attempt, read_id, Code.LEASE_EXPIRED,
                           f"request {req_id!r} is held under another attempt than {attempt} (re-registered, or a "
                           "wrong attempt id); do not read it")
        return LeaseRefused(req_id, attempt, read_id, Code.NOT_REGISTERED,
                       f"request {req_id!r} attempt {attempt} is not registered (yet) on this prefill rank; the "
                       "prefill engine registers a request when its step ends: retry briefly")

    def acquire(self, req_id: str, attempt: int, reader: Reader, read_id: str, readers: int,
                now: float) -> LeaseGranted | LeaseRefused:
        """Pin the lease for ``(reader, read_id)`` (or refresh that pin); refused: nothing changes."""
        got = self._lookup(req_id, attempt, read_id)
        if isinstance(got, LeaseRefused):
            return got
        lease = got
        key: PinKey = (reader, read_id)
        ckey: ClaimKey = (reader[0], read_id)
        claim = lease.claims.get(ckey)
        bad = self._bad_count(lease, claim, readers)
        if bad:
            return LeaseRefused(req_id, attempt, read_id, Code.BAD_REQUEST, bad)
        if claim is not None and (reader[1] in claim.settled or lease.claim_settled(ckey)):
            return LeaseRefused(req_id, attempt, read_id, Code.DONE,
                           f"decode rank {reader[1]} of {reader[0]!r} already finished read {read_id!r} of "
                           f"{req_id!r}; a new read needs a new read id")
        pin = lease.pins.get(key)
        if pin is None:
            pin = lease.pins[key] = Pin(reader, read_id, now, now, now, now)
            self._pins_of[reader] = self._pins_of.get(reader, 0) + 1
            if claim is None:
                lease.claims[ckey] = Claim(readers)
            _fire(lease, LeaseEvent.PIN)
        self._refresh(lease, pin, now)
        self._schedule(lease)
        return LeaseGranted(req_id, attempt, read_id, max(0.0, pin.deadline - now))

    def heartbeat(self, req_id: str, attempt: int, reader: Reader, read_id: str, now: float,
                  progress: tuple[int, int] | None = None) -> LeaseGranted | LeaseRefused:
        """A decode still wants this read: refresh its pin (``progress``: the read's bytes ``(done,
        inflight)`` so far, see the module docstring), or (a request queued at the decode, no pin) push
        the lease's deadline to ``now + lease_s`` (never past ``hold_until``). Never pins."""
        got = self._lookup(req_id, attempt, read_id)
        if isinstance(got, LeaseRefused):
            return got
        lease = got
        pin = lease.pins.get((reader, read_id))
        if pin is not None:
            if progress is not None:
                self._progress(lease, pin, progress, now)
            self._refresh(lease, pin, now)
            return LeaseGranted(req_id, attempt, read_id, max(0.0, pin.deadline - now))
        claim = lease.claims.get((reader[0], read_id))
        if claim is not None and reader[1] in claim.settled:
            return LeaseRefused(req_id, attempt, read_id, Code.DONE,
                           f"decode rank {reader[1]} of {reader[0]!r} already finished read {read_id!r}")
        lease.deadline = max(lease.deadline, min(now + lease.lease_s, lease.hold_until))
        return LeaseGranted(req_id, attempt, read_id, max(0.0, lease.deadline - now))

    def release(self, req_id: str, attempt: int, reader: Reader, read_id: str, readers: int, ok: bool,
                now: float) -> tuple[Outcome, list[Effect]]:
        """The holder of pin ``(reader, read_id)`` is done with it (``ok``: it read everything)."""
        lease = self.leases.get(req_id)
        if lease is None:
            return Outcome.UNKNOWN, []
        if lease.attempt != attempt:
            return Outcome.STALE, []
        key: PinKey = (reader, read_id)
        if key not in lease.pins:
            return Outcome.NOT_HOLDER, []
        ckey: ClaimKey = (reader[0], read_id)
        claim = lease.claims[ckey]
        if readers != claim.readers:
            return Outcome.BAD_COUNT, []
        effects = self._unpin(lease, key)
        claim.settled[reader[1]] = bool(ok)
        lease.deadline = max(lease.deadline, now + lease.lease_s)  # the claim's other ranks may still come
        effects += self._settle(lease)
        self._schedule(lease)
        return Outcome.RELEASED, effects

    def decline(self, req_id: str, attempt: int, reader: Reader, read_id: str, readers: int, ok: bool,
                now: float) -> tuple[Outcome, list[Effect]]:
        """``reader`` holds no pin for ``read_id`` and settles its part of the claim without reading: it
        has nothing to read here (``ok``), or its request was aborted or rejected before it read. Frees
        the lease only if that leaves no pin held and every claim settled."""
        lease = self.leases.get(req_id)
        if lease is None:
            return Outcome.UNKNOWN, []
        if lease.attempt != attempt:
            return Outcome.STALE, []
        if (reader, read_id) in lease.pins:
            return Outcome.HOLDER, []
        ckey: ClaimKey = (reader[0], read_id)
        claim = lease.claims.get(ckey)
        if self._bad_count(lease, claim, readers):
            return Outcome.BAD_COUNT, []
        if claim is None:
            claim = lease.claims[ckey] = Claim(readers)
        if reader[1] in claim.settled:
            return Outcome.DUPLICATE, []
        claim.settled[reader[1]] = bool(ok)
        lease.deadline = max(lease.deadline, now + lease.lease_s)
        effects = self._settle(lease)
        self._schedule(lease)
        return Outcome.DECLINED, effects

    def tick(self, now: float) -> list[Effect]:
        """Time out pins (their part of the claim settles as failed) and unpinned leases. Costs O(log n)
        per lease whose deadline heap entry is due, nothing per other live lease."""
        effects: list[Effect] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if not self._current(entry):
                continue
            lease = entry[2]
            lease.wake = float("inf")
            effects += self._time_out(lease, now)
            self._schedule(lease)
        if len(heap) > 2 * len(self.leases) + 64:  # entries of ended leases and superseded ones
            self._rebuild()
        return effects

    def _time_out(self, lease: Lease, now: float) -> list[Effect]:
        effects: list[Effect] = []
        timed_out = [k for k, p in lease.pins.items() if p.deadline <= now]
        for key in timed_out:
            effects += self._unpin(lease, key)
            claim = lease.claims[(key[0][0], key[1])]
            claim.settled.setdefault(key[0][1], False)
        if timed_out:
            ended = self._settle(lease, LeaseState.EXPIRED)
            if ended:
                return effects + ended
        if not lease.pins and lease.deadline <= now:
            effects += self._end(lease, LeaseState.EXPIRED)
        return effects

    # ---- the deadline heap -----------------------------------------------------------------------
    @staticmethod
    def _wake(lease: Lease) -> float:
        """When :meth:`tick` can next change ``lease``: its first pin's deadline, or (no pin) its own."""
        if lease.pins:
            return min(p.deadline for p in lease.pins.values())
        return lease.deadline

    def _current(self, entry: tuple[float, int, Lease]) -> bool:
        lease = entry[2]
        return lease.wake == entry[0] and self.leases.get(lease.req_id) is lease

    def _schedule(self, lease: Lease) -> None:
        """``lease`` changed: give it a heap entry if it may now be due earlier than its current one."""
        if self.leases.get(lease.req_id) is not lease:
            return
        w = self._wake(lease)
        if w < lease.wake:
            lease.wake = w
            heapq.heappush(self._heap, (w, next(self._seq), lease))

    def _rebuild(self) -> None:
        self._heap = []
        for lease in self.leases.values():
            lease.wake = float("inf")
            self._schedule(lease)

    # ---- internals -------------------------------------------------------------------------------
    def pin_bound_at(self, lease: Lease, pin: Pin) -> float:
        """No pin outlives this time (its *bound*)."""
        return pin.pinned_at + pin_bound_s(lease.nbytes, self.pin_s, self.min_read_rate)

    def _refresh(self, lease: Lease, pin: Pin, now: float) -> None:
        """The holder showed itself at ``now``: the pin holds to the earliest of its idle, stall and bound
        times (never earlier than it already did)."""
        pin.refreshed_at = max(pin.refreshed_at, now)
        stall = pin.progress_at + self.pin_s + pin.inflight / self.min_read_rate
        pin.deadline = max(pin.deadline, min(pin.refreshed_at + self.pin_idle_s, stall, self.pin_bound_at(lease, pin)))

    @staticmethod
    def _progress(lease: Lease, pin: Pin, progress: tuple[int, int], now: float) -> None:
        """Record a progress report: more bytes done than before is progress (at ``now``); ``inflight``
        counts at most the bytes of the lease not reported done."""
        done, inflight = (max(0, int(x)) for x in progress)
        if lease.nbytes:
            done = min(done, lease.nbytes)
        if done > pin.done:
            pin.done, pin.progress_at = done, now
        pin.inflight = min(inflight, max(0, lease.nbytes - pin.done))

    def _bad_count(self, lease: Lease, claim: Claim | None, readers: int) -> str:
        if readers < 1:
            return f"readers must be >= 1, got {readers}"
        if claim is not None and claim.readers != readers:
            return f"readers {readers} disagrees with the read's {claim.readers}"
        if claim is None and len(lease.claims) >= self.max_reads:
            return f"request {lease.req_id!r} has {len(lease.claims)} reads already (at most {self.max_reads})"
        return ""

    def _unpin(self, lease: Lease, key: PinKey, ending: bool = False) -> list[Effect]:
        """End pin ``key``; the last one unpins the lease (unless the lease itself is ``ending``)."""
        del lease.pins[key]
        left = self._pins_of[key[0]] - 1
        if left:
            self._pins_of[key[0]] = left
        else:
            del self._pins_of[key[0]]
        if not lease.pins and not ending:
            _fire(lease, LeaseEvent.UNPIN)
        return [PinEnded(lease.req_id, key)]

    def _settle(self, lease: Lease, how: LeaseState = LeaseState.FREED) -> list[Effect]:
        if lease.pins or len(lease.claims) < lease.reads or not all(lease.claim_settled(k) for k in lease.claims):
            return []
        return self._end(lease, how)

    def _end(self, lease: Lease, state: LeaseState) -> list[Effect]:
        effects: list[Effect] = [self._unpin(lease, k, ending=True)[0] for k in list(lease.pins)]
        _fire(lease, _ENDING[state])
        if self.leases.get(lease.req_id) is lease:
            del self.leases[lease.req_id]
        self._ended[(lease.req_id, lease.attempt)] = state
        while len(self._ended) > self._ended_cap:
            self._ended.popitem(last=False)
        return effects + [LeaseEnded(lease.req_id, lease.attempt, state)]


def _fire(lease: Lease, event: LeaseEvent) -> None:
    """The one place a lease's state changes: a cell of :data:`TRANSITIONS`."""
    lease.state = step(TRANSITIONS, lease.state, event, "lease")


@dataclass
class _Bound:
    agent: str
    last_seen: float


class ReaderTable:
    """Decode readers this prefill rank handshook with: identity ``(decode engine, decode rank)`` bound
    to the NIXL agent it named, bounded without evicting live readers.

    A handshake (:meth:`bind`) with the agent already bound refreshes it. One with another agent rebinds
    only if the bound reader is idle (holds no pin and was not seen for ``idle_s``): a third party cannot
    take over a live reader's identity (its Done notifications would be ignored) by sending one frame.
    A full table evicts the longest-idle reader holding no pin; if every reader is live the handshake is
    refused (``TOO_MANY_READERS``), never a live reader evicted."""

    def __init__(self, cap: int = MAX_READERS, idle_s: float = READER_IDLE_S) -> None:
        self.cap, self.idle_s = cap, idle_s
        self._by_id: OrderedDict[Reader, _Bound] = OrderedDict()   # least recently seen first

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, reader: object) -> bool:
        return reader in self._by_id

    def agent_of(self, reader: Reader) -> str | None:
        b = self._by_id.get(reader)
        return None if b is None else b.agent

    def touch(self, reader: Reader, now: float) -> None:
        b = self._by_id.get(reader)
        if b is not None:
            b.last_seen = now
            self._by_id.move_to_end(reader)

    def bind(self, reader: Reader, agent: str, now: float, pins_held: Callable[[Reader], int]) -> Code | None:
        b = self._by_id.get(reader)
        if b is not None:
            if b.agent != agent and (pins_held(reader) or now - b.last_seen < self.idle_s):
                return Code.IDENTITY_IN_USE
            b.agent = agent
            self.touch(reader, now)
            return None
        if len(self._by_id) >= self.cap:
            victim = next((r for r, x in self._by_id.items()
                           if not pins_held(r) and now - x.last_seen >= self.idle_s), None)
            if victim is None:
                return Code.TOO_MANY_READERS
            del self._by_id[victim]
        self._by_id[reader] = _Bound(agent, now)
        return None
