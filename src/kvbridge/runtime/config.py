"""Typed, frozen options of a prefill and a decode rank: the one place their defaults are written.

A rank is built from one: ``PrefillEndpoint(engine, rank, engine_id, memory=..., config=PrefillConfig(...))``
(or keyword options, ``PrefillEndpoint(..., lease_s=10)``, which replace fields of ``config``), and the
same for :class:`DecodeConfig` / ``DecodeEndpoint``. :meth:`~_Config.from_mapping` builds one from a plain
mapping (a connector's extra config, CLI flags), converting strings; an unknown key or a bad value raises
:class:`ConfigError` naming the key, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from ..errors import ConfigError
from ..modes import AUTO, TransferMode, parse_mode
from .lease import LEASE_S, MAX_READERS, MIN_READ_RATE, PIN_S, READER_IDLE_S
from .probe import PROBE_BYTES, PROBE_MS
from .protocol import STAGE_SEGMENT_BYTES

T = TypeVar("T", bound="_Config")


@dataclass(frozen=True)
class _Config:
    @classmethod
    def from_mapping(cls: type[T], m: Mapping[str, Any]) -> T:
        """Options from ``m`` (strings are converted: "30" -> 30.0); unknown keys are an error."""
        return cls(**cls._convert(m))

    @classmethod
    def resolve(cls: type[T], config: T | None, options: Mapping[str, Any]) -> T:
        """``config`` (None: every default) with ``options`` (a rank constructor's keyword arguments)
        replacing its fields, converted and checked like :meth:`from_mapping`."""
        base = config if config is not None else cls()
        if not options:
            return base
        return dataclasses.replace(base, **cls._convert(options))

    @classmethod
    def _convert(cls, m: Mapping[str, Any]) -> dict[str, Any]:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(m) - set(known))
        if unknown:
            raise ConfigError(f"unknown {cls.__name__} option(s) {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for k, v in m.items():
            want = known[k].type if isinstance(known[k].type, str) else getattr(known[k].type, "__name__", "")
            try:
                if v is None and "None" in want:
                    values[k] = None
                elif want.startswith("bool"):
                    values[k] = _bool(v)
                elif want.startswith("float"):
                    values[k] = float(v)
                elif want.startswith("int"):
                    values[k] = int(v)
                else:
                    values[k] = str(v)
            except (TypeError, ValueError):
                raise ConfigError(f"{cls.__name__}.{k} must be {want}, got {v!r}") from None
        return values

    def _positive(self, *names: str, zero_ok: tuple[str, ...] = ()) -> None:
        for n in names:
            v = getattr(self, n)
            if v is None:
                continue
            if v < 0 or (v == 0 and n not in zero_ok):
                raise ConfigError(f"{type(self).__name__}.{n} must be {'>= 0' if n in zero_ok else '> 0'}, got {v!r}")


_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})


def _bool(v: Any) -> bool:
    """A flag from a bool, 0/1, or a string (true/false, yes/no, on/off, 1/0; any case)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise ValueError(v)


@dataclass(frozen=True)
class PrefillConfig(_Config):
    """Options of a prefill rank (:class:`~kvbridge.PrefillEndpoint`)."""

    host: str = "127.0.0.1"
    """Address the side channel binds (and that decode ranks connect to)."""
    port: int = 0
    """Side-channel port (0: any free port; the bound one is ``endpoint.port``)."""
    lease_s: float = LEASE_S
    """How long a request's blocks are held for readers that have not claimed them yet."""
    pin_s: float = PIN_S
    """Longest a reader's pin (an acquire or stage request) holds the blocks after it was made."""
    pin_idle_s: float | None = None
    """A pin not refreshed (by its reader's heartbeats) for this long ends (None: ``lease_s``)."""
    staging_bytes: int = 64 << 20
    """Staging buffer for staged reads, on the KV memory's device (0: none; decode ranks read directly)."""
    stage_wait_s: float = 2.0
    """A stage request that finds the staging buffer full waits this long for space before the reader is
    told to read directly."""
    staging_peer_share: float = 0.5
    """Largest share of the staging buffer one decode engine's requests may hold at once, in (0, 1]."""
    lowered_cache: int = 64
    """Lowered plans kept (one per decode layout and rank), least recently used first out."""
    lowered_per_peer: int = 16
    """Lowered plans one decode engine may hold in that cache."""
    max_readers: int = MAX_READERS
    """Decode ranks this rank remembers (a live reader is never evicted)."""
    reader_idle_s: float = READER_IDLE_S
    """A reader without a live pin or message for this long may be forgotten."""
    min_read_rate: float = MIN_READ_RATE
    """Slowest read (bytes per second) accepted: a pin's bound grows by the request's bytes at this rate."""
    poll_s: float = 0.002
    """How often a :class:`~kvbridge.PrefillServer` checks NIXL notifications (Done) while pins are held
    (side-channel messages and hand-overs wake its thread at once)."""

    def __post_init__(self) -> None:
        self._positive("lease_s", "pin_s", "pin_idle_s", "min_read_rate", "lowered_cache", "lowered_per_peer",
                       "max_readers", "reader_idle_s", "staging_bytes", "stage_wait_s", "port", "poll_s",
                       zero_ok=("staging_bytes", "stage_wait_s", "port"))
        if not 0 < self.staging_peer_share <= 1:
            raise ConfigError(f"PrefillConfig.staging_peer_share must be in (0, 1], got {self.staging_peer_share!r}")


@dataclass(frozen=True)
class DecodeConfig(_Config):
    """Options of a decode rank (:class:`~kvbridge.DecodeEndpoint`)."""

    handshake_timeout_s: float = 5.0
    """Bound on each step of a handshake with one prefill rank (its metadata, its answer). A background
    handshake's metadata fetch from a rank that accepted the TCP connection (alive, maybe busy) waits up to
    ``connect_timeout_s`` instead; a closed port fails at once."""
    transfer_mode: TransferMode = AUTO
    """``auto`` (the cost model picks a path per prefill rank and request), or one path forced:
    ``direct``, ``staged``, ``host`` or ``push`` (:mod:`kvbridge.modes`); a pair that does not offer
    the forced path reads directly."""
    staging_bytes: int = 64 << 20
    """Staging buffer staged reads land in before their scatter (0, or ``transfer_mode="direct"``: none)."""
    stage_timeout_s: float = 10.0
    """A staged read with no answer or segment from its prefill rank for this long fails (TransferTimeout)."""
    transfer_timeout_s: float = 120.0
    """A posted read with no progress for this long fails (TransferTimeout)."""
    stage_segment_bytes: int = STAGE_SEGMENT_BYTES
    """Largest segment a prefill rank packs and announces at once for a staged read."""
    post_threads: int = 1
    """Threads that post reads to NIXL (its ``transfer()`` blocks for the whole copy on shared memory)."""
    inline_post_bytes: int = 0
    """Off by default (0) in this API; 64 MiB under vLLM (``VLLM_DECODE_DEFAULTS``: the READ posted on the
    engine's thread, as NixlConnector posts its own). When > 0, a direct
    read of at most this many bytes is posted on the calling thread (the one that runs
    ``start``/``poll``/``wait``) when no post is queued or running on the post threads: it skips the
    thread hand-over (about 0.15 ms on a 2-core host), and on shared memory (cma) the caller then waits
    for the copy itself (0.3-0.5 ms for 2 MiB here; on RDMA ``transfer()`` returns at once). 0: every read
    goes through the post threads, the calling thread never waits for a copy."""
    register_grace_s: float = 2.0
    """A read the prefill refuses because the request is not registered yet (its engine registers it when
    its step ends) is asked again for this long."""
    connect_timeout_s: float | None = None
    """Bound on a whole background handshake (None: ``2 * handshake_timeout_s + 5``)."""
    rehandshake_timeout_s: float = 1.0
    """Reads re-queued after their prefill engine restarted or disconnected wait this long for it to accept
    a connection (a dead engine fails them fast); once it has, its re-handshake is bounded as a whole
    handshake (``connect_timeout_s``): a restarted engine on a busy machine may take seconds to answer."""
    peer_idle_s: float = 3600.0
    """A prefill engine no read or connect asked for this long is released (side channel, NIXL agents,
    prepared lists) and handshaken again on its next read (vLLM's NixlConnector: an hour)."""
    max_peers: int = 1024
    """Prefill engines kept live at most; past it the least recently used idle ones are released first."""
    probe_ms: float = PROBE_MS
    """Measuring time of the link probe of each prefill rank at handshake (0: no probe; the cost model's
    constants stand in)."""
    probe_bytes: int = PROBE_BYTES
    """Bytes the link probe of one prefill rank moves at most."""
    optimistic_reads: bool = True
    """Direct reads post their READ at once, beside the acquire, instead of after the prefill granted the
    pin (the transfer overlaps the acquire's round trip: a starved prefill thread no longer delays the
    bytes, only the report). The read is still reported done only once the pin is granted and every byte
    arrived; a "not registered yet" refusal, or a READ failing before any answer, discards the bytes and
    reads again once granted; other refusals fail as before
    (:class:`~kvbridge.runtime.readmachine.RankRead`); a failed read may have written its own blocks.
    Staged reads are unchanged. False: the READ waits for the grant."""
    tag_checks: bool = False
    """With ``optimistic_reads``: a direct read whose READ ended before its grant READs its lease's tag from
    the prefill rank (64 bytes, ``runtime/tags.py``) and completes at once if the lease is still live, which
    proves what the grant would; the prefill's serving thread is then off the read's path. Its pin is
    released when its grant arrives, so the rank must keep being polled until then (``busy``; a
    :class:`~kvbridge.runtime.driver.DecodeDriver` does): a caller that stops polling once ``wait`` returned
    holds that pin until the prefill's ``pin_idle_s``. Hence off by default in this API and on under vLLM,
    whose connector's driver thread keeps polling (``VLLM_DECODE_DEFAULTS``); the whole core suite passed
    with it on (2026-12-06). Measured gains in RESULTS Q0/Q2. False: the grant decides."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "transfer_mode", parse_mode(self.transfer_mode, "DecodeConfig.transfer_mode"))
        self._positive("handshake_timeout_s", "stage_timeout_s", "transfer_timeout_s", "stage_segment_bytes",
                       "post_threads", "inline_post_bytes", "register_grace_s", "connect_timeout_s",
                       "rehandshake_timeout_s",
                       "staging_bytes", "peer_idle_s", "max_peers", "probe_ms", "probe_bytes",
                       zero_ok=("staging_bytes", "inline_post_bytes", "register_grace_s", "probe_ms",
                                "probe_bytes"))

    @property
    def connect_bound_s(self) -> float:
        """The bound on a whole background handshake: ``connect_timeout_s``, or its default."""
        return self.connect_timeout_s if self.connect_timeout_s is not None else 2 * self.handshake_timeout_s + 5.0
