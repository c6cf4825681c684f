"""The host-staged path's buffers and copies: one code path for numpy arrays and torch tensors on any
device (a CPU-only rank runs the same operations, its "device" being host memory).

Host staging mirrors a rank's device staging buffer: the same size, the same slot offsets (one slot
allocator serves both). The prefill packs a segment into its device staging slot (the usual pack) and
copies it device -> host (:func:`copy_span`); the decode READs host -> host into the same offsets of its
host staging, copies host -> device staging and scatters as usual. A host buffer is pinned (page-locked)
when the rank's memory is on a CUDA device, so both copies are DMA transfers.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def new_host_buffer(kv: Any, nbytes: int) -> Any:
    """A host buffer of ``nbytes`` for a rank whose KV bytes are ``kv`` (a :class:`~kvbridge.runtime.memhost.KVBytes`):
    a torch CPU tensor (pinned on a CUDA rank) when the rank copies with torch, else a numpy array;
    every page touched now."""
    torch = getattr(kv, "torch", None)
    if torch is not None:
        pin = bool(getattr(kv, "cuda", False)) and bool(torch.cuda.is_available())
        t = torch.zeros(int(nbytes), dtype=torch.uint8, pin_memory=pin)
        return t
    out = np.empty(int(nbytes), dtype=np.uint8)
    out.fill(0)
    return out


def _torch_of(*bufs: Any) -> Any:
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and any(isinstance(b, torch.Tensor) for b in bufs):
        return torch
    return None


def copy_span(dst: Any, dst_off: int, src: Any, src_off: int, nbytes: int) -> None:
    """``dst[dst_off:dst_off+nbytes] = src[src_off:src_off+nbytes]`` for byte buffers (numpy arrays or torch
    uint8 tensors, on any devices: torch copies between them, device -> host or host -> device)."""
    if nbytes <= 0:
        return
    torch = _torch_of(dst, src)
    if torch is None:
        dst[dst_off:dst_off + nbytes] = src[src_off:src_off + nbytes]
        return
    d = dst if isinstance(dst, torch.Tensor) else torch.from_numpy(dst)
    s = src if isinstance(src, torch.Tensor) else torch.from_numpy(src)
    d[dst_off:dst_off + nbytes].copy_(s[src_off:src_off + nbytes])


def sync(buf: Any) -> None:
    """Wait for the copies queued on ``buf``'s CUDA device (nothing for host buffers)."""
    torch = _torch_of(buf)
    if torch is not None and buf.device.type == "cuda":
        torch.cuda.current_stream(buf.device).synchronize()


def offset_view(buf: Any, offset: int) -> Any:
    """``buf`` from byte ``offset`` on (a second region of one buffer, for copy timing)."""
    return buf[offset:]


def to_host_segment(staging: Any, host: Any, offset: int, nbytes: int) -> None:
    """Prefill: a packed segment of the device staging buffer -> the same offsets of host staging (the
    copy finished on return: a peer READs it next)."""
    copy_span(host, offset, staging, offset, nbytes)
    sync(staging)


def from_host_segment(host: Any, staging: Any, offset: int, nbytes: int) -> None:
    """Decode: a segment READ into host staging -> the same offsets of the device staging buffer, before
    it is scattered."""
    copy_span(staging, offset, host, offset, nbytes)
    sync(staging)


__all__ = ["new_host_buffer", "copy_span", "sync", "to_host_segment", "from_host_segment"]
