"""What the decode side knows of a request (:class:`ReadRequest`, public) and of a read in flight."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..lower import GroupBlocks
from ..plan import Rank
from .peer import Peer
from .readmachine import RankRead


@dataclass(frozen=True)
class ReadRequest:
    """What the decode side knows of a request (vLLM's kv_transfer_params).

    ``attempt``: the lease's attempt id that ``PrefillRank.add_request`` returned (the same on every
    prefill rank when the engine passes one; or a mapping prefill rank -> attempt). The decode never
    sees a lease time: the prefill alone decides, on its own clock, whether the attempt is still live.
    ``read_id``: see :attr:`key`.
    """

    req_id: str
    engine_id: str
    num_tokens: int
    prefill_blocks: dict[str, GroupBlocks]
    decode_blocks: dict[str, GroupBlocks]
    attempt: int | dict[Any, int] = 0
    read_id: str = ""

    @property
    def key(self) -> str:
        """This read's id on the decode side and the prefill's pin: ``read_id`` (the decode engine's own
        request id, the same on all of its ranks), or ``req_id`` when none is given. Several reads of one
        prefill request (vLLM ``n > 1``, retries, hedges) need distinct read ids; :meth:`DecodeRank.poll`,
        :meth:`~DecodeRank.abort` and :meth:`~DecodeRank.release` name a read by this key."""
        return self.read_id or self.req_id

    def attempt_for(self, prefill_rank: Rank) -> int:
        a = self.attempt
        if isinstance(a, dict):
            return int(a.get(tuple(prefill_rank), 0))
        return int(a or 0)


@dataclass
class InFlight:
    """A read in flight on this decode rank: the request, its peer, one machine per prefill rank."""

    req: ReadRequest
    peer: Peer
    ranks: dict[Rank, RankRead]  # one read machine per prefill rank
    started: float
    nbytes: int = 0
    ndescs: int = 0
    stage_sent: float = 0.0
    # perf_counter_ns of the end of each phase (metrics.DECODE_PHASES; index 0: start), the latest over
    # its prefill ranks; 0: not reached (readloop.py records them, observed when the read completes)
    marks: list[int] = field(default_factory=lambda: [0] * 8)
    # no other read of this rank was in flight when it started (``seq``: its start's number; the loop knows
    # whether one started after it): only such reads' times are their own, a path's fixed cost is learned
    # from them (cost.PathFigures.overhead_us)
    alone: bool = True
    seq: int = 0

    @property
    def xfers(self) -> list[Any]:
        return [r.xfer for rr in self.ranks.values() for r in rr.reads]
