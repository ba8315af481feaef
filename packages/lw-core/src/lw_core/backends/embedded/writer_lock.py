"""The pool's writer lock: one index writer at a time, across processes and across threads.

* Across processes: an ``flock`` on ``writer.lock`` in the pool directory, waited for until a
  deadline (``timeout_s``): a process stopped while holding it fails the others with
  ``BackendUnavailable`` naming the lock, never a hang.
* Across this backend's threads: a thread lock, waited for with the same deadline.
* ``create.lock``: openers take turns on it while one of them may be building the pool (which
  takes time that grows with the arena), so its wait is ``timeout_s`` plus an allowance for that.

State: the two lock files' descriptors (opened at attach, closed and reopened when the pool is
re-attached), the thread lock, and the thread that holds it for a whole re-attach (``exclusive``),
whose own ``locked`` calls inside it do not wait on themselves. Closing a descriptor drops its
``flock``, so a process that dies holds nothing.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from lw_core.backend import BackendUnavailable
from lw_core.backends.embedded import files
from lw_core.backends.embedded.env import flock_by
from lw_core.backends.embedded.records import CREATE_BYTES_PER_S


class WriterLock:
    """``writer.lock`` and ``create.lock`` of the pool at ``path``, and this backend's thread lock."""

    def __init__(self, path: str, *, timeout_s: float, capacity: int) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.capacity = capacity  # how long a creator may take (create_locked)
        self._tlock = threading.Lock()
        self._owner: int | None = None  # the thread in exclusive(), if any
        self._fd: int | None = None
        self._create_fd: int | None = None

    def open_files(self) -> None:
        """Open (creating them if needed) the two lock files of the pool directory."""
        self._fd = files.open_file(os.path.join(self.path, "writer.lock"), os.O_RDWR | os.O_CREAT)
        self._create_fd = files.open_file(os.path.join(self.path, "create.lock"), os.O_RDWR | os.O_CREAT)

    def close_files(self) -> None:
        """Close the lock files (which also drops any ``flock`` held through them)."""
        for fd in (self._fd, self._create_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._create_fd = None

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the writer lock: the thread lock (unless this thread is in ``exclusive``), then the flock."""
        assert self._fd is not None, "writer lock used before open_files()"
        fd = self._fd
        deadline = time.monotonic() + self.timeout_s
        nested = self._owner == threading.get_ident()
        if not nested and not self._tlock.acquire(timeout=self.timeout_s):
            raise BackendUnavailable(f"embedded pool {self.path!r}: writer lock busy in this process for {self.timeout_s}s")
        try:
            flock_by(
                fd,
                deadline,
                lambda: f"embedded pool {self.path!r}: another process held the index writer lock for more "
                f"than lock_timeout_s={self.timeout_s}s (stopped or stuck?)",
            )
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            if not nested:
                self._tlock.release()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold this backend's thread lock for a whole block (re-attaching); ``locked`` inside it,
        in this thread, takes only the flock."""
        if not self._tlock.acquire(timeout=self.timeout_s):
            raise BackendUnavailable(f"embedded pool {self.path!r}: busy in this process for {self.timeout_s}s")
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            self._owner = None
            self._tlock.release()

    @contextmanager
    def create_locked(self) -> Iterator[None]:
        """Held while opening: another opener may be building the pool, which takes time that
        grows with the arena, so the wait is timeout_s plus a generous allowance for it."""
        assert self._create_fd is not None, "writer lock used before open_files()"
        fd = self._create_fd
        wait_s = self.timeout_s + self.capacity / CREATE_BYTES_PER_S
        lock = os.path.join(self.path, "create.lock")
        flock_by(
            fd,
            time.monotonic() + wait_s,
            lambda: f"embedded pool {self.path!r}: another process held {lock!r} for more than {wait_s:.1f}s "
            f"(lock_timeout_s={self.timeout_s} plus time to create {self.capacity} bytes); it is "
            "stopped or stuck while creating or opening the pool",
        )
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
