"""The read of one request from one prefill rank, as an explicit state machine.

Everything that changes a read's state is in :data:`TRANSITIONS` (``state -> event -> next state``);
a missing entry is an illegal transition and raises :class:`~kvbridge.errors.IllegalTransition`
naming the event and the state. The machine does no I/O: the decode rank feeds it events and acts on
the state it returns.

::

    ACQUIRING ──GRANTED──▶ POSTED ──COMPLETED──▶ DONE
    STAGE_REQUESTED ──STAGE_SEGMENT──▶ STAGING ──STAGE_LAST──▶ SCATTERING ──COMPLETED──▶ DONE
    STAGE_REQUESTED ──STAGE_LAST──▶ SCATTERING           (one segment, or nothing to read)
    STAGE_REQUESTED ──STAGE_FULL──▶ POSTED               (no staging room: read directly, under the pin)
    any live state ──REFUSED | NIXL_ERROR | PROTOCOL_ERROR | DISCONNECT | TIMEOUT──▶ FAILED
    any live state ──ABORT──▶ CANCELLED                  (aborted, or another rank of the request failed)

DONE, FAILED and CANCELLED are terminal.
"""
from __future__ import annotations

import enum

from ..errors import IllegalTransition


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
    S.ACQUIRING: {E.GRANTED: S.POSTED, **_FAIL},
    S.STAGE_REQUESTED: {E.STAGE_SEGMENT: S.STAGING, E.STAGE_LAST: S.SCATTERING, E.STAGE_FULL: S.POSTED, **_FAIL},
    S.POSTED: {E.COMPLETED: S.DONE, **_FAIL},
    S.STAGING: {E.STAGE_SEGMENT: S.STAGING, E.STAGE_LAST: S.SCATTERING, **_FAIL},
    S.SCATTERING: {E.COMPLETED: S.DONE, **_FAIL},
    S.DONE: {},
    S.FAILED: {},
    S.CANCELLED: {},
}
TERMINAL = frozenset(s for s, t in TRANSITIONS.items() if not t)
# waiting for the prefill to answer on the side channel (a frozen prefill shows up here first)
AWAITING_REPLY = frozenset({S.ACQUIRING, S.STAGE_REQUESTED, S.STAGING})


def next_state(state: ReadState, event: ReadEvent) -> ReadState:
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise IllegalTransition(f"read state machine: event {event.name} is not allowed in state {state.name} "
                                f"(allowed: {sorted(e.name for e in TRANSITIONS.get(state, {}))})") from None


class ReadMachine:
    """State of one (request, prefill rank) read; :meth:`fire` applies one event."""

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
        return f"ReadMachine({self.state.name})"
