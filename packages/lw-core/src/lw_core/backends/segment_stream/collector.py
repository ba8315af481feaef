"""Removals a backend does from its own calls, with no thread of its own (Mooncake): ``remove``
removes at once and queues what the store refused (a reader's lease) to be tried again
``RETRY_S`` apart, up to ``MAX_TRIES`` times; ``later`` queues what should stay a while (abort
markers: ``MARKER_KEEP_S``); ``collect``, called from the backend's later calls, removes what is
due, at most every ``every_s``. It owns its queue, its lock and the quiet period (``QUIET_S``
after a store call timed out), during which ``collect`` does nothing and the backend skips its
other streaming calls (``quiet``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from lw_core.backend import BackendError
from lw_core.backends.segment_stream.policy import MAX_QUEUED, RETRY_S, QuietPeriod
from lw_core.backends.segment_stream.removals import Removals

log = logging.getLogger(__name__)


class Collector:
    def __init__(self, name: str, remove: Callable[[list[str]], Sequence[bool]], *, max_queued: int = MAX_QUEUED) -> None:
        """``remove(names)``: per name True when it is gone (removed, or not there), False when
        the store refused; raises ``BackendError`` when the store fails."""
        self.name = name
        self._remove = remove
        self._lock = threading.Lock()
        self._queue: Removals[str] = Removals(max_queued)
        self._collected_at = 0.0
        self.quiet = QuietPeriod()

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue)

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()

    def later(self, names: Sequence[str], after_s: float) -> None:
        with self._lock:
            dropped = self._queue.add(names, time.monotonic() + after_s)
        for k in dropped:
            log.warning("%s: removal queue full; %s is left to eviction", self.name, k)

    def remove(self, names: list[str]) -> None:
        """Remove now; what the store refuses is tried again later. Raises what ``remove`` raises."""
        if not names:
            return
        gone = self._remove(names)
        self.later([k for k, g in zip(names, gone) if not g], RETRY_S)

    def collect(self, *, every_s: float = 0.5) -> None:
        """Remove what is due (at most every ``every_s``; never in the quiet period); refused
        again goes back (``Removals.retry``)."""
        now = time.monotonic()
        with self._lock:
            if now - self._collected_at < every_s or not self._queue or self.quiet:
                return
            self._collected_at = now
            due = self._queue.take_due(now)
            if not due:
                return
        try:
            gone = list(self._remove([d.item for d in due]))
        except BackendError as e:
            gone = [False] * len(due)
            log.debug("%s: removal of %d leftover(s) failed: %s", self.name, len(due), e)
        with self._lock:
            self._queue.retry([d for d, g in zip(due, gone) if not g], now)
