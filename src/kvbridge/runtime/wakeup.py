"""A file descriptor one thread makes readable for another that waits in ``poll(2)`` beside its sockets."""
from __future__ import annotations

import os


class Wakeup:
    """A file descriptor another thread makes readable (:meth:`set`), for ``poll(2)`` beside sockets:
    an eventfd on Linux, a pipe elsewhere."""

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            self.fd = self._w = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # pragma: no cover - not Linux
            self.fd, self._w = os.pipe()
            os.set_blocking(self.fd, False)
            os.set_blocking(self._w, False)
        self.closed = False

    def set(self) -> None:
        if self.closed:
            return
        try:
            os.write(self._w, (1).to_bytes(8, "little"))
        except (BlockingIOError, OSError):  # already readable (counter or pipe full), or closed
            pass

    def clear(self) -> None:
        try:
            os.read(self.fd, 4096)
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        self.closed = True
        for fd in {self.fd, self._w}:
            try:
                os.close(fd)
            except OSError:
                pass
