"""The read of one request from one prefill rank, as an explicit state machine.

Everything that changes a read's state is in :data:`TRANSITIONS` (``state -> event -> next state``);
a missing entry is an illegal transition and raises :class:`~kvbridge.errors.IllegalTransition`
naming the event and the state (:func:`~kvbridge.runtime.machine.step`, shared with the peer and the
lease). The machine does no I/O (h11's pattern): :class:`RankRead` owns all of one read's state (its
deadlines, pin, staging slot and posted transfers) and :meth:`RankRead.handle` takes one frozen event
(built from a ZMQ frame or a NIXL state by the decode rank's I/O loop, in one place) and returns the
actions the loop must run (post a read, send a request, notify the prefill, fail the request); the
loop never changes the read's fields itself. This module is the machine's vocabulary (table, events,
actions); the machine is ``readmachine.py``.

::

    ACQUIRING ──GRANTED──▶ POSTED ──COMPLETED──▶ DONE
    ACQUIRING ──CHECKED──▶ POSTED                        (optimistic: the lease's tag proved it live)
    STAGE_REQUESTED ──STAGE_SEGMENT──▶ STAGING ──STAGE_LAST──▶ SCATTERING ──COMPLETED──▶ DONE
    STAGE_REQUESTED ──STAGE_LAST──▶ SCATTERING           (one segment, or nothing to read)
    STAGE_REQUESTED ──STAGE_FULL──▶ POSTED               (no staging room: read directly, under the pin)
    any live state ──REFUSED | NIXL_ERROR | PROTOCOL_ERROR | DISCONNECT | TIMEOUT──▶ FAILED
    any live state ──ABORT──▶ CANCELLED                  (aborted, or another rank of the request failed)

DONE, FAILED and CANCELLED are terminal.

With ``DecodeConfig.optimistic_reads`` a direct read posts its READ in ACQUIRING already, as its acquire
goes out (:class:`Sent`); it completes only in POSTED, i.e. once GRANTED, or once CHECKED: its READ ended
and a READ of the lease's tag after it found the lease still live (``runtime/tags.py``; ``RankRead``
states the soundness rules).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ReadFailure
from .machine import step as step  # the transition helper of every machine here (re-exported)
from .machine import terminal_states

if TYPE_CHECKING:
    from ..transport.base import DirectRead


class ReadState(enum.Enum):
    ACQUIRING = "acquiring"              # direct: asked the prefill to pin the lease, no answer yet
    STAGE_REQUESTED = "stage_requested"  # staged: stage request sent (it pins the lease), no segment yet
    POSTED = "posted"                    # direct read posted under a granted pin
    STAGING = "staging"                  # staged: some segments announced and being read, more to come
    SCATTERING = "scattering"            # staged: every segment announced; reads and scatters finishing
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ReadEvent(enum.Enum):
    GRANTED = "granted"                # the prefill pinned the lease for this attempt
    CHECKED = "checked"                # optimistic: the READ ended, then the lease's tag was read, still live
    REFUSED = "refused"                # the prefill refused (lease gone, other attempt, restarted)
    STAGE_SEGMENT = "stage_segment"    # a packed segment was announced (not the last)
    STAGE_LAST = "stage_last"          # the last packed segment was announced
    STAGE_FULL = "stage_full"          # no staging room (theirs or ours): read directly
    COMPLETED = "completed"            # every read (and scatter) of this rank finished
    NIXL_ERROR = "nixl_error"          # the transport failed a read
    PROTOCOL_ERROR = "protocol_error"  # the prefill's answer does not match this rank's lowering
    DISCONNECT = "disconnect"          # the prefill rank's agent went away
    TIMEOUT = "timeout"                # no progress from this rank within its deadline
    ABORT = "abort"                    # the request was aborted, or another rank of it failed


S, E = ReadState, ReadEvent
_FAIL = {E.REFUSED: S.FAILED, E.NIXL_ERROR: S.FAILED, E.PROTOCOL_ERROR: S.FAILED, E.DISCONNECT: S.FAILED,
         E.TIMEOUT: S.FAILED, E.ABORT: S.CANCELLED}

TRANSITIONS: dict[ReadState, dict[ReadEvent, ReadState]] = {
    S.ACQUIRING: {E.GRANTED: S.POSTED, E.CHECKED: S.POSTED, **_FAIL},
    S.STAGE_REQUESTED: {E.STAGE_SEGMENT: S.STAGING, E.STAGE_LAST: S.SCATTERING, E.STAGE_FULL: S.POSTED, **_FAIL},
    S.POSTED: {E.COMPLETED: S.DONE, **_FAIL},
    S.STAGING: {E.STAGE_SEGMENT: S.STAGING, E.STAGE_LAST: S.SCATTERING, **_FAIL},
    S.SCATTERING: {E.COMPLETED: S.DONE, **_FAIL},
    S.DONE: {},
    S.FAILED: {},
    S.CANCELLED: {},
}
TERMINAL = terminal_states(TRANSITIONS)
# waiting for the prefill to answer on the side channel (a frozen prefill shows up here first)
AWAITING_REPLY = frozenset({S.ACQUIRING, S.STAGE_REQUESTED, S.STAGING})


def next_state(state: ReadState, event: ReadEvent) -> ReadState:
    return step(TRANSITIONS, state, event, "read")


class ReadStateCell:
    """The state of one (request, prefill rank) read and nothing else: :meth:`fire` moves it by one cell of
    :data:`TRANSITIONS`. The read's machine is :class:`~kvbridge.runtime.readmachine.RankRead`, which holds
    one of these beside its pin, deadlines and transfers."""

    __slots__ = ("state",)

    def __init__(self, state: ReadState):
        self.state = state

    def fire(self, event: ReadEvent) -> ReadState:
        self.state = next_state(self.state, event)
        return self.state

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def __repr__(self) -> str:
        return f"ReadStateCell({self.state.name})"


# ---- events: what happened (frozen; the decode rank builds them from ZMQ frames and NIXL states) -------
@dataclass(frozen=True, slots=True)
class Sent:
    """The acquire/stage request went out: a pin may exist on the prefill from now on (an optimistic
    direct read posts its READ now, right behind its first acquire)."""


@dataclass(frozen=True, slots=True)
class Granted:
    """The prefill pinned the lease for this read (an ``Acquired.granted`` entry)."""

    ttl_s: float


@dataclass(frozen=True, slots=True)
class Refreshed:
    """A heartbeat was answered: the pin holds ``ttl_s`` from when the heartbeat went out."""

    ttl_s: float


@dataclass(frozen=True, slots=True)
class Refused:
    """The prefill refused the acquire (an ``Acquired.refused`` entry): no pin was made."""

    code: str
    text: str


@dataclass(frozen=True, slots=True)
class Segment:
    """A packed segment was announced (``Staged``)."""

    total: int
    offset: int
    nbytes: int
    addr: int
    last: bool
    ttl_s: float


@dataclass(frozen=True, slots=True)
class StageFailed:
    """The stage request was answered with an error (``StageError``)."""

    code: str
    text: str
    expired: bool
    ttl_s: float


@dataclass(frozen=True, slots=True)
class AlignRetry:
    """Another read of the same prefill request asks this rank again at ``at``: ask together."""

    at: float


@dataclass(frozen=True, slots=True)
class Checked:
    """The READ of the lease's tag bucket, posted after every READ of this rank ended, settled: ``live``,
    the tag was there (the lease had not ended when the READs did); False: not there, or the READ failed."""

    live: bool


@dataclass(frozen=True, slots=True)
class XferDone:
    """Transfer ``index`` of :attr:`RankRead.reads` completed (NIXL state DONE)."""

    index: int


@dataclass(frozen=True, slots=True)
class XferFailed:
    """The transport failed a transfer for another reason than a disconnect; ``index``: which one of
    :attr:`RankRead.reads` (None: not known)."""

    text: str
    index: int | None = None


@dataclass(frozen=True, slots=True)
class ScatterDone:
    index: int


@dataclass(frozen=True, slots=True)
class ScatterFailed:
    text: str


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: retries, heartbeats, completion and deadlines. ``peer_progress``: the last time any
    read from this prefill rank completed; ``queued_locally``: an unfinished transfer of this read is
    still in our own post queue (the clock stops: a long local queue is not the peer's fault);
    ``posted_latest``: the latest time one of its unfinished transfers was posted."""

    peer_progress: float = 0.0
    queued_locally: bool = False
    posted_latest: float = float("-inf")


