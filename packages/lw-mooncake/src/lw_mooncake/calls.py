"""Store calls under a deadline.

Mooncake's calls can block (a master that is gone, a peer that stopped answering): each runs on a
worker thread and the caller waits at most ``timeout_s``, then gets ``BackendUnavailable``. A call
that timed out may still be copying: staging it used is retired (never reused) until the call
returns (``CallTimedOut.pending``), see ``lw_mooncake.buffers.LateBuffers``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from lw_core.backend import BackendUnavailable

T = TypeVar("T")


class CallTimedOut(BackendUnavailable):
    """A call past its deadline. ``pending`` is done once the call itself has returned (until then
    it may still read or write the buffers it was given)."""

    def __init__(self, text: str, pending: Future[Any]) -> None:
        super().__init__(text)
        self.pending = pending


class Deadlines:
    def __init__(self, timeout_s: float, where: str, workers: int = 8) -> None:
        self.timeout_s = timeout_s
        self.where = where
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lw-mooncake")
        self.timeouts = 0
        # Start every worker now, from the constructing thread: threads inherit its network
        # namespace, and Mooncake may open connections from whichever worker calls it.
        gate = threading.Barrier(workers + 1)
        for _ in range(workers):
            self._pool.submit(gate.wait, 10.0)
        gate.wait(10.0)

    def call(self, what: str, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        t = self.timeout_s if timeout_s is None else timeout_s
        fut = self._pool.submit(fn, *args)
        try:
            return fut.result(timeout=t)
        except FutureTimeout:
            self.timeouts += 1
            fut.cancel()  # still queued behind stuck calls: it never runs (and is done now)
            raise CallTimedOut(f"mooncake {what} did not answer within {t:g} s ({self.where})", fut) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
