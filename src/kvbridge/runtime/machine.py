"""The one transition helper of kvbridge's state machines (the read, the peer and the lease).

Each machine is one table ``state -> event -> next state`` (a missing entry is an illegal transition)
and changes its state only through :func:`step`, so a table is the whole truth of what can happen to it.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

from ..errors import IllegalTransition

_S = TypeVar("_S", bound=enum.Enum)
_E = TypeVar("_E", bound=enum.Enum)


def step(table: Mapping[_S, Mapping[_E, _S]], state: _S, event: _E, machine: str) -> _S:
    """``table[state][event]``; an event the state does not accept raises :class:`IllegalTransition` naming
    ``machine``, the event, the state and what it accepts."""
    try:
        return table[state][event]
    except KeyError:
        raise IllegalTransition(f"{machine} state machine: event {event.name} is not allowed in state {state.name} "
                                f"(allowed: {sorted(e.name for e in table.get(state, {}))})") from None


def terminal_states(table: Mapping[_S, Mapping[_E, _S]]) -> frozenset[_S]:
    """The states of ``table`` that accept no event."""
    return frozenset(s for s, t in table.items() if not t)
