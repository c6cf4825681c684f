"""Serving a prefill endpoint from an engine that has its own loop (a vLLM worker): :class:`PrefillServer`.

An engine embedding :class:`~kvbridge.PrefillEndpoint` must have ``serve_once`` run when decode ranks'
acquires and stage requests arrive, while the engine is busy in a forward pass or idle.
:class:`PrefillServer` does that from a background thread *and* from the engine's own thread
(:meth:`PrefillServer.pump`), one at a time under a lock; the endpoint is only ever used under that lock.

The thread waits on the event itself, never on a timer: ``poll(2)`` on the side-channel socket's ZMQ
file descriptor (an OS fd, waited on without touching the socket, which only the lock holder uses) and
on a wake-up fd that :meth:`add`, :meth:`expect` and :meth:`close` write. After every serving turn the
socket's ``EVENTS`` is read again under the lock (ZMQ's fd is edge-triggered: an operation may consume
the edge of a message that arrived meanwhile), so a message is never left waiting for a timeout. NIXL
notifications (readers' Done) have no file descriptor: while pins are held (reads in flight) they are
checked every ``poll_s``; with none, the thread sleeps until the next lease deadline (at most
``IDLE_S``). An idle prefill process wakes a few times a second. The push path's WRITEs end on the
transport's post thread: its wake-up fd (where it has one) wakes the thread too, and while WRITEs are in
flight (an RDMA WRITE completes with no event) they are checked every ``poll_s``.

The engine's steps (:meth:`PrefillServer.pump`) register hand-overs at once and serve only a message the
thread left waiting (``PUMP_STARVED_S``): inside a vLLM worker a background thread alone was seen starved
of CPU while vLLM's own threads busy-wait, but serving work done on the engine's step (packing a staged
segment: 4 ms per step seen in ``benchmarks/e2e_vs_nixl.py``) lengthens that step.
"""
from __future__ import annotations

import logging
import queue
import select
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .config import PrefillConfig
from .wakeup import Wakeup

if TYPE_CHECKING:
    from ..lower import GroupBlocks
    from ..memory import KVMemory
    from ..transport.nixl import NixlTransport
    from .prefill import PrefillRank

log = logging.getLogger(__name__)
STALL_S = 2.0  # a serving gap or turn longer than this is logged (a warning)
IDLE_S = 0.5   # the serving thread's longest sleep with nothing to wait for (leases are ticked on wake)
PARKED_S = 0.001  # stage requests parked for staging space are retried this often
# pump() serves (on the engine's thread) a message that has waited this long for the background thread
PUMP_STARVED_S = 0.005


