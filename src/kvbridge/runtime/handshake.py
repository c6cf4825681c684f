"""The handshake of a decode rank with one prefill engine: metadata fetch per prefill rank, checks,
plan, NIXL agents, prepared lists. Runs on a background thread (``DecodeRank.connect``) or on the
caller's (``DecodeRank.handshake``); its result, a frozen :class:`RemoteEngine` and the prepared
lists, is handed to a :class:`~kvbridge.runtime.peer.Peer`, which owns it from then on (and opens the
side-channel sockets on the decode rank's own thread)."""
from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from ..cost import LinkFigures, PairShape
from ..errors import HandshakeError, IncompatibleLayoutsError, LayoutError
from ..layout import EngineLayout, engine_from_dict
from ..lower import LoweredPlan
from ..memory import KVMemory
from ..modes import AUTO, TransferMode, TransferPath
from ..plan import Rank, TransferPlan, plan_transfer
from ..transport.base import Transport
from . import prepped_hook as _prepped_hook
from . import probe as _probe
from .protocol import ErrorReply, GetMeta, RankMeta, pack, unpack
from .tags import BUCKET

if TYPE_CHECKING:
    from ..prepped import Prepared

log = logging.getLogger(__name__)
Step = Callable[[str], None]  # names the step a handshake is at (diagnostics of a slow handshake)


def _no_step(what: str) -> None:
    pass


class LinkCache:
    """Measured link figures by link, shared by every prefill engine behind it: a decode rank probes the
    link to a host once, not once per engine and rank (a burst of engines on known hosts costs no probe).
    One cache per decode rank (its transport: :func:`links_of`); a link is (the prefill rank's host, the
    device of the memory the probe reads, whether it has device and host staging, the transfer mode and the
    decode's staging, the prefill's pin bounds); least recently used out past ``max_entries``, measured
    again after ``max_age_s``."""

    def __init__(self, max_entries: int = 4096, max_age_s: float = 600.0):
        self.max_entries, self.max_age_s = max_entries, max_age_s
        self._items: OrderedDict[tuple[Any, ...], tuple[float, Any]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(endpoint: str, meta: RankMeta, mem: KVMemory | None, mode: TransferMode, staging: int,
            host_staging: int) -> tuple[Any, ...]:
        allocs = list(getattr(mem, "allocations", ()) or ())
        device = str(max(allocs, key=lambda a: a.nbytes).device) if allocs else "cpu"
        return (endpoint.rpartition(":")[0], device, bool(meta.staging_bytes),
                bool(getattr(meta, "host_staging_bytes", 0)), str(mode), bool(staging), bool(host_staging),
                getattr(meta, "pin_s", 0), getattr(meta, "min_read_rate", 0), bool(getattr(meta, "push", False)))

    def get(self, key: tuple[Any, ...]) -> Any:
        with self._lock:
            hit = self._items.get(key)
            if hit is None or time.monotonic() - hit[0] > self.max_age_s:
                return None
            self._items.move_to_end(key)
            return hit[1]

    def put(self, key: tuple[Any, ...], figures: Any) -> None:
        with self._lock:
            self._items[key] = (time.monotonic(), figures)
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)


_LINKS: weakref.WeakKeyDictionary[Any, LinkCache] = weakref.WeakKeyDictionary()
_LINKS_LOCK = threading.Lock()


def links_of(transport: Transport) -> LinkCache | None:
    """The link cache of the decode rank that owns ``transport`` (made on first use; None for a
    transport that cannot be weakly referenced)."""
    with _LINKS_LOCK:
        try:
            cache = _LINKS.get(transport)
            if cache is None:
                cache = _LINKS[transport] = LinkCache()
        except TypeError:
            return None
    return cache


