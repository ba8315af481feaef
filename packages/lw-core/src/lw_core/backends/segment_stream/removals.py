"""The queue of finished stream objects waiting for removal under the clean-up policy
(``policy``): each entry is an item (a name, or what the backend needs to remove it) with the time
it is due and how often its removal was refused. At most ``MAX_QUEUED`` entries: beyond, the oldest
is dropped and left to eviction (``add`` returns it, for the log). A refused removal goes back for
``RETRY_S`` up to ``MAX_TRIES`` times. Not thread-safe: its owner holds its lock around each call."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from lw_core.backends.segment_stream.policy import MAX_QUEUED, MAX_TRIES, RETRY_S

T = TypeVar("T")


@dataclass(slots=True)
class Due(Generic[T]):
    at: float  # time.monotonic() from which it may be removed
    item: T
    tries: int = 0  # refusals so far


class Removals(Generic[T]):
    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        if max_queued < 1:
            raise ValueError(f"Removals: max_queued={max_queued!r} must be >= 1")
        self.max_queued = max_queued
        self._q: deque[Due[T]] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def clear(self) -> None:
        self._q.clear()

    def add(self, items: Iterable[T], at: float) -> list[T]:
        """Queue ``items`` due at ``at``; returns the oldest ones dropped to stay within the bound."""
        dropped: list[T] = []
        for it in items:
            if len(self._q) >= self.max_queued:
                dropped.append(self._q.popleft().item)
            self._q.append(Due(at, it))
        return dropped

    def next_at(self) -> float | None:
        """When the earliest entry is due; None when the queue is empty."""
        return min((d.at for d in self._q), default=None)

    def take_due(self, now: float) -> list[Due[T]]:
        """Take out the entries due at ``now``, oldest first."""
        due = [d for d in self._q if d.at <= now]
        if due:
            self._q = deque(d for d in self._q if d.at > now)
        return due

    def take_all(self) -> list[Due[T]]:
        out = list(self._q)
        self._q.clear()
        return out

    def retry(self, refused: Iterable[Due[T]], now: float) -> None:
        """Queue again, ``RETRY_S`` from ``now``, the entries whose removal was refused, unless
        refused ``MAX_TRIES`` times already (then they are left to eviction)."""
        for d in refused:
            if d.tries < MAX_TRIES:
                self._q.append(Due(now + RETRY_S, d.item, d.tries + 1))
