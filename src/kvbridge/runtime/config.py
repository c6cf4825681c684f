"""Typed, frozen options of a prefill and a decode rank, built from a plain mapping (a connector's extra
config, CLI flags) with every key and value checked once, at build time.

``PrefillRank(engine, rank, engine_id, memory=..., **PrefillConfig.from_mapping(m).kwargs())`` and the same
for :class:`DecodeConfig` / ``DecodeRank``; an unknown key or a bad value raises :class:`ConfigError`
naming the key, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from ..errors import KVBridgeError
from .protocol import STAGE_SEGMENT_BYTES


class ConfigError(KVBridgeError, ValueError):
    """An option of a prefill or decode rank is unknown or has a bad value."""


T = TypeVar("T", bound="_Config")


@dataclass(frozen=True)
class _Config:
    @classmethod
    def from_mapping(cls: type[T], m: Mapping[str, Any]) -> T:
        """Options from ``m`` (strings are converted: "30" -> 30.0); unknown keys are an error."""
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
                elif want.startswith("float"):
                    values[k] = float(v)
                elif want.startswith("int"):
                    values[k] = int(v)
                else:
                    values[k] = str(v)
            except (TypeError, ValueError):
                raise ConfigError(f"{cls.__name__}.{k} must be {want}, got {v!r}") from None
        return cls(**values)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the rank's constructor."""
        return dataclasses.asdict(self)

    def _positive(self, *names: str, zero_ok: tuple[str, ...] = ()) -> None:
        for n in names:
            v = getattr(self, n)
            if v is None:
                continue
            if v < 0 or (v == 0 and n not in zero_ok):
                raise ConfigError(f"{type(self).__name__}.{n} must be {'>= 0' if n in zero_ok else '> 0'}, got {v!r}")


@dataclass(frozen=True)
class PrefillConfig(_Config):
    """Options of :class:`~kvbridge.runtime.prefill.PrefillRank` (see its docstring)."""

    host: str = "127.0.0.1"
    port: int = 0
    lease_s: float = 30.0
    pin_s: float = 120.0
    pin_idle_s: float | None = None
    staging_bytes: int = 64 << 20
    stage_wait_s: float = 2.0
    staging_peer_share: float = 0.5
    lowered_cache: int = 64
    lowered_per_peer: int = 16
    max_readers: int = 4096
    reader_idle_s: float = 60.0

    def __post_init__(self) -> None:
        self._positive("lease_s", "pin_s", "pin_idle_s", "lowered_cache", "lowered_per_peer", "max_readers",
                       "reader_idle_s", "staging_bytes", "stage_wait_s", "port", zero_ok=("staging_bytes",
                                                                                      "stage_wait_s", "port"))
        if not 0 < self.staging_peer_share <= 1:
            raise ConfigError(f"PrefillConfig.staging_peer_share must be in (0, 1], got {self.staging_peer_share!r}")


@dataclass(frozen=True)
class DecodeConfig(_Config):
    """Options of :class:`~kvbridge.runtime.decode.DecodeRank` (see its docstring)."""

    handshake_timeout_s: float = 5.0
    transfer_mode: str = "auto"
    staging_bytes: int = 64 << 20
    stage_timeout_s: float = 10.0
    transfer_timeout_s: float = 120.0
    stage_segment_bytes: int = STAGE_SEGMENT_BYTES
    post_threads: int = 1
    register_grace_s: float = 2.0
    connect_timeout_s: float | None = None
    rehandshake_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if self.transfer_mode not in ("auto", "direct", "staged"):
            raise ConfigError(f"DecodeConfig.transfer_mode must be auto, direct or staged, got {self.transfer_mode!r}")
        self._positive("handshake_timeout_s", "stage_timeout_s", "transfer_timeout_s", "stage_segment_bytes",
                       "post_threads", "register_grace_s", "connect_timeout_s", "rehandshake_timeout_s",
                       "staging_bytes", zero_ok=("staging_bytes", "register_grace_s"))