@dataclass(frozen=True)
class RemoteEngine:
    """Everything learned at handshake with one prefill engine (no sockets: its :class:`Peer` owns them)."""

    engine_id: str
    layout: EngineLayout
    plan: TransferPlan
    lowered: LoweredPlan
    agents: dict[Rank, str]         # prefill rank -> NIXL agent name (only the ranks this decode rank reads)
    readers: dict[Rank, int]        # prefill rank -> number of decode ranks reading it (for the notification)
    endpoints: dict[Rank, str]      # prefill rank -> "host:port" of its side channel
    digest0: str          # sha256 of the first rank's NIXL metadata (first_rank): a restarted engine has a new one
    modes: dict[Rank, TransferPath]  # prefill rank -> its path (cost model for shuffled blocks, or forced)
    shapes: dict[Rank, PairShape]   # prefill rank -> its descriptor shape (auto mode re-decides per request from it)
    digests: dict[Rank, str] = field(default_factory=dict)  # prefill rank -> sha256 of its NIXL metadata (restarts)
    can_stage: frozenset[Rank] = frozenset()           # prefill ranks that can stage
    # acquire (direct), stage and heartbeat requests go to every prefill rank this rank notifies (a rank
    # with nothing to read here is acquired and released too: only a pin holder's Done counts)
    side_ranks: tuple[Rank, ...] = ()
    # prefill rank -> its figures: measured per path at handshake, kept current by completed reads
    links: dict[Rank, LinkFigures] = field(default_factory=dict)
    # prefill rank -> (address, words, salt) of its lease tags (runtime/tags.py); absent: wait for grants
    tags: dict[Rank, tuple[int, int, int]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Plain-data view (what a handshake RPC returns)."""
        return {
            "engine_id": self.engine_id,
            "prefill": str(self.layout),
            "modes": {str(p): m.value for p, m in self.modes.items()},
            "agents": {str(p): a for p, a in self.agents.items()},
        }


def fetch_meta(ctx: zmq.Context[Any], endpoint: str, msg: GetMeta, timeout_s: float) -> RankMeta:
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{endpoint}")
        sock.send_multipart(pack(msg))
        try:
            frames = sock.recv_multipart()
        except zmq.Again:
            raise HandshakeError(f"no answer from prefill rank {tuple(msg.prefill_rank)} at tcp://{endpoint} within "
                                 f"{timeout_s:g} s; is the prefill engine running and is the address right?") from None
        reply = unpack(frames)
    finally:
        sock.close(0)
    if isinstance(reply, ErrorReply):
        raise HandshakeError(f"prefill at {endpoint} refused the handshake: {reply.message}")
    if not isinstance(reply, RankMeta):
        raise HandshakeError(f"prefill at {endpoint} answered {type(reply).__name__}, expected rank_meta")
    return reply


@dataclass
class Handshaker:
    """What a handshake needs from the decode rank (a snapshot: the transfer mode at the time)."""

    ctx: Any
    transport: Transport
    engine: EngineLayout
    rank: Rank
    mem: KVMemory
    engine_id: str                 # the decode engine's id
    timeout_s: float               # per metadata fetch
    staging_bytes: int
    transfer_mode: TransferMode
    cost_model: Any
    prober: Any = None             # probe.Prober: measures each link at handshake (None: the cost model's constants)
    host_staging_bytes: int = 0
    push: bool = False             # this rank can be pushed to: its agent metadata goes with the handshake
    # called once a probed prefill rank accepted its TCP connection (the engine is up: a background
    # re-handshake is then bounded as a whole handshake, not by the short bound that fails a dead one fast)
    connected: Callable[[], None] | None = None
    # a metadata fetch from a rank that just accepted the TCP connection (probed: the engine is up) waits up to
    # this long instead of timeout_s (the peer's whole handshake bound): a restarted engine serving a burst on a
    # busy machine answered its first GetMeta after more than 5 s, and the reads re-queued behind it failed
    reached_timeout_s: float = 0.0

    def get_meta(self, prank: Rank) -> GetMeta:
        if not self.push:
            return GetMeta(self.engine_id, self.rank, prank, self.transport.agent_name)
        from ..transport.nixl import metadata_digest
        if self.prober is not None:  # the push probe WRITEs into a probe buffer: in the metadata it sends
            self.prober.prepare()
        md = self.transport.metadata()
        return GetMeta(self.engine_id, self.rank, prank, self.transport.agent_name, md, metadata_digest(md))

    def same_agents(self, remote: RemoteEngine, endpoints: dict[Rank, str]) -> bool:
        """Every rank this rank handshook with still has the NIXL agent (metadata) it had then."""
        digests = remote.digests or {self.first_rank(endpoints): remote.digest0}
        for prank, digest in digests.items():
            try:
                meta = fetch_meta(self.ctx, endpoints[prank], self.get_meta(prank), self.timeout_s)
            except (HandshakeError, KeyError):
                return False
            if meta.metadata_sha256 != digest:
                return False
        return True

    def first_rank(self, endpoints: dict[Rank, str]) -> Rank:
        """The prefill rank asked first (for the engine's layout): the one this decode rank most likely
        reads, guessed from the ranks given (``(pp, tp)`` keys) as the plan pairs ranks (same position in
        the stage, the stage holding the same layers); (0, 0) when the guess is not among them. A wrong
        guess costs one metadata fetch more, never a wrong plan."""
        p_pp = 1 + max(p for p, _ in endpoints) if endpoints else 1
        p_rps = sum(1 for p, _ in endpoints if p == 0) or 1
        d_pp, d_rps = max(1, self.engine.pp), max(1, self.engine.ranks_per_stage)
        guess = (self.rank[0] * p_pp // d_pp, self.rank[1] * p_rps // d_rps)
        return guess if guess in endpoints else (0, 0)

    def probe(self, engine_id: str, endpoints: dict[Rank, str], step: Step = _no_step,
              ranks: Sequence[Rank] | None = None) -> None:
        """A plain TCP connect to each endpoint of ``ranks`` (default: all given): a dead process's closed
        port answers at once (refused), where ZMQ would wait out ``timeout_s``."""
        for prank in sorted(endpoints) if ranks is None else ranks:
            ep = endpoints.get(prank)
            if ep is None:
                continue  # reported by the metadata fetch
            step(f"TCP connect to rank {prank} at {ep}")
            host, _, port = ep.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=self.timeout_s).close()
            except (OSError, ValueError) as e:
                raise HandshakeError(f"prefill rank {prank} of {engine_id!r} at {ep} does not accept connections "
                                     f"({type(e).__name__}: {e}); is the prefill engine running?") from None
            if self.connected is not None:
                self.connected()

    def background(self, engine_id: str, endpoints: dict[Rank, str],
                   phase: list[str] | None = None) -> tuple[RemoteEngine, dict[Rank, Prepared]]:
        """The whole handshake (a background thread): handshake (each rank it asks probed first),
        prepared lists. ``phase[0]`` names the step it is at (a handshake that runs past its bound says
        where it was stuck); one that takes more than 2 s logs how long each step took."""
        phase = phase if phase is not None else ["started"]
        t0 = time.monotonic()
        times: list[tuple[str, float]] = []

        def step(what: str) -> None:
            times.append((phase[0], time.monotonic()))
            phase[0] = what

        out = self.run(engine_id, endpoints, step, probe=True)
        step("done")
        total = time.monotonic() - t0
        if total > 2.0:  # an operator's first clue when a prefill engine is slow to reach
            marks = [t0] + [t for _, t in times]
            log.warning("kvbridge: handshake with prefill engine %r took %.1f s: %s", engine_id, total, "; ".join(
                f"{what} {b - a:.2f} s" for (what, _), a, b in zip(times[1:], marks[1:], marks[2:])))
        return out

    def run(self, engine_id: str, endpoints: dict[Rank, str], step: Step = _no_step,
            probe: bool = False) -> tuple[RemoteEngine, dict[Rank, Prepared]]:
        """Handshake and prepare the lists; on failure nothing it added stays (agents removed).
        ``probe``: TCP-connect to each rank before asking it (:meth:`probe`)."""
        remote = self.handshake(engine_id, endpoints, step, probe)
        step("NIXL prepared descriptor lists")
        try:
            prepped = _prepped_hook.prepare(self.transport, remote, None)
        except BaseException:
            for agent in remote.agents.values():
                self.transport.remove_peer(agent)
            raise
        return remote, prepped

    def _get(self, engine_id: str, endpoints: dict[Rank, str], prank: Rank, step: Step = _no_step,
             probe: bool = False) -> RankMeta:
        if prank not in endpoints:
            raise HandshakeError(f"no endpoint given for prefill rank {prank} of engine {engine_id!r}; "
                                 f"give one per rank, got {sorted(endpoints)}")
        timeout_s = self.timeout_s
        if probe:
            self.probe(engine_id, endpoints, step, [prank])
            timeout_s = max(timeout_s, self.reached_timeout_s)  # it accepted the connection: alive, maybe busy
        step(f"metadata from rank {prank}")
        meta = fetch_meta(self.ctx, endpoints[prank], self.get_meta(prank), timeout_s)
        if meta.engine_id != engine_id:
            raise HandshakeError(f"endpoint {endpoints[prank]} is engine {meta.engine_id!r}, expected {engine_id!r}")
        if tuple(meta.rank) != prank:
            raise HandshakeError(f"endpoint {endpoints[prank]} is rank {tuple(meta.rank)}, expected {prank}")
        return meta

    def handshake(self, engine_id: str, endpoints: dict[Rank, str], step: Step = _no_step,
                  probe: bool = False) -> RemoteEngine:
        """Metadata from the first rank (:meth:`first_rank`: the engine's layout), the plan, then metadata
        and NIXL agents of only the prefill ranks this rank notifies (those it reads, or is the designated
        notifier of); ``probe``: TCP-connect to each before asking it."""
        r0 = self.first_rank(endpoints)
        first = self._get(engine_id, endpoints, r0, step, probe)
        try:
            layout = engine_from_dict(first.layout)
        except LayoutError as e:
            raise HandshakeError(f"prefill engine {engine_id!r} sent an invalid layout description: {e}") from e
        if first.model_fingerprint != layout.model.fingerprint:
            raise HandshakeError("prefill layout does not match its own model fingerprint (corrupted metadata)")
        if layout.model.fingerprint != self.engine.model.fingerprint:
            plan_transfer(layout, self.engine)  # raises IncompatibleLayoutsError naming the difference
            raise IncompatibleLayoutsError(f"prefill model {layout.model.name!r} differs from decode model "
                                           f"{self.engine.model.name!r}; serve the same model on both")
        step("planning")
        plan = plan_transfer(layout, self.engine)
        metas = {r0: first}
        needed = plan.ranks_to_notify(self.rank)
        for prank in needed:
            if prank not in metas:
                metas[prank] = self._get(engine_id, endpoints, prank, step, probe)
        agents: dict[Rank, str] = {}
        bases: dict[Rank, KVMemory] = {}
        step("NIXL add_remote_agent")
        try:
            self._add_agents(engine_id, layout, first, metas, needed, agents, bases)
        except BaseException:
            for agent in agents.values():  # no half-added engine
                self.transport.remove_peer(agent)
            raise
        step("measuring the links")
        links = self._links(engine_id, endpoints, plan.prefill_ranks_for(self.rank), metas, bases, agents)
        step("lowering the plan")
        lowered = LoweredPlan(plan, self.rank, prefill_mems=bases, decode_mem=self.mem)
        readers = {p: len(plan.notifiers_of(p)) for p in needed}
        modes = self._modes(plan, {p: metas[p].staging_bytes for p in needed}, links)
        can_stage = {p for p in plan.prefill_ranks_for(self.rank)
                     if metas[p].staging_bytes and self.staging_bytes and self.transfer_mode != TransferPath.DIRECT}
        side = tuple(sorted(set(needed) | set(plan.prefill_ranks_for(self.rank))))
        missing = [p for p in side if p not in endpoints]
        if missing:
            for agent in agents.values():
                self.transport.remove_peer(agent)
            raise HandshakeError(f"no endpoint given for prefill ranks {missing} of engine {engine_id!r}; "
                                 f"give one per rank, got {sorted(endpoints)}")
        from ..cost import pair_shapes
        return RemoteEngine(engine_id, layout, plan, lowered, agents, readers, endpoints, first.metadata_sha256,
                            modes, pair_shapes(lowered), digests={p: metas[p].metadata_sha256 for p in needed},
                            can_stage=frozenset(can_stage), side_ranks=side, links=links,
                            tags={p: (int(m.tags_addr), int(m.tags_words), int(m.tag_salt)) for p, m in metas.items()
                                  if p in agents and m.tags_addr and m.tags_words >= BUCKET})

    def _links(self, engine_id: str, endpoints: dict[Rank, str], reads: Sequence[Rank], metas: dict[Rank, RankMeta],
               mems: dict[Rank, KVMemory], agents: dict[Rank, str]) -> dict[Rank, LinkFigures]:
        """Link figures of each prefill rank read: measured once per link (:data:`LINKS`), the constants
        without a prober."""
        out: dict[Rank, LinkFigures] = {}
        cache = links_of(self.transport) if self.prober is not None else None
        keys = {p: LinkCache.key(endpoints[p], metas[p], mems.get(p), self.transfer_mode, self.staging_bytes,
                                 self.host_staging_bytes) for p in reads}
        if cache is not None:
            out = {p: f for p in reads if (f := cache.get(keys[p])) is not None}
        todo = [p for p in reads if p not in out]
        if todo:
            def push(p: Rank) -> _probe.PushProber | None:  # times the prefill's WRITEs (it said it pushes to us)
                if not self.push or not getattr(metas[p], "push", False):
                    return None
                return _probe.PushProber(self.ctx, endpoints[p], (self.engine_id, self.rank,
                                                                  self.transport.agent_name, metas[p].metadata_sha256))
            got = _probe.measure_links(self.prober, self.cost_model, self.transfer_mode, self.staging_bytes,
                                       self.host_staging_bytes, todo, metas, mems, agents,
                                       f"decode rank {self.rank} <- prefill engine {engine_id!r} ", push)
            if cache is not None:
                for p, f in got.items():
                    cache.put(keys[p], f)
            out |= got
        return out

    def _add_agents(self, engine_id: str, layout: EngineLayout, first: RankMeta, metas: dict[Rank, RankMeta],
                    needed: Sequence[Rank], agents: dict[Rank, str], bases: dict[Rank, KVMemory]) -> None:
        for prank in needed:
            m = metas[prank]
            if m.model_fingerprint != first.model_fingerprint or m.layout != first.layout:
                raise HandshakeError(
                    f"prefill rank {prank} of {engine_id!r} reports a different layout than rank {tuple(first.rank)}"
                )
            try:
                p_mem = KVMemory.from_wire(layout, m.memory)
            except LayoutError as e:
                raise HandshakeError(
                    f"prefill rank {prank} of {engine_id!r} sent an invalid memory description: {e}"
                ) from e
            if p_mem.rank != prank:
                raise HandshakeError(f"prefill rank {prank} of {engine_id!r} describes the memory of rank {p_mem.rank}")
            agents[prank] = self.transport.add_peer(m.agent_metadata, m.metadata_sha256)
            bases[prank] = p_mem

    def _modes(self, plan: TransferPlan, prefill_staging: dict[Rank, int],
               links: dict[Rank, LinkFigures] | None = None) -> dict[Rank, TransferPath]:
        """The path per prefill rank this rank reads: forced (where the pair offers it, else direct), or
        chosen from the pair's measured link figures (the cost model's constants where none)."""
        from ..cost import choose_modes
        reads = plan.prefill_ranks_for(self.rank)
        direct = TransferPath.DIRECT
        if self.transfer_mode == direct or not self.staging_bytes:
            return {p: direct for p in reads}
        chosen: dict[Rank, TransferPath]
        if self.transfer_mode != AUTO:
            forced = TransferPath(self.transfer_mode)
            offered = {p: (links[p].paths if links and p in links else (direct, TransferPath.STAGED)) for p in reads}
            chosen = {p: (forced if forced in offered[p] else direct) for p in reads}
        else:
            chosen = {m.prefill: TransferPath(m.mode) for m in choose_modes(plan, self.cost_model,
                                                                            decode_ranks=[self.rank], links=links)}
        return {p: (chosen.get(p, direct) if prefill_staging.get(p) else direct) for p in reads}
