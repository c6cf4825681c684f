"""NIXL transport (UCX backend): the only module that imports NIXL.

* Memory: each rank registers its one buffer ("DRAM" for host memory, "VRAM" for GPU memory).
* Reads: one ``initialize_xfer`` + ``transfer`` per (request, remote rank) with descriptors that
  kvbridge has already merged (``initialize_xfer`` does not merge; our lowering does), carrying the
  notification for the remote.
* ``transfer()`` blocks for the whole copy on the cma transport (GIL released), so posts run on a
  worker thread: :meth:`read` returns at once and the decode loop never blocks on a copy.
* Errors come back as typed :class:`~kvbridge.errors.TransferError` / :class:`HandshakeError`.
"""
from __future__ import annotations

import hashlib
import importlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import HandshakeError, PeerGoneError, TransferError, TransportUnavailableError
from ..lower import Descriptors
from .base import TransportStats

if TYPE_CHECKING:
    from .. import prepped

log = logging.getLogger(__name__)

_API = None
# NIXL's Python API starts the agent's progress thread with no delay between progress calls: on a
# small CPU machine every idle rank then burns a whole core (measured: 100% per process). kvbridge
# sets a delay (microseconds) between progress calls instead; 0 restores NIXL's behaviour. The environment
# (KVBRIDGE_NIXL_PROGRESS_DELAY_US) is read when a transport is built, not at import.
PROGRESS_DELAY_US = 200


def load_nixl_api():
    """Import NIXL's Python API without importing torch (``import nixl`` may import torch)."""
    global _API
    if _API is None:
        errs = []
        for mod in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
            try:
                _API = importlib.import_module(mod)
                break
            except Exception as e:  # noqa: BLE001 - try the next wheel
                errs.append(f"{mod}: {e}")
        else:
            raise TransportUnavailableError(
                "NIXL is not installed: run `pip install --no-deps nixl-cu12` (no torch needed). Tried: " + "; ".join(errs))
    import logging
    import os
    logging.getLogger("nixl").setLevel(os.environ.get("KVBRIDGE_NIXL_LOG", "WARNING"))
    return _API


def nixl_available() -> bool:
    try:
        load_nixl_api()
        return True
    except TransportUnavailableError:
        return False


def metadata_digest(md: bytes) -> str:
    return hashlib.sha256(md).hexdigest()


@dataclass
class NixlXfer:
    peer: str
    future: Future
    handle: object = None
    num_descs: int = 0
    nbytes: int = 0
    released: bool = False
    tail: object = None    # prepped reads: the partial last chunk's transfer, running beside ``handle``
    notif: bytes = b""     # sent once ``handle`` and ``tail`` have both completed (see read_prepped)
    posted_at: float | None = None  # monotonic time the post thread began posting it (None: still queued)


NixlStats = TransportStats  # the counters every transport keeps