@dataclass(frozen=True, slots=True)
class Failed:
    """The loop failed this read: ``event`` (DISCONNECT, REFUSED, ...) with a failure of ``kind``."""

    event: ReadEvent
    kind: type[ReadFailure]
    text: str


@dataclass(frozen=True, slots=True)
class Abort:
    """The request was aborted, or another rank of it failed."""


@dataclass(frozen=True, slots=True)
class PinsReleased:
    """The loop sent the Done that releases this read's pin (or a release of a pin it may hold)."""


Event = (Sent | Granted | Refreshed | Refused | Segment | StageFailed | AlignRetry | XferDone | XferFailed
         | ScatterDone | ScatterFailed | Tick | Failed | Abort | PinsReleased | Checked)

# events that never change a read's state (named non-transitions: they go through no table entry). Each
# updates the read's own fields only: XferDone (a transfer completed: scatter it, or read again after
# discarded optimistic bytes), ScatterDone (a scatter finished), Sent (a request went out: a pin may exist;
# an optimistic read posts its READ), PinsReleased (the Done releasing its pin was sent), Refreshed (a
# heartbeat answered: the pin's deadline moves), AlignRetry (ask again together with a sibling read).
# Completion, failure and timeouts are the Tick's and the other events' (tests/test_readstate.py checks
# that none of these changes the state, in any state).
NON_TRANSITIONS: frozenset[type] = frozenset({XferDone, ScatterDone, Sent, PinsReleased, Refreshed, AlignRetry})


