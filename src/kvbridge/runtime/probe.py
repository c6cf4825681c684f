"""Measure the link to each prefill rank at handshake, and say so when a device path is degraded.

A decode rank's handshake thread (never the engine's step) READs from each prefill rank it will read,
once per memory kind a path uses: the prefill's device memory (direct and device-staged READs move that
kind) and its host staging buffer (host-staged READs), into probe buffers of the decode rank's own (the
bytes land nowhere a read in flight could use). The device kind is READ from the prefill's staging buffer
(on its KV memory's device, every page touched) where it has one, else from its KV memory. Per kind, in
this order:

1. a warm-up READ of one small descriptor (UCX connects lazily);
2. the time of one small descriptor, best of three (``t1``: the fixed cost of a READ);
3. ``SMALL_DESCS`` descriptors of ``SMALL_BYTES`` in one READ (``t_n``);
4. single-descriptor READs from 256 KiB (less where the small READs show a slow link), four times
   larger each while the next fits the time left, the probe buffer and the byte budget, then up to
   ``BIG_REPS`` READs of the largest size (``t``, the fastest: on a busy machine noise only ever slows a
   READ down). With ``t = fixed + descs * per_desc + bytes / bandwidth``:
   ``gbps = (bytes - SMALL_BYTES) / (t - t1)`` and
   ``per_desc_us = (t_n - t1) / (n - 1) - SMALL_BYTES / bandwidth``, exact on such a link.

The push path is measured the same way, with WRITEs the prefill posts (``PushProbe`` requests on the
side channel, after the READs, its share of the same time): the prefill WRITEs the descriptors asked
for from its staging buffer into the decode's device probe buffer, times the WRITE itself (from handing
it to its transport to seeing it complete) and answers with that time once it completed, so neither the
side channel's round trip nor either side's scheduling is in the figures. A first empty probe (nothing
written) checks the prefill serves them; the warm-up WRITE adds the decode's agent on the prefill and
connects. A prefill that does not answer (or refuses) leaves the push path with the device READ's
figures, not measured.

**Bounds.** The probe of a prefill rank first connects: one small transfer per kind (UCX connects
lazily, and the first request would pay it otherwise; the empty push probe too), all within
``WARMUP_S`` together (kinds not reached by then stay unmeasured), their time reported as
``probe_connect_ms``. The measuring then ends within ``probe_ms``
(default 50 ms) of wall time and moves at most ``probe_bytes`` (default 64 MiB): each kind gets an equal
share of the time left when it starts (a quick kind leaves the rest of its share to the next), every
transfer's timeout is the end of its kind's share, and a transfer that has not ended by then is given up
(its handle released once it ends, on a thread). A given-up transfer still says something: the kind is
at most that fast (``bound``: its size over the time waited). A kind that fails, or that has no time
left for a large transfer, keeps the cost model's constants until completed transfers measure it. The probe buffers are
allocated, touched and registered, and the local copy rates (device to device, host to device) timed,
once per decode rank when it is built (:meth:`Prober.prepare`), not inside a probe. The figures become
a :class:`~kvbridge.cost.LinkFigures` per prefill rank; completed transfers keep them current
(:meth:`~kvbridge.cost.PathFigures.observe`).

:func:`link_warning` is the one warning per link when a device path runs far below the host path or
below an absolute floor.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cost import CostModel, LinkFigures, PathFigures, model_link
from ..modes import TransferMode, TransferPath
from ..transport.base import elapsed_s

log = logging.getLogger(__name__)

PROBE_MS = 50.0              # measuring time per prefill rank (all memory kinds together)
PROBE_BYTES = 64 << 20       # bytes moved per prefill rank at most
PROBE_BUFFER_BYTES = 16 << 20  # the device probe buffer of a GPU rank: its largest single READ
# every probe buffer in host memory (a CPU rank's device kind, the host kind): host links run at tens of GB/s
# at most, and a READ into host memory may copy inside the transport's post call (cma), holding the GIL
HOST_PROBE_BUFFER_BYTES = 4 << 20
WARMUP_S = 2.0               # connecting (a first transfer of each kind) takes this long at most, all kinds together
SMALL_DESCS = 128
SMALL_BYTES = 256
FIRST_BIG = 256 << 10
MIN_BIG = 16 << 10
# a pack or scatter is more than a memcpy (run indices, a kernel launch, a stream sync): its fixed cost is
# taken as at least this
COPY_FIXED_FLOOR_US = 10.0
BIG_REPS = 3                 # READs of the largest size that fits, best kept
# a device path reading at less than this fraction of the host path, or (GPU memory) below the floor, is
# degraded. Where the KV memory is host memory both paths read host memory: only a far larger gap says
# something about the transport there
DEGRADED_RATIO = 0.2
DEGRADED_RATIO_CPU = 0.05
DEVICE_FLOOR_GBPS = 1.0
# the paths whose transfer moves the prefill's device memory kind. The push path's WRITE is measured by
# the push probe; where that fails its first estimate is the READ of the same kind (not measured)
DEVICE_KIND = (TransferPath.DIRECT, TransferPath.STAGED, TransferPath.PUSH)
# local copies per path: pack and scatter; host staging adds a bounce on each side
COPIES = {TransferPath.DIRECT: 0, TransferPath.STAGED: 2, TransferPath.PUSH: 2, TransferPath.HOST: 4}


@dataclass(frozen=True)
class KindFigures:
    """What one memory kind measured: per-descriptor µs, GB/s, bytes moved, seconds spent; ``bound``:
    the GB/s is an upper bound (a large transfer did not end within the probe's time)."""

    per_desc_us: float
    gbps: float
    nbytes: int
    seconds: float
    bound: bool = False


@dataclass(frozen=True)
class Target:
    """A READ source on the prefill (address, bytes, device) and the local buffer it lands in."""

    remote_addr: int
    remote_nbytes: int
    remote_device: str
    local_addr: int
    local_nbytes: int
    local_device: str | None  # None: the decode rank's own kind; "cpu": host memory of a GPU rank


def _timed(transport: Any, agent: str, t: Target, offsets: np.ndarray, nbytes: np.ndarray,
           timeout_s: float) -> float | None:
    """Seconds one READ of ``nbytes`` at ``offsets`` (into both buffers) took; None: failed or too slow."""
    remote = (t.remote_addr + offsets).astype(np.int64)
    local = (t.local_addr + offsets).astype(np.int64)
    n = np.asarray(nbytes, np.int64)
    t0 = time.perf_counter()
    kw = {"local_device": t.local_device} if t.local_device is not None else {}
    x = transport.read(agent, remote, local, n, b"", remote_device=t.remote_device, **kw)
    ok = transport.settle(x, timeout_s)
    dt = time.perf_counter() - t0
    if ok is None:  # still running: its handle is released when it ends (a thread waits for it)
        threading.Thread(target=_release_later, args=(transport, x), daemon=True).start()
        return None
    own = elapsed_s(x)  # the transport's own time (the post thread's queue and this thread's waits not in it)
    transport.release(x)
    if not ok:
        return None
    return own if own is not None and 0 < own <= dt else dt


Timer = Callable[[np.ndarray, np.ndarray, float], "float | None"]  # (offsets, nbytes, timeout) -> seconds


class PushProber:
    """Times the push path's WRITE to one prefill rank: ``PushProbe`` requests on a DEALER socket of its
    own, one at a time, sent as the decode rank bound at handshake (``ident``: decode engine, decode
    rank, agent, and the prefill metadata's sha256). A request whose answer does not come in time is
    given up with its socket (a late answer goes nowhere); the next one connects anew."""

    def __init__(self, ctx: Any, endpoint: str, ident: tuple[str, tuple[int, int], str, str]):
        self.ctx, self.endpoint, self.ident = ctx, endpoint, ident
        self.sock: Any = None

    def _socket(self) -> Any:
        import zmq
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(f"tcp://{self.endpoint}")
        return self.sock

    def ask(self, addr: int, device: str, descs: int, nbytes: int, stride: int, timeout_s: float) -> float | None:
        """Seconds the prefill's WRITE took (its own clock, ``PushProbed.seconds``; for an empty probe the
        round trip); None: refused, failed or no answer in time."""
        import zmq

        from .protocol import PushProbe, PushProbed, pack, unpack
        eng, rank, agent, incarnation = self.ident
        msg = PushProbe(eng, rank, agent, incarnation, addr, device, descs, nbytes, stride)
        sock = self._socket()
        t0 = time.perf_counter()
        try:
            sock.send_multipart(pack(msg), zmq.NOBLOCK)
            if not sock.poll(max(int(timeout_s * 1000), 1), zmq.POLLIN):
                self.close()  # given up: its answer, if it ever comes, must not be taken for the next one's
                return None
            reply = unpack(sock.recv_multipart())
        except Exception as e:  # noqa: BLE001 - a probe never fails a handshake
            log.debug("push probe: %r", e)
            self.close()
            return None
        dt = time.perf_counter() - t0
        if not isinstance(reply, PushProbed) or not reply.ok:
            log.debug("push probe refused: %s", getattr(reply, "message", type(reply).__name__))
            return None
        # the WRITE's own time on the prefill (post to completion seen); the round trip for an empty probe
        return float(reply.seconds) if descs and reply.seconds > 0 else dt

    def timer(self, t: Target) -> Timer:
        """A timer over the descriptors of :func:`measure_kind` (evenly spaced offsets into ``t``'s local
        buffer, all of one size), for the prefill to WRITE into ``t.local_addr`` on the decode's device."""
        def timed(offsets: np.ndarray, nbytes: np.ndarray, timeout_s: float) -> float | None:
            stride = int(offsets[1] - offsets[0]) if len(offsets) > 1 else 0
            return self.ask(t.local_addr + int(offsets[0]), t.remote_device, len(offsets), int(nbytes[0]), stride,
                            timeout_s)
        return timed

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None


def _release_later(transport: Any, x: Any) -> None:
    if transport.settle(x, 60.0) is not None:
        transport.release(x)


@dataclass
class _Run:
    """One memory kind's measuring run: where it READs, when it must end and the bytes it moved so far."""

    transport: Any
    agent: str
    t: Target
    end: float  # perf_counter time by which every transfer of this run has ended or been given up
    moved: int = 0
    timer: Timer | None = None  # times one transfer (default: a READ of ``t``; the push probe: a WRITE)

    def left(self) -> float:
        """Seconds until :attr:`end` (0 past it): every transfer's timeout."""
        return max(self.end - time.perf_counter(), 0.0)

    def over(self) -> bool:
        return time.perf_counter() >= self.end

    def read(self, offsets: np.ndarray, nbytes: np.ndarray) -> float | None:
        """Seconds one transfer took; None: it failed or did not end by :attr:`end` (given up)."""
        timeout = self.left()
        if timeout <= 0:
            return None
        if self.timer is not None:
            return self.timer(offsets, nbytes, timeout)
        return _timed(self.transport, self.agent, self.t, offsets, nbytes, timeout)


def _fixed_cost(run: _Run) -> float | None:
    """``t1``: the time of one small descriptor, best of three (fewer only when the time left would not
    hold another of the fastest so far: one slow first sample must not stand for the fixed cost, or the
    per-descriptor cost and the bandwidth come out too low and too high); None when none ended in time."""
    one = np.zeros(1, np.int64)
    small = np.full(1, SMALL_BYTES, np.int64)
    times: list[float] = []
    for _ in range(3):
        if times and run.left() < 4 * min(times):
            break
        dt = run.read(one, small)
        if dt is None:
            break
        times.append(dt)
        run.moved += SMALL_BYTES
    return min(times) if times else None


def _many_small(run: _Run, span: int) -> float | None:
    """The time of ``SMALL_DESCS`` small descriptors in one READ, best of two (the second only while
    enough time is left for it and a large READ); None when none ended."""
    stride = span // SMALL_DESCS // SMALL_BYTES * SMALL_BYTES
    offs = np.arange(SMALL_DESCS, dtype=np.int64) * stride
    tns: list[float] = []
    for _ in range(2):  # best of two: noise on a busy machine only ever slows a READ down
        if tns and run.left() < 3 * min(tns):
            break
        tn = run.read(offs, np.full(SMALL_DESCS, SMALL_BYTES, np.int64))
        if tn is None:
            break
        tns.append(tn)
        run.moved += SMALL_DESCS * SMALL_BYTES
    return min(tns) if tns else None


def _first_big_size(run: _Run, tn: float) -> int:
    """The first large READ's size: at a first guess of the bandwidth (the small READs' bytes over their
    time) about a quarter of the time left, so a slow link is measured too."""
    guess = SMALL_DESCS * SMALL_BYTES / max(tn, 1e-9)
    size = FIRST_BIG
    while size > MIN_BIG and size / guess > run.left() / 4:
        size //= 4
    return size


def _largest(run: _Run, size: int, span: int, max_bytes: int) -> tuple[int, float, bool] | None:
    """Single-descriptor READs from ``size``, four times larger each while the next fits the time and
    bytes left, then up to ``BIG_REPS`` of the largest: (that size, its best time, False); None when no
    large READ was tried. A first one that did not end by the run's end is given up: (its size, the time
    it was waited for, True), a bound (the link is at most that fast)."""
    one = np.zeros(1, np.int64)
    best, fallback = math.inf, None
    limit = min(span, max_bytes // (BIG_REPS + 1))  # room for the growth and BIG_REPS READs of the largest
    reps = 0
    while size <= limit and run.moved + size <= max_bytes and reps < BIG_REPS:
        if run.over():
            break
        t0 = time.perf_counter()
        dt = run.read(one, np.full(1, size, np.int64))
        if dt is None:
            if reps == 0 and fallback is None and run.over():  # the first large READ ran out of time
                return size, time.perf_counter() - t0, True
            break
        run.moved += size
        nxt = size * 4
        if reps == 0 and nxt <= limit and run.moved + nxt <= max_bytes and dt * 4 < run.left() / 3:
            fallback, size = (size, dt), nxt  # still growing (this size's time is used only if nothing larger fits)
            continue
        best, reps = min(best, dt), reps + 1  # the largest size that fits: best of up to BIG_REPS
        if dt > run.left():  # another READ of this size would not end in time
            break
    if not math.isfinite(best) and fallback is not None:
        return fallback[0], fallback[1], False
    return (size, best, False) if math.isfinite(best) else None


def _warm_up(transport: Any, agent: str, t: Target, timer: Timer | None = None,
             end: float | None = None) -> bool:
    """One small transfer of ``t`` (it connects), ended or given up by ``end`` (a ``perf_counter`` time;
    default ``WARMUP_S`` from now): True if it ended."""
    if min(t.remote_nbytes, t.local_nbytes) < SMALL_DESCS * SMALL_BYTES * 2:
        return False
    run = _Run(transport, agent, t, time.perf_counter() + WARMUP_S if end is None else end, timer=timer)
    if run.read(np.zeros(1, np.int64), np.full(1, SMALL_BYTES, np.int64)) is None:
        log.debug("probe of %s: the warm-up transfer failed or did not end in time", agent)
        return False
    return True


def measure_kind(transport: Any, agent: str, t: Target, end: float, max_bytes: int,
                 timer: Timer | None = None) -> KindFigures | None:
    """The per-descriptor cost and bandwidth of READs from ``t`` (see the module docstring), or of the
    transfers ``timer`` times (the push probe's WRITEs), every transfer ended or given up by ``end`` (a
    ``perf_counter`` time), after a warm-up (:func:`_warm_up`). A transfer given up at ``end`` bounds the
    figures (``bound``: the link is at most that fast); None when nothing could be measured (a failed
    transfer, or no time for a large one)."""
    span = min(t.remote_nbytes, t.local_nbytes)
    if span < SMALL_DESCS * SMALL_BYTES * 2:
        return None
    t0 = time.perf_counter()
    run = _Run(transport, agent, t, end, timer=timer)
    t1 = _fixed_cost(run)
    if t1 is None:
        waited = time.perf_counter() - t0
        if not run.over():
            log.debug("probe of %s: a one-descriptor transfer failed", agent)
            return None
        log.debug("probe of %s: a one-descriptor transfer did not end in %.1f ms", agent, waited * 1e3)
        return KindFigures(waited * 1e6, SMALL_BYTES / max(waited, 1e-9) / 1e9, run.moved, waited, True)
    t_small = time.perf_counter()
    tn = _many_small(run, span)
    if tn is None:
        waited = time.perf_counter() - t_small
        if not run.over():
            log.debug("probe of %s: the %d-descriptor transfer failed", agent, SMALL_DESCS)
            return None
        log.debug("probe of %s: the %d-descriptor transfer did not end in %.1f ms", agent, SMALL_DESCS, waited * 1e3)
        over = max(waited - t1, 1e-9)  # it would have taken longer: each figure is a bound
        return KindFigures(over / (SMALL_DESCS - 1) * 1e6, SMALL_DESCS * SMALL_BYTES / over / 1e9, run.moved,
                           time.perf_counter() - t0, True)
    big = _largest(run, _first_big_size(run, tn), span, max_bytes)
    if big is None:  # small READs alone say little of the bandwidth: not measured
        log.debug("probe of %s: no time for a large transfer (t1 %.2f ms, tn %.2f ms)", agent, t1 * 1e3, tn * 1e3)
        return None
    size, best, bound = big
    if best - t1 < 0.05 * best or tn <= t1:
        # the one-descriptor transfer took 95 % of the largest one's time or more (or as long as many
        # descriptors): its time is not the link's fixed cost but noise (a clock that includes scheduling:
        # the push probe's WRITE timed by a busy prefill). Taking it out would make the link look many times
        # faster and its descriptors free (a push probe measured 107 GB/s and 0.01 us per descriptor on
        # cma in a busy vLLM engine, and auto pushed on it); no fixed cost taken out, the figures are bounds
        # the other way: the link at least this fast, a descriptor at most this dear
        log.debug("probe of %s: the one-descriptor transfer (%.3f ms) is no fixed cost of the largest (%.3f ms) "
                  "or of %d descriptors (%.3f ms): figures without it", agent, t1 * 1e3, best * 1e3, SMALL_DESCS,
                  tn * 1e3)
        gbps = size / max(best, 1e-9) / 1e9
        return KindFigures(max(tn / SMALL_DESCS, 1e-8) * 1e6, gbps, run.moved, time.perf_counter() - t0, bound)
    # t = fixed + descs * per_desc + bytes / bandwidth: exact on such a link (the one-descriptor READ's
    # bytes taken out of both differences)
    gbps = (size - SMALL_BYTES) / max(best - t1, best * 0.05, 1e-9) / 1e9
    per_desc = max((tn - t1) / (SMALL_DESCS - 1) - SMALL_BYTES / (gbps * 1e9), 1e-8)
    if bound:
        log.debug("probe of %s: a %d B transfer did not end in %.1f ms: at most %.3g GB/s", agent, size,
                  best * 1e3, gbps)
    return KindFigures(per_desc * 1e6, gbps, run.moved, time.perf_counter() - t0, bound)


def copy_gbps(dst: Any, src: Any, nbytes: int, reps: int = 3) -> float:
    """GB/s of copying ``nbytes`` from ``src`` to ``dst`` (numpy arrays or torch tensors, any devices),
    best of ``reps``."""
    from .paths import copy_span, sync
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        copy_span(dst, 0, src, 0, nbytes)
        sync(dst)
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9) / 1e9


class Prober:
    """A decode rank's probe buffers (allocated and registered on first use, kept for later handshakes)
    and the local copy rates; :meth:`link` measures one prefill rank. Thread-safe: handshakes with
    several engines may run at once (one probe at a time)."""

    def __init__(self, transport: Any, kv: Any, model: CostModel, probe_ms: float = PROBE_MS,
                 probe_bytes: int = PROBE_BYTES, buffer_bytes: int = PROBE_BUFFER_BYTES, metrics: Any = None):
        self.transport, self.kv, self.model = transport, kv, model
        self.metrics = metrics  # counts the degraded-link warnings (``degraded_links``)
        self.probe_ms, self.probe_bytes = float(probe_ms), int(probe_bytes)
        self.buffer_bytes = int(min(buffer_bytes, max(probe_bytes, 0)))
        self.host_buffer_bytes = min(self.buffer_bytes, HOST_PROBE_BUFFER_BYTES)
        self._lock = threading.Lock()
        self._bufs: dict[str, tuple[Any, int]] = {}
        self._copy: tuple[float, float, float] | None = None  # (d->d GB/s, h->d GB/s, µs of a small copy)

    @property
    def buffers(self) -> int:
        """How many probe buffers this rank has registered (0 until a probe runs; at most one per kind)."""
        return len(self._bufs)

    @property
    def enabled(self) -> bool:
        return self.probe_ms > 0 and self.buffer_bytes >= SMALL_DESCS * SMALL_BYTES * 2 and self.kv.usable

    def size_of(self, kind: str) -> int:
        """Bytes of the probe buffer of ``kind`` ("device" or "host"): the largest single READ probed."""
        on_gpu = kind == "device" and _device_of(self.kv) != "cpu"
        return self.buffer_bytes if on_gpu else self.host_buffer_bytes

    def _buffer(self, kind: str) -> tuple[Any, int]:
        if kind not in self._bufs:
            from .paths import new_host_buffer

            buf = (
                self.kv.new_staging(self.size_of(kind))
                if kind == "device"
                else new_host_buffer(self.kv, self.size_of(kind))
            )
            self._bufs[kind] = (buf, self.transport.register(buf))
        return self._bufs[kind]

    def prepare(self) -> None:
        """Allocate, touch and register the probe buffers and time the local copies now: once per rank,
        when it is built (as its staging buffers are), so that a handshake's probe only measures the link
        (and the buffer the push probe WRITEs into is in the agent metadata the rank sends)."""
        if self.enabled:
            with self._lock:
                self._prepare()

    def _prepare(self) -> None:
        for kind in ("device", "host"):
            self._buffer(kind)
        self.copy_rates()

    def copy_rates(self) -> tuple[float, float, float]:
        """(device->device GB/s, host->device GB/s, µs of one small host->device copy: the fixed cost of a
        copy) on this rank, timed once on the probe buffers."""
        if self._copy is None:
            dev, _ = self._buffer("device")
            host, _ = self._buffer("host")
            n = min(self.size_of("device"), self.size_of("host")) // 2
            from .paths import offset_view
            d2d = copy_gbps(offset_view(dev, n), dev, n)
            h2d = copy_gbps(dev, host, n)
            fixed = SMALL_BYTES / copy_gbps(dev, host, SMALL_BYTES, reps=5) / 1e3
            self._copy = (d2d, h2d, fixed)
        return self._copy

    def _target(self, kind: str, kv_region: tuple[int, int, str] | None, host_region: tuple[int, int] | None,
                push: PushProber | None, push_bytes: int) -> tuple[Target, Timer | None]:
        """Where ``kind`` ("device", "host", "push") is measured, and its timer (the push probe's WRITE)."""
        _, addr = self._buffer("device" if kind == "push" else kind)
        if kind == "push":
            assert push is not None
            from .protocol import PUSH_PROBE_MAX_BYTES
            target = Target(0, min(push_bytes, PUSH_PROBE_MAX_BYTES), _device_of(self.kv), addr,
                            self.size_of("device"), None)
            return target, push.timer(target)
        if kind == "device":
            assert kv_region is not None
            return Target(kv_region[0], kv_region[1], kv_region[2], addr, self.size_of("device"), None), None
        assert host_region is not None
        return Target(host_region[0], host_region[1], "cpu", addr, self.size_of("host"), "cpu"), None

    def link(self, agent: str, kv_region: tuple[int, int, str] | None, host_region: tuple[int, int] | None,
             paths: list[TransferPath], pin_s: float = math.inf, min_read_rate: float = math.inf,
             push: PushProber | None = None, push_bytes: int = 0) -> LinkFigures:
        """Measure the paths ``paths`` to one prefill rank: ``kv_region`` (addr, bytes, device) is its KV
        memory (direct and device staging READ that kind), ``host_region`` (addr, bytes) its host
        staging; ``push``: times the prefill's WRITEs from its staging (``push_bytes``) into this rank's
        device probe buffer. Paths it cannot measure keep the cost model's constants (the push path:
        the device READ's figures, not measured)."""
        link = model_link(self.model, paths, pin_s, min_read_rate)
        local = str(getattr(self.kv, "device", "cpu"))
        link.device = kv_region[2] if kv_region is not None and kv_region[2] != "cpu" else local
        if not self.enabled:
            return link
        with self._lock:
            want = []
            if kv_region is not None and any(p in paths for p in DEVICE_KIND):
                want.append("device")
            if host_region is not None and TransferPath.HOST in paths:
                want.append("host")
            if push is not None and push_bytes and TransferPath.PUSH in paths:
                want.append("push")
            self._prepare()  # (normally done already when the rank was built: not part of a probe's time)
            t0 = time.perf_counter()
            ready = self._connect(agent, want, kv_region, host_region, push, push_bytes)
            t_measure = time.perf_counter()
            kinds = self._measure(agent, ready)
            link.probe_connect_ms = (t_measure - t0) * 1e3
            link.probe_wall_ms = (time.perf_counter() - t_measure) * 1e3
            link.probe_ms = sum(k.seconds for k in kinds.values()) * 1e3
            link.probe_bytes = sum(k.nbytes for k in kinds.values()) + SMALL_BYTES * len(ready)
            self._figures(link, paths, kinds)
            return link

    def _connect(self, agent: str, want: list[str], kv_region: tuple[int, int, str] | None,
                 host_region: tuple[int, int] | None, push: PushProber | None,
                 push_bytes: int) -> list[tuple[str, Target, Timer | None]]:
        """One small transfer per kind (UCX connects lazily; the first request would pay it otherwise),
        all of them within ``WARMUP_S`` together (a starved or frozen prefill costs the handshake that
        once, not once per kind; the kinds not reached are left unmeasured): the kinds that connected,
        where they are measured, their timers."""
        ready: list[tuple[str, Target, Timer | None]] = []
        end = time.perf_counter() + WARMUP_S
        for kind in want:
            left = end - time.perf_counter()
            if left <= 0:
                log.debug("probe of %s: connecting took %g s; %s not measured", agent, WARMUP_S,
                          ", ".join(want[want.index(kind):]))
                break
            target, timer = self._target(kind, kv_region, host_region, push, push_bytes)
            if kind == "push":
                assert push is not None
                if push.ask(target.local_addr, target.remote_device, 0, 0, 0, left) is None:
                    log.debug("probe of %s: the prefill does not serve push probes (or not in time)", agent)
                    continue
            if _warm_up(self.transport, agent, target, timer, end):
                ready.append((kind, target, timer))
        return ready

    def _measure(self, agent: str, ready: list[tuple[str, Target, Timer | None]]) -> dict[str, KindFigures]:
        """Each connected kind measured, all within ``probe_ms`` of wall time and ``probe_bytes``."""
        deadline = time.perf_counter() + self.probe_ms / 1e3  # every transfer ended or given up by then
        left_bytes = self.probe_bytes - SMALL_BYTES * len(ready)  # (the warm-ups' bytes count)
        kinds: dict[str, KindFigures] = {}
        for i, (kind, target, timer) in enumerate(ready):
            # an equal share of the time left each (a slow kind cannot starve the next; a quick one leaves
            # its rest to them)
            now = time.perf_counter()
            end = now + max(deadline - now, 0.0) / (len(ready) - i)
            got = measure_kind(self.transport, agent, target, end, left_bytes // (len(ready) - i), timer)
            if got is not None:
                kinds[kind] = got
                left_bytes -= got.nbytes
        return kinds

    def _figures(self, link: LinkFigures, paths: list[TransferPath], kinds: dict[str, KindFigures]) -> None:
        """Each path's :class:`PathFigures` from its kind's measure and the local copy rates."""
        d2d, h2d, fixed = self.copy_rates() if kinds else (self.model.copy_gbps, self.model.copy_gbps, 0.0)
        for p in paths:
            kind = {TransferPath.HOST: "host", TransferPath.PUSH: "push"}.get(p, "device")
            k = kinds.get(kind)
            measured = k is not None
            if k is None and p is TransferPath.PUSH:  # the push probe failed: the device READ's figures
                k = kinds.get("device")
            if k is None:
                continue
            copy = {TransferPath.DIRECT: 0.0, TransferPath.STAGED: 2e3 / d2d, TransferPath.PUSH: 2e3 / d2d,
                    TransferPath.HOST: 2e3 / d2d + 2e3 / h2d}[p]
            link.paths[p] = PathFigures(k.per_desc_us, k.gbps, copy, measured=measured,
                                        copy_fixed_us=COPIES[p] * max(fixed, COPY_FIXED_FLOOR_US),
                                        bound=k.bound and measured)
        if kinds:
            link.source = "probe"


def _device_of(kv: Any) -> str:
    """The device string of a rank's KV memory ("cpu" or "cuda:N")."""
    return str(getattr(kv, "device", "cpu") or "cpu")


def link_warning(link: LinkFigures, where: str) -> str | None:
    """The warning for a degraded link (None if it is not): a device path (direct or device staging)
    reading far below the host path or below ``DEVICE_FLOOR_GBPS``. Names the likely causes and what to
    change. Once per link: :func:`check_link` keeps it in ``link.warning``."""
    # the READs of device memory (a fast push beside them still leaves the pulls degraded)
    dev = [(p, f) for p, f in link.paths.items() if p in (TransferPath.DIRECT, TransferPath.STAGED) and f.measured]
    if not dev:
        return None
    p_dev, f_dev = max(dev, key=lambda pf: pf[1].effective_gbps)
    host = link.paths.get(TransferPath.HOST)
    g_dev = f_dev.effective_gbps
    g_host = host.effective_gbps if host is not None and host.measured else None
    ratio = DEGRADED_RATIO_CPU if link.device == "cpu" else DEGRADED_RATIO
    slow_vs_host = g_host is not None and g_dev < ratio * g_host
    # the absolute floor only where the KV memory is on a GPU (a host-memory path of a busy CPU machine
    # reading slowly is not a transport misconfiguration)
    below_floor = link.device != "cpu" and g_dev < DEVICE_FLOOR_GBPS
    if not slow_vs_host and not below_floor:
        return None
    floor = f"; below the floor of {DEVICE_FLOOR_GBPS:g} GB/s" if below_floor else ""
    vs = (f"the host path reads at {g_host:.3g} GB/s ({g_dev / g_host:.2g}x)" if g_host is not None
          else "no host path to compare")
    return (f"kvbridge: degraded link {where}: the device path ({p_dev.value}) reads at {g_dev:.3g} GB/s, "
            f"{f_dev.per_desc_us:.3g} us per descriptor; {vs}{floor}. Likely causes: "
            "no CUDA IPC / GPUDirect RDMA between these processes (UCX_PROTO_INFO=y prints 'software emulation | "
            "tcp' instead of 'zero-copy | cuda_ipc'; check UCX_TLS includes cuda_ipc and, across hosts, rc/dc "
            "and UCX_NET_DEVICES); the processes in separate PID namespaces (containers: share the PID "
            "namespace, e.g. --pid=host / hostPID, or CUDA IPC cannot open the peer's memory); CUDA "
            "expandable-segment memory (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: turn it off for the "
            "KV cache); UCX fell back to TCP (set UCX_NET_DEVICES, enable the RDMA/NVLink transports). kvbridge "
            "chooses the fastest measured path per request; transfer_mode forces one.")


def check_link(link: LinkFigures, where: str) -> str | None:
    """Log :func:`link_warning` once per link; returns its text when it was logged now."""
    if link.warning:
        return None
    text = link_warning(link, where)
    if text is not None:
        link.warning = text
        log.warning("%s", text)
    return text


def pair_paths(mode: TransferMode, decode_staging: int, decode_host: int, meta: Any) -> list[TransferPath]:
    """The paths a (decode rank, prefill rank) pair offers: direct always; device staging when both sides
    have a staging buffer; host staging when both have host staging (``meta``: the prefill's RankMeta);
    push when both have a staging buffer and the prefill said it will WRITE into ours (``meta.push``);
    none but direct when the decode rank is forced direct."""
    out = [TransferPath.DIRECT]
    if mode == TransferPath.DIRECT or not decode_staging or not meta.staging_bytes:
        return out
    out.append(TransferPath.STAGED)
    if decode_host and meta.host_staging_bytes:
        out.append(TransferPath.HOST)
    if getattr(meta, "push", False):
        out.append(TransferPath.PUSH)
    return out


def measure_links(prober: "Prober | None", model: CostModel, mode: TransferMode, decode_staging: int, decode_host: int,
                  reads: Sequence[Any], metas: dict[Any, Any], mems: dict[Any, Any], agents: dict[Any, str],
                  where: str = "", push: Callable[[Any], PushProber | None] | None = None) -> dict[Any, LinkFigures]:
    """The :class:`LinkFigures` of each prefill rank in ``reads`` (measured by ``prober`` when given, else
    the cost model's constants), the paths each pair offers, and one warning per degraded link.
    ``metas``: RankMeta per prefill rank; ``mems``: its KVMemory; ``agents``: its NIXL agent; ``push``:
    a :class:`PushProber` of a prefill rank that pushes to this one (closed here), for the push path."""
    out: dict[Any, LinkFigures] = {}
    for p in reads:
        meta = metas[p]
        paths = pair_paths(mode, decode_staging, decode_host, meta)
        pin_s = float(meta.pin_s) if getattr(meta, "pin_s", 0) else math.inf
        rate = float(meta.min_read_rate) if getattr(meta, "min_read_rate", 0) else math.inf
        if prober is None or p not in agents:
            out[p] = model_link(model, paths, pin_s, rate)
            continue
        allocs = list(getattr(mems.get(p), "allocations", ()) or ())
        kv = None
        if allocs:  # the device kind: the prefill's staging buffer (every page touched), else its KV memory
            a = max(allocs, key=lambda a: a.nbytes)
            kv = (
                (int(meta.staging_addr), int(meta.staging_bytes), str(a.device))
                if getattr(meta, "staging_addr", 0) and meta.staging_bytes
                else (int(a.addr), int(a.nbytes), str(a.device))
            )
        host = (int(meta.host_staging_addr), int(meta.host_staging_bytes)) if meta.host_staging_bytes else None
        pusher = push(p) if push is not None and TransferPath.PUSH in paths else None
        try:
            out[p] = prober.link(agents[p], kv, host, paths, pin_s, rate, pusher, int(meta.staging_bytes))
        except Exception as e:  # noqa: BLE001 - a probe never fails a handshake: the constants stand in
            log.info("kvbridge: link probe of prefill rank %s failed (%r); using the cost model's constants", p, e)
            out[p] = model_link(model, paths, pin_s, rate)
        finally:
            if pusher is not None:
                pusher.close()
        if check_link(out[p], f"{where}prefill rank {p}") and prober is not None and prober.metrics is not None:
            prober.metrics.degraded_links += 1
    return out


def observe_read(f: Any, now: float, metrics: Any = None, alone: bool = True, seconds: float | None = None) -> None:
    """A read completed (``f``: its :class:`~kvbridge.runtime.request.InFlight`, ``now``: perf_counter): fold
    each prefill rank's bytes, descriptors and the read's seconds (``seconds``, default since its start) into
    that pair's figures of the path it took, and warn once if the link now looks degraded. ``alone``: no other
    read of this rank overlapped it (only then does a small read's time say the path's fixed cost; queueing is
    not the path's)."""
    links = getattr(getattr(f.peer, "remote", None), "links", None)
    if not links:
        return
    if seconds is None:
        seconds = now - f.started
    for prank, rr in f.ranks.items():
        link = links.get(prank)
        if link is None or not rr.reads:
            continue
        nbytes = descs = 0
        for t in rr.reads:
            if t.work is not None:
                nbytes += int(t.work.total_bytes)
                descs += int(t.work.count)
            else:
                nbytes += int(t.nbytes or 0)
                descs += 1
        fig = link.paths.get(TransferPath(rr.path))
        if fig is None or not nbytes:
            continue
        fig.observe(descs, nbytes, seconds, fixed=alone)
        if check_link(link, f"to prefill engine {f.peer.engine_id!r} rank {prank}") and metrics is not None:
            metrics.degraded_links += 1


__all__ = ["Prober", "PushProber", "observe_read", "measure_kind", "link_warning", "check_link", "PROBE_MS",
           "PROBE_BYTES"]
