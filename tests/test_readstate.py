"""Every cell of the read state machine's transition table (``runtime/readstate.py``), without sockets:
each (state, event) pair either moves to the state the table names or raises IllegalTransition naming
both; terminal states accept nothing; every live state can fail, time out and be aborted."""
from __future__ import annotations

import itertools

import pytest

from kvbridge.errors import IllegalTransition
from kvbridge.runtime.readstate import AWAITING_REPLY, TERMINAL, TRANSITIONS, ReadEvent, ReadMachine, ReadState


@pytest.mark.parametrize("state, event", list(itertools.product(ReadState, ReadEvent)))
def test_every_cell(state, event):
    m = ReadMachine(state)
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
        m = ReadMachine(ReadState.ACQUIRING if path[0] is ReadEvent.GRANTED else ReadState.STAGE_REQUESTED)
        for e in path:
            m.fire(e)
        assert m.state is ReadState.DONE and m.terminal
