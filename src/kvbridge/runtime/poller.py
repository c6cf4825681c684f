"""One poller over a decode rank's side channels: a poll looks only at the channels that have something.

Every side channel (:class:`~kvbridge.runtime.peer.SideChannel`: a ROUTER and its monitor) is registered
from the moment it opens until it closes, by the file descriptors ZMQ gives for its two sockets
(``ZMQ_FD``), in one ``epoll`` set (``poll(2)`` where there is no epoll) beside the transport's wake-up
fd. Asking that set costs the same with 1 or 512 idle channels; only the ready ones are visited.

ZMQ's descriptors are edge-style: one is readable when its socket has commands to process, not when a
message waits, and any operation on the socket (a send, a receive, reading ``ZMQ_EVENTS``) may consume
that signal while a message stays queued. Hence:

* a visited channel is drained until ``ZMQ_EVENTS`` shows no ``POLLIN`` (its descriptor is then accurate
  again: the next message or disconnect makes it readable);
* a channel this rank sent on is *touched* (:attr:`ChannelPoller.touched`, written by the channel itself):
  visited on the next poll whatever its descriptor says, and asked (``ZMQ_EVENTS``) before the rank
  blocks (:meth:`ChannelPoller.pending`); so is a channel whose monitor reported a disconnect not handed
  out yet.

:class:`PollWork` counts what polls visit (tests assert on it, never on time).
"""
from __future__ import annotations

import select
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

if TYPE_CHECKING:
    from .peer import Peer, SideChannel

MAX_EVENTS = 256  # ready descriptors taken per poll (level-triggered: the rest come on the next one)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: enum ops cost µs


@dataclass
class PollWork:
    """What a decode rank's polls visited, cumulative: ``polls`` (:meth:`DecodeRank.poll` calls),
    ``channels`` (side channels drained: readable, sent on, or a disconnect pending), ``flushed`` (peers
    whose queued acquires, heartbeats or unsent frames were sent), ``connecting`` (background handshakes
    looked at). Idle peers add nothing to any of them."""

    polls: int = 0
    channels: int = 0
    flushed: int = 0
    connecting: int = 0

    def snapshot(self) -> dict[str, int]:
        return dict(vars(self))


class ChannelPoller:
    """The side channels of one decode rank, by their ZMQ descriptors (see the module docstring)."""

    def __init__(self, work: PollWork | None = None) -> None:
        self.work = work if work is not None else PollWork()
        self._ep: Any = select.epoll() if hasattr(select, "epoll") else None
        self._poll: Any = select.poll() if self._ep is None else None
        self._fds: dict[SideChannel, tuple[int, ...]] = {}
        self._by_fd: dict[int, SideChannel] = {}
        self._owner: dict[SideChannel, Peer] = {}
        self.touched: dict[SideChannel, None] = {}  # visited on the next poll whatever their descriptors say
        self.closed = False

    def __len__(self) -> int:
        """Side channels registered."""
        return len(self._owner)

    def _register(self, fd: int) -> None:
        if self._ep is not None:
            try:
                self._ep.register(fd, select.EPOLLIN)
            except FileExistsError:  # a closed socket's number, reused
                self._ep.modify(fd, select.EPOLLIN)
        else:
            self._poll.register(fd, select.POLLIN)

    def _unregister(self, fd: int) -> None:
        try:
            (self._ep if self._ep is not None else self._poll).unregister(fd)
        except (OSError, KeyError, ValueError):  # already gone (closed), or the poller is closed
            pass

    def add_fd(self, fd: int) -> None:
        """A descriptor that only wakes :meth:`wait` (the transport's wake-up fd); never drained here."""
        self._register(fd)

    def add(self, peer: Peer, ch: SideChannel) -> None:
        """Watch ``peer``'s side channel ``ch`` from now until :meth:`remove` (before it closes)."""
        fds = ch.fds()
        self._fds[ch], self._owner[ch] = fds, peer
        for fd in fds:
            self._by_fd[fd] = ch
            self._register(fd)
        ch.watch = self.touched
        self.touched[ch] = None  # looked at once: what arrived before it was registered

    def remove(self, ch: SideChannel) -> None:
        """Stop watching ``ch`` (call before its sockets close: their numbers may be reused)."""
        if self._owner.pop(ch, None) is None:
            return
        for fd in self._fds.pop(ch, ()):
            if self._by_fd.get(fd) is ch:
                del self._by_fd[fd]
            self._unregister(fd)
        self.touched.pop(ch, None)
        ch.watch = None

    def ready(self) -> list[Peer]:
        """The peers whose side channel must be drained now: a descriptor readable, or touched
        (counted in :attr:`PollWork.channels`). Costs O(ready + touched), not O(channels)."""
        chans = dict(self.touched)
        self.touched.clear()  # (the same dict: every channel writes into it)
        if self.closed:
            evs = []
        else:
            evs = self._ep.poll(0, MAX_EVENTS) if self._ep is not None else self._poll.poll(0)
        for fd, _ in evs:
            ch = self._by_fd.get(fd)
            if ch is not None:
                chans[ch] = None
        out = [self._owner[ch] for ch in chans if ch in self._owner]
        self.work.channels += len(out)
        return out

    def pending(self) -> bool:
        """Whether a touched channel has something no descriptor will announce (a reply queued, one
        already taken off its socket, a disconnect not handed out): then do not block. Asking settles the
        others (their descriptors are accurate again)."""
        for ch in list(self.touched):
            if ch not in self._owner:
                del self.touched[ch]
                continue
            if ch.buffered or ch.down:
                return True
            try:
                if int(ch.sock.get(_EVENTS)) & _POLLIN:
                    return True
            except zmq.ZMQError:  # closed under us: the next poll sees why
                return True
            del self.touched[ch]
        return False

    def readable(self) -> bool:
        """Whether a registered descriptor is readable now (nothing is taken: :meth:`ready` sees it too)."""
        if self.closed:
            return False
        return bool(self._ep.poll(0, 1) if self._ep is not None else self._poll.poll(0))

    def wait(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s`` or until a registered descriptor is readable (call :meth:`pending`
        first)."""
        if self.closed:
            return
        if self._ep is not None:
            self._ep.poll(timeout_s, 1)
        else:
            self._poll.poll(max(1, int(timeout_s * 1000 + 0.999)))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._ep is not None:
                self._ep.close()