# ---- actions: what the I/O loop must do -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ask:
    """Ask the prefill rank again: queue an acquire (``stage`` False) or re-send the stage request."""

    stage: bool


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Queue a heartbeat for this read's pin."""


@dataclass(frozen=True, slots=True)
class Post:
    """Post ``transfer`` (a direct read of ``transfer.work``; its Done rides on it unless ``notify`` is
    False: an optimistic read, posted before its pin, whose Done goes out when the request completes)."""

    transfer: Transfer
    notify: bool = True


@dataclass(frozen=True, slots=True)
class PostSegment:
    """Read a packed segment at the prefill's ``addr`` into our staging at ``local`` (no notification)."""

    transfer: Transfer
    addr: int
    local: int
    host: bool = False  # host staging on both sides (the host-staged path)


@dataclass(frozen=True, slots=True)
class Check:
    """Optimistic, not granted yet, every READ ended: READ the lease's tag bucket from the prefill rank (the
    loop answers :class:`Checked`; it posts nothing if the rank has no tags or no bucket buffer is free,
    and the read waits for the grant)."""


@dataclass(frozen=True, slots=True)
class Scatter:
    """Scatter a read staged segment from staging into the KV memory."""

    transfer: Transfer


@dataclass(frozen=True, slots=True)
class Landed:
    """The push path: the prefill WROTE a segment into our staging (its Staged says so); count it and
    scatter it (no READ is posted)."""

    transfer: Transfer


@dataclass(frozen=True, slots=True)
class Notify:
    """Send Done (ok) to this prefill rank: it releases our pin."""


@dataclass(frozen=True, slots=True)
class LetGo:
    """A pin was granted for this read after it stopped needing it: release it (once)."""


@dataclass(frozen=True, slots=True)
class Restarted:
    """The prefill rank answered "restarted": the loop re-queues the request or fails it."""

    text: str


@dataclass(frozen=True, slots=True)
class Retry:
    """Refused "not registered yet": asked again at ``at`` (the loop aligns other reads of the request)."""

    at: float


@dataclass(frozen=True, slots=True)
class Fail:
    """The read failed (the machine took the failing event): the loop fails the request."""

    kind: type[ReadFailure]
    text: str


@dataclass(frozen=True, slots=True)
class Count:
    """Add one to the decode rank's counter ``name`` (``staging_fallbacks``, ``staged_transfers``, ...)."""

    name: str


Action = (Ask | Heartbeat | Post | PostSegment | Scatter | Landed | Notify | LetGo | Restarted | Retry | Fail | Count
          | Check)


@dataclass(eq=False)
class Transfer:
    """One posted READ of this read. The machine creates it; the I/O loop stores its I/O handles in the
    slots named below (``xfer``, ``scatter``) and reports on them through events.

    ``cancelled`` is checked on the post thread before anything is handed to the transport's library."""

    work: DirectRead | None = None  # direct: what to post; sizes counted at completion
    nbytes: int | None = None  # staged: the segment's bytes
    slot: int | None = None    # staged: our staging offset of the segment
    runs: tuple[Any, Any] | None = None  # staged: (dst, nbytes) of the runs this segment scatters to
    host: bool = False         # staged: READ into host staging (copied to device staging before the scatter)
    xfer: Any = None           # the transport's handle (set by the loop when posted; None: pushed, no READ)
    scatter: Any = None        # the scatter's Future (set by the loop)
    done: bool = False         # the transfer completed
    scattered: bool = False    # staged: the scatter finished
    cancelled: bool = False
    # optimistic: READ before the pin and refused "not registered": its bytes are not trusted; it only has
    # to settle (``done`` then means ended, completed or failed) before a fresh READ into the same blocks
    discard: bool = False

    @property
    def finished(self) -> bool:
        return self.done and (self.runs is None or self.scattered)

    @property
    def size(self) -> int:
        """Bytes this transfer reads (a direct work item's are counted when first asked)."""
        if self.nbytes is not None:
            return self.nbytes
        return int(getattr(self.work, "total_bytes", 0) or 0)
