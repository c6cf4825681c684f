"""In-process reference transport: one agent that reads from its own registered memory.

A :class:`~kvbridge.transport.loopback.LoopbackTransport` whose every peer name means itself: prefill and
decode buffers are registered on the one transport and descriptor pairs are performed as copies between
them (with :func:`kvbridge.staging.copy_runs`). Every descriptor is bounds-checked against the registered
regions first (like NIXL's ``NIXL_ERR_NOT_FOUND``), so a lowering bug is an error, never a stray write.
"""
from __future__ import annotations

from .loopback import LoopbackRegistry, LoopbackTransport


class ReferenceTransport(LoopbackTransport):
    name = "reference"

    def __init__(self, agent: str = "ref") -> None:
        super().__init__(agent, LoopbackRegistry())
        self.agent = agent

    def _peer(self, name: str) -> LoopbackTransport:  # any peer name reads this agent's own memory
        return self
