"""Normalise the engine's memory objects into (address, shape, byte strides, itemsize, device).

Accepted: numpy arrays, torch tensors (CPU or CUDA) and :class:`RawRegion` (address, size, device).
torch is never imported here: a value can only be a torch tensor if the engine already imported
torch, so the check looks in ``sys.modules`` first (as NIXL's own ``_is_torch_tensor`` does).
Strides are normalised to bytes (torch counts them in elements).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import LayoutError


@dataclass(frozen=True, slots=True)
class RawRegion:
    """Memory given by address: ``nbytes`` bytes at ``addr`` on ``device`` (``"cpu"`` or ``"cuda:N"``).

    Use it for memory kvbridge cannot inspect (another framework's allocation). As a tensor it is a
    1-D uint8 array of ``nbytes``: give it to :meth:`KVMemory.from_buffer <kvbridge.memory.KVMemory.from_buffer>`
    (kvbridge's default layout placed in it)."""

    addr: int
    nbytes: int
    device: str = "cpu"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    addr: int                 # address of element [0, 0, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # bytes
    itemsize: int
    device: str               # "cpu" or "cuda:N"
    alloc_addr: int           # the allocation (storage) holding it
    alloc_nbytes: int

    @property
    def nbytes(self) -> int:
        """Bytes from the first element to the end of the allocation."""
        return self.alloc_addr + self.alloc_nbytes - self.addr


def is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def tensor_info(x: Any) -> TensorInfo:
    """Describe ``x`` without copying it; raises LayoutError for anything else."""
    if isinstance(x, RawRegion):
        if x.addr <= 0 or x.nbytes <= 0:
            raise LayoutError(f"raw region {x!r}: address and size must be positive")
        return TensorInfo(x.addr, (x.nbytes,), (1,), 1, _device_name(x.device), x.addr, x.nbytes)
    if isinstance(x, np.ndarray):
        root = x
        while isinstance(root.base, np.ndarray):
            root = root.base
        addr = x.__array_interface__["data"][0]
        raddr = root.__array_interface__["data"][0]
        rbytes = root.nbytes if root.flags.c_contiguous or root.flags.f_contiguous else _span(root)
        return TensorInfo(addr, tuple(x.shape), tuple(x.strides), x.itemsize, "cpu", raddr, rbytes)
    if is_torch_tensor(x):
        st = x.untyped_storage()
        dev = x.device
        device = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
        es = x.element_size()
        return TensorInfo(x.data_ptr(), tuple(x.shape), tuple(s * es for s in x.stride()), es, device,
                          st.data_ptr(), st.nbytes())
    raise LayoutError(f"cannot use {type(x).__name__} as KV memory: give a numpy array, a torch tensor or a "
                      f"kvbridge.RawRegion(addr, nbytes, device)")


def _span(a: np.ndarray) -> int:
    lo = hi = 0
    for n, s in zip(a.shape, a.strides):
        lo, hi = lo + min((n - 1) * s, 0), hi + max((n - 1) * s, 0)
    return hi - lo + a.itemsize


def _device_name(device: str) -> str:
    d = str(device)
    if d == "cpu" or d.startswith("cuda"):
        return d if d == "cpu" or ":" in d else "cuda:0"
    raise LayoutError(f"device {device!r}: use 'cpu' or 'cuda:N'")


def buffer_region(buf: Any) -> tuple[int, int, str]:
    """``(addr, nbytes, device)`` of a contiguous buffer (numpy array or torch tensor) to register."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("register a contiguous buffer")
        return int(buf.ctypes.data), int(buf.nbytes), "cpu"
    if is_torch_tensor(buf):
        if not buf.is_contiguous():
            raise ValueError("register a contiguous buffer")
        dev = buf.device
        device = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size()), device
    raise TypeError(f"cannot register {type(buf).__name__}: give a numpy array or a torch tensor")


def host_view(addr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 numpy view of host memory ``[addr, addr+nbytes)`` (no copy, nothing touched)."""
    import ctypes
    raw = (ctypes.c_uint8 * nbytes).from_address(addr)
    view: np.ndarray = np.frombuffer(raw, dtype=np.uint8)  # type: ignore[call-overload]  # a ctypes array is a buffer
    return view