class NixlTransport:
    name = "nixl"

    def __init__(self, agent_name: str, mem_type: str = "DRAM", device_id: int = 0,
                 ucx_params: dict[str, str] | None = None, telemetry: bool = False, post_threads: int = 1,
                 multi_threaded: bool = True, copy_threads: int = 1, backends: tuple[str, ...] | list[str] = ("UCX",),
                 num_threads: int = 0):
        api = load_nixl_api()
        self.api = api
        self.agent_name = agent_name
        self.mem_type = mem_type
        self.device_id = device_id
        # RW sync whenever more than one thread of ours calls the agent: an initiator (the caller's thread and
        # the post threads) and a prefill served by PrefillServer (its thread and the engine's step); NONE
        # only for an agent used by one thread
        sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW if multi_threaded else api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        # backends: NIXL plugins to create (UCX; LIBFABRIC for EFA, GDS, ...); num_threads: their worker
        # threads (0: the plugin's default)
        conf = api.nixl_agent_config(enable_prog_thread=True, backends=[] if ucx_params else list(backends),
                                     capture_telemetry=telemetry, sync_mode=sync, num_threads=int(num_threads))
        try:
            delay = int(os.environ.get("KVBRIDGE_NIXL_PROGRESS_DELAY_US", PROGRESS_DELAY_US))
            self.agent = _make_agent(api, agent_name, conf, delay)
            if ucx_params:
                self.agent.create_backend("UCX", dict(ucx_params))
        except Exception as e:  # noqa: BLE001
            raise TransportUnavailableError(f"cannot create a NIXL agent with the UCX backend: {e!r}; "
                                            "check UCX_TLS (it must include tcp) and the nixl install") from e
        # NIXL skips a backend whose plugin is missing (a warning); an agent without it cannot move anything
        missing = [] if ucx_params else [b for b in backends if b not in (self.agent.plugin_list or [])]
        if missing:
            raise TransportUnavailableError(f"NIXL backend(s) {missing} are not available here (plugins found: "
                                            f"{sorted(self.agent.plugin_list or [])}); choose backends among "
                                            "those, or install the plugin")
        self._regs: dict[int, object] = {}
        self._peers: set[str] = set()
        self._live: set[int] = set()
        self._lock = threading.Lock()
        # transfer() blocks for the whole copy on cma (GIL released), so reads are posted from worker
        # threads. One by default: two cma reads at once from one process ran at about half the speed
        # of the same reads one after the other here (PP P4pp2->D4: 3.4-6.5 vs 8-8.9 GB/s); on RDMA
        # transfer() returns at once and one thread posts everything. Local copies (staged scatters)
        # get their own thread so they overlap the next read instead of queueing behind it.
        self._pool = ThreadPoolExecutor(max(1, post_threads), thread_name_prefix=f"nixl-post-{agent_name}")
        self._copy_pool = ThreadPoolExecutor(max(1, copy_threads), thread_name_prefix=f"kvbridge-copy-{agent_name}")
        self.stats = NixlStats()

    # ---- memory & peers ----------------------------------------------------------------------
    def register(self, buf) -> int:
        """Register a contiguous buffer (numpy array, or torch tensor on its own device) as one region."""
        from ..tensors import buffer_region
        return self.register_region(*buffer_region(buf))

    def register_region(self, addr: int, nbytes: int, device: str = "cpu") -> int:
        """Register ``nbytes`` at ``addr`` (host DRAM for "cpu", VRAM for "cuda:N") as one region."""
        kind, _, dev = device.partition(":")
        mem_type = "DRAM" if kind == "cpu" else "VRAM"
        descs = np.array([[addr, nbytes, int(dev or 0)]], dtype=np.uint64)
        self._regs[addr] = self.agent.register_memory(descs, mem_type)
        self.stats.regions_registered += 1
        return addr

    def deregister_region(self, addr: int) -> None:
        reg = self._regs.pop(addr, None)
        if reg is not None:
            self.agent.deregister_memory(reg)
            self.stats.regions_deregistered += 1

    def deregister(self, buf) -> None:
        from ..tensors import buffer_region
        self.deregister_region(buffer_region(buf)[0])

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes, digest: str | None = None) -> str:
        """Add a remote agent. ``digest`` (sha256 of the metadata, sent separately) is checked first:
        a corrupted blob can poison a peer name inside NIXL for good."""
        if digest is not None and metadata_digest(metadata) != digest:
            raise HandshakeError("NIXL agent metadata does not match its checksum (corrupted or truncated in "
                                 "transit); not adding it. Retry the handshake")
        try:
            name = self.agent.add_remote_agent(metadata)
        except Exception as e:  # noqa: BLE001
            raise HandshakeError(f"NIXL refused the remote agent metadata: {e!r}") from e
        name = name.decode() if isinstance(name, bytes) else name
        with self._lock:  # handshakes may run on a background thread (DecodeRank.connect)
            if name not in self._peers:
                self._peers.add(name)
                self.stats.peers_added += 1
        return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            if name not in self._peers:
                return
            self._peers.discard(name)
            self.stats.peers_removed += 1
        try:
            self.agent.remove_remote_agent(name)
        except Exception:  # noqa: BLE001 - already gone
            pass

    @property
    def peers(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._peers)

    # ---- transfers ---------------------------------------------------------------------------
    def xfer_descs(self, arr: np.ndarray, mem_type: str | None = None):
        """NIXL's descriptor list of an Nx3 ``[addr, len, device]`` array (``mem_type``: ours by default)."""
        d = self.agent.get_xfer_descs(arr, mem_type or self.mem_type)
        if d is None:
            raise TransferError("NIXL rejected the descriptor list (get_xfer_descs returned None)")
        return d

    def remote_mem(self, device=None) -> tuple[str, int]:
        """NIXL memory type and device id of a peer's memory on ``device`` ("cpu", "cuda:N", or an int id
        of our own kind); None: our kind, device 0."""
        if device is None or isinstance(device, int):
            return self.mem_type, int(device or 0)
        kind, _, n = str(device).partition(":")
        return ("DRAM", 0) if kind == "cpu" else ("VRAM", int(n or 0))

    def read(self, peer: str, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray,
             notif: bytes = b"", remote_device=None) -> NixlXfer:
        """Post a READ off the caller's thread; returns a handle to :meth:`check` and :meth:`release`.
        ``remote_device``: where the peer's memory lives ("cpu" or "cuda:N", see :meth:`remote_mem`)."""
        return self.read_descs(peer, Descriptors(None, remote, local, nbytes), notif, remote_device)

    def read_descs(self, peer: str, descs, notif: bytes = b"", remote_device=None, cancel=None) -> NixlXfer:
        """Post a READ of a :class:`~kvbridge.lower.Descriptors`: its NIXL descriptor arrays are written
        from the factored form on the post thread, in one pass (the caller only hands it over).
        ``cancel``: as in :meth:`read_prepped`."""
        rtype, rdev = self.remote_mem(remote_device)

        def arrays():
            if cancel is not None and cancel.cancelled:
                raise TransferError("read cancelled before it was posted", peer=peer)
            return descs.nixl_arrays(self.device_id, rdev)
        return self._post(peer, arrays, descs.count, descs.total_bytes, notif, rtype)

    def post(self, peer: str, work, notif: bytes = b"", cancel=None, remote_device=None) -> NixlXfer:
        """Post one direct read of a lowered work item: a :class:`~kvbridge.lower.Descriptors`, or a
        request validated against prepared lists (``prep``, ``ranges``, block ids, ``size``: see
        :class:`~kvbridge.runtime.prepped_hook.PreppedWork`). ``cancel``: an object whose ``cancelled``
        is checked on the post thread first (a cancelled read is never handed to NIXL)."""
        if isinstance(work, Descriptors):
            return self.read_descs(peer, work, notif, remote_device, cancel=cancel)
        return self.read_prepped(work.prep, work.ranges, work.prefill_blocks, work.decode_blocks, notif, work.size,
                                 cancel=cancel)

    def _post(self, peer: str, arrays, count: int, nbytes: int, notif: bytes, remote_type: str) -> NixlXfer:
        def post(x: NixlXfer):
            local, remote = arrays()
            x.handle = self.agent.initialize_xfer("READ", self.xfer_descs(local), self.xfer_descs(remote, remote_type),
                                                  peer, notif)
            return self._start(x.handle, peer)
        return self._submit_post(peer, 0, 0, post)

    def _submit_post(self, peer: str, count: int, nbytes: int, post) -> NixlXfer:
        """Track a new transfer and run ``post(x)`` (which sets ``x.handle``) on the post thread."""
        x = NixlXfer(peer, Future(), num_descs=count, nbytes=nbytes)
        with self._lock:
            self._live.add(id(x))
        self.stats.handles_created += 1

        def run():
            x.posted_at = time.monotonic()  # from here on the time is the peer's (and the wire's), not our queue's
            try:
                return post(x)
            except TransferError:
                raise
            except Exception as e:  # noqa: BLE001
                raise _wrap(e, peer) from e

        self._pool.submit(_run_into, x.future, run)
        return x

    # ---- prepared descriptor lists (issue 14) ------------------------------------------------
    def prepare(self, peer: str, lowered, prank, remote_device=None) -> "prepped.Prepared | None":
        """At handshake: the lowered chunk templates of (this decode rank, ``prank``) as two regular strided
        prepped lists (``prep_xfer_dlist`` with Nx5 rows, local and ``peer``'s), for :meth:`read_prepped`.
        None when there is nothing to prepare (no reads from that rank)."""
        from ..prepped import Prepared, PreparedGeometry
        if remote_device is None:  # the prefill rank's memory, as its handshake described it
            remote_device = getattr(lowered.p_mem(tuple(prank)), "device", None)
        rtype, rdev = self.remote_mem(remote_device)
        geo = PreparedGeometry(lowered, prank, self.device_id, rdev)
        if not len(geo.local_rows):
            return None
        handles = []
        try:
            for rows, agent, mem in ((geo.local_rows, "NIXL_INIT_AGENT", self.mem_type), (geo.remote_rows, peer, rtype),
                                     (geo.local_span_rows, "NIXL_INIT_AGENT", self.mem_type),
                                     (geo.remote_span_rows, peer, rtype)):
                handles.append(None if rows is None else self.agent.prep_xfer_dlist(agent, rows, mem))
                if handles[-1] is not None:
                    self.stats.dlists_prepared += 1
        except Exception as e:  # noqa: BLE001
            self._release_dlists(handles)
            raise _wrap(e, peer) from e
        return Prepared(peer, geo, handles[0], handles[1], remote_type=rtype, local_span=handles[2],
                        remote_span=handles[3])

    def unprepare(self, prep: "prepped.Prepared | None") -> None:
        """Release the prepped lists of :meth:`prepare` (the peer's transfers must have been released)."""
        if prep is None or prep.released:
            return
        prep.released = True
        self._release_dlists((prep.local, prep.remote, prep.local_span, prep.remote_span))

    def _release_dlists(self, handles) -> None:
        for h in handles:
            if h is None:
                continue
            try:
                self.agent.release_dlist_handle(h)
                self.stats.dlists_released += 1
            except Exception:  # noqa: BLE001 - a removed peer's list may refuse; NIXL frees it at teardown
                pass

    def read_prepped(self, prep: "prepped.Prepared", ranges: dict, prefill_blocks, decode_blocks,
                     notif: bytes = b"", size=None, cancel=None) -> NixlXfer:
        """Post a READ of one validated request (``ranges`` from :meth:`PreparedGeometry.validate`) through
        the prepared lists. The caller's thread only hands over: index arrays (vectorised numpy) and
        ``make_prepped_xfer`` (NIXL merges adjacent ids) run on the post thread. A partial last chunk,
        which has no entry in the lists, is read by a second, small ``initialize_xfer`` posted beside it;
        neither is waited for on the post thread (a frozen peer must not hold every later read of this
        agent, other peers' included) and neither carries the notification: :meth:`check` (or
        :meth:`settle`) sends it once both have completed, so the prefill never hears "done" while a
        part is still being read. ``cancel``: an object whose ``cancelled`` is checked on the post
        thread first (a cancelled read is never handed to NIXL). ``size``: ``(descriptors, bytes)`` or a
        zero-argument callable returning them, called on the post thread (``PreppedWork.size``)."""
        peer = prep.peer

        def post(x: NixlXfer):
            if cancel is not None and cancel.cancelled:
                raise TransferError("read cancelled before it was posted", peer=peer)
            x.num_descs, x.nbytes = (size() if callable(size) else size if size is not None
                                     else prep.geometry.size(ranges))
            req = prep.geometry.request(ranges, prefill_blocks, decode_blocks)
            main = req.local_ids.size > 0
            if req.tail is not None:
                local, remote = Descriptors(prep.geometry.prank, *req.tail).nixl_arrays(
                    self.device_id, prep.geometry.remote_dev)
                h = self.agent.initialize_xfer("READ", self.xfer_descs(local),
                                               self.xfer_descs(remote, prep.remote_type or self.mem_type), peer,
                                               b"" if main else notif)
                if not main:
                    x.handle = h
                    return self._start(h, peer)
                x.tail, x.notif = h, notif  # the notification waits for both parts (check / settle)
                self._start(h, peer)
            local, remote = (prep.local_span, prep.remote_span) if req.spans else (prep.local, prep.remote)
            h = self.agent.make_prepped_xfer("READ", local, req.local_ids, remote, req.remote_ids,
                                             b"" if x.tail is not None else notif)
            x.handle = h
            return self._start(h, peer)

        return self._submit_post(peer, 0, 0, post)

    def _start(self, h, peer: str) -> str:
        state = self.agent.transfer(h)
        if state == "ERR":
            raise TransferError(f"NIXL transfer from {peer!r} returned ERR", peer=peer)
        return state

    def _both_done(self, x: NixlXfer) -> None:
        """Both parts of a read with a tail completed: send its notification now (once)."""
        notif, x.notif = x.notif, b""
        if notif:
            try:
                self.agent.send_notif(x.peer, notif)
            except Exception as e:  # noqa: BLE001 - the data is complete; the prefill's lease will expire
                log.warning("could not send the notification of a completed read to %s: %r", x.peer, e)

    def submit(self, fn, *args) -> Future:
        """Run ``fn`` on a copy thread (local copies such as a staged scatter, off the caller's thread)."""
        return self._copy_pool.submit(fn, *args)

    def check(self, x: NixlXfer) -> str:
        if not x.future.done():
            return "PROC"
        x.future.result()  # raises TransferError
        states = []
        for h in (x.handle, x.tail) if x.tail is not None else (x.handle,):
            try:
                state = self.agent.check_xfer_state(h)
            except Exception as e:  # noqa: BLE001
                raise _wrap(e, x.peer) from e
            if state == "ERR":
                raise TransferError(f"NIXL transfer from {x.peer!r} failed (state ERR)", peer=x.peer)
            states.append(state)
        if "PROC" in states:
            return "PROC"
        if x.tail is not None:
            self._both_done(x)
        return states[0]

    def settle(self, x: NixlXfer, timeout_s: float = 5.0) -> bool | None:
        """Wait up to ``timeout_s`` for the transfer to end: True if it completed (its notification went
        out), False if it failed, None if it is still in progress (do not free its memory yet)."""
        deadline = time.monotonic() + timeout_s
        posted = True
        try:
            x.future.result(timeout=max(0.0, timeout_s))
        except FutureTimeout:
            return None
        except Exception:  # noqa: BLE001 - the post failed (a tail posted before it may still run)
            posted = False
        while True:
            states = []
            for h in (x.handle, x.tail):
                if h is None:
                    continue
                try:
                    states.append(self.agent.check_xfer_state(h))
                except Exception:  # noqa: BLE001 - failed (e.g. remote disconnect)
                    states.append("ERR")
            if "PROC" not in states:
                ok = posted and bool(states) and all(st == "DONE" for st in states)
                if ok and x.tail is not None:
                    self._both_done(x)
                return ok
            if time.monotonic() > deadline:
                return None
            time.sleep(1e-4)

    def release(self, x: NixlXfer) -> None:
        if x.released:
            return
        if not x.future.done():
            x.future.exception()  # wait for the post to finish before releasing its handle
        for h in (x.handle, x.tail):
            if h is None:
                continue
            try:
                self.agent.release_xfer_handle(h)
            except Exception:  # noqa: BLE001 - a dead peer's handle may refuse; NIXL frees it at teardown
                pass
        x.released = True
        with self._lock:
            self._live.discard(id(x))
        self.stats.handles_released += 1

    def live_handles(self) -> int:
        return len(self._live)

    # ---- notifications -----------------------------------------------------------------------
    def get_notifs(self) -> dict[str, list[bytes]]:
        return self.agent.get_new_notifs()

    def send_notif(self, peer: str, msg: bytes) -> None:
        try:
            self.agent.send_notif(peer, msg)
        except Exception as e:  # noqa: BLE001
            raise _wrap(e, peer) from e

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._copy_pool.shutdown(wait=True)
        for addr in list(self._regs):
            reg = self._regs.pop(addr)
            try:
                self.agent.deregister_memory(reg)
                self.stats.regions_deregistered += 1
            except Exception:  # noqa: BLE001
                pass
        for p in list(self._peers):
            self.remove_peer(p)


