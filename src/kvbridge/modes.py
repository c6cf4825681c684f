"""How a decode rank moves one prefill rank's part of a request: the one vocabulary of paths and modes.

A *path* (:class:`TransferPath`) is how one (decode rank, prefill rank) pair moves one request's bytes:
``direct`` (one READ of the prefill's blocks into the decode's), ``staged`` (the prefill packs the
blocks into a staging buffer on its device and the decode reads segments of it and scatters) or
``host`` (the same through registered host staging buffers: device -> host on the prefill, a host to
host READ, host -> device on the decode) or ``push`` (the prefill packs into its staging buffer and
WRITEs each segment into the decode's staging slot, named in the stage request; the decode issues no
READ and scatters). A decode rank's
*transfer mode* is one path forced for every read, or :data:`AUTO` (the cost model picks a path per
pair and request). :class:`TransferPath` is a ``str`` enum: ``TransferPath.DIRECT == "direct"``, and the
strings are what users pass (``DecodeConfig(transfer_mode="staged")``, ``--mode staged``).
"""
from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeAlias

from .errors import ConfigError


class TransferPath(StrEnum):
    """How one (decode rank, prefill rank) pair moves a request's bytes."""

    DIRECT = "direct"  # READ of the KV memory, one descriptor per contiguous run
    STAGED = "staged"  # prefill packs into its staging buffer; READ of segments; decode scatters
    HOST = "host"      # as staged, through host staging: device -> host, READ host -> host, host -> device
    PUSH = "push"      # prefill packs and WRITEs into the decode's staging slot; decode scatters (no READ)


AUTO: Literal["auto"] = "auto"
#: a decode rank's transfer mode: a path forced for every read, or ``"auto"``
TransferMode: TypeAlias = TransferPath | Literal["auto"]
#: every value a ``transfer_mode`` option takes
TRANSFER_MODES: tuple[str, ...] = (AUTO, *(p.value for p in TransferPath))
#: the paths a decode rank can be forced to take, in order (a GPU suite runs a row per path and auto)
PATHS: tuple[TransferPath, ...] = tuple(TransferPath)


def parse_mode(mode: str, what: str = "transfer_mode") -> TransferMode:
    """``mode`` checked: ``"auto"`` or a :class:`TransferPath`; :class:`~kvbridge.errors.ConfigError` (a
    ``ValueError``) names ``what`` and the choices otherwise."""
    if mode == AUTO:
        return AUTO
    try:
        return TransferPath(mode)
    except ValueError:
        raise ConfigError(f"{what} must be one of {', '.join(TRANSFER_MODES)}, got {mode!r}") from None


__all__ = ["TransferPath", "TransferMode", "AUTO", "TRANSFER_MODES", "PATHS", "parse_mode"]
