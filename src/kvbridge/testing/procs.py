"""One process per rank: start, drive over a pipe (small RPC), stop or kill.

Each worker owns its NIXL agent and, for prefill ranks, its ZMQ side-channel socket. The worker loop
waits on the control pipe and the ZMQ socket together (no busy spin: on 2 cores a spinning poller
starves UCX's progress threads) and services notifications, leases and in-flight reads in between.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from .. import errors
from ..layout import EngineLayout, engine_from_dict, engine_to_dict
from ..memory import rank_memory
from ..runtime.driver import IDLE_POLL_S
from . import rankbench
from .engine import buffer_of, default_memory
from .oracle import count_mismatches, fill_prefill, new_buffer, write_expected

Rank = tuple[int, int]


_LOWERED: dict = {}  # engine id -> the lowered plan of its last handshake (verify after the engine is gone)


def verify_rank(obj, requests: list) -> dict:
    """Decode side: rebuild the expected buffer for ``requests`` (in order) and compare every byte.

    The oracle check of the tests (the decode side's counterpart of :func:`fill_rank`): ``requests`` is a list
    of ``(oracle request number, ReadRequest)``; returns ``mismatched_bytes``, ``checked_bytes`` and
    ``needed_bytes``. Over a pipe it is :class:`EngineProcs`' ``verify`` command."""
    layout, buf = rank_memory(obj.engine, *obj.rank), buffer_of(obj.mem)
    expected = new_buffer(layout)
    needed = 0
    for req_num, req in requests:
        remote = obj.remotes.get(req.engine_id)
        lp = remote.lowered if remote is not None else _LOWERED[req.engine_id]
        ranges = lp.validate(req.num_tokens, req.prefill_blocks, req.decode_blocks)
        needed += write_expected(expected, layout, req_num, ranges, req.decode_blocks)
    return {"mismatched_bytes": count_mismatches(buf, expected), "checked_bytes": int(buf.size),
            "needed_bytes": needed}


def fill_rank(obj, req: int, num_tokens: int, blocks: dict) -> None:
    """Prefill side: write request ``req``'s oracle values into the rank's KV memory."""
    layout = rank_memory(obj.engine, *obj.rank)
    fill_prefill(buffer_of(obj.mem), layout, req, num_tokens, {g: b for g, b in blocks.items() if g in layout.regions})


def _memcpy_gbps(nbytes: int, reps: int = 3) -> float:
    """numpy memcpy bandwidth for ``nbytes`` in this process (the physical limit for host memory)."""
    nbytes = max(int(nbytes), 1 << 20)
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def _start_freeze(obj, reqs: list, done: list, failed: dict, min_finished: int = 0, timeout: float = 30.0) -> dict:
    """Decode side, fault injection: start ``reqs`` and poll until at least ``min_finished`` of them
    finished and some in-flight request has a read handed to the transport that has not completed;
    returns what is in flight at that moment (the caller then freezes or kills this process, so the
    fault lands mid-transfer by construction, not by timing)."""
    for req in reqs:
        obj.start(req)
    ids, deadline = {r.req_id for r in reqs}, time.monotonic() + timeout
    while True:
        d, f = obj.poll()
        done += d
        failed |= f
        reading = [rid for rid, fl in obj.inflight.items()  # a read or its scatter not completed
                   if any(not r.done or (r.runs is not None and (r.scatter is None or not r.scatter.done()))
                          for rr in fl.ranks.values() for r in rr.reads)]
        finished = len(ids.intersection(done))
        if (finished >= min_finished and reading) or not obj.inflight or time.monotonic() > deadline:
            return {"finished": finished, "failed": len(ids.intersection(failed)), "inflight": len(obj.inflight),
                    "reading": len(reading), "inflight_ids": sorted(obj.inflight)}
        time.sleep(1e-4)


class _Worker:
    """A rank in its worker process: the commands of :class:`EngineProcs` (a method each, or any method of
    the rank) and the reads it finished between two commands."""

    def __init__(self, role: str, obj: Any) -> None:
        self.role, self.obj = role, obj
        self.done: list[str] = []
        self.failed: dict[str, Any] = {}
        self.idle_poll_at = 0.0

    def take(self) -> tuple[list[str], dict[str, Any]]:
        out = (self.done, self.failed)
        self.done, self.failed = [], {}
        return out

    def wait(self, *args: Any, **kwargs: Any) -> tuple[list[str], dict[str, Any]]:
        d, f = self.obj.wait(*args, **kwargs)
        self.done, self.failed = self.done + d, self.failed | f
        return self.take()

    def verify(self, *args: Any) -> Any:
        return verify_rank(self.obj, *args)

    def handshake(self, *args: Any, **kwargs: Any) -> Any:
        remote = self.obj.handshake(*args, **kwargs)
        _LOWERED[remote.engine_id] = remote.lowered
        return remote.summary()

    def memcpy_gbps(self, *args: Any) -> Any:
        return _memcpy_gbps(*args)

    def fill_many(self, items: list[Any]) -> None:
        for a in items:
            fill_rank(self.obj, *a)

    def fill(self, *args: Any) -> Any:
        return fill_rank(self.obj, *args)

    def start_abort(self, req: Any) -> bool:
        """Tests: abort while the read is surely in flight (no poll between)."""
        self.obj.start(req)
        res = req.req_id in self.obj.inflight
        self.obj.abort(req.req_id)
        return res

    def start_many(self, reqs: list[Any]) -> dict[str, str]:
        res = {}
        for req in reqs:
            try:
                self.obj.start(req)
            except errors.KVBridgeError as e:
                res[req.req_id] = f"{type(e).__name__}: {e}"
        return res

    COMMANDS = ("take", "wait", "verify", "handshake", "memcpy_gbps", "fill_many", "fill", "start_abort", "start_many")

    def call(self, cmd: str, args: Any, kwargs: Any) -> Any:
        if cmd in rankbench.OPERATIONS:  # benchmark operations on the rank
            return rankbench.OPERATIONS[cmd](self.obj, *args, **kwargs)
        fn = getattr(self, cmd) if cmd in self.COMMANDS else getattr(self.obj, cmd)
        return fn(*args, **kwargs)

    def pump(self) -> None:
        """Serve (prefill) or collect finished reads (decode; idle ranks still reap parked reads and
        retired peers)."""
        obj = self.obj
        if self.role == "prefill":
            obj.serve_once()
        elif obj.busy or obj.finished or obj.failed or time.monotonic() >= self.idle_poll_at:
            # an idle rank too, about once a second (as an engine's step, or DecodeDriver, polls it): a late
            # answer (a thawed prefill granting a read that failed meanwhile) is then let go, not left
            # pinning the prefill's blocks until its pin bound
            self.idle_poll_at = time.monotonic() + IDLE_POLL_S
            d, f = obj.poll()
            self.done += d
            self.failed |= f


def _reply(conn: Any, fn: Any) -> bool:
    """Send ``fn()``'s result, or its error (a kvbridge error by name; anything else with its traceback);
    whether it succeeded."""
    try:
        res = fn()
    except errors.KVBridgeError as e:
        conn.send(("err", type(e).__name__, str(e)))
        return False
    except Exception as e:  # noqa: BLE001 - report, keep the rank alive
        conn.send(("err", type(e).__name__, f"{e}\n{traceback.format_exc()}"))
        return False
    conn.send(("ok", res))
    return True


def _build(conn: Any, role: str, layout: dict[str, Any], rank: Rank, engine_id: str, kw: dict[str, Any]) -> Any:
    """The rank, or None (the error sent to the parent)."""
    from ..runtime.decode import DecodeRank
    from ..runtime.prefill import PrefillRank
    try:
        engine = engine_from_dict(layout)
        memory = default_memory(engine, tuple(rank))  # the harness allocates, as an engine would
        return (PrefillRank if role == "prefill" else DecodeRank)(engine, tuple(rank), engine_id, memory=memory, **kw)
    except Exception as e:  # noqa: BLE001
        conn.send(("err", type(e).__name__, f"{e}\n{traceback.format_exc()}"))
        return None


def _main(conn, role: str, layout: dict, rank: Rank, engine_id: str, kw: dict) -> None:
    import logging

    import zmq
    logging.basicConfig(level=os.environ.get("KVBRIDGE_LOG", "WARNING"))
    from ..malloc import tune_malloc
    tune_malloc()  # per-request descriptor arrays reuse heap memory instead of page-faulting (kvbridge.malloc)
    skew = kw.pop("clock_skew_s", 0.0)
    if skew:  # fault injection: this process's wall clock is off by ``skew`` seconds (kvbridge must not care)
        real_time = time.time
        time.time = lambda: real_time() + skew
    obj = _build(conn, role, layout, rank, engine_id, kw)
    if obj is None:
        return
    if role == "decode":
        buffer_of(obj.mem).fill(0xA5)  # oracle sentinel: bytes no read touches must stay as they are
    conn.send(("ok", {"port": getattr(obj, "port", None), "agent": obj.transport.agent_name, "pid": os.getpid()}))
    poller = zmq.Poller()
    poller.register(conn.fileno(), zmq.POLLIN)
    if role == "prefill":
        poller.register(obj.sock, zmq.POLLIN)
    w = _Worker(role, obj)
    while True:
        busy = role == "decode" and obj.busy
        events = dict(poller.poll(timeout=1 if busy else 2))
        if conn.fileno() in events or conn.poll():
            cmd, args, kwargs = conn.recv()
            if cmd == "stop":
                try:
                    obj.close()
                finally:
                    conn.send(("ok", None))
                return
            if cmd == "start_freeze":  # fault injection: freeze (SIGSTOP) this rank with reads in flight
                if _reply(conn, partial(_start_freeze, obj, args[0], w.done, w.failed, **kwargs)):
                    os.kill(os.getpid(), signal.SIGSTOP)  # the caller kills it (or SIGCONT)
                continue
            _reply(conn, partial(w.call, cmd, args, kwargs))
        w.pump()


class WorkerError(RuntimeError):
    """A worker process raised something that is not a kvbridge error (a bug), or died."""


def _raise(name: str, msg: str):
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.KVBridgeError):
        raise cls(msg)
    raise WorkerError(f"{name}: {msg}")


