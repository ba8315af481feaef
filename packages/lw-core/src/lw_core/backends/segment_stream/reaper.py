"""A backend's reaper: removes what it queues once the policy's grace (``REMOVE_GRACE_S``) has
passed, on a daemon thread started at the first ``later``, and at ``close`` removes what is left
at once (the client is leaving). It owns its queue (``Removals``), its thread and its condition;
``remove`` is the store's removal, best effort (it logs its own failures and never raises)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from lw_core.backends.segment_stream.policy import MAX_QUEUED, REMOVE_GRACE_S
from lw_core.backends.segment_stream.removals import Removals

T = TypeVar("T")


class Reaper(Generic[T]):
    def __init__(self, name: str, remove: Callable[[Sequence[T]], None], *, grace_s: float = REMOVE_GRACE_S,
                 max_queued: int = MAX_QUEUED) -> None:
        if not grace_s >= 0:
            raise ValueError(f"Reaper: grace_s={grace_s!r} must be >= 0")
        self.name = name
        self.grace_s = grace_s
        self._remove = remove
        self._cv = threading.Condition()
        self._queue: Removals[T] = Removals(max_queued)
        self._thread: threading.Thread | None = None
        self._closing = False

    def __len__(self) -> int:
        with self._cv:
            return len(self._queue)

    def later(self, items: Sequence[T]) -> list[T]:
        """Queue ``items`` for removal after the grace; returns those dropped to stay bounded."""
        with self._cv:
            if self._closing:
                return self._queue.add(items, 0.0)  # close() is removing what is left
            dropped = self._queue.add(items, time.monotonic() + self.grace_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cv.notify()
        return dropped

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closing and ((at := self._queue.next_at()) is None or at > time.monotonic()):
                    self._cv.wait(None if at is None else at - time.monotonic())
                if self._closing:
                    return
                due = [d.item for d in self._queue.take_due(time.monotonic())]
            self._remove(due)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and remove what is left now."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
        with self._cv:
            left = [d.item for d in self._queue.take_all()]
        if left:
            self._remove(left)
