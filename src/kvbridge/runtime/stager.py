"""A prefill rank's stage packer: stage requests packed into staging slots, segment by segment (read by
the decode, device- or host-staged) or written into the decode's staging (the push path, and its probe)."""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ..errors import HandshakeError, KVBridgeError
from ..lower import Descriptors
from ..modes import TransferPath
from ..transport.base import Transport, elapsed_s
from ..transport.nixl import metadata_digest
from .lease import Lease, PinKey, Rank, Reader
from .memhost import KVBytes, staging_nbytes
from .metrics import Metrics
from .paths import new_host_buffer, to_host_segment
from .protocol import (
    PUSH_PROBE_MAX_BYTES,
    PUSH_PROBE_MAX_DESCS,
    Code,
    GetMeta,
    PushProbe,
    PushProbed,
    Stage,
    Staged,
    StageError,
    pack,
)
from .readers import ReaderAuth
from .slots import SlotAllocator

log = logging.getLogger("kvbridge.runtime.prefill")

SlotKey = tuple[str, str, tuple[int, ...], str]  # (request, decode engine, decode rank, read id)
Reply = Staged | StageError

# the paths a stage request may name (those that stage on this rank); a str enum: ``"push" in STAGE_PATHS``
STAGE_PATHS: frozenset[TransferPath] = frozenset({TransferPath.STAGED, TransferPath.HOST, TransferPath.PUSH})


def as_rank(rank: Sequence[int]) -> Rank:
    """``rank`` as a (pp, tp) tuple."""
    return cast(Rank, tuple(rank))


def reader_of(msg: Any) -> Reader:
    """The reader a decode's message names: (decode engine, decode rank)."""
    return (msg.decode_engine, as_rank(msg.decode_rank))


def read_id_of(msg: Any) -> str:
    """The read a message names (its request id when it names none)."""
    return str(msg.read_id or msg.req_id)


def pin_key(msg: Stage) -> PinKey:
    """The pin a stage request's reader holds: ((decode engine, decode rank), read id)."""
    return (reader_of(msg), read_id_of(msg))


def slot_key(msg: Stage) -> SlotKey:
    """A staging slot is held by one pin: (request, decode engine, decode rank, read id)."""
    return (msg.req_id, msg.decode_engine, tuple(msg.decode_rank), read_id_of(msg))


def ttl_of(lease: Lease, msg: Stage) -> float:
    """Seconds the pin of ``msg``'s reader still holds (0 if it holds none)."""
    pin = lease.pins.get(pin_key(msg))
    return max(0.0, pin.deadline - time.monotonic()) if pin is not None else 0.0


@dataclass
class Parked:
    """A stage request waiting for staging space."""
    envelope: list[bytes]
    msg: Stage
    descs: Descriptors | None
    deadline: float


@dataclass
class Push:
    """A push stage request being written: its segments' WRITEs in segment order, each answered (Staged)
    once it and every earlier one completed; ``error`` (or the pin ending, ``ended``) is answered once no
    WRITE of it is in flight, so the decode never reuses its slot while a WRITE may still land there."""

    envelope: list[bytes]
    msg: Stage
    agent: str
    # (handle, stream offset, bytes, last), in segment order
    pending: deque[tuple[Any, int, int, bool]] = field(default_factory=deque)
    error: StageError | None = None
    total: int = 0        # the packed stream's bytes
    ended: bool = False   # the pin ended meanwhile: its staging slot is freed once the WRITEs settled
    posted: bool = False  # every segment was packed and its WRITE posted (or the posting stopped on an error)


