"""Backends (prefillers, decoders): least-loaded choice, health, and probing failed ones back in."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Literal

import aiohttp

from .metrics import ProxyMetrics

log = logging.getLogger("lw_proxy")


Role = Literal["prefiller", "decoder"]


class Backend:
    __slots__ = ("url", "role", "healthy", "in_flight", "load", "failures", "down_since", "_seconds", "_healthy_g",
                 "_load_g", "_in_flight_g", "_failures_c")

    def __init__(self, url: str, role: Role, metrics: ProxyMetrics) -> None:
        self.url = url
        self.role = role
        self.healthy = True
        self.in_flight = 0
        self.load = 0  # estimated tokens; what the balancer minimises
        self.failures = 0  # consecutive
        self.down_since = 0.0
        # Label children resolved once: the hot path only observes.
        self._seconds = metrics.backend_seconds.labels(role, url)
        self._healthy_g = metrics.backend_healthy.labels(role, url)
        self._load_g = metrics.backend_load.labels(role, url)
        self._in_flight_g = metrics.backend_in_flight.labels(role, url)
        self._failures_c = metrics.backend_failures.labels(role, url)
        self._healthy_g.set(1)

    def acquire(self, work: int) -> None:
        self.in_flight += 1
        self.load += work
        self._load_g.set(self.load)
        self._in_flight_g.set(self.in_flight)

    def release(self, work: int, started: float) -> None:
        self.in_flight -= 1
        self.load -= work
        self._load_g.set(self.load)
        self._in_flight_g.set(self.in_flight)
        self._seconds.observe(time.perf_counter() - started)

    def mark_ok(self) -> None:
        self.failures = 0
        if not self.healthy:
            log.info("%s %s is back", self.role, self.url)
            self.healthy = True
            self._healthy_g.set(1)

    def mark_failed(self, why: str) -> None:
        self.failures += 1
        self._failures_c.inc()
        if self.healthy:
            log.warning("%s %s taken out: %s", self.role, self.url, why)
            self.healthy = False
            self.down_since = time.monotonic()
            self._healthy_g.set(0)


class BackendPool:
    def __init__(self, role: Role, urls: Iterable[str], metrics: ProxyMetrics) -> None:
        self.role = role
        self.backends = [Backend(u, role, metrics) for u in urls]
        self._rr = 0

    def pick(self, exclude: Backend | set[Backend] | None = None) -> Backend | None:
        """Least-loaded healthy backend not in ``exclude``; ties broken round-robin so equal backends
        share the work.

        When every backend is out, fall back to all of them: a probe may simply not have run yet,
        and a fast connect error beats refusing traffic to a cluster that just came back.
        ``None`` only when the pool has no backends.
        """
        skip = exclude if isinstance(exclude, set) else {exclude}
        cands = [b for b in self.backends if b.healthy and b not in skip]
        if not cands:
            cands = [b for b in self.backends if b not in skip] or self.backends
        n = len(cands)
        self._rr = (self._rr + 1) % n if n else 0
        best = None
        for i in range(n):
            b = cands[(self._rr + i) % n]
            if best is None or b.load < best.load:
                best = b
        return best

    def healthy_count(self) -> int:
        return sum(b.healthy for b in self.backends)


async def probe_loop(pools: list[BackendPool], session: aiohttp.ClientSession, interval: float,
                     headers: dict[str, str]) -> None:
    """Every ``interval`` s, GET /health on each backend that is out; a 200 puts it back in."""
    timeout = aiohttp.ClientTimeout(total=max(interval, 1.0))

    async def probe(b: Backend) -> None:
        try:
            async with session.get(b.url + "/health", timeout=timeout, headers=headers) as r:
                if r.status == 200:
                    b.mark_ok()
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass

    while True:
        await asyncio.sleep(interval)
        down = [b for p in pools for b in p.backends if not b.healthy]
        if down:
            await asyncio.gather(*(probe(b) for b in down))
