"""A transport wrapper that makes one memory kind or one direction slow: tests and demonstrations of
link-aware path choice (a degraded link, on a machine whose links are all fast).

``DelayedTransport(inner, [LinkDelay("host", "read", fixed_s=0.002, s_per_mib=0.001)])`` answers every
matching transfer no earlier than ``fixed_s + MiB * s_per_mib`` after it was posted (the bytes still move
through ``inner``; a transfer that takes longer than that takes its own time). What matches:

* ``kind``: the local memory of a READ. ``"host"`` is a READ into host memory named as such
  (``read(..., local_device="cpu")``: the host staging path and the probe of it); ``"device"`` is every
  other READ, into the rank's own KV device memory or device staging (on a CPU-only rank that memory is
  host memory too: "device" means the rank's own memory kind, not a GPU). Every WRITE is of kind
  ``"device"`` (the push path and its probe WRITE the prefill's device staging into the decode's
  device staging or probe buffer; no WRITE moves host staging). ``"*"`` matches both.
* ``op``: ``"read"`` (this transport is the initiator of the READ: a decode rank's reads and probes) or
  ``"write"`` (this transport WRITEs: a prefill rank's pushes and push probes).

Set ``KVBRIDGE_DELAY_LINK`` to wrap the transports a rank builds or is given (decode and prefill ranks
both read it), e.g. ``KVBRIDGE_DELAY_LINK="device:read:5:2"`` (5 ms per READ plus 2 ms per MiB into
device memory; fields ``KIND:OP:FIXED_MS[:MS_PER_MIB]``, several separated by commas). A rule of the
other direction is inert on a rank (a decode rank never WRITEs, a prefill rank never READs), so one
value set for both processes slows reads on the decode and writes on the prefill:
``"*:write:2:500"`` makes pushes slow, ``"*:read:2:500"`` every pull. Never set it in production.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ENV = "KVBRIDGE_DELAY_LINK"
KINDS = ("device", "host", "*")
OPS = ("read", "write")


@dataclass(frozen=True)
class LinkDelay:
    kind: str
    op: str = "read"
    fixed_s: float = 0.0
    s_per_mib: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"LinkDelay.kind must be one of {KINDS}, not {self.kind!r}")
        if self.op not in OPS:
            raise ValueError(f"LinkDelay.op must be one of {OPS}, not {self.op!r}")
        if self.fixed_s < 0 or self.s_per_mib < 0:
            raise ValueError(f"LinkDelay delays must be >= 0, got {self.fixed_s!r} s and {self.s_per_mib!r} s/MiB")

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + nbytes / (1 << 20) * self.s_per_mib


def parse_delays(spec: str) -> list[LinkDelay]:
    """``KIND:OP:FIXED_MS[:MS_PER_MIB]`` items separated by commas (see the module docstring)."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        parts = item.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"{ENV} item {item!r}: expected KIND:OP:FIXED_MS[:MS_PER_MIB], e.g. device:read:5:2")
        try:
            ms = [float(x) for x in parts[2:]]
        except ValueError:
            raise ValueError(f"{ENV} item {item!r}: FIXED_MS and MS_PER_MIB must be numbers") from None
        out.append(LinkDelay(parts[0], parts[1], ms[0] / 1e3, (ms[1] if len(ms) > 1 else 0.0) / 1e3))
    return out


class _Delayed:
    """A transfer handle of the inner transport, not done before ``ready_at``."""

    __slots__ = ("inner", "ready_at", "ready_ns")

    def __init__(self, inner: Any, delay_s: float):
        self.inner, self.ready_at = inner, time.monotonic() + delay_s
        self.ready_ns = time.perf_counter_ns() + int(delay_s * 1e9)

    @property
    def done_ns(self) -> int:
        """When it completed (:func:`~kvbridge.transport.base.elapsed_s`): not before its delay ended."""
        inner = int(getattr(self.inner, "done_ns", 0) or 0)
        return max(inner, self.ready_ns) if inner else 0

    def __getattr__(self, name: str) -> Any:  # posted_at and the like: the inner handle's
        return getattr(self.inner, name)


def _nbytes(work: Any) -> int:
    n = getattr(work, "total_bytes", None)
    if n is None:
        size = getattr(work, "size", None)
        size = size() if callable(size) else size
        n = size[1] if isinstance(size, tuple) else 0
    return int(n)


class DelayedTransport:
    """``inner`` with :class:`LinkDelay` rules applied (see the module docstring); everything else is
    the inner transport's."""

    def __init__(self, inner: Any, delays: list[LinkDelay]):
        self.inner, self.delays = inner, list(delays)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _delay(self, kind: str, nbytes: int, handle: Any, op: str = "read") -> Any:
        s = sum(d.seconds(nbytes) for d in self.delays if d.kind in (kind, "*") and d.op == op)
        return _Delayed(handle, s) if s > 0 else handle

    def read(self, peer: str, remote: Any, local: Any, nbytes: Any, notif: bytes = b"", remote_device: Any = None,
             cancel: Any = None, local_device: str | None = None) -> Any:
        import numpy as np
        h = self.inner.read(peer, remote, local, nbytes, notif, remote_device=remote_device, cancel=cancel,
                            local_device=local_device)
        return self._delay("host" if local_device == "cpu" else "device", int(np.asarray(nbytes).sum()), h)

    def write(self, peer: str, local: Any, remote: Any, nbytes: Any, notif: bytes = b"", remote_device: Any = None,
              local_device: str | None = None) -> Any:
        import numpy as np
        h = self.inner.write(peer, local, remote, nbytes, notif, remote_device=remote_device, local_device=local_device)
        return self._delay("device", int(np.asarray(nbytes).sum()), h, op="write")

    def post(self, peer: str, work: Any, notif: bytes = b"", cancel: Any = None, remote_device: Any = None) -> Any:
        return self._delay("device", _nbytes(work), self.inner.post(peer, work, notif, cancel=cancel,
                                                                    remote_device=remote_device))

    @staticmethod
    def _inner(h: Any) -> Any:
        return h.inner if isinstance(h, _Delayed) else h

    def check(self, h: Any) -> str:
        state: str = self.inner.check(self._inner(h))
        if state == "DONE" and isinstance(h, _Delayed) and time.monotonic() < h.ready_at:
            return "PROC"
        return state

    def settle(self, h: Any, timeout_s: float = 5.0) -> bool | None:
        if isinstance(h, _Delayed):
            wait = h.ready_at - time.monotonic()
            if wait > timeout_s:
                time.sleep(max(timeout_s, 0.0))
                return None
            if wait > 0:
                time.sleep(wait)
                timeout_s -= wait
        out: bool | None = self.inner.settle(self._inner(h), max(timeout_s, 0.0))
        return out

    def release(self, h: Any) -> None:
        self.inner.release(self._inner(h))


def wrap_from_env(transport: Any) -> Any:
    """``transport`` wrapped in a :class:`DelayedTransport` when ``KVBRIDGE_DELAY_LINK`` is set (a test or
    demonstration of a slow link); else ``transport`` itself."""
    spec = os.environ.get(ENV, "")
    if not spec:
        return transport
    delays = parse_delays(spec)
    log.warning("kvbridge: %s=%r: transfers of %s are delayed on purpose (a test of a slow link)", ENV, spec,
                getattr(transport, "agent_name", "this transport"))
    return DelayedTransport(transport, delays)


__all__ = ["LinkDelay", "DelayedTransport", "parse_delays", "wrap_from_env", "ENV"]