class Stager:
    """The staging buffers of one prefill rank (on its KV memory's device, and a host mirror), their slots,
    the stage requests parked for space, and the push path's WRITEs and probes. Answers that go out later
    (parked requests, completed WRITEs) go through ``send`` (frames onto the rank's ROUTER socket);
    ``lease_of`` looks up a request's live lease."""

    def __init__(self, rank: Rank, kv: KVBytes, transport: Transport,
                 send: Callable[[list[bytes]], object], metrics: Metrics, auth: ReaderAuth,
                 lease_of: Callable[[str], Lease | None], staging_bytes: int, staging_peer_share: float,
                 stage_wait_s: float) -> None:
        self.rank, self.kv, self.transport, self.send, self.metrics = rank, kv, transport, send, metrics
        self.auth, self.lease_of = auth, lease_of
        # a stage request that finds the staging buffer full waits this long for a slot to free (the
        # previous request's Done is usually in flight) before the prefill says "full, read directly":
        # a direct read of small head slices is many times slower than waiting a few milliseconds
        self.stage_wait_s = stage_wait_s
        self.parked: list[Parked] = []
        # staged transfers: runs packed here for one decode rank, read with one descriptor. The staging
        # buffer lives on the KV memory's device (VRAM there on a GPU) and packing runs there (torch ops
        # for torch tensors, CPU or CUDA; numpy for other host memory)
        self.staging: Any = kv.new_staging(staging_bytes) if staging_bytes else np.empty(0, np.uint8)
        self.staging_bytes = staging_nbytes(self.staging)
        self.staging_addr = transport.register(self.staging) if self.staging_bytes else 0
        # host staging mirrors the staging buffer (same slots): the host-staged path packs on the device,
        # copies device -> host here, and the decode READs host -> host (pinned on a CUDA rank)
        self.host_staging: Any = (
            new_host_buffer(kv, self.staging_bytes) if self.staging_bytes else np.empty(0, np.uint8)
        )
        self.host_staging_addr = transport.register(self.host_staging) if self.staging_bytes else 0
        self.slots = SlotAllocator(self.staging_bytes)
        # per-peer quota: one decode engine's staging slots (all its ranks together) hold at most this
        # share of the buffer, so a slow, stuck or dead decode engine cannot starve the others
        self.staging_peer_bytes = int(self.staging_bytes * staging_peer_share)
        # the push path: readers' NIXL agent metadata from their handshake (reader -> (agent, metadata,
        # sha256)), the agents added to this rank's transport for WRITEs (added at a reader's first push
        # stage request, removed when the reader is evicted or rebound), push stage requests being written
        self.push_meta: dict[Reader, tuple[str, bytes, str]] = {}
        self.push_peers: dict[Reader, str] = {}
        self.pushes: dict[SlotKey, Push] = {}  # slot key -> its push
        # push probes being written (reader -> (envelope, WRITE handle, perf_counter when posted)): one at
        # a time per reader
        self.probes: dict[Reader, tuple[list[bytes], Any, float]] = {}

    # ---- stage requests ------------------------------------------------------------------------
    def stage(self, msg: Stage, d: Descriptors | None, lease: Lease, ttl: float,
              envelope: list[bytes]) -> Iterator[Reply]:
        """Answer a pinned stage request whose runs on this rank are ``d``: packed into a staging slot,
        segment by segment; with no free staging space it waits (up to ``stage_wait_s``) for a slot."""
        read_id = read_id_of(msg)
        if msg.path == TransferPath.PUSH:
            bad_push = self.push_check(msg, reader_of(msg))
            if bad_push is not None:
                yield StageError(msg.req_id, f"cannot push: {bad_push}; read it", code=Code.BAD_REQUEST, ttl_s=ttl,
                                 read_id=read_id, attempt=msg.attempt)
                return
        self.unpark(*slot_key(msg))  # a retried request replaces a parked one
        replies = self.pack_into_slot(msg, d, lease, envelope)
        if replies is None:
            total = d.total_bytes if d is not None else 0
            if self.slots.rounded(total) > min(self.slots.capacity, self.staging_peer_bytes) or self.stage_wait_s <= 0:
                yield self.full_error(msg, d, lease)
                return
            self.metrics.stage_waits += 1
            self.parked.append(Parked(envelope, msg, d, time.monotonic() + self.stage_wait_s))
            return
        yield from replies

    def unpark(self, req_id: str, decode_engine: str, decode_rank: tuple[int, ...], read_id: str) -> None:
        key = (req_id, decode_engine, tuple(decode_rank), read_id)
        self.parked = [p for p in self.parked if slot_key(p.msg) != key]

    def pin_ended(self, key: SlotKey) -> None:
        """The pin holding slot ``key`` ended: its slot goes back (once its WRITEs settled, on the push
        path), and a stage request of it parked for space is dropped."""
        push = self.pushes.get(key)
        if push is not None:  # WRITEs from the slot may be in flight: it is freed once they settled
            push.ended = True
        else:
            self.slots.free(key)
        lease = self.lease_of(key[0])
        if lease is not None:
            lease.staged.discard(key)
        if self.parked:
            self.unpark(*key)

    def expired_error(self, msg: Stage) -> StageError:
        self.metrics.refused_reads += 1
        return StageError(msg.req_id, f"request {msg.req_id!r} is unknown, expired or re-registered (another "
                                      f"attempt) on prefill rank {self.rank}; its blocks may be reused: do not read "
                                      "them", expired=True, code=Code.LEASE_EXPIRED, read_id=read_id_of(msg),
                          attempt=msg.attempt)

    def retry_parked(self) -> None:
        """Serve stage requests that waited for staging space, in arrival order (first fit). A request
        whose lease is gone, or whose pin ended meanwhile (its reader's Done: it aborted or failed; or a
        timeout), is dropped; one that still does not fit waits until its deadline, then gets "full"."""
        now = time.monotonic()
        parked, self.parked = self.parked, []
        for p in parked:
            lease = self.lease_of(p.msg.req_id)
            try:
                replies: list[Reply] | Iterator[Reply] | None
                if lease is None or lease.attempt != p.msg.attempt:
                    replies = [self.expired_error(p.msg)]
                elif pin_key(p.msg) not in lease.pins:
                    continue  # the reader gave up on it meanwhile: nobody will read it
                else:
                    replies = self.pack_into_slot(p.msg, p.descs, lease, p.envelope)
                    if replies is None:
                        if now < p.deadline:
                            self.parked.append(p)
                            continue
                        replies = [self.full_error(p.msg, p.descs, lease)]
                for reply in replies:
                    self.send(p.envelope + pack(reply))
            except Exception as e:  # noqa: BLE001 - one bad request must not drop the others or the rank
                log.warning("stage request %s failed while packing: %r", p.msg.req_id, e)
                self.metrics.failed_stage_requests += 1
                self.send(p.envelope + pack(StageError(
                    p.msg.req_id, f"prefill rank {self.rank} failed packing {p.msg.req_id!r}; read it directly",
                    code=Code.INTERNAL, ttl_s=ttl_of(lease, p.msg) if lease is not None else 0.0,
                    read_id=read_id_of(p.msg), attempt=p.msg.attempt)))

    def full_error(self, msg: Stage, d: Descriptors | None, lease: Lease) -> StageError:
        total = d.total_bytes if d is not None else 0
        self.metrics.stage_full += 1
        held = self.slots.group_bytes(msg.decode_engine)
        if held + self.slots.rounded(total) > self.staging_peer_bytes:
            self.metrics.stage_quota_full += 1
            why = (f"decode engine {msg.decode_engine!r} holds {held} B of its {self.staging_peer_bytes} B share "
                   f"of the {self.slots.capacity} B staging buffer")
        else:
            why = f"staging buffer full: {self.slots.bytes_used} of {self.slots.capacity} B used"
        return StageError(msg.req_id, f"cannot stage {total} B ({why}; waited up to {self.stage_wait_s:g} s); "
                                      "read directly", code=Code.FULL, ttl_s=ttl_of(lease, msg),
                          read_id=read_id_of(msg), attempt=msg.attempt)

    def pack_into_slot(self, msg: Stage, d: Descriptors | None, lease: Lease,
                       envelope: list[bytes] | None = None) -> Iterator[Reply] | None:
        """Allocate a staging slot (held by the reader's pin, of ``lease``) and return a generator of Staged
        replies that packs segment by segment; None when there is no free slot of the size needed. A push stage
        request's generator packs and posts each segment's WRITE and yields nothing: its answers go out
        as the WRITEs complete (:meth:`advance_pushes`)."""
        from ..staging import RunSlice, run_lengths, segment_bounds
        total = d.total_bytes if d is not None else 0
        key = slot_key(msg)
        off = self.slots.alloc(key, total, group=msg.decode_engine, limit=self.staging_peer_bytes)
        if off is None:
            return None
        lease.staged.add(key)
        read_id = read_id_of(msg)
        if msg.path == TransferPath.PUSH and total:
            assert d is not None
            return self.push_segments(msg, d, off, list(envelope or ()))

        host = msg.path == TransferPath.HOST  # the decode READs host staging: each packed segment is copied there
        base = self.host_staging_addr if host else self.staging_addr

        def replies() -> Iterator[Reply]:
            if not total:
                yield Staged(msg.req_id, base + off, 0, 0, 0, True, ttl_of(lease, msg), read_id,
                             msg.attempt)
                return
            assert d is not None
            lengths = run_lengths(d)  # the runs' addresses stay factored: computed where the copy runs
            bounds = segment_bounds(lengths, msg.segment_bytes)
            pos = 0
            for i, (a, b) in enumerate(bounds):
                n = self.kv.pack(RunSlice(d, "src", a, b), lengths[a:b], self.staging, off + pos)
                if host:
                    to_host_segment(self.staging, self.host_staging, off + pos, n)
                yield Staged(msg.req_id, base + off + pos, n, pos, total, i == len(bounds) - 1,
                             ttl_of(lease, msg), read_id, msg.attempt)
                pos += n
        return replies()

    # ---- the push path: WRITE packed segments into the decode's staging --------------------------
    def bind_push(self, reader: Reader, msg: GetMeta) -> bool:
        """Remember the reader's agent metadata from its handshake (the push path), and forget the agents
        of readers no longer bound as they were (evicted from the reader table, or rebound to another
        agent). True if this reader can be pushed to."""
        for r, (agent, _, _) in list(self.push_meta.items()):
            if self.auth.table.agent_of(r) != agent:
                del self.push_meta[r]
                self.drop_push_peer(r)
        md = bytes(msg.decode_agent_metadata)
        if not md or not self.staging_bytes or metadata_digest(md) != msg.decode_metadata_sha256:
            return False
        old = self.push_meta.get(reader)
        if (old is not None and old[1] != md and not any(k[1:3] == reader for k in self.pushes)
                and reader not in self.probes):
            # new metadata (a restarted decode process, or memory it registered since): added anew at the
            # reader's next push stage request or probe (never while one of its pushes or probes is in flight)
            self.drop_push_peer(reader)
        self.push_meta[reader] = (msg.decode_agent, md, msg.decode_metadata_sha256)
        return True

    def drop_push_peer(self, reader: Reader) -> None:
        name = self.push_peers.pop(reader, None)
        if name is not None and name not in self.push_peers.values():
            self.transport.remove_peer(name)

    def push_agent(self, reader: Reader) -> str:
        """The transport's peer name of ``reader``'s agent (added on its first push stage request)."""
        name = self.push_peers.get(reader)
        if name is not None:
            return name
        meta = self.push_meta.get(reader)
        if meta is None:
            raise HandshakeError(f"decode rank {reader[1]} of {reader[0]!r} sent no NIXL agent metadata at its "
                                 f"handshake with prefill rank {self.rank}")
        name = self.transport.add_peer(meta[1], meta[2])
        if name != meta[0]:
            self.transport.remove_peer(name)
            raise HandshakeError(f"decode rank {reader[1]} of {reader[0]!r} sent the metadata of agent {name!r}, "
                                 f"not of {meta[0]!r}")
        self.push_peers[reader] = name
        return name

    def push_check(self, msg: Stage, reader: Reader) -> str | None:
        """Why this push stage request cannot be served (None: it can; the reader's agent is added)."""
        if not msg.push_addr:
            return "the stage request names no staging slot of the decode (push_addr)"
        if slot_key(msg) in self.pushes:
            return "this read's segments are being written already"
        try:
            self.push_agent(reader)
        except KVBridgeError as e:
            return str(e)
        return None

    def push_segments(self, msg: Stage, d: Descriptors, off: int, envelope: list[bytes]) -> Iterator[Reply]:
        """Pack each segment into this rank's staging slot at ``off`` and post its WRITE to the same stream
        offset of the decode's slot (``msg.push_addr``); a generator that yields nothing (its answers go
        out as the WRITEs complete). A failure stops the posting; it is answered once nothing is in flight."""
        from ..staging import RunSlice, run_lengths, segment_bounds
        reader = reader_of(msg)
        job = self.pushes[slot_key(msg)] = Push(envelope, msg, self.push_peers[reader], total=d.total_bytes)
        one = np.ones(1, dtype=np.int64)
        try:
            lengths = run_lengths(d)
            bounds = segment_bounds(lengths, msg.segment_bytes)
            pos = 0
            for i, (a, b) in enumerate(bounds):
                n = self.kv.pack(RunSlice(d, "src", a, b), lengths[a:b], self.staging, off + pos)
                h = self.transport.write(job.agent, one * (self.staging_addr + off + pos), one * (msg.push_addr + pos),
                                         one * n, remote_device=msg.push_device or None)
                job.pending.append((h, pos, n, i == len(bounds) - 1))
                self.metrics.pushed_segments += 1
                pos += n
        except Exception as e:  # noqa: BLE001 - answered typed once the WRITEs posted so far settled
            job.error = self.push_error(msg, e)
        finally:
            job.posted = True
        return
        yield  # (a generator: the stage request's answers are the WRITEs' completions)

    def push_error(self, msg: Stage, e: BaseException) -> StageError:
        self.metrics.failed_pushes += 1
        log.warning("prefill rank %s: pushing %s to decode rank %s of %r failed: %r", self.rank, msg.req_id,
                    tuple(msg.decode_rank), msg.decode_engine, e)
        lease = self.lease_of(msg.req_id)
        ok = lease is not None and lease.attempt == msg.attempt
        text = str(e) if isinstance(e, KVBridgeError) else type(e).__name__
        return StageError(msg.req_id, f"prefill rank {self.rank} could not WRITE {msg.req_id!r} into the decode's "
                                      f"staging: {text}", code=Code.INTERNAL,
                          ttl_s=ttl_of(lease, msg) if ok and lease is not None else 0.0, read_id=read_id_of(msg),
                          attempt=msg.attempt)

    def advance_pushes(self) -> int:
        """Answer the push stage requests' segments whose WRITEs completed (in segment order); a failed
        WRITE, or a pin that ended, is answered once none of the request's WRITEs is in flight (then its
        staging slot is freed if its pin ended). Returns how many answers went out."""
        sent = 0
        for key, job in list(self.pushes.items()):
            msg = job.msg
            while job.pending and job.error is None and not job.ended:
                h, pos, n, last = job.pending[0]
                try:
                    state = self.transport.check(h)
                except Exception as e:  # noqa: BLE001 - a typed answer, never a dead rank
                    job.error = self.push_error(msg, e)
                    break
                if state != "DONE":
                    break
                job.pending.popleft()
                self.transport.release(h)
                lease = self.lease_of(msg.req_id)
                ttl = ttl_of(lease, msg) if lease is not None else 0.0
                self.send(job.envelope + pack(Staged(
                    msg.req_id, msg.push_addr + pos, n, pos, job.total, last, ttl, read_id_of(msg), msg.attempt)))
                sent += 1
            if job.error is not None or job.ended:
                if any(self.transport.settle(h, 0) is None for h, *_ in job.pending):
                    continue  # a WRITE is still in flight: answer once it settled
                for h, *_ in job.pending:
                    self.transport.release(h)
                job.pending.clear()
                self.send(job.envelope + pack(job.error or StageError(
                    msg.req_id, f"the pin of read {read_id_of(msg)!r} ended while its segments were being written; "
                                "do not use them", expired=True, code=Code.LEASE_EXPIRED, read_id=read_id_of(msg),
                    attempt=msg.attempt)))
                sent += 1
            if job.posted and not job.pending:
                del self.pushes[key]
                if job.ended:
                    self.slots.free(key)
        return sent

    # ---- the push probe: a reader times the push path's WRITE at its handshake ---------------------
    def push_probe(self, msg: PushProbe, envelope: list[bytes]) -> PushProbed | None:
        """Post the WRITE a push probe asks for (from this rank's staging buffer into the reader's probe
        buffer); None: answered once it completed (:meth:`advance_probes`), never waited for here.
        Refused typed: a reader not bound at handshake as this agent or not pushed to, one with a probe
        in flight, or more than ``PUSH_PROBE_MAX_BYTES`` / ``PUSH_PROBE_MAX_DESCS``."""
        reader = reader_of(msg)
        bad = self.auth.check(reader, msg.decode_agent, msg.incarnation)
        if bad is not None:
            return PushProbed(False, bad[0], bad[1])
        if reader not in self.push_meta:
            return PushProbed(False, Code.BAD_REQUEST, f"prefill rank {self.rank} does not push to decode rank "
                                                       f"{reader[1]} of {reader[0]!r} (no staging, or no agent "
                                                       "metadata at its handshake)")
        if reader in self.probes:
            return PushProbed(False, Code.BUSY, "a push probe of this decode rank is being written already")
        descs, nbytes, stride = int(msg.descs), int(msg.nbytes), int(msg.stride)
        if descs == 0:
            return PushProbed(True)  # the side channel's round trip
        extent = (descs - 1) * stride + nbytes
        if (descs < 0 or nbytes <= 0 or stride < 0 or (descs > 1 and stride < nbytes) or not msg.addr
                or descs > PUSH_PROBE_MAX_DESCS or extent > min(PUSH_PROBE_MAX_BYTES, self.staging_bytes)):
            return PushProbed(False, Code.BAD_REQUEST, f"a push probe writes 1..{PUSH_PROBE_MAX_DESCS} descriptors "
                                                       f"within {min(PUSH_PROBE_MAX_BYTES, self.staging_bytes)} B "
                                                       "to a named address")
        try:
            agent = self.push_agent(reader)
            offs = np.arange(descs, dtype=np.int64) * stride
            t_post = time.perf_counter()
            h = self.transport.write(agent, self.staging_addr + offs, msg.addr + offs,
                                     np.full(descs, nbytes, np.int64), remote_device=msg.device or None)
        except Exception as e:  # noqa: BLE001 - a typed answer, never a dead rank
            text = str(e) if isinstance(e, KVBridgeError) else type(e).__name__
            return PushProbed(False, Code.INTERNAL, f"prefill rank {self.rank} could not WRITE the probe: {text}")
        self.probes[reader] = (envelope, h, t_post)
        return self.advance_probe(reader)

    def advance_probe(self, reader: Reader) -> PushProbed | None:
        """The answer of ``reader``'s probe if its WRITE ended (its handle released), else None."""
        envelope, h, t_post = self.probes[reader]
        try:
            if self.transport.check(h) != "DONE":
                return None
            # the transport's own time where it says (from the wire's start to completion), else as seen here
            seconds = elapsed_s(h)
            answer = PushProbed(True, seconds=seconds if seconds is not None else time.perf_counter() - t_post)
        except Exception as e:  # noqa: BLE001
            text = str(e) if isinstance(e, KVBridgeError) else type(e).__name__
            answer = PushProbed(False, Code.INTERNAL, f"the probe's WRITE failed on prefill rank {self.rank}: {text}")
        del self.probes[reader]
        self.transport.release(h)
        return answer

    def advance_probes(self) -> int:
        """Answer the push probes whose WRITEs ended; returns how many answers went out."""
        sent = 0
        for reader in list(self.probes):
            envelope = self.probes[reader][0]
            answer = self.advance_probe(reader)
            if answer is not None:
                self.send(envelope + pack(answer))
                sent += 1
        return sent

    def close(self) -> None:
        """Let the WRITEs still in flight end before the memory goes."""
        for job in self.pushes.values():
            for h, *_ in job.pending:
                if self.transport.settle(h, 1.0) is not None:
                    self.transport.release(h)
        self.pushes.clear()
        for _, h, _ in self.probes.values():
            if self.transport.settle(h, 1.0) is not None:
                self.transport.release(h)
        self.probes.clear()
