"""Serving a prefill endpoint from an engine that has its own loop (a vLLM worker): :class:`PrefillServer`.

An engine embedding :class:`~kvbridge.PrefillEndpoint` must call ``serve_once`` often enough that
decode ranks' acquires and stage requests are answered while the engine is busy in a forward pass or
idle. :class:`PrefillServer` does that from a background thread *and* from the engine's own thread
(:meth:`PrefillServer.pump`), one at a time under a lock; the endpoint is only ever used under that lock.

Why both: inside a vLLM worker the background thread alone was seen to stall for 4-45 s (issue 12, TP2
decode): py-spy showed it inside ``zmq_poll`` with a 2 ms timeout the whole time, while acquires from the
decode sat unanswered. So the thread never waits in ZMQ (it sleeps on a Python event), and the engine's
own steps serve the channel as well: while a prefill holds blocks for a decode, vLLM keeps stepping it to
collect ``finished_sending``.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

log = logging.getLogger(__name__)
STALL_S = 2.0  # a serving gap or turn longer than this is logged (a warning)


class PrefillServer:
    """Serve ``endpoint`` (a :class:`~kvbridge.PrefillEndpoint`) on a background thread and on
    :meth:`pump`; register leases handed over with :meth:`add` (any thread); collect the requests whose
    blocks may be given back to the engine with :meth:`take_finished` (freed by every reader's Done, or
    expired)."""

    def __init__(self, endpoint, poll_s: float = 0.002):
        self.ep, self.poll_s = endpoint, poll_s
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._serve = threading.Lock()
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbridge-prefill", daemon=True)
        self._thread.start()

    def add(self, req_id: str, blocks: dict, attempt: int, reads: int = 1) -> None:
        """Hold ``blocks`` under a lease for ``req_id`` with the attempt id the scheduler drew (registered
        on the next serving turn, before any acquire that turn answers), for at least ``reads`` reads."""
        self._new.put((req_id, blocks, attempt, reads))

    def expect(self, req_id: str, attempt: int, reads: int) -> None:
        """Hold the lease of ``req_id`` (added before) for ``reads`` reads (``PrefillEndpoint.expect_reads``),
        in order with :meth:`add`."""
        self._new.put((req_id, None, attempt, reads))

    def take_finished(self) -> set[str]:
        """Requests freed (every reader's Done) or expired since the previous call."""
        with self._lock:
            out, self._finished = self._finished, set()
        return out

    def stats(self) -> dict:
        """The endpoint's ``stats()`` now (waits for a serving turn in progress to end)."""
        with self._serve:
            return self.ep.stats()

    def pump(self) -> bool:
        """Serve the side channel now from the caller's thread, unless the background thread is at it.
        True if it ran."""
        if not self._serve.acquire(blocking=False):
            return False
        try:
            self._tick()
        except Exception:  # noqa: BLE001 - a bad message must not take the engine's step down
            log.exception("kvbridge: prefill side channel")
        finally:
            self._serve.release()
        return True

    def _tick(self) -> None:
        try:
            while True:
                rid, blocks, attempt, reads = self._new.get_nowait()
                if blocks is None:
                    self.ep.expect_reads(rid, attempt, reads)
                else:
                    self.ep.add_request(rid, blocks, attempt=attempt, reads=reads)
        except queue.Empty:
            pass
        self.ep.serve_once()
        freed = self.ep.take_freed()
        with self._lock:
            self._finished.update(freed["freed"])
            self._finished.update(freed["expired"])

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            try:
                with self._serve:
                    start = time.monotonic()
                    if start - last > STALL_S:  # an operator's clue when decode ranks see no answer
                        log.warning("kvbridge: prefill side channel %s was not served for %.1f s (its thread was not "
                                    "scheduled: CPU starved, or the GIL held by another thread)", self._name(),
                                    start - last)
                    self._tick()
                    last = time.monotonic()
                    if last - start > STALL_S:
                        log.warning("kvbridge: one serving turn of prefill side channel %s took %.1f s",
                                    self._name(), last - start)
            except Exception:  # noqa: BLE001 - the side channel must outlive a bad message
                log.exception("kvbridge: prefill side channel")
                self._stop.wait(0.01)
            self._stop.wait(self.poll_s)

    def _name(self) -> str:
        return f"{getattr(self.ep, 'engine_id', '?')} rank {getattr(self.ep, 'rank', '?')}"

    def close(self) -> None:
        """Stop the thread and close the endpoint."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._serve:
            self.ep.close()


def nixl_transport(memory, agent_name: str, *, initiator: bool, backends=("UCX",), num_threads: int = 0,
                   post_threads: int = 1):
    """A NIXL transport for an endpoint over ``memory`` (a :class:`~kvbridge.KVMemory`) with the given NIXL
    backends (``["UCX"]``, ``["LIBFABRIC"]`` for EFA, ...) and backend threads, to pass as
    ``PrefillEndpoint(..., transport=)`` (``initiator=False``) or ``DecodeEndpoint(..., transport=)``
    (``initiator=True``). A backend this host's NIXL lacks raises :class:`~kvbridge.TransportUnavailableError`
    naming it."""
    from ..transport.nixl import NixlTransport
    from .memhost import transport_device

    return NixlTransport(agent_name, backends=tuple(backends), num_threads=int(num_threads or 0),
                         multi_threaded=True, post_threads=post_threads, **transport_device(memory))