class PrefillServer:
    """Serve ``endpoint`` (a :class:`~kvbridge.PrefillEndpoint`) on a background thread and on
    :meth:`pump`; register leases handed over with :meth:`add` (any thread); collect the requests whose
    blocks may be given back to the engine with :meth:`take_finished` (freed by every reader's Done, or
    expired)."""

    def __init__(self, endpoint: PrefillRank, poll_s: float | None = None) -> None:
        # poll_s: how often NIXL notifications (Done) are checked while pins are held (None: the
        # endpoint's PrefillConfig.poll_s); side-channel messages and hand-overs wake the thread at once
        if poll_s is None:
            cfg = getattr(endpoint, "config", None)
            poll_s = cfg.poll_s if isinstance(cfg, PrefillConfig) else PrefillConfig().poll_s
        self.ep, self.poll_s = endpoint, poll_s
        self._new: queue.SimpleQueue[tuple[str, dict[str, GroupBlocks] | None, int, int]] = queue.SimpleQueue()
        self._serve = threading.Lock()
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._stop = threading.Event()
        self._wake = Wakeup()
        sock = getattr(endpoint, "sock", None)
        self._zfd = sock.getsockopt(_zmq().FD) if sock is not None else None
        # the transport's wake-up fd: readable when one of its posts (a push WRITE) ends
        self._tfd = getattr(getattr(endpoint, "transport", None), "wake_fd", None)
        self.wakeups = 0  # times the thread woke up (tests and benchmarks read the idle rate)
        self._sleep_until = 0.0  # when the thread's current wait ends at the latest
        self._waiting_since: float | None = None  # when pump() first saw a message its thread had not served
        self._thread = threading.Thread(target=self._run, name="kvbridge-prefill", daemon=True)
        self._thread.start()

    def add(self, req_id: str, blocks: dict[str, GroupBlocks], attempt: int, reads: int = 1) -> None:
        """Hold ``blocks`` under a lease for ``req_id`` with the attempt id the scheduler drew (registered
        on the next serving turn, before any acquire that turn answers), for at least ``reads`` reads."""
        self._new.put((req_id, blocks, attempt, reads))
        self._wake.set()

    def expect(self, req_id: str, attempt: int, reads: int) -> None:
        """Hold the lease of ``req_id`` (added before) for ``reads`` reads (``PrefillEndpoint.expect_reads``),
        in order with :meth:`add`."""
        self._new.put((req_id, None, attempt, reads))
        self._wake.set()

    def take_finished(self) -> set[str]:
        """Requests freed (every reader's Done) or expired since the previous call."""
        with self._lock:
            out, self._finished = self._finished, set()
        return out

    def stats(self) -> dict[str, Any]:
        """The endpoint's ``stats()`` now (waits for a serving turn in progress to end)."""
        with self._serve:
            return self.ep.stats()

    def pump(self) -> bool:
        """From the engine's thread: register the leases handed over, and serve the side channel only where
        the background thread seems starved (a message already waited at the previous pump, ``PUMP_STARVED_S``
        or more ago, and is still waiting); skipped while the background thread is at it. Serving work (an
        acquire, a staged segment's packing) is otherwise left to that thread: done here it lengthens the
        engine's step. True if it ran."""
        if not self._serve.acquire(blocking=False):
            return False
        try:
            now = time.monotonic()
            if self._readable():
                if self._waiting_since is None:
                    self._waiting_since = now
                starved = now - self._waiting_since >= PUMP_STARVED_S
                if not starved:  # (reading EVENTS here may have taken the edge its poll waits for)
                    self._wake.set()
            else:
                self._waiting_since, starved = None, False
            self._tick(serve=starved)
            if time.monotonic() + self._timeout() < self._sleep_until:
                self._wake.set()  # the thread sleeps longer than what this turn left needs (new pins)
        except Exception:  # noqa: BLE001 - a bad message must not take the engine's step down
            log.exception("kvbridge: prefill side channel")
        finally:
            self._serve.release()
        return True

    def _tick(self, serve: bool = True) -> None:
        try:
            while True:
                rid, blocks, attempt, reads = self._new.get_nowait()
                if blocks is None:
                    self.ep.expect_reads(rid, attempt, reads)
                else:
                    self.ep.add_request(rid, blocks, attempt=attempt, reads=reads)
        except queue.Empty:
            pass
        if serve:
            self._waiting_since = None
            for _ in range(64):  # a message that arrived during the turn is served now, not after a sleep
                self.ep.serve_once()
                if not self._readable():
                    break
        freed = self.ep.take_freed()
        with self._lock:
            self._finished.update(freed["freed"])
            self._finished.update(freed["expired"])

    def _readable(self) -> bool:
        """A side-channel message is waiting (ZMQ ``EVENTS``; call with the serving lock held)."""
        sock = getattr(self.ep, "sock", None)
        if sock is None:
            return False
        zmq = _zmq()
        try:
            return bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError:
            return False

    def _timeout(self) -> float:
        """How long the thread may sleep with no event (seconds; call with the serving lock held)."""
        hint = getattr(self.ep, "idle_hint", None)
        if hint is None or self._zfd is None:
            return self.poll_s  # an endpoint that cannot say: serve every poll_s
        return float(hint(self.poll_s, PARKED_S, IDLE_S))

    def _run(self) -> None:
        last = time.monotonic()
        waiter = select.poll()
        waiter.register(self._wake.fd, select.POLLIN)
        if self._zfd is not None:
            waiter.register(self._zfd, select.POLLIN)
        clear_transport = getattr(getattr(self.ep, "transport", None), "clear_wake", None)
        if isinstance(self._tfd, int) and clear_transport is not None:
            waiter.register(self._tfd, select.POLLIN)
        else:
            clear_transport = None
        while not self._stop.is_set():
            timeout = 0.01
            try:
                with self._serve:
                    start = time.monotonic()
                    if start - last > STALL_S + IDLE_S:  # an operator's clue when decode ranks see no answer
                        log.warning("kvbridge: prefill side channel %s was not served for %.1f s (its thread was not "
                                    "scheduled: CPU starved, or the GIL held by another thread)", self._name(),
                                    start - last)
                    self._tick()
                    last = time.monotonic()
                    if last - start > STALL_S:
                        log.warning("kvbridge: one serving turn of prefill side channel %s took %.1f s",
                                    self._name(), last - start)
                    timeout = self._timeout()
            except Exception:  # noqa: BLE001 - the side channel must outlive a bad message
                log.exception("kvbridge: prefill side channel")
            if self._stop.is_set():
                break
            self._sleep_until = time.monotonic() + timeout
            waiter.poll(max(0, int(timeout * 1000 + 0.999)))
            self.wakeups += 1
            self._wake.clear()
            if clear_transport is not None:
                clear_transport()

    def _name(self) -> str:
        return f"{getattr(self.ep, 'engine_id', '?')} rank {getattr(self.ep, 'rank', '?')}"

    def close(self) -> None:
        """Stop the thread and close the endpoint."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        with self._serve:
            self.ep.close()
        self._wake.close()


def _zmq() -> Any:
    import zmq
    return zmq


def nixl_transport(memory: KVMemory, agent_name: str, *, initiator: bool, backends: Sequence[str] = ("UCX",),
                   num_threads: int = 0, post_threads: int = 1) -> NixlTransport:
    """A NIXL transport for an endpoint over ``memory`` (a :class:`~kvbridge.KVMemory`) with the given NIXL
    backends (``["UCX"]``, ``["LIBFABRIC"]`` for EFA, ...) and backend threads, to pass as
    ``PrefillEndpoint(..., transport=)`` (``initiator=False``) or ``DecodeEndpoint(..., transport=)``
    (``initiator=True``). A backend this host's NIXL lacks raises :class:`~kvbridge.TransportUnavailableError`
    naming it."""
    from ..transport.nixl import NixlTransport
    from .memhost import transport_device

    return NixlTransport(agent_name, backends=tuple(backends), num_threads=int(num_threads or 0),
                         multi_threaded=True, post_threads=post_threads, **transport_device(memory))
