"""The read of one (request, prefill rank) as a sans-IO machine (h11's pattern).

:class:`RankRead` owns all of a read's state: its :class:`~kvbridge.runtime.readstate.ReadStateCell`
(every state change goes through ``readstate.TRANSITIONS``), its pin and deadlines (this process's
monotonic clock), its staging slot and its posted transfers. :meth:`RankRead.handle` takes one event of
``readstate`` and returns the actions the decode rank's I/O loop must run; nothing else changes it.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import LeaseExpired, NotRegistered, ReadFailure, RemoteError, TransferFailed, TransferTimeout
from ..modes import TransferPath
from ..staging import RunSlice, offsets, run_lengths
from .lease import MIN_READ_RATE
from .protocol import REFUSALS as REFUSALS  # re-exported: the read loop tells pinning answers by it
from .protocol import Code
from .readstate import (
    AWAITING_REPLY,
    Abort,
    Action,
    AlignRetry,
    Ask,
    Check,
    Checked,
    Count,
    Event,
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
    ReadStateCell,
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

# ---- the machine --------------------------------------------------------------------------------------
MAX_BEATS = 16  # unanswered heartbeats remembered per read
@dataclass
class Staging:
    """Our staging slot of a staged rank and the runs the packed stream feeds."""

    slot: int
    dst: Any       # the request's descriptors (run destinations on this side, in packed order)
    nbytes: Any
    starts: Any    # offset of each run in the packed stream


@dataclass(frozen=True)
class ReadContext:
    """What every read of a decode rank shares: its timeouts, staging allocator and staging address.
    ``min_read_rate``: the slowest read accepted (bytes per second): a transfer in flight has its bytes
    at this rate beyond ``transfer_timeout_s`` (NIXL reports no bytes until a transfer ends), as the
    prefill holds its pin."""

    stage_timeout_s: float
    transfer_timeout_s: float
    register_grace_s: float
    slots: Any            # SlotAllocator
    staging_addr: int
    min_read_rate: float = MIN_READ_RATE
    host_staging_addr: int = 0  # host staging (mirrors the staging buffer's slots): the host-staged path
    optimistic: bool = False    # DecodeConfig.optimistic_reads: direct READs posted beside the acquire




class RankRead:
    """The read of one request from one prefill rank: state, pin, deadlines (this process's monotonic
    clock), staging slot and posted transfers. :meth:`handle` is the only way in.

    ``work``: the lowered work item of a direct rank (None: nothing to read, pin and release);
    ``lower``: returns this rank's lowered descriptors, called at most once (a staged rank's first
    segment); ``request``: the stage request the
    loop re-sends on a "not registered" refusal; ``slot_key``: its key in the staging allocator;
    ``push_slot``: the push path's staging slot, allocated before the stage request named it (the
    prefill WRITEs the packed stream there); ``direct``: a staged rank's direct read (a
    :class:`~kvbridge.transport.base.DirectRead` through the prepared lists, or None: nothing to read),
    made only if its staging is full, and posted as a direct rank's work is.

    **Optimistic reads** (``ctx.optimistic``, ``DecodeConfig.optimistic_reads``; direct ranks only): when
    the first acquire goes out (:class:`Sent`) the READ is posted at once, beside it, before any pin (the
    acquire first: the READ's copy, on the post thread, must not delay it). A grant proves the
    lease was alive when the prefill pinned it, hence ever since its registration (a lease never comes
    back), and the read started after its parameters were issued, which the prefill does only once the
    blocks hold the request's KV and stay held (``add_request`` registers first; vLLM's scheduler keeps
    the blocks from ``request_finished`` on): so a granted READ touched live blocks only. The rules:

    * the read is reported done (COMPLETED, then Done to the prefill) only when BOTH the pin is granted
      and every transfer completed; a transfer completing before the grant waits for the grant (it stays
      ACQUIRING; completion happens in POSTED only), and the pin's deadline applies to it as to any read;
    * the optimistic READ carries no notification: its Done is sent by the loop when the request
      completes, and only for a granted pin (``notify_at_end`` and ``pinned``), as a staged read's;
    * refused "not registered" (retried within ``register_grace_s``): the transfer's bytes are discarded
      (``Transfer.discard``); once it has settled (completed or failed) and the pin is granted, a fresh
      READ is posted into the same blocks, never while the discarded one may still write them;
    * any other refusal (expired, done, unknown attempt, restarted: the loop's decision) fails typed as
      before; the transfer in flight is cancelled (never posted if the post thread has not reached it)
      and the loop parks its handle until it settles, as for every failed read with a posted transfer;
    * abort, timeout and disconnect: as for a posted read (cancelled, parked until settled);
    * heartbeats, progress and the pin's deadline are unchanged once granted; staged paths unchanged;
    * **checked** (``runtime/tags.py``): once every READ ended with no grant yet, the loop READs the lease's
      tag from the prefill rank (:class:`Check`); found (:class:`Checked` ``live``), the lease had not
      ended when those READs did, which proves what a grant proves: the read moves to POSTED (CHECKED) and
      completes with no pin. Its acquire is still out and no Done is sent at completion: the grant,
      when it comes, is let go as a success (released ``ok``), which settles this reader's part; a Done
      sent before the pin could settle it unpinned and free a lease that vLLM ``n > 1`` siblings, whose
      acquires are batched to pin together, still need. A late refusal changes nothing. Not found, or the
      check's READ failed: nothing changes, the grant decides."""

    def __init__(self, prefill: tuple[int, int], state: ReadState, now: float, ctx: ReadContext, *,
                 work: Any = None, lower: Callable[[], Any] | None = None, request: Any = None,
                 slot_key: Hashable = None, push_slot: int | None = None,
                 direct: Callable[[], Any] | None = None):
        self.prefill, self.ctx = prefill, ctx
        self.sm = ReadStateCell(state)
        self.sent_at = now               # when the acquire/stage request was made: the pin counts from here
        self.progress_at = now           # last progress from this rank (its own deadline re-arms only on it)
        self.first_sent = now            # the first request (not-registered retries count from here)
        self.work = work                 # direct: posted once the pin is granted
        self._direct = direct            # staged: this rank's direct read, should its staging be full
        self._lower, self._lowered = lower, None
        self.request, self.slot_key = request, slot_key
        # the path this rank's bytes take: a stage request names it (device or host staging), else direct
        self.path = (
            TransferPath(getattr(request, "path", TransferPath.STAGED)) if request is not None else TransferPath.DIRECT
        )
        self.pin_deadline = float("inf")
        self.reads: list[Transfer] = []
        self.staging: Staging | None = None
        # the prefill answered its last word on the stage request (the last Staged, or a StageError): on
        # the push path no WRITE of it can land in our slot after that
        self.answered_last = False
        if push_slot is not None:
            d = self.lowered()
            lengths = run_lengths(d)
            self.staging = Staging(push_slot, d, lengths, offsets(lengths))
        self.early = False               # its READ went out before a pin (optimistic_reads)
        self.notify_at_end = False       # no read carries this rank's Done: send it when the request completes
        self.pinned = False              # the prefill granted this rank's pin (only then is a Done sent for it)
        self.checked = False             # optimistic: the lease's tag proved the READs' blocks live (no pin)
        self.asked = state is ReadState.STAGE_REQUESTED  # a request is out, unanswered (a pin may exist)
        self.retry_at: float | None = None  # not registered yet: ask again at this time
        self.refresh_at = float("inf")   # pinned: send a heartbeat (re-arms the pin) at this time
        self.refresh_sent = 0.0          # when the last heartbeat (or the request that pinned) went out
        # heartbeats out and unanswered, oldest first: an answer counts from the oldest one (the prefill answers
        # each in order; an answer credited to a later send would outlive the prefill's own pin), else from
        # ``refresh_base``, the send time the last answer counted from
        self.beats: list[float] = []
        self.refresh_base = 0.0
        # no Tick can change anything before this time (0: tick at the next poll); every other event resets
        # it, a Tick sets it from the read's own deadlines: the loop skips idle reads' ticks
        self.wake_at = 0.0

    @property
    def state(self) -> ReadState:
        return self.sm.state

    @property
    def terminal(self) -> bool:
        return self.sm.terminal

    def progress(self) -> tuple[int, int]:
        """Bytes ``(done, inflight)`` of this read: transfers finished, and transfers posted (or queued to
        post) and not finished; heartbeats carry it, and the prefill holds a progressing read's pin."""
        done = inflight = 0
        for t in self.reads:
            if t.done:
                done += 0 if t.discard else t.size
            elif not t.cancelled:
                inflight += t.size
        return done, inflight

    @property
    def early_only(self) -> bool:
        """No pin here, and every READ of this rank was posted before one (optimistic): nothing this read
        did is trusted yet, so it may start again elsewhere once those READs have settled."""
        return not self.pinned and not self.checked and self.early and all(t.work is not None for t in self.reads)

    @property
    def holds_nothing(self) -> bool:
        """No pin and no READ but optimistic ones: the read may be withdrawn and started again (a restart)."""
        return not self.pinned and (not self.reads or self.early_only)

    def lowered(self) -> Any:
        if self._lowered is None:
            assert self._lower is not None, "a staged rank needs its lowering"
            self._lowered = self._lower()
        return self._lowered

    def __repr__(self) -> str:
        return f"RankRead({self.prefill}, {self.state.name}, reads={len(self.reads)}, pinned={self.pinned})"

    # ---- the one entry point ----------------------------------------------------------------------
    def handle(self, ev: Event, now: float) -> list[Action]:
        """Apply one event at ``now``; returns what the I/O loop must do (one method per event type:
        ``_HANDLERS``)."""
        handler = _HANDLERS.get(type(ev))
        if handler is None:
            raise TypeError(f"not a read event: {ev!r}")
        if isinstance(ev, Tick):
            out = handler(self, ev, now)
            self.wake_at = self._next_wake()
            return out
        self.wake_at = 0.0
        return handler(self, ev, now)

    # ---- one method per event (``readstate.NON_TRANSITIONS``: those never change the state) ----------
    def _on_xfer_done(self, ev: XferDone, now: float) -> list[Action]:
        t = self.reads[ev.index]
        t.done, self.progress_at = True, now
        if t.discard:  # optimistic bytes refused "not registered": settled, read again if granted
            return self._repost()
        if t.runs is not None:
            return [Scatter(t)]
        return [Check()] if self._checkable() else []

    def _checkable(self) -> bool:
        """Optimistic, no answer yet, every READ ended and trusted if the lease was live: check its tag."""
        return (self.early and not self.pinned and self.state is ReadState.ACQUIRING and self.retry_at is None
                and bool(self.reads) and all(t.done and not t.discard and t.work is not None for t in self.reads))

    def _on_checked(self, ev: Checked, now: float) -> list[Action]:
        if not ev.live or not self._checkable():
            return []  # not proven (or answered meanwhile): the grant decides, as without tags
        self.checked = True
        self.sm.fire(ReadEvent.CHECKED)
        return [Count("checked_reads")]

    def _on_scatter_done(self, ev: ScatterDone, now: float) -> list[Action]:
        self.reads[ev.index].scattered = True
        return []

    def _on_sent(self, ev: Sent, now: float) -> list[Action]:
        if not self.terminal:
            self.asked = True
        return self._post_early()

    def _on_pins_released(self, ev: PinsReleased, now: float) -> list[Action]:
        self.pinned = self.asked = False
        return []

    def _on_refreshed(self, ev: Refreshed, now: float) -> list[Action]:
        if self.pinned and not self.terminal:
            base = self.beats.pop(0) if self.beats else self.refresh_base
            self.refresh_base = base
            self.pin_deadline = max(self.pin_deadline, base + ev.ttl_s)
            self.refresh_at = min(self.refresh_at, base + ev.ttl_s / 3) if self.beats else base + ev.ttl_s / 3
        return []

    def _on_refused(self, ev: Refused, now: float) -> list[Action]:
        if self.state is not ReadState.ACQUIRING or self.retry_at is not None:
            return []
        self.asked = False
        return self._not_registered(ev.code, now) or self._refused(ev.code, ev.text)

    def _on_align_retry(self, ev: AlignRetry, now: float) -> list[Action]:
        if self.retry_at is not None:
            self.retry_at = min(self.retry_at, ev.at)
        return []

    def _on_xfer_failed(self, ev: XferFailed, now: float) -> list[Action]:
        if ev.index is not None and not self.terminal and self.reads[ev.index].discard:
            self.reads[ev.index].done = True  # settled (failed): its bytes were discarded anyway
            return self._repost()
        if ev.index is not None and self.early_only and self.state is ReadState.ACQUIRING:
            # an optimistic READ failed before any pin: the acquire's answer decides (granted: read again,
            # once; refused or restarted: fail or re-queue as a read that never posted)
            t = self.reads[ev.index]
            t.discard = t.done = True
            return [Count("discarded_reads")]
        return self._fail(ReadEvent.NIXL_ERROR, TransferFailed, ev.text)

    def _on_scatter_failed(self, ev: ScatterFailed, now: float) -> list[Action]:
        return self._fail(ReadEvent.PROTOCOL_ERROR, ReadFailure, f"scatter failed: {ev.text}")

    def _on_failed(self, ev: Failed, now: float) -> list[Action]:
        return self._fail(ev.event, ev.kind, ev.text)

    def _on_abort(self, ev: Abort, now: float) -> list[Action]:
        if self.terminal:
            return []
        self.sm.fire(ReadEvent.ABORT)
        return self._cancel()

    # ---- the cases ---------------------------------------------------------------------------------
    def _fail(self, event: ReadEvent, kind: type[ReadFailure], text: str) -> list[Action]:
        self.sm.fire(event)
        return self._cancel() + [Fail(kind, text)]

    def _cancel(self) -> list[Action]:
        """Ended without completing: direct reads not finished are cancelled (one the post thread has not
        reached yet is never handed to the transport's library)."""
        out: list[Action] = []
        for t in self.reads:
            if t.work is not None and not t.done and not t.cancelled:
                t.cancelled = True
                out.append(Count("cancelled_reads"))
        return out

    def _granted(self, ev: Granted, now: float) -> list[Action]:
        if self.state is not ReadState.ACQUIRING or self.retry_at is not None:
            return [LetGo()]  # a pin no live read of ours will use
        self.pinned, self.asked = True, False
        if ev.ttl_s <= 0:
            return self._fail(ReadEvent.REFUSED, LeaseExpired, "the pin was granted with no time left")
        self.sm.fire(ReadEvent.GRANTED)
        self.pin_deadline, self.progress_at = self.sent_at + ev.ttl_s, now
        self.refresh_sent, self.refresh_at = self.sent_at, self.sent_at + ev.ttl_s / 3
        self.beats, self.refresh_base = [], self.sent_at
        if self.reads:  # optimistic: the READ is posted already (or its bytes were discarded: read again)
            return self._repost()
        if self.work is None:  # nothing to read from this rank: release the pin at once
            self.pinned = False
            self.sm.fire(ReadEvent.COMPLETED)
            return [Notify()]
        t = Transfer(work=self.work)
        self.work = None
        self.reads.append(t)
        return [Post(t)]

    def _not_registered(self, code: str, now: float) -> list[Action]:
        """A refusal "not registered yet": ask again shortly, within ``register_grace_s`` of the first try.
        No pin exists and nothing is sent meanwhile; an optimistic READ's bytes are discarded."""
        if code != Code.NOT_REGISTERED or now - self.first_sent >= self.ctx.register_grace_s:
            return []
        self.retry_at = now + min(0.1, 0.005 * 2 ** min(5, int((now - self.first_sent) / 0.02)))
        self.progress_at = now
        out: list[Action] = [Count("register_retries"), Retry(self.retry_at)]
        for t in self.reads:  # (only an optimistic read has transfers while it asks)
            if not t.discard:
                t.discard = True
                out.append(Count("discarded_reads"))
        return out

    def _post_early(self) -> list[Action]:
        """Optimistic: post the direct READ now, before the pin (see the class docstring); its Done goes
        out when the request completes, for a granted pin only."""
        if not self.ctx.optimistic or self.state is not ReadState.ACQUIRING or self.work is None or self.reads:
            return []
        t = Transfer(work=self.work)
        self.work, self.notify_at_end, self.early = None, True, True
        self.reads.append(t)
        return [Count("optimistic_reads"), Post(t, notify=False)]

    def _repost(self) -> list[Action]:
        """Optimistic, granted: nothing to do while a trusted READ exists; if every READ so far was
        discarded ("not registered") and all have settled, post a fresh one into the same blocks."""
        if self.state is not ReadState.POSTED or not all(t.discard and t.done for t in self.reads):
            return []
        t = Transfer(work=self.reads[-1].work)
        self.reads.append(t)
        return [Post(t, notify=False)]

    def _refused(self, code: str, text: str) -> list[Action]:
        if code == Code.RESTARTED:
            return [Restarted(text)]
        if code == Code.NOT_REGISTERED:
            return self._fail(ReadEvent.REFUSED, NotRegistered,
                              f"{text} (asked for {self.ctx.register_grace_s:g} s: register_grace_s)")
        if code in (Code.LEASE_EXPIRED, Code.DONE):
            return self._fail(ReadEvent.REFUSED, LeaseExpired, text)
        return self._fail(ReadEvent.REFUSED, RemoteError, f"[{code}] {text}")

    def _stage_reply(self, ev: Segment | StageFailed, now: float) -> list[Action]:
        pins = isinstance(ev, Segment) or ev.code not in REFUSALS
        if isinstance(ev, StageFailed) or ev.last:
            self.answered_last = True
        if self.state not in (ReadState.STAGE_REQUESTED, ReadState.STAGING) or self.retry_at is not None:
            # failed or aborted meanwhile, or fell back to direct reads: a pin made for a read no longer
            # live here is released (once)
            return [LetGo()] if pins and self.terminal else []
        self.progress_at = now
        self.pinned, self.asked = self.pinned or pins, False
        if isinstance(ev, StageFailed):
            if self.state is ReadState.STAGE_REQUESTED:
                retry = self._not_registered(ev.code, now)
                if retry:
                    return retry
            if ev.expired or ev.code in REFUSALS:
                return self._refused(ev.code or Code.LEASE_EXPIRED, ev.text)
            if self.state is ReadState.STAGE_REQUESTED and ev.ttl_s > 0:  # no room: read directly, pinned
                self.pin_deadline = self.sent_at + ev.ttl_s
                self.refresh_sent, self.refresh_at = self.sent_at, self.sent_at + ev.ttl_s / 3
                self.beats, self.refresh_base = [], self.sent_at
                return self._direct_fallback()
            return self._fail(ReadEvent.REFUSED, RemoteError, ev.text)
        out: list[Action] = []
        if self.state is ReadState.STAGE_REQUESTED:  # first segment
            first = self._first_segment(ev, now)
            if first is not None:
                return first
            out.append(Count("staged_transfers"))
            if self.path is TransferPath.HOST:
                out.append(Count("host_staged_transfers"))
            elif self.path is TransferPath.PUSH:
                out.append(Count("pushed_transfers"))
        st = self.staging
        if st is None:
            return out
        a, b = (int(i) for i in np.searchsorted(st.starts, [ev.offset, ev.offset + ev.nbytes]))
        if (ev.offset + ev.nbytes > ev.total or a >= st.starts.size or st.starts[a] != ev.offset
                or int(st.nbytes[a:b].sum()) != ev.nbytes):
            return out + self._fail(ReadEvent.PROTOCOL_ERROR, RemoteError,
                                    f"the prefill sent a segment [{ev.offset}, +{ev.nbytes}) that does not start "
                                    "and end on run boundaries of this rank's lowering")
        self.sm.fire(ReadEvent.STAGE_LAST if ev.last else ReadEvent.STAGE_SEGMENT)
        if self.path is TransferPath.PUSH:  # the prefill WROTE it into our slot already: scatter it
            t = Transfer(nbytes=int(ev.nbytes), slot=st.slot + ev.offset, runs=(RunSlice(st.dst, "dst", a, b),
                                                                                 st.nbytes[a:b]), done=True)
            self.reads.append(t)
            return out + [Landed(t)]
        # no notification on segment reads: Done is sent once every segment is read (the prefill frees
        # its staging slot on Done, and segments may complete out of order)
        host = self.path is TransferPath.HOST
        t = Transfer(
            nbytes=int(ev.nbytes),
            slot=st.slot + ev.offset,
            runs=(RunSlice(st.dst, "dst", a, b), st.nbytes[a:b]),
            host=host,
        )
        self.reads.append(t)
        base = self.ctx.host_staging_addr if host else self.ctx.staging_addr
        return out + [PostSegment(t, ev.addr, base + st.slot + ev.offset, host)]

    def _first_segment(self, ev: Segment, now: float) -> list[Action] | None:
        """The first segment's answer: pin deadline, heartbeats, and (staged) our staging slot. None to go
        on with the segment; else the actions that end the answer here."""
        self.refresh_sent, self.refresh_at = self.sent_at, self.sent_at + max(ev.ttl_s, 0.0) / 3
        self.beats, self.refresh_base = [], self.sent_at
        if ev.total == 0 and self.staging is None:
            self.notify_at_end = True  # nothing to read: Done goes out when the request completes
            self.pin_deadline = now + 1e9  # nothing read: nothing to trust
            self.sm.fire(ReadEvent.STAGE_LAST)
            return []
        d = self.lowered()
        if d.total_bytes != ev.total:
            return self._fail(ReadEvent.PROTOCOL_ERROR, RemoteError,
                              f"the prefill packed {ev.total} B but this rank expects {d.total_bytes} B: "
                              "the two sides lower differently (same kvbridge release?)")
        if ev.ttl_s <= 0:
            return self._fail(ReadEvent.REFUSED, LeaseExpired, "staged with no pin time left")
        self.pin_deadline = self.sent_at + ev.ttl_s
        if self.staging is None:  # staged: our slot now (push: allocated before the stage request)
            off = self.ctx.slots.alloc(self.slot_key, ev.total)
            if off is None:  # our staging is full: read directly (under the pin), ignore the rest
                return self._direct_fallback()
            lengths = run_lengths(d)
            self.staging = Staging(off, d, lengths, offsets(lengths))
        self.notify_at_end = True
        return None

    def _direct_fallback(self) -> list[Action]:
        self.sm.fire(ReadEvent.STAGE_FULL)
        self.path = TransferPath.DIRECT
        out: list[Action] = [Count("staging_fallbacks")]
        w = self._direct() if self._direct is not None else None  # through the prepared lists, as a direct rank
        if w is not None and w.nonempty:
            t = Transfer(work=w)
            self.reads.append(t)
            out.append(Post(t))
        else:
            self.notify_at_end = True
        return out

    def _tick(self, ev: Tick, now: float) -> list[Action]:
        if self.terminal:
            return []
        out: list[Action] = []
        if self.retry_at is not None:  # refused "not registered yet": nothing is held, nothing is sent
            if now < self.retry_at:
                return out
            self.retry_at, self.sent_at = None, now
            if self.state is ReadState.ACQUIRING:
                out.append(Ask(stage=False))
            elif self.request is not None:
                out.append(Ask(stage=True))
        if self.pinned and now >= self.refresh_at:  # keep our pin alive on the prefill (its idle timeout)
            self.refresh_sent = now
            if len(self.beats) < MAX_BEATS:  # (full: later answers count from older sends, never later ones)
                self.beats.append(now)
            self.refresh_at = now + max(0.05, (self.pin_deadline - now) / 2)  # again then if nobody answers
            out.append(Heartbeat())
        # (discarded optimistic bytes alone are never a finished read: a fresh READ follows them)
        finished = all(t.finished for t in self.reads) and not (self.reads and all(t.discard for t in self.reads))
        if finished and self.state in (ReadState.POSTED, ReadState.SCATTERING):
            if now > self.pin_deadline:  # the read ended after the pin the prefill granted: not trusted
                return out + self._fail(ReadEvent.TIMEOUT, LeaseExpired,
                                        "the read ended after the lease pin the prefill granted ran out; its "
                                        "blocks may have been reused, the data is not trusted")
            self.sm.fire(ReadEvent.COMPLETED)
            return out
        waiting = self.state in AWAITING_REPLY and not (self.state is ReadState.STAGING and not finished)
        limit = self.ctx.stage_timeout_s if waiting else \
            self.ctx.transfer_timeout_s + self.progress()[1] / self.ctx.min_read_rate
        if now - self._progress_ref(ev, now, waiting) > limit:
            what = ("did not answer the acquire/stage request within stage_timeout_s" if waiting
                    else "made no progress within transfer_timeout_s")
            return out + self._fail(ReadEvent.TIMEOUT, TransferTimeout,
                                    f"{what}={limit:g} s (state {self.state.name}; frozen, overloaded or "
                                    "unreachable)")
        if now > self.pin_deadline:
            return out + self._fail(ReadEvent.TIMEOUT, LeaseExpired,
                                    "the lease pin the prefill granted ran out before the read ended")
        return out

    def _next_wake(self) -> float:
        """The earliest time a Tick could act: a retry, a heartbeat, the pin's end, or the earliest a
        progress deadline can run out (peer progress and posting times only push those later)."""
        if self.terminal:
            return float("inf")
        if self.retry_at is not None:
            return self.retry_at
        wake = min(self.pin_deadline, self.progress_at + min(self.ctx.stage_timeout_s, self.ctx.transfer_timeout_s))
        return min(wake, self.refresh_at) if self.pinned else wake

    def _progress_ref(self, ev: Tick, now: float, waiting: bool) -> float:
        """When this read last showed the peer alive: its deadline runs from there. Waiting for an answer:
        the request or the last answer. Reading: the latest of the last progress, the last read completed
        from the same prefill rank, and the time each unfinished transfer was posted; a transfer still in
        our own post queue stops the clock."""
        if waiting:
            return self.progress_at
        if ev.queued_locally:
            return now
        return max(self.progress_at, ev.peer_progress, ev.posted_latest)


# event type -> its method of RankRead (every type of ``readstate.Event``: tests check the two agree)
_HANDLERS: dict[type, Callable[[RankRead, Any, float], list[Action]]] = {
    Tick: RankRead._tick,
    XferDone: RankRead._on_xfer_done,
    ScatterDone: RankRead._on_scatter_done,
    Sent: RankRead._on_sent,
    PinsReleased: RankRead._on_pins_released,
    Granted: RankRead._granted,
    Refreshed: RankRead._on_refreshed,
    Refused: RankRead._on_refused,
    Segment: RankRead._stage_reply,
    StageFailed: RankRead._stage_reply,
    AlignRetry: RankRead._on_align_retry,
    XferFailed: RankRead._on_xfer_failed,
    ScatterFailed: RankRead._on_scatter_failed,
    Failed: RankRead._on_failed,
    Abort: RankRead._on_abort,
    Checked: RankRead._on_checked,
}
