"""NIXL transport (UCX backend): the only module that imports NIXL.

* Memory: each rank registers its one buffer ("DRAM" for host memory, "VRAM" for GPU memory).
* Reads: one ``initialize_xfer`` + ``transfer`` per (request, remote rank) with descriptors that
  kvbridge has already merged (``initialize_xfer`` does not merge; our lowering does), carrying the
  notification for the remote.
* ``transfer()`` blocks for the whole copy on the cma transport (GIL released), so posts run on a
  worker thread: :meth:`~NixlTransport.post` and :meth:`~NixlTransport.read` return at once and the
  decode loop never blocks on a copy.
* Writes (the push path): :meth:`~NixlTransport.write`, the same post with ``initialize_xfer("WRITE")``.
* Errors come back as typed :class:`~kvbridge.errors.TransferError` / :class:`HandshakeError`.
"""
from __future__ import annotations

import hashlib
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from ..errors import HandshakeError, PeerGoneError, TransferError, TransportUnavailableError
from ..lower import Descriptors
from ..runtime.wakeup import Wakeup
from .base import Cancellable, DirectRead, TransportBookkeeping, check_cancel

if TYPE_CHECKING:
    from ..lower import LoweredPlan
    from ..prepped import Prepared

R = TypeVar("R")

log = logging.getLogger(__name__)

_API = None
# NIXL's Python API starts the agent's progress thread with no delay between progress calls: on a
# small CPU machine every idle rank then burns a whole core (measured: 100% per process). kvbridge
# sets a delay (microseconds) between progress calls instead; 0 restores NIXL's behaviour. The environment
# (KVBRIDGE_NIXL_PROGRESS_DELAY_US) is read when a transport is built, not at import.
PROGRESS_DELAY_US = 200
# reads of at most this many bytes are posted on the caller's thread when no post is queued or running:
# handing one to the post thread cost about 0.15 ms of thread wake-up here (the phase ``post_queue``),
# a third of a 2 MiB read's wire time, while on cma its copy blocks the caller for about that long
INLINE_POST_BYTES = 0  # off by default: see DecodeConfig.inline_post_bytes


def load_nixl_api() -> Any:
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
                "NIXL is not installed: run `pip install --no-deps nixl-cu12` (no torch needed). Tried: "
                + "; ".join(errs)
            )
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
    future: Future[str]
    handle: object = None
    num_descs: int = 0
    nbytes: int = 0
    released: bool = False
    tail: object = None    # prepped reads: the partial last chunk's transfer, running beside ``handle``
    notif: bytes = b""     # sent once ``handle`` and ``tail`` have both completed (see post)
    posted_at: float | None = None  # monotonic time the post thread began posting it (None: still queued)
    posted_ns: int = 0     # perf_counter_ns when the post thread began posting it (0: not yet)
    tail_state: str = ""   # what transfer() answered for ``tail`` ("DONE": complete when it returned)
    complete: bool = False  # every part is known DONE (NIXL is not asked again)
    returned_ns: int = 0   # perf_counter_ns when its post call returned (on cma after the copy itself)
    done_ns: int = 0       # perf_counter_ns when it was first known complete (returned_ns when transfer() said DONE)