class Worker:
    """Handle on one rank's process."""

    def __init__(self, role: str, engine: EngineLayout, rank: Rank, engine_id: str, **kw):
        ctx = mp.get_context("spawn")
        self.role, self.rank, self.engine_id = role, tuple(rank), engine_id
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, role, engine_to_dict(engine), rank, engine_id, kw),
                                daemon=True, name=f"kvbridge-{role}-{engine_id}-{rank}")
        self.proc.start()
        child.close()
        self.info: dict | None = None
        self.broken = False

    def ready(self, timeout: float = 120.0) -> dict:
        if self.info is None:
            self.info = self.recv(timeout)
        return self.info

    def recv(self, timeout: float):
        if self.broken:
            raise WorkerError(f"{self.role} rank {self.rank} missed an earlier answer; its replies are out of step")
        if not self.conn.poll(timeout):
            self.broken = True  # a late answer would be taken for the next call's
            raise WorkerError(f"{self.role} rank {self.rank} did not answer within {timeout:g} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise WorkerError(f"{self.role} rank {self.rank} process died (exit code {self.proc.exitcode})") from None
        if msg[0] == "err":
            _raise(msg[1], msg[2])
        return msg[1]

    def call(self, cmd: str, *args, timeout: float = 300.0, **kwargs):
        try:
            self.conn.send((cmd, args, kwargs))
        except (BrokenPipeError, OSError):
            raise WorkerError(f"{self.role} rank {self.rank} process is gone") from None
        return self.recv(timeout)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=timeout)
            except (WorkerError, errors.KVBridgeError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)


@dataclass
class EngineProcs:
    """All rank processes of one engine."""

    role: str
    engine_id: str
    layout: EngineLayout
    workers: dict

    @classmethod
    def start(cls, role: str, layout: EngineLayout, engine_id: str, host: str = "127.0.0.1", **kw) -> "EngineProcs":
        workers = {}
        try:
            for r in layout.ranks():
                extra = dict(kw)
                if role == "prefill":
                    extra.setdefault("host", host)
                workers[r] = Worker(role, layout, r, engine_id, **extra)
            for w in workers.values():
                w.ready()
        except BaseException:
            for w in workers.values():
                w.kill()
            raise
        return cls(role, engine_id, layout, workers)

    def endpoints(self, host: str = "127.0.0.1") -> dict[Rank, str]:
        return {r: f"{host}:{w.info['port']}" for r, w in self.workers.items()}

    def call_all(self, cmd: str, *args, **kwargs) -> dict:
        for w in self.workers.values():
            w.conn.send((cmd, args, kwargs))
        return {r: w.recv(300.0) for r, w in self.workers.items()}

    def stop(self) -> None:
        for w in self.workers.values():
            w.stop()

