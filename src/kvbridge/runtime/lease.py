"""The prefill's leases as a sans-IO state machine with per-reader pins (issue 20, point 1).

A *lease* holds one attempt of a request's blocks on one prefill rank::

    RESERVED ──acquire──▶ PINNED ──last pin released, every claim (at least ``reads``) settled──▶ FREED
    RESERVED ──deadline (no pin)──▶ EXPIRED            PINNED ──last pin timed out──▶ EXPIRED
    any live state ──register() of the same request id──▶ REPLACED

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
  that reader's release (its ``Done``), or by timing out: ``pin_idle_s`` after it was last refreshed
  (an acquire or heartbeat for the same pin), and at most ``pin_s`` after it was created. A refused
  acquire creates no pin.
* A *claim* ``(decode engine, read_id)`` gathers the ``readers`` decode ranks of that engine that
  notify this prefill rank (from the transfer plan). Each of them settles its part once: by releasing
  its pin (``ok`` or failed), or by *declining* (a rank with nothing to read here, or a request aborted
  before it read: a reader that holds no pin for the read). A claim is settled when all its ranks
  settled, or when one of them failed and no pin of the claim is held.

The rules the property test (``tests/test_lease.py``) checks:

1. a lease never ends (FREED/EXPIRED) while a pin on it is held and not timed out;
2. it is FREED when no pin is held, at least ``reads`` claims exist and every claim is settled; it is
   EXPIRED when it holds no pin and its deadline passed (``lease_s`` after registration, after the last
   heartbeat of a queued request, or after the last release of a claim still waiting for other ranks);
3. a release of a pin the sender does not hold, a message for another attempt, a decline of a read the
   sender holds a pin for, a second settlement of the same part, or a readers count that disagrees with
   the claim's has no effect at all.
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Rank = tuple[int, int]
Reader = tuple[str, Rank]            # (decode engine id, decode rank)
PinKey = tuple[Reader, str]          # (reader, read_id)
ClaimKey = tuple[str, str]           # (decode engine id, read_id)


# claims one lease takes at most (router retries, hedges and vLLM n > 1 children together)
MAX_READS = 64


class LeaseState(enum.Enum):
    RESERVED = "reserved"
    PINNED = "pinned"
    FREED = "freed"
    EXPIRED = "expired"
    REPLACED = "replaced"


TERMINAL = frozenset({LeaseState.FREED, LeaseState.EXPIRED, LeaseState.REPLACED})


class Refusal(str, enum.Enum):
    """Why the prefill refused an acquire, stage request, heartbeat or handshake (the wire ``code``)."""

    NOT_REGISTERED = "not_registered"      # no lease for this attempt yet: the decode retries, bounded
    LEASE_EXPIRED = "lease_expired"        # the attempt's lease ended (freed, expired, replaced)
    RESTARTED = "restarted"                # the prefill process is not the one the reader handshook with
    UNKNOWN_READER = "unknown_reader"      # no handshake from this reader (or from another agent)
    DONE = "done"                          # this reader already settled its part of this read
    BAD_REQUEST = "bad_request"            # readers < 1, a readers count that disagrees, too many reads
    IDENTITY_IN_USE = "identity_in_use"    # GetMeta claims a live reader's identity with another agent
    TOO_MANY_READERS = "too_many_readers"  # the reader table is full of live readers


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
class Granted:
    req_id: str
    attempt: int
    read_id: str
    ttl_s: float   # seconds the pin (or, for a heartbeat of an unpinned lease, the lease) still holds


@dataclass(frozen=True)
class Refused:
    req_id: str
    attempt: int
    read_id: str
    code: Refusal
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
    deadline: float


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
    state: LeaseState = LeaseState.RESERVED
    reads: int = 1                       # claims expected before it may be FREED (vLLM n > 1: n)
    pins: dict[PinKey, Pin] = field(default_factory=dict)
    claims: dict[ClaimKey, Claim] = field(default_factory=dict)
    staged: set[Any] = field(default_factory=set)  # IO layer: staging slot keys held for this lease

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

    ``lease_s``: default lease of a registration; ``pin_s``: hard cap of a pin from its creation (and of
    heartbeats of a queued request from its registration); ``pin_idle_s``: a pin not refreshed for this
    long ends (a dead decode's pins end on this scale; default ``lease_s``); ``max_reads``: claims per
    lease; ``ended_cap``: how many ended (request, attempt) pairs are remembered to tell "expired" from
    "not registered yet"."""

    def __init__(self, lease_s: float = 30.0, pin_s: float = 120.0, pin_idle_s: float | None = None,
                 max_reads: int = MAX_READS, ended_cap: int = 1 << 16):
        self.lease_s, self.pin_s = float(lease_s), float(pin_s)
        self.pin_idle_s = float(lease_s if pin_idle_s is None else pin_idle_s)
        self.max_reads, self._ended_cap = max_reads, ended_cap
        self.leases: dict[str, Lease] = {}
        self._ended: OrderedDict[tuple[str, int], LeaseState] = OrderedDict()
        self._pins_of: dict[Reader, int] = {}   # reader -> pins it holds (all leases)

    # ---- queries ---------------------------------------------------------------------------------
    def get(self, req_id: str) -> Lease | None:
        return self.leases.get(req_id)

    def pins_held(self, reader: Reader) -> int:
        return self._pins_of.get(reader, 0)

    def ttl(self, lease: Lease, now: float) -> float:
        return max(0.0, lease.deadline - now)

    def next_deadline(self) -> float:
        """The earliest time :meth:`tick` can end something (inf when nothing is held)."""
        out = float("inf")
        for lease in self.leases.values():
            out = min([out, *(p.deadline for p in lease.pins.values())] if lease.pins else [out, lease.deadline])
        return out

    # ---- events ----------------------------------------------------------------------------------
    def register(self, req_id: str, blocks: Any, attempt: int, now: float,
                 lease_s: float | None = None, reads: int = 1) -> list[Effect]:
        """Hold ``blocks`` for ``attempt`` of ``req_id`` until ``reads`` claims are settled (or it
        expires); a live lease of the same id is REPLACED."""
        effects: list[Effect] = []
        old = self.leases.get(req_id)
        if old is not None:
            effects += self._end(old, LeaseState.REPLACED)
        ls = self.lease_s if lease_s is None else float(lease_s)
        self.leases[req_id] = Lease(req_id, blocks, int(attempt), ls, now, now + ls, now + max(ls, self.pin_s),
                                    reads=self._reads(reads))
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

    def _lookup(self, req_id: str, attempt: int, read_id: str) -> Lease | Refused:
        lease = self.leases.get(req_id)
        if lease is not None and lease.attempt == attempt:
            return lease
        if (req_id, attempt) in self._ended:
            return Refused(req_id, attempt, read_id, Refusal.LEASE_EXPIRED,
                           f"request {req_id!r} attempt {attempt} ended ({self._ended[(req_id, attempt)].value}); "
                           "its blocks may be reused: do not read them")
        if lease is not None:  # held under another attempt: a stale or wrong attempt, not a future one
            return Refused(req_id, attempt, read_id, Refusal.LEASE_EXPIRED,
                           f"request {req_id!r} is held under another attempt than {attempt} (re-registered, or a "
                           "wrong attempt id); do not read it")
        return Refused(req_id, attempt, read_id, Refusal.NOT_REGISTERED,
                       f"request {req_id!r} attempt {attempt} is not registered (yet) on this prefill rank; the "
                       "prefill engine registers a request when its step ends: retry briefly")

    def acquire(self, req_id: str, attempt: int, reader: Reader, read_id: str, readers: int,
                now: float) -> Granted | Refused:
        """Pin the lease for ``(reader, read_id)`` (or refresh that pin); refused: nothing changes."""
        got = self._lookup(req_id, attempt, read_id)
        if isinstance(got, Refused):
            return got
        lease = got
        key: PinKey = (reader, read_id)
        ckey: ClaimKey = (reader[0], read_id)
        claim = lease.claims.get(ckey)
        bad = self._bad_count(lease, claim, readers)
        if bad:
            return Refused(req_id, attempt, read_id, Refusal.BAD_REQUEST, bad)
        if claim is not None and (reader[1] in claim.settled or lease.claim_settled(ckey)):
            return Refused(req_id, attempt, read_id, Refusal.DONE,
                           f"decode rank {reader[1]} of {reader[0]!r} already finished read {read_id!r} of "
                           f"{req_id!r}; a new read needs a new read id")
        pin = lease.pins.get(key)
        if pin is None:
            pin = lease.pins[key] = Pin(reader, read_id, now, now)
            self._pins_of[reader] = self._pins_of.get(reader, 0) + 1
            if claim is None:
                lease.claims[ckey] = Claim(readers)
            lease.state = LeaseState.PINNED
        pin.deadline = max(pin.deadline, min(pin.pinned_at + self.pin_s, now + self.pin_idle_s))
        return Granted(req_id, attempt, read_id, max(0.0, pin.deadline - now))

    def heartbeat(self, req_id: str, attempt: int, reader: Reader, read_id: str, now: float) -> Granted | Refused:
        """A decode still wants this read: refresh its pin, or (a request queued at the decode, no pin)
        push the lease's deadline to ``now + lease_s`` (never past ``hold_until``). Never pins."""
        got = self._lookup(req_id, attempt, read_id)
        if isinstance(got, Refused):
            return got
        lease = got
        pin = lease.pins.get((reader, read_id))
        if pin is not None:
            pin.deadline = max(pin.deadline, min(pin.pinned_at + self.pin_s, now + self.pin_idle_s))
            return Granted(req_id, attempt, read_id, max(0.0, pin.deadline - now))
        claim = lease.claims.get((reader[0], read_id))
        if claim is not None and reader[1] in claim.settled:
            return Refused(req_id, attempt, read_id, Refusal.DONE,
                           f"decode rank {reader[1]} of {reader[0]!r} already finished read {read_id!r}")
        lease.deadline = max(lease.deadline, min(now + lease.lease_s, lease.hold_until))
        return Granted(req_id, attempt, read_id, max(0.0, lease.deadline - now))

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
        return Outcome.RELEASED, effects + self._settle(lease)

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
        return Outcome.DECLINED, self._settle(lease)

    def tick(self, now: float) -> list[Effect]:
        """Time out pins (their part of the claim settles as failed) and unpinned leases."""
        effects: list[Effect] = []
        for lease in list(self.leases.values()):
            timed_out = [k for k, p in lease.pins.items() if p.deadline <= now]
            for key in timed_out:
                effects += self._unpin(lease, key)
                claim = lease.claims[(key[0][0], key[1])]
                claim.settled.setdefault(key[0][1], False)
            if timed_out:
                ended = self._settle(lease, LeaseState.EXPIRED)
                effects += ended
                if ended:
                    continue
            if not lease.pins and lease.deadline <= now:
                effects += self._end(lease, LeaseState.EXPIRED)
        return effects

    # ---- internals -------------------------------------------------------------------------------
    def _bad_count(self, lease: Lease, claim: Claim | None, readers: int) -> str:
        if readers < 1:
            return f"readers must be >= 1, got {readers}"
        if claim is not None and claim.readers != readers:
            return f"readers {readers} disagrees with the read's {claim.readers}"
        if claim is None and len(lease.claims) >= self.max_reads:
            return f"request {lease.req_id!r} has {len(lease.claims)} reads already (at most {self.max_reads})"
        return ""

    def _unpin(self, lease: Lease, key: PinKey) -> list[Effect]:
        del lease.pins[key]
        left = self._pins_of[key[0]] - 1
        if left:
            self._pins_of[key[0]] = left
        else:
            del self._pins_of[key[0]]
        if not lease.pins and lease.state is LeaseState.PINNED:
            lease.state = LeaseState.RESERVED
        return [PinEnded(lease.req_id, key)]

    def _settle(self, lease: Lease, how: LeaseState = LeaseState.FREED) -> list[Effect]:
        if lease.pins or len(lease.claims) < lease.reads or not all(lease.claim_settled(k) for k in lease.claims):
            return []
        return self._end(lease, how)

    def _end(self, lease: Lease, state: LeaseState) -> list[Effect]:
        effects: list[Effect] = [self._unpin(lease, k)[0] for k in list(lease.pins)]
        lease.state = state
        if self.leases.get(lease.req_id) is lease:
            del self.leases[lease.req_id]
        self._ended[(lease.req_id, lease.attempt)] = state
        while len(self._ended) > self._ended_cap:
            self._ended.popitem(last=False)
        return effects + [LeaseEnded(lease.req_id, lease.attempt, state)]


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

    def __init__(self, cap: int = 4096, idle_s: float = 60.0):
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

    def bind(self, reader: Reader, agent: str, now: float, pins_held: Callable[[Reader], int]) -> Refusal | None:
        b = self._by_id.get(reader)
        if b is not None:
            if b.agent != agent and (pins_held(reader) or now - b.last_seen < self.idle_s):
                return Refusal.IDENTITY_IN_USE
            b.agent = agent
            self.touch(reader, now)
            return None
        if len(self._by_id) >= self.cap:
            victim = next((r for r, x in self._by_id.items()
                           if not pins_held(r) and now - x.last_seen >= self.idle_s), None)
            if victim is None:
                return Refusal.TOO_MANY_READERS
            del self._by_id[victim]
        self._by_id[reader] = _Bound(agent, now)
        return None