class NixlTransport(TransportBookkeeping):
    name = "nixl"

    def __init__(self, agent_name: str, mem_type: str = "DRAM", device_id: int = 0,
                 ucx_params: dict[str, str] | None = None, telemetry: bool = False, post_threads: int = 1,
                 multi_threaded: bool = True, copy_threads: int = 1, backends: tuple[str, ...] | list[str] = ("UCX",),
                 num_threads: int = 0, inline_post_bytes: int = INLINE_POST_BYTES):
        super().__init__()
        api = load_nixl_api()
        self.api = api
        self.agent_name = agent_name
        self.mem_type = mem_type
        self.device_id = device_id
        # RW sync whenever more than one thread of ours calls the agent: an initiator (the caller's thread and
        # the post threads) and a prefill served by PrefillServer (its thread and the engine's step); NONE
        # only for an agent used by one thread
        sync = (
            api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
            if multi_threaded
            else api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        )
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
        # transfer() blocks for the whole copy on cma (GIL released), so reads are posted from worker
        # threads. One by default: two cma reads at once from one process ran at about half the speed
        # of the same reads one after the other here (PP P4pp2->D4: 3.4-6.5 vs 8-8.9 GB/s); on RDMA
        # transfer() returns at once and one thread posts everything. Local copies (staged scatters)
        # get their own thread so they overlap the next read instead of queueing behind it.
        self._pool = ThreadPoolExecutor(max(1, post_threads), thread_name_prefix=f"nixl-post-{agent_name}")
        self._copy_pool = ThreadPoolExecutor(max(1, copy_threads), thread_name_prefix=f"kvbridge-copy-{agent_name}")
        self.wake = Wakeup()  # readable when a post or a copy ends (wake_fd)
        # a read of at most this many bytes is posted on the caller's thread when the post thread is
        # idle (nothing queued or running there: no wait on the agent's lock, no reordering); 0: never
        self.inline_post_bytes = int(inline_post_bytes)
        self._posts_lock = threading.Lock()
        self._posts_pending = 0  # posts handed to the post threads and not finished there

    # ---- memory & peers ----------------------------------------------------------------------
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

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

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
        self.peer_added(name)
        return name

    def remove_peer(self, name: str) -> None:
        if not self.peer_removed(name):
            return
        try:
            self.agent.remove_remote_agent(name)
        except Exception:  # noqa: BLE001 - already gone
            pass

    # ---- transfers ---------------------------------------------------------------------------
    def xfer_descs(self, arr: np.ndarray, mem_type: str | None = None) -> Any:
        """NIXL's descriptor list of an Nx3 ``[addr, len, device]`` array (``mem_type``: ours by default)."""
        d = self.agent.get_xfer_descs(arr, mem_type or self.mem_type)
        if d is None:
            raise TransferError("NIXL rejected the descriptor list (get_xfer_descs returned None)")
        return d

    def remote_mem(self, device: str | int | None = None) -> tuple[str, int]:
        """NIXL memory type and device id of a peer's memory on ``device`` ("cpu", "cuda:N", or an int id
        of our own kind); None: our kind, device 0."""
        if device is None or isinstance(device, int):
            return self.mem_type, int(device or 0)
        kind, _, n = str(device).partition(":")
        return ("DRAM", 0) if kind == "cpu" else ("VRAM", int(n or 0))

    def read(self, peer: str, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray, notif: bytes = b"",
             remote_device: str | None = None, cancel: Cancellable | None = None,
             local_device: str | None = None, inline: bool = False) -> NixlXfer:
        """Post a READ of explicit descriptor lists off the caller's thread; returns a handle to :meth:`check`
        and :meth:`release`. ``remote_device``: where the peer's memory lives ("cpu" or "cuda:N", see
        :meth:`remote_mem`); ``local_device``: where ours does (None: this agent's own kind, e.g. "cpu" for a
        host staging buffer of a GPU rank); ``cancel``: as in :meth:`post`; ``inline``: post it on the
        caller's thread if no post is queued (a few bytes, e.g. a lease-tag check: a hand-off to the post
        thread would cost more than the READ)."""
        rtype, rdev = self.remote_mem(remote_device)
        ltype, ldev = (self.mem_type, self.device_id) if local_device is None else self.remote_mem(local_device)
        descs = Descriptors(None, remote, local, nbytes)  # no prefill rank: explicit lists

        def arrays() -> tuple[np.ndarray, np.ndarray]:
            check_cancel(cancel, peer)
            return descs.nixl_arrays(ldev, rdev)
        return self._post(peer, arrays, descs.count, descs.total_bytes, notif, rtype, ltype, inline=inline)

    def write(self, peer: str, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, notif: bytes = b"",
              remote_device: str | None = None, local_device: str | None = None) -> NixlXfer:
        """Post a WRITE of explicit descriptor lists (``local[i]`` -> ``remote[i]``) off the caller's thread:
        the mirror of :meth:`read` (``initialize_xfer("WRITE", ...)``), checked and released the same way.
        The push path's prefill writes packed segments into a decode rank's staging with it."""
        rtype, rdev = self.remote_mem(remote_device)
        ltype, ldev = (self.mem_type, self.device_id) if local_device is None else self.remote_mem(local_device)
        descs = Descriptors(None, remote, local, nbytes)  # (remote, local) as a read's: only the op differs

        def arrays() -> tuple[np.ndarray, np.ndarray]:
            return descs.nixl_arrays(ldev, rdev)
        return self._post(peer, arrays, descs.count, descs.total_bytes, notif, rtype, ltype, op="WRITE")

    def _post(
        self,
        peer: str,
        arrays: Callable[[], tuple[np.ndarray, np.ndarray]],
        count: int,
        nbytes: int,
        notif: bytes,
        remote_type: str,
        local_type: str | None = None,
        op: str = "READ",
        inline: bool = False,
    ) -> NixlXfer:
        def post(x: NixlXfer) -> str:
            local, remote = arrays()
            x.handle = self.agent.initialize_xfer(op, self.xfer_descs(local, local_type),
                                                  self.xfer_descs(remote, remote_type), peer, notif)
            return self._start(x.handle, peer)
        return self._submit_post(peer, 0, 0, post, size=nbytes, inline=inline)

    def _submit_post(self, peer: str, count: int, nbytes: int, post: Callable[[NixlXfer], str],
                     size: int | None = None, inline: bool = False) -> NixlXfer:
        """Track a new transfer and run ``post(x)`` (which sets ``x.handle``) on the post thread, or at once
        on the caller's thread when ``size`` (its bytes) is at most :attr:`inline_post_bytes` and the post
        threads are idle (the read's copy then runs here on cma; on RDMA ``transfer()`` returns at once)."""
        x = NixlXfer(peer, Future[str](), num_descs=count, nbytes=nbytes)
        self.track(id(x))
        inline = inline or (size is not None and 0 < self.inline_post_bytes and size <= self.inline_post_bytes)

        def run() -> str:
            x.posted_ns = time.perf_counter_ns()
            x.posted_at = time.monotonic()  # from here on the time is the peer's (and the wire's), not our queue's
            try:
                return post(x)
            except TransferError:
                raise
            except Exception as e:  # noqa: BLE001
                raise _wrap(e, peer) from e
            finally:
                x.returned_ns = time.perf_counter_ns()

        x.future.add_done_callback(self._wakeup)
        with self._posts_lock:
            inline = inline and self._posts_pending == 0
            if not inline:
                self._posts_pending += 1
        if inline:
            self.stats.inline_posts += 1
            _run_into(x.future, run)
        else:
            self._pool.submit(self._run_posted, x.future, run)
        return x

    def _run_posted(self, fut: Future[str], run: Callable[[], str]) -> None:
        try:
            _run_into(fut, run)
        finally:
            with self._posts_lock:
                self._posts_pending -= 1

    # ---- prepared descriptor lists ------------------------------------------------------------
    def prepare(self, peer: str, lowered: LoweredPlan, prank: tuple[int, int],
                remote_device: str | None = None) -> Prepared | None:
        """At handshake: the lowered chunk templates of (this decode rank, ``prank``) as two regular strided
        prepped lists (``prep_xfer_dlist`` with Nx5 rows, local and ``peer``'s), for :meth:`post`.
        None when there is nothing to prepare (no reads from that rank)."""
        from ..prepped import Prepared, PreparedGeometry
        if remote_device is None:  # the prefill rank's memory, as its handshake described it
            remote_device = getattr(lowered.p_mem((prank[0], prank[1])), "device", None)
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

    def unprepare(self, prep: Prepared | None) -> None:
        """Release the prepped lists of :meth:`prepare` (the peer's transfers must have been released)."""
        if prep is None or prep.released:
            return
        prep.released = True
        self._release_dlists((prep.local, prep.remote, prep.local_span, prep.remote_span))

    def _release_dlists(self, handles: Iterable[object]) -> None:
        for h in handles:
            if h is None:
                continue
            try:
                self.agent.release_dlist_handle(h)
                self.stats.dlists_released += 1
            except Exception:  # noqa: BLE001 - a removed peer's list may refuse; NIXL frees it at teardown
                pass

    def post(self, peer: str, work: DirectRead, notif: bytes = b"", cancel: Cancellable | None = None,
             remote_device: str | None = None) -> NixlXfer:
        """Post one direct read (a request validated against the lists of :meth:`prepare`). The caller's
        thread only hands over: the sizes, index arrays (vectorised numpy) and ``make_prepped_xfer`` (NIXL
        merges adjacent ids) run on the post thread. A partial last chunk, which has no entry in the
        lists, is read by a second, small ``initialize_xfer`` posted beside it; neither is waited for on
        the post thread (a frozen peer must not hold every later read of this agent, other peers'
        included) and neither carries the notification: :meth:`check` (or :meth:`settle`) sends it once
        both have completed, so the prefill never hears "done" while a part is still being read.
        ``cancel``: an object whose ``cancelled`` is checked on the post thread first (a cancelled read
        is never handed to NIXL)."""
        prep, ranges, prefill_blocks, decode_blocks = work.prep, work.ranges, work.prefill_blocks, work.decode_blocks
        peer = prep.peer

        def post(x: NixlXfer) -> str:
            check_cancel(cancel, peer)
            x.num_descs, x.nbytes = work.size()
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
                x.tail_state = self._start(h, peer)
            lists = (prep.local_span, prep.remote_span) if req.spans else (prep.local, prep.remote)
            h = self.agent.make_prepped_xfer("READ", lists[0], req.local_ids, lists[1], req.remote_ids,
                                             b"" if x.tail is not None else notif)
            x.handle = h
            return self._start(h, peer)

        # (the bytes are worked out here only when an inline post may use them; else on the post thread)
        return self._submit_post(peer, 0, 0, post, size=work.total_bytes if self.inline_post_bytes > 0 else None)

    def _start(self, h: object, peer: str) -> str:
        state = str(self.agent.transfer(h))
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

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        """Run ``fn`` on a copy thread (local copies such as a staged scatter, off the caller's thread)."""
        fut = self._copy_pool.submit(fn, *args)
        fut.add_done_callback(self._wakeup)
        return fut

    def _wakeup(self, _fut: object = None) -> None:
        """A post or a copy ended: whoever waits on :attr:`wake_fd` looks again."""
        self.wake.set()

    @property
    def wake_fd(self) -> int:
        """A file descriptor that becomes readable when a post or a local copy of this transport ends
        (a decode's wait sleeps on it beside its sockets; :meth:`clear_wake` re-arms it)."""
        return self.wake.fd

    def clear_wake(self) -> None:
        self.wake.clear()

    def _known_done(self, x: NixlXfer) -> bool:
        """Every part of ``x`` is complete by what ``transfer()`` answered when it was posted (a blocking
        transport, cma, copies inside ``transfer()``) or by an earlier check: NIXL need not be asked.
        Asking would wait on the agent's lock, which the post thread holds while it copies the next read."""
        if x.complete:
            return True
        if x.future.exception() is not None or x.future.result() != "DONE":
            return False
        if x.tail is not None and x.tail_state != "DONE":
            return False
        x.complete = True
        x.done_ns = x.done_ns or x.returned_ns or time.perf_counter_ns()
        if x.tail is not None:
            self._both_done(x)
        return True

    def check(self, x: NixlXfer) -> str:
        if not x.future.done():
            return "PROC"
        x.future.result()  # raises TransferError
        if self._known_done(x):
            return "DONE"
        states: list[str] = []
        for h in (x.handle, x.tail) if x.tail is not None else (x.handle,):
            try:
                state = str(self.agent.check_xfer_state(h))
            except Exception as e:  # noqa: BLE001
                raise _wrap(e, x.peer) from e
            if state == "ERR":
                raise TransferError(f"NIXL transfer from {x.peer!r} failed (state ERR)", peer=x.peer)
            states.append(state)
        if "PROC" in states:
            return "PROC"
        if x.tail is not None:
            self._both_done(x)
        x.complete = states[0] == "DONE"
        if x.complete and not x.done_ns:
            x.done_ns = time.perf_counter_ns()
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
        if posted and self._known_done(x):
            return True
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
                if ok and not x.done_ns:
                    x.done_ns = time.perf_counter_ns()
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
        self.untrack(id(x))

    # ---- notifications -----------------------------------------------------------------------
    def get_notifs(self) -> dict[str, list[bytes]]:
        return cast("dict[str, list[bytes]]", self.agent.get_new_notifs())

    def send_notif(self, peer: str, msg: bytes) -> None:
        try:
            self.agent.send_notif(peer, msg)
        except Exception as e:  # noqa: BLE001
            raise _wrap(e, peer) from e

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._copy_pool.shutdown(wait=True)
        self.wake.close()
        for addr in list(self._regs):
            reg = self._regs.pop(addr)
            try:
                self.agent.deregister_memory(reg)
                self.stats.regions_deregistered += 1
            except Exception:  # noqa: BLE001
                pass
        self.remove_all_peers()


def _make_agent(api: Any, name: str, conf: Any, progress_delay_us: int) -> Any:
    """``nixl_agent(name, conf)`` with the progress thread's delay set (the Python API hard-codes 0)."""
    bind = api.nixlBind
    real = bind.nixlAgent

    def agent_with_delay(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = progress_delay_us
        return real(agent_name, agent_config)

    bind.nixlAgent = agent_with_delay
    try:
        return api.nixl_agent(name, conf)
    finally:
        bind.nixlAgent = real


def _run_into(fut: Future[R], fn: Callable[[], R]) -> None:
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
