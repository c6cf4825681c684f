"""Transports move descriptor pairs. Only :mod:`kvbridge.transport.nixl` imports NIXL."""
from .base import Transport, XferHandle
from .loopback import LoopbackRegistry, LoopbackTransport
from .reference import ReferenceTransport

__all__ = ["Transport", "XferHandle", "LoopbackTransport", "LoopbackRegistry", "ReferenceTransport"]
