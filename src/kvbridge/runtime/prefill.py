"""A prefill rank: registers its KV memory, serves its metadata, frees blocks when readers are done."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from ..layout import EngineLayout, engine_to_dict
from ..lower import GroupBlocks
from ..memory import rank_memory
from ..oracle import fill_prefill
from ..transport.nixl import NixlTransport, metadata_digest
from .metrics import Metrics
from .protocol import Done, ErrorReply, GetMeta, RankMeta, decode_notif, pack, unpack

log = logging.getLogger(__name__)


@dataclass
class Lease:
    req_id: str
    blocks: dict[str, GroupBlocks]
    expires_at: float
    done_ranks: set = field(default_factory=set)
    readers: int | None = None


class PrefillRank:
    def __init__(self, engine: EngineLayout, rank: tuple[int, int], engine_id: str, host: str = "127.0.0.1",
                 port: int = 0, lease_s: float = 30.0, transport=None):
        self.engine, self.rank, self.engine_id, self.lease_s = engine, tuple(rank), engine_id, lease_s
        self.mem = rank_memory(engine, *rank)
        self.buf = np.zeros(self.mem.size, dtype=np.uint8)
        self.transport = transport or NixlTransport(f"{engine_id}-p{rank[0]}t{rank[1]}")
        self.base = self.transport.register(self.buf)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.leases: dict[str, Lease] = {}
        self.freed: list[str] = []
        self.expired: list[str] = []
        self.metrics = Metrics()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, req_id: str, blocks: dict[str, GroupBlocks], lease_s: float | None = None) -> float:
        """Hold ``blocks`` for ``req_id`` until its readers are done or the lease expires; returns expiry."""
        exp = time.time() + (self.lease_s if lease_s is None else lease_s)
        self.leases[req_id] = Lease(req_id, blocks, exp)
        return exp

    def fill(self, req: int, num_tokens: int, blocks: dict[str, GroupBlocks]) -> None:
        fill_prefill(self.buf, self.mem, req, num_tokens, {g: b for g, b in blocks.items() if g in self.mem.regions})

    def take_freed(self) -> dict:
        out = {"freed": self.freed, "expired": self.expired}
        self.freed, self.expired = [], []
        return out

    # ---- event loop ----------------------------------------------------------------------------
    def serve_once(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            ident, body = frames[0], frames[2:] if len(frames) > 2 and frames[1] == b"" else frames[1:]
            self.sock.send_multipart([ident, b""] + self._answer(body))
        for agent, msgs in self.transport.get_notifs().items():
            for m in msgs:
                self._on_notif(agent, m)
        now = time.time()
        for rid in [r for r, l in self.leases.items() if l.expires_at < now]:
            del self.leases[rid]
            self.expired.append(rid)
            self.metrics.expired_requests += 1

    def _answer(self, body: list[bytes]) -> list[bytes]:
        try:
            msg = unpack(body)
        except Exception as e:  # noqa: BLE001 - answer the peer, keep serving
            return pack(ErrorReply(str(e)))
        if not isinstance(msg, GetMeta):
            return pack(ErrorReply(f"unexpected message {type(msg).__name__}; send get_meta"))
        if tuple(msg.prefill_rank) != self.rank:
            return pack(ErrorReply(f"this endpoint is prefill rank {self.rank}, not {tuple(msg.prefill_rank)}"))
        md = self.transport.metadata()
        return pack(RankMeta(self.engine_id, self.rank, engine_to_dict(self.engine), self.engine.model.fingerprint,
                             self.transport.agent_name, md, metadata_digest(md), self.base, self.buf.size))

    def _on_notif(self, agent: str, raw: bytes) -> None:
        try:
            d: Done = decode_notif(raw)
        except Exception:  # noqa: BLE001
            self.metrics.unknown_notifications += 1
            log.warning("ignoring malformed notification from %s", agent)
            return
        lease = self.leases.get(d.req_id)
        if lease is None:
            self.metrics.unknown_notifications += 1
            log.info("notification for unknown or expired request %s from %s", d.req_id, agent)
            return
        lease.done_ranks.add((d.decode_engine, tuple(d.decode_rank)))
        lease.readers = d.readers
        if len(lease.done_ranks) >= d.readers:
            del self.leases[d.req_id]
            self.freed.append(d.req_id)
            self.metrics.freed_requests += 1

    def stats(self) -> dict:
        return {"metrics": self.metrics.to_json(), "leases": len(self.leases),
                "nixl": vars(self.transport.stats).copy() if hasattr(self.transport, "stats") else {}}

    def close(self) -> None:
        self.sock.close(0)
        self.transport.close()

    # ---- staged transfers (benchmarks; appended) -----------------------------------------------
    def alloc_staging(self, nbytes: int) -> int:
        """Allocate and register a staging buffer of ``nbytes`` (before the decode's handshake, so its
        metadata covers it); returns its address."""
        self.staging = np.empty(max(int(nbytes), 4096), dtype=np.uint8)
        self.staging.fill(0)
        self.staging_addr = self.transport.register(self.staging)
        return self.staging_addr

    def stage(self, src: np.ndarray, nbytes: np.ndarray) -> tuple[int, int, float]:
        """Pack the runs ``(src, nbytes)`` (offsets in this rank's buffer) into the staging buffer;
        returns (staging address, bytes packed, seconds)."""
        from ..staging import pack
        t = time.perf_counter()
        total = pack(self.buf, src, nbytes, self.staging)
        return self.staging_addr, total, time.perf_counter() - t

    def fill_random(self, seed: int = 0) -> None:
        """Fill the buffer with a random pattern (period 16 MiB + 4099 B, so no two nearby runs match)."""
        pat = np.random.default_rng(seed).integers(0, 256, (16 << 20) + 4099, dtype=np.uint8)
        for i in range(0, self.buf.size, pat.size):
            n = min(pat.size, self.buf.size - i)
            self.buf[i:i + n] = pat[:n]
