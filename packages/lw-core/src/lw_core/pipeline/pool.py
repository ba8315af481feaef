"""Threads and buffers the layer pipeline runs on: a fixed pool of daemon workers that can replace a
worker stuck in a backend call, deadline-bounded calls into that pool, staging buffers, and a
bounded error log."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from lw_core.backend import BackendError, Lent
from lw_core.pipeline.buffers import aligned_empty

log = logging.getLogger("lw_core.pipeline")


class WorkerPool:
    """``size`` daemon threads running jobs in FIFO order (so one worker keeps layer order).

    A job stuck in a backend call past its deadline cannot be interrupted from Python; ``unstick``
    lets that thread finish (and exit) on its own while a fresh thread takes over the queue. At most
    ``max_stuck`` threads are abandoned at once, so a wedged store costs a bounded number of threads.
    """

    def __init__(self, name: str, size: int = 1, max_stuck: int = 4):
        if size < 1:
            raise ValueError(f"{name}: threads={size} must be >= 1")
        self.name = name
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._abandoned: set[threading.Thread] = set()
        self._busy: dict[threading.Thread, float] = {}
        self._stuck_left = max_stuck
        self._serial = 0
        self._closed = False
        for _ in range(size):
            self._spawn()

    def _spawn(self) -> None:
        self._serial += 1
        t = threading.Thread(target=self._loop, name=f"{self.name}-{self._serial}", daemon=True)
        self._threads.add(t)
        t.start()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            job = self._q.get()
            if job is None:
                break
            with self._lock:
                self._busy[me] = time.monotonic()
            try:
                job()
            except BaseException:  # jobs record their own errors; this only guards the thread
                log.exception("%s: job raised", self.name)
            with self._lock:
                self._busy.pop(me, None)
                if me in self._abandoned:  # a replacement owns the queue now
                    self._abandoned.discard(me)
                    self._stuck_left += 1
                    break
        with self._lock:
            self._threads.discard(me)

    def submit(self, job: Callable[[], None]) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name}: pool is closed")
        self._q.put(job)

    def unstick(self, older_than_s: float = 0.0) -> int:
        """Replace every worker busy in one job for ``older_than_s`` or more (a stalled backend
        call: whichever job it is, it holds up the queue). Returns how many were replaced; fewer
        than that once ``max_stuck`` threads are already abandoned.

        Callers that just missed a deadline pass nothing (every busy worker): the job that made them
        miss may have started long after their wait began (it queued behind a slow, healthy job), so
        its age says nothing. A healthy worker replaced by mistake finishes its job and exits."""
        now = time.monotonic()
        replaced = []
        with self._lock:
            for t, t0 in self._busy.items():
                if self._closed or self._stuck_left <= 0:
                    break
                if now - t0 >= older_than_s and t not in self._abandoned:
                    self._stuck_left -= 1
                    self._abandoned.add(t)
                    replaced.append(t.name)
            for _ in replaced:
                self._spawn()
        for name in replaced:
            log.warning("%s: %s is stuck in a backend call; started a replacement", self.name, name)
        return len(replaced)

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return list(self._threads)

    def close(self, timeout_s: float) -> list[threading.Thread]:
        """Stop after the queued jobs; returns threads still alive at the deadline (stuck ones)."""
        with self._lock:
            if self._closed:
                return [t for t in self._threads if t.is_alive()]
            self._closed = True
            live = [t for t in self._threads if t not in self._abandoned]
        for _ in live:
            self._q.put(None)
        end = _now() + timeout_s
        for t in live:
            t.join(max(0.0, end - _now()))
        return [t for t in self.threads() if t.is_alive()]


def _now() -> float:
    return time.monotonic()


class DeadlineCall:
    """Run ``fn`` on a pool and wait at most ``timeout_s``. On timeout the worker is abandoned and,
    if ``fn`` returns later, ``on_late(value)`` cleans up (e.g. releases leases nobody will use)."""

    def __init__(self, pool: WorkerPool, fn: Callable[[], Any], on_late: Callable[[Any], None] | None = None):
        self._fn, self._on_late, self._pool = fn, on_late, pool
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._late = False
        self.value: Any = None
        self.error: BaseException | None = None
        pool.submit(self._run)

    def _run(self) -> None:
        try:
            self.value = self._fn()
        except BaseException as e:  # surfaced to the caller through .error
            self.error = e
        with self._lock:
            late = self._late
            self._done.set()
        if late and self._on_late is not None and self.error is None:
            try:
                self._on_late(self.value)
            except Exception:
                log.exception("%s: cleanup after a late call failed", self._pool.name)

    def wait(self, timeout_s: float) -> bool:
        """True when ``fn`` finished (see ``value``/``error``); False on timeout."""
        if self._done.wait(max(0.0, timeout_s)):
            return True
        with self._lock:
            if self._done.is_set():
                return True
            self._late = True
        self._pool.unstick()
        return False


class StagingPool:
    """Reusable page-aligned host buffers for transfers that cannot go zero-copy.

    A buffer handed to an asynchronous device copy is parked with its token and reused only once
    the copy is done; fresh large allocations would page-fault on every step. A backend's lent
    memory (``lw_core.backend.Lent``, from ``read_lent``) is parked the same way and given back to
    the backend once its copy is done, never if its token is broken.
    """

    def __init__(self, wait_token: Callable[[Any, float], bool], max_free_bytes: int = 256 << 20,
                 alloc: Callable[[int], np.ndarray] | None = None):
        self._wait_token = wait_token
        self._alloc = alloc or aligned_empty  # a device copier's pinned memory (Copier.host_buffer)
        self._max_free = max_free_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._free_bytes = 0
        self._parked: list[tuple[Any, list[np.ndarray | Lent]]] = []

    def get(self, nbytes: int) -> np.ndarray:
        self._reclaim()
        with self._lock:
            lst = self._free.get(nbytes)
            if lst:
                self._free_bytes -= nbytes
                return lst.pop()
        return self._alloc(nbytes)

    def put(self, buf: np.ndarray | Lent | None, token: Any = None) -> None:
        """``buf`` is free once the copy of ``token`` (None: no copy in flight) is done."""
        if buf is None:
            return
        if token is not None:
            with self._lock:
                self._parked.append((token, [buf]))
            return
        if not isinstance(buf, np.ndarray):
            try:
                buf.give_back()
            except Exception:  # the backend's own bookkeeping failed: its memory stays lent
                log.exception("giving lent pool memory back failed")
            return
        with self._lock:
            if self._free_bytes + buf.nbytes <= self._max_free:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._free_bytes += buf.nbytes

    def reclaim(self) -> None:
        """Free (give back) what was parked behind copies that are done."""
        self._reclaim()

    def _reclaim(self) -> None:
        with self._lock:
            parked, self._parked = self._parked, []
        keep = []
        for token, bufs in parked:
            try:
                done = self._wait_token(token, 0.0)
            except Exception:
                done = False  # a broken token: never reuse its buffers
                bufs = []
            if done:
                for b in bufs:
                    self.put(b)
            elif bufs:
                keep.append((token, bufs))
        if keep:
            with self._lock:
                self._parked.extend(keep)


class ErrorLog:
    """Distinct error messages of one step, bounded so a failing store cannot flood results."""

    def __init__(self, limit: int = 64):
        self.messages: list[str] = []
        self.dropped = 0
        self._limit = limit

    def add(self, msg: str) -> None:
        if msg in self.messages:
            return
        if len(self.messages) < self._limit:
            self.messages.append(msg)
            log.warning("%s", msg)
        else:
            self.dropped += 1

    def extend(self, msgs: list[str]) -> None:
        for m in msgs:
            self.add(m)

    def out(self) -> list[str]:
        if self.dropped:
            return [*self.messages, f"... and {self.dropped} more errors"]
        return list(self.messages)


def describe(e: BaseException) -> str:
    kind = type(e).__name__ if isinstance(e, BackendError) else f"unexpected {type(e).__name__}"
    return f"{kind}: {e}"
