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

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from .wakeup import Wakeup

if TYPE_CHECKING:
    from ..errors import ReadFailure
    from .decode import DecodeRank

log = logging.getLogger(__name__)
IDLE_S = 0.5  # the driver's longest sleep with nothing in flight


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
        self.rank: Any = _Locked(rank, self._lock, self._wake.set)
        self.wakeups = 0  # times the thread woke up (tests read the idle rate)
        self._thread = threading.Thread(target=self._run, name=f"kvbridge-decode-{rank.engine_id}", daemon=True)
        self._thread.start()

    def poll(self) -> tuple[list[str], dict[str, ReadFailure]]:
        """Reads finished and failed since the previous call (the driver's and this poll's own)."""
        with self._lock:
            done, failed = self._rank.poll()
            out_done, out_failed = self._done + done, {**self._failed, **failed}
            self._done, self._failed = [], {}
        self._wake.set()  # (this poll may have started work: retries, heartbeats)
        return out_done, out_failed

    def _turn(self) -> float:
        """Poll the rank if it has work; the seconds the thread may then sleep with no event."""
        rank = self._rank
        clear = getattr(rank.transport, "clear_wake", None)
        if clear is not None:
            clear()  # before looking: a post that ends from here on makes the fd readable again
        self._wake.clear()
        if not rank.busy:
            return 0.0 if rank.peers.poller.pending() else IDLE_S
        done, failed = rank.poll()
        self._done += done
        self._failed.update(failed)
        if rank.peers.poller.pending():  # a reply no descriptor announces: poll again now
            return 0.0
        return max(0.0, min(IDLE_S, rank.next_wake(time.monotonic())))

    def _run(self) -> None:
        poller = self._rank.peers.poller
        while not self._stop.is_set():
            try:
                with self._lock:
                    if self._stop.is_set():
                        break
                    pause = self._turn()
            except Exception:  # noqa: BLE001 - the driver must outlive one bad turn (the engine's poll sees it)
                log.exception("kvbridge: decode driver")
                pause = IDLE_S
            if pause > 0:
                poller.wait(pause)
                self.wakeups += 1

    def close(self) -> None:
        """Stop the thread, then close the rank."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        with self._lock:
            self._rank.close()
        self._wake.close()
