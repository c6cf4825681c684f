"""Driving a decode rank from a background thread, for an engine whose own loop only steps now and then:
:class:`DecodeDriver` (the decode side's mirror of :class:`~kvbridge.runtime.server.PrefillServer`).

A decode rank does its work when :meth:`~kvbridge.runtime.decode.DecodeRank.poll` runs: a granted pin
becomes a posted READ, a staged segment's reply a READ of it, a completed READ a scatter or a finished read.
Driven from an engine's step alone (a vLLM worker's ``get_finished``), each of those waits for the next
step: a read then takes two or three steps (tens of milliseconds on a loaded CPU engine) whatever its
bytes. The driver's thread sleeps on the rank's one poller (every side channel, the transport's wake-up fd
that a post's or a scatter's end writes, and its own wake-up fd) and polls the rank when one of them
fires, or when the earliest deadline of a read in flight comes; with nothing in flight it sleeps up to
``IDLE_S``. What finished or failed is kept until the engine's thread takes it with :meth:`poll`.

Every use of the rank goes through one lock: the driver's thread holds it while it polls; the engine's
thread calls the rank through :attr:`rank`, a view whose every method call holds it (attributes such as
``metrics`` are read as they are).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .wakeup import Wakeup

if TYPE_CHECKING:
    from ..errors import ReadFailure
    from .decode import DecodeRank

log = logging.getLogger(__name__)
IDLE_S = 0.5  # the driver's longest sleep with nothing in flight
IDLE_POLL_S = 1.0  # how often the engine's poll() polls an idle rank (its housekeeping)


class _Locked:
    """``rank``'s methods, each called holding ``lock``; anything else read as it is."""

    def __init__(self, rank: DecodeRank, lock: threading.RLock, kick: Any) -> None:
        self._rank, self._lock, self._kick = rank, lock, kick

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._rank, name)
        if not callable(attr):
            return attr
        lock, kick = self._lock, self._kick

        def locked(*args: Any, **kwargs: Any) -> Any:
            with lock:
                out = attr(*args, **kwargs)
                kick()  # (a new read: the driver's sleep may now be too long)
            return out
        locked.__name__ = name
        return locked


class DecodeDriver:
    """Poll ``rank`` (a :class:`~kvbridge.DecodeEndpoint`) from a background thread as its events happen
    (see the module docstring). Use the rank through :attr:`rank`; take finished and failed reads with
    :meth:`poll`; :meth:`close` stops the thread and closes the rank."""

    def __init__(self, rank: DecodeRank) -> None:
        self._rank = rank
        self._lock = threading.RLock()
        self._done: list[str] = []
        self._failed: dict[str, ReadFailure] = {}
        self._stop = threading.Event()
        self._wake = Wakeup()
        rank.peers.poller.add_fd(self._wake.fd)
        self._idle_poll_at = 0.0  # poll(): when an idle rank is polled from the engine's thread next
        self._until = 0.0  # when the thread's current sleep ends (monotonic; set under the lock before it sleeps)
        self.kicks = 0  # wake-ups the engine's calls asked for (tests read them)
        self.rank: Any = _Locked(rank, self._lock, self._kick)
        self.wakeups = 0  # times the thread woke up (tests read the idle rate)
        self._thread = threading.Thread(target=self._run, name=f"kvbridge-decode-{rank.engine_id}", daemon=True)
        self._thread.start()

    def poll(self) -> tuple[list[str], dict[str, ReadFailure]]:
        """Reads finished and failed since the previous call (the driver's and this poll's own)."""
        with self._lock:
            # an idle rank is polled here about once a second (its housekeeping: idle peers evicted, a side
            # channel's disconnect taken), not on every engine step: the driver's thread takes every event
            now = time.monotonic()
            done: list[str] = []
            failed: dict[str, ReadFailure] = {}
            if self._rank.busy or now >= self._idle_poll_at:
                done, failed = self._rank.poll()
                self._idle_poll_at = now + IDLE_POLL_S
            out_done, out_failed = self._done + done, {**self._failed, **failed}
            self._done, self._failed = [], {}
            self._kick()  # (this poll may have started work: retries, heartbeats)
        return out_done, out_failed

    def _pause(self, now: float) -> float:
        """The seconds the thread may sleep with no event, as the rank stands (call holding the lock)."""
        rank = self._rank
        if rank.peers.poller.pending():  # a reply no descriptor announces: poll again now
            return 0.0
        if not rank.busy:
            return IDLE_S
        return max(0.0, min(IDLE_S, rank.next_wake(now)))

    def _kick(self) -> None:
        """After the engine's thread used the rank (holding the lock): wake the driver's thread only where
        its sleep would now end too late (a reply no descriptor announces, a deadline before its wake-up).
        A wake-up it does not need costs the engine's thread a turn of the driver's (the GIL) on its step."""
        now = time.monotonic()
        if now + self._pause(now) < self._until:
            self.kicks += 1
            self._wake.set()

    def _turn(self) -> float:
        """Poll the rank if it has work; the seconds the thread may then sleep with no event."""
        rank = self._rank
        clear = getattr(rank.transport, "clear_wake", None)
        if clear is not None:
            clear()  # before looking: a post that ends from here on makes the fd readable again
        self._wake.clear()
        # (readable with nothing in flight: a late answer, e.g. the grant of a read completed on its lease's
        # tag; left on its socket, it would wake this thread at once, again and again)
        if rank.busy or rank.peers.poller.readable():
            done, failed = rank.poll()
            self._done += done
            self._failed.update(failed)
        return self._pause(time.monotonic())

    def _run(self) -> None:
        poller = self._rank.peers.poller
        while not self._stop.is_set():
            try:
                with self._lock:
                    if self._stop.is_set():
                        break
                    pause = self._turn()
                    self._until = time.monotonic() + pause
            except Exception:  # noqa: BLE001 - the driver must outlive one bad turn (the engine's poll sees it)
                log.exception("kvbridge: decode driver")
                pause = IDLE_S
                self._until = time.monotonic() + pause
            if pause > 0:
                poller.wait(pause)
                self.wakeups += 1

    @contextlib.contextmanager
    def held(self) -> Iterator[DecodeRank]:
        """The rank itself, under the driver's lock for the whole ``with`` block: an engine's step that makes
        several calls (connect, start, release, flush) takes the lock once and wakes the driver at most once,
        at the end, instead of once per call (each wake-up a turn of the driver's thread that the next call
        then waits for)."""
        with self._lock:
            yield self._rank
            self._kick()

    def close(self) -> None:
        """Stop the thread, then close the rank."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        with self._lock:
            self._rank.close()
        self._wake.close()
