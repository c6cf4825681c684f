"""Benchmark and test operations on a rank, kept out of the runtime: timed reads, NIXL's own READ of the
same descriptors, digests of what a read wrote, and filling or clearing a rank's KV memory.

Each takes the rank (a :class:`~kvbridge.runtime.decode.DecodeRank` or
:class:`~kvbridge.runtime.prefill.PrefillRank`) as its first argument; the worker processes of
:mod:`kvbridge.testing.procs` run them as commands of the same names.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np

from ..errors import RequestError, TransferError
from ..runtime.memhost import KVBytes, to_host
from ..runtime.request import ReadRequest
from ..tensors import host_view


def timed_read(rank: Any, req: ReadRequest, timeout_s: float = 120.0) -> dict[str, Any]:
    """Post ``req`` on decode ``rank`` and wait for it here (no RPC in the timing); returns seconds, bytes,
    descriptors."""
    t0 = time.perf_counter()
    rank.start(req)
    f = rank.inflight.get(req.key)
    done, failed = rank.wait(timeout_s)
    if req.req_id in failed or req.req_id not in done:
        raise TransferError(f"request {req.req_id} failed: {failed.get(req.req_id, 'timeout')}")
    dt = time.perf_counter() - t0
    nbytes, ndescs = (f.nbytes, f.ndescs) if f else (0, 0)  # counted at completion
    return {"seconds": dt, "bytes": nbytes, "descriptors": ndescs}


def _device_of(remote: Any, prank: tuple[int, int]) -> str:
    return str(getattr(remote.lowered.p_mem(prank), "device", "cpu"))


def _nixl_posts(rank: Any, agent: Any, reqs: list[ReadRequest], one_desc: bool) -> list[list[tuple[str, Any, Any]]]:
    """Per request, per prefill rank read: (peer agent, local list, remote list) of NIXL descriptors."""
    t = rank.transport
    posts = []
    for req in reqs:
        remote = rank.remotes[req.engine_id]
        arrays = []
        for d in remote.lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks):
            if not d.count:
                continue
            rtype, rdev = t.remote_mem(_device_of(remote, d.prefill))
            local, rem = d.nixl_arrays(t.device_id, rdev)
            if one_desc:  # into the rank's staging buffer: the KV blocks around the runs stay as they are
                n = int(local[:, 1].sum())
                if not rank.staging_bytes:
                    raise RequestError("nixl_reads(one_desc=True) reads into the staging buffer; this decode "
                                       "rank has none (transfer_mode='direct')")
                lo = int(rem[:, 0].min())
                alloc = next((a for a in remote.lowered.p_mem(d.prefill).allocations
                              if a.addr <= lo < a.addr + a.nbytes and a.nbytes >= n), None)
                if alloc is None:
                    raise RequestError(f"nixl_reads(one_desc=True): no allocation of {n} B on prefill rank "
                                       f"{d.prefill} around its first run")
                lo = min(lo, alloc.addr + alloc.nbytes - n)
                # one descriptor, or one per staging buffer's worth when the bytes do not fit in it
                step = min(n, int(rank.staging_bytes))
                starts = np.arange(0, n, step, dtype=np.uint64)
                sizes = np.minimum(step, n - starts).astype(np.uint64)
                local = np.stack([np.full_like(starts, rank.staging_addr), sizes,
                                  np.full_like(starts, local[0, 2])], axis=1)
                rem = np.stack([starts + np.uint64(lo), sizes, np.full_like(starts, rem[0, 2])], axis=1)
            arrays.append((remote.agents[d.prefill], agent.get_xfer_descs(local, t.mem_type),
                           agent.get_xfer_descs(rem, rtype)))
        posts.append(arrays)
    return posts


def nixl_reads(rank: Any, reqs: list[ReadRequest], one_desc: bool = False, timeout_s: float = 60.0) -> list[float]:
    """NIXL's own READ (``initialize_xfer`` + ``transfer``, polled with ``check_xfer_state``) of the very
    descriptors decode ``rank`` would post for each of ``reqs`` (started at once, one READ per prefill
    rank, no notification, no lease: the bytes must stay put), between the rank's NIXL agent and the
    prefill's. ``one_desc``: the same number of bytes as one descriptor per prefill rank (one per staging
    buffer's worth if larger), from the prefill's memory at its first run into the rank's staging buffer
    (nothing else may use it meanwhile; the reads land on the same bytes). Per request: seconds from the
    first post to its last READ completing. Needs a
    NIXL transport and a handshaken engine."""
    agent = getattr(rank.transport, "agent", None)
    if agent is None:
        raise RequestError("nixl_reads needs a NIXL transport")
    posts = _nixl_posts(rank, agent, reqs, one_desc)
    t0 = time.perf_counter()
    handles = []
    for arrays in posts:
        hs = []
        for peer, local_d, remote_d in arrays:
            h = agent.initialize_xfer("READ", local_d, remote_d, peer, b"")
            if agent.transfer(h) == "ERR":
                raise TransferError(f"NIXL READ from {peer!r} failed")
            hs.append(h)
        handles.append(hs)
    out = [0.0] * len(reqs)
    left = set(range(len(reqs)))
    deadline = time.monotonic() + timeout_s
    try:
        while left:
            for i in list(left):
                states = [agent.check_xfer_state(h) for h in handles[i]]
                if "ERR" in states:
                    raise TransferError(f"NIXL READ of {reqs[i].req_id!r} failed")
                if all(st == "DONE" for st in states):
                    out[i] = time.perf_counter() - t0
                    left.discard(i)
            if time.monotonic() > deadline:
                raise TransferError(f"NIXL READs did not complete in {timeout_s:g} s")
    finally:
        for hs in handles:
            for h in hs:
                try:
                    agent.release_xfer_handle(h)
                except Exception:  # noqa: BLE001 - still in progress after a failure
                    pass
    return out


def runs_digest(rank: Any, req: ReadRequest) -> str:
    """sha256 of the request's destination runs in decode ``rank``'s memory (to compare direct and staged)."""
    kv = KVBytes(rank.mem)
    descs = rank.remotes[req.engine_id].lowered.descriptors(req.num_tokens, req.prefill_blocks, req.decode_blocks)
    h = hashlib.sha256()
    for d in descs:
        out = kv.new_staging(d.total_bytes)
        kv.pack(d.dst, d.nbytes, out, 0)
        h.update(to_host(out).tobytes())
    return h.hexdigest()


def clear(rank: Any, value: int = 0xA5) -> None:
    """Set every byte of ``rank``'s KV memory to ``value``."""
    kv = KVBytes(rank.mem)
    if kv.torch is not None:  # torch memory (CPU or CUDA): one byte tensor per allocation
        for b in kv.bufs:
            b.fill_(value)
        return
    for a in rank.mem.allocations:
        host_view(a.addr, a.nbytes).fill(value)


def fill_random(rank: Any, seed: int = 0) -> None:
    """Fill ``rank``'s KV memory with a random pattern (period 16 MiB + 4099 B)."""
    pat = np.random.default_rng(seed).integers(0, 256, (16 << 20) + 4099, dtype=np.uint8)
    for a in rank.mem.allocations:
        buf = host_view(a.addr, a.nbytes)
        for i in range(0, buf.size, pat.size):
            n = min(pat.size, buf.size - i)
            buf[i:i + n] = pat[:n]


#: the operations above, by name (the commands of kvbridge.testing.procs workers)
OPERATIONS = {f.__name__: f for f in (timed_read, nixl_reads, runs_digest, clear, fill_random)}
