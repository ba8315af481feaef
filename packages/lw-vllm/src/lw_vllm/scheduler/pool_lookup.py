"""The scheduler side's pool lookups: ``PoolLookup``, owned by ``SchedulerSide`` (and handed to its
``PdCoordinator`` as the coordinator's lookup function).

A lookup answers how many leading chunks every needed rank's object holds. It runs in vLLM's
scheduler loop, so it runs under ``lookup_timeout_s`` on this module's own thread: a stalled store
costs a miss, never a stalled engine. After a timeout, lookups pause for ``LOOKUP_BACKOFF_S``
(misses at once) instead of paying the deadline again for every request. A lookup that times out
or fails is counted in ``lookup_errors`` here; callers turn the exception into a miss.

Nothing under this engine's TP size: ``at_other_tp`` looks for chunks an engine of this model at
another TP size saved whose GQA heads this engine reads by byte ranges (``lw_core.tp_split``).

Recurrent-state boundaries (``state_plan``) are not a chained prefix: ``first_held`` looks up
candidates one by one, all of them in one call under the same deadline and back-off.

State this module owns: its lookup thread and the time until which lookups are paused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from lw_core.backend import TIER_DISK, Backend, BackendUnavailable, lookup_tiers
from lw_core.keys import KeySpace
from lw_core.pipeline.pool import DeadlineCall, WorkerPool
from lw_vllm.metrics import Collector

# After a lookup timeout, lookups are skipped (misses) for this long: a wedged store then costs
# one deadline every few seconds instead of one per request.
LOOKUP_BACKOFF_S = 5.0
T = TypeVar("T")


class PoolLookup:
    """``backend``: the pool; ``keyspace``, ``tags``: this engine's key space and rank tags;
    ``other_tp``: key space and rank tags at other TP sizes, ``readable_tp`` the sizes among them
    whose heads this engine reads; ``timeout_s``: ``lookup_timeout_s``; ``metrics``: where
    ``lookup_errors`` goes."""

    def __init__(self, backend: Backend, keyspace: KeySpace, tags: list[str],
                 other_tp: dict[int, tuple[KeySpace, list[str]]], readable_tp: list[int], timeout_s: float,
                 metrics: Collector) -> None:
        self.backend = backend
        self.keyspace = keyspace
        self.tags = tags
        self.other_tp = other_tp
        self.readable_tp = readable_tp
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._pool = WorkerPool("lw-lookup", size=1)
        self._paused_until = 0.0

    def __call__(self, hashes: list[bytes], keyspace: KeySpace | None = None, tags: list[str] | None = None) -> int:
        """Leading ``hashes`` every rank of ``tags`` (this engine's by default) holds under
        ``keyspace`` (this engine's by default)."""
        if not hashes:
            return 0

        def run() -> int:
            n = len(hashes)
            ks = keyspace or self.keyspace
            for tag in tags or self.tags:
                if n == 0:
                    break
                n = min(n, self.backend.lookup(ks.keys(tag, hashes[:n])))
            return n

        return self._deadlined(run)

    def first_held(self, candidates: list[list[str]]) -> int:
        """Index of the first of ``candidates`` (each a list of keys) whose every key the pool
        holds; ``len(candidates)`` when none is. One call, one deadline, however many candidates."""
        if not candidates:
            return 0

        def run() -> int:
            for i, keys in enumerate(candidates):
                if keys and self.backend.lookup(keys) == len(keys):
                    return i
            return len(candidates)

        return self._deadlined(run)

    def tiers(self, hashes: list[bytes]) -> list[str]:
        """The lookup of ``hashes`` (this engine's ranks and key space) naming, for each leading
        chunk every rank holds, the tier it is read from (``lw_core.backend.TIER_DISK`` when any
        rank's object is on disk, else ``TIER_DRAM``): what KV events say of the chunk."""
        if not hashes:
            return []

        def run() -> list[str]:
            out: list[str] | None = None
            for tag in self.tags:
                got = lookup_tiers(self.backend, self.keyspace.keys(tag, hashes[: len(hashes) if out is None else len(out)]))
                out = got if out is None else [TIER_DISK if TIER_DISK in (a, b) else a for a, b in zip(out, got)]
                if not out:
                    break
            return out or []

        return self._deadlined(run)

    def _deadlined(self, run: Callable[[], T]) -> T:
        """``run`` on the lookup thread within ``lookup_timeout_s`` (else paused lookups)."""
        if time.monotonic() < self._paused_until:
            raise BackendUnavailable("pool lookups paused after a lookup timeout")
        call = DeadlineCall(self._pool, run)
        if not call.wait(self.timeout_s):
            self._paused_until = time.monotonic() + LOOKUP_BACKOFF_S
            self.metrics.add(lookup_errors=1)
            raise BackendUnavailable(
                f"pool lookup took longer than lookup_timeout_s={self.timeout_s}s; "
                f"lookups paused for {LOOKUP_BACKOFF_S}s"
            )
        if call.error is not None:
            self.metrics.add(lookup_errors=1)  # the callers turn it into a miss: count it here
            raise call.error
        return call.value

    def at_other_tp(self, hashes: list[bytes], local: int, limit: int) -> tuple[int, int]:
        """After a miss at this engine's TP size: ``(hit, saver TP size)`` of chunks an engine at
        another size saved whose heads this engine reads by ranges, else ``(local, 0)``. One key
        per size first (a cheap miss), then every saver rank's objects (each holds some of the
        heads some rank of this engine needs)."""
        for tp in self.readable_tp:
            ks, tags = self.other_tp[tp]
            if self(hashes[local:local + 1], ks, tags[:1]) == 1:
                n = self(hashes[local:limit], ks, tags)
                if n:
                    return local + n, tp
        return local, 0

    def close(self) -> None:
        self._pool.close(timeout_s=1.0)
