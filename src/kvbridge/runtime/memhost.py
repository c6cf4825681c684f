"""What a rank does with the engine's KV memory: check it, register it, address it for copies."""
from __future__ import annotations

import msgspec
import numpy as np

from ..errors import LayoutError
from ..layout import engine_to_dict
from ..memory import KVMemory
from ..tensors import host_view

_enc = msgspec.msgpack.Encoder()


def check_memory(memory, engine, rank) -> KVMemory:
    """The rank's :class:`KVMemory`, checked against the engine layout it is used with."""
    if not isinstance(memory, KVMemory):
        raise LayoutError(f"rank {tuple(rank)}: give the engine's KV memory as a kvbridge.KVMemory "
                          f"(kvbridge.describe_memory(...)); got {type(memory).__name__}")
    if tuple(memory.rank) != tuple(rank):
        raise LayoutError(f"the memory describes rank {memory.rank}, this endpoint is rank {tuple(rank)}")
    if memory.engine != engine and engine_to_dict(memory.engine) != engine_to_dict(engine):
        raise LayoutError(f"the memory was described for {memory.engine}, this endpoint serves {engine}")
    return memory


def transport_device(mem: KVMemory) -> dict:
    """NIXL memory type and device of the rank's KV memory (one device per rank)."""
    dev = mem.device
    if dev == "mixed":
        raise LayoutError(f"rank {mem.rank}: KV memory on several devices {sorted({a.device for a in mem.allocations})}; "
                          f"one rank's cache must live on one device")
    if dev == "cpu":
        return {"mem_type": "DRAM", "device_id": 0}
    return {"mem_type": "VRAM", "device_id": mem.allocations[0].device_id}


def register_memory(transport, mem: KVMemory) -> None:
    """Register every distinct allocation once, as its own region."""
    for a in mem.allocations:
        transport.register_region(a.addr, a.nbytes, a.device)


def deregister_memory(transport, mem: KVMemory) -> None:
    for a in mem.allocations:
        transport.deregister_region(a.addr)


def host_span(mem: KVMemory) -> tuple[np.ndarray | None, int]:
    """One uint8 view over ``[lowest, highest)`` address of the rank's host allocations, and its base
    (absolute run addresses minus the base index it). Only bytes inside the allocations are ever
    touched through it (runs are checked to lie in them). None for GPU memory."""
    if mem.device != "cpu" or not mem.allocations:
        return None, 0
    lo = mem.allocations[0].addr
    hi = max(a.end for a in mem.allocations)
    return host_view(lo, hi - lo), lo


def wire_key(d: dict) -> bytes:
    """A cache key for a memory description received on the wire."""
    return _enc.encode(d)