def _make_agent(api, name: str, conf, progress_delay_us: int):
    """``nixl_agent(name, conf)`` with the progress thread's delay set (the Python API hard-codes 0)."""
    bind = api.nixlBind
    real = bind.nixlAgent

    def agent_with_delay(agent_name, agent_config):
        agent_config.pthrDelay = progress_delay_us
        return real(agent_name, agent_config)

    bind.nixlAgent = agent_with_delay
    try:
        return api.nixl_agent(name, conf)
    finally:
        bind.nixlAgent = real


def _run_into(fut: Future, fn) -> None:
    try:
        fut.set_result(fn())
    except BaseException as e:  # noqa: BLE001
        fut.set_exception(e)


def _is_class(e: Exception, name: str) -> bool:
    """``e`` is NIXL's exception class ``name`` (nixlBind), by class, not by text."""
    cls = getattr(getattr(_API, "nixlBind", None), name, None)
    return isinstance(cls, type) and isinstance(e, cls)


def _wrap(e: Exception, peer: str) -> TransferError:
    kind = type(e).__name__
    if _is_class(e, "nixlRemoteDisconnectError"):
        return PeerGoneError(f"remote agent {peer!r} disconnected (NIXL_ERR_REMOTE_DISCONNECT): the prefill "
                             "process died or its network went away", peer=peer)
    if _is_class(e, "nixlNotFoundError"):
        return TransferError(f"NIXL could not find memory or metadata for {peer!r} ({kind}): descriptors outside "
                             "the registered region, or the remote was removed; re-handshake", peer=peer)
    return TransferError(f"NIXL error talking to {peer!r}: {kind}: {e}", peer=peer)
