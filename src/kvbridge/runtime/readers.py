"""Reader authentication on a prefill rank: the decode readers it handshook with (each bound to the NIXL
agent it named, :class:`~kvbridge.runtime.lease.ReaderTable`) and the metadata digests this process
served (a reader that handshook with an earlier process is told it restarted)."""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from .lease import Rank, Reader, ReaderTable
from .lowerings import remember
from .metrics import Metrics
from .protocol import Code, ErrorReply


class ReaderAuth:
    """Who may read from this prefill rank: a reader is known by its handshake (:meth:`bind`, as the
    agent it named), and every later request and notification of it must come as that agent from a
    reader of this process (:meth:`check`)."""

    def __init__(self, rank: Rank, engine_id: str, metrics: Metrics, max_readers: int,
                 reader_idle_s: float) -> None:
        self.rank, self.engine_id, self.metrics = rank, engine_id, metrics
        # readers this rank handshook with: (decode engine, decode rank) bound to a NIXL agent (bounded,
        # never evicting a live reader)
        self.table = ReaderTable(max_readers, reader_idle_s)
        self.digests: OrderedDict[str, bool] = OrderedDict()  # metadata digests this process has served

    def check(self, reader: Reader, agent: str, incarnation: str) -> tuple[Code, str] | None:
        """None if ``reader`` (as ``agent``) may read from this process; else (code, message)."""
        if incarnation and incarnation not in self.digests:
            return Code.RESTARTED, (f"prefill rank {self.rank} of {self.engine_id!r} is not the process this "
                                       "decode rank handshook with (restarted); handshake again")
        bound = self.table.agent_of(reader)
        if bound is None or agent != bound:
            self.metrics.forged_messages += 1
            return Code.UNKNOWN_READER, (f"decode rank {reader[1]} of {reader[0]!r} has not handshaken with "
                                            f"prefill rank {self.rank} as agent {agent!r}; handshake first")
        self.table.touch(reader, time.monotonic())
        return None

    def bind(self, reader: Reader, agent: str, pins_held: Callable[[Reader], int]) -> ErrorReply | None:
        """Bind ``reader`` to ``agent`` at its handshake; the refusal to answer if it cannot be (a live
        reader's identity is never rebound to another agent, nor evicted by a flood of new ones)."""
        refusal = self.table.bind(reader, agent, time.monotonic(), pins_held)
        if refusal is None:
            return None
        self.metrics.forged_messages += refusal is Code.IDENTITY_IN_USE
        why = ("is bound to another NIXL agent that is still live" if refusal is Code.IDENTITY_IN_USE
               else f"cannot be added: {len(self.table)} live readers fill the table")
        return ErrorReply(f"decode rank {reader[1]} of {reader[0]!r} {why} on prefill rank {self.rank}; "
                          "use a distinct decode engine id per engine", code=refusal)

    def served(self, digest: str) -> None:
        """This process served metadata of this digest (its readers present it as their incarnation)."""
        remember(self.digests, digest, True, 8)
