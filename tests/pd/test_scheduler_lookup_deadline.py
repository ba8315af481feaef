"""A stalled pool lookup costs vLLM's scheduler loop at most ``lookup_timeout_s`` (then a miss),
and after a timeout lookups pause (``pool_lookup.LOOKUP_BACKOFF_S``) instead of paying the deadline
for every request, then resume."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from test_scheduler_pd import _publish, _req, _side  # noqa: E402

from lw_vllm.scheduler import pool_lookup  # noqa: E402


class _StallingLookups:
    def __init__(self, backend) -> None:
        self._backend, self.release = backend, threading.Event()

    def lookup(self, keys):
        self.release.wait(30)
        return self._backend.lookup(keys)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def test_stalled_lookup_is_a_miss_within_the_deadline_then_lookups_pause_and_resume(pool_dir, monkeypatch) -> None:
    backoff_s = 1.0
    monkeypatch.setattr(pool_lookup, "LOOKUP_BACKOFF_S", backoff_s)
    side = _side(pool_dir, lookup_timeout_s=0.3, consumer_is_to_load=True)
    try:
        req = _req("r1", 5 * 16 + 3, None)
        _publish(side, req, 5)
        assert side.get_num_new_matched_tokens(req, 0) == (5 * 16, False)  # healthy: a hit

        stall = _StallingLookups(side.lookup.backend)
        side.lookup.backend = stall
        t = time.perf_counter()
        assert side.get_num_new_matched_tokens(_req("r2", 5 * 16 + 3, None), 0) == (0, False)
        assert time.perf_counter() - t < 0.3 + 0.5
        # paused: the next request misses at once instead of waiting out another deadline
        t = time.perf_counter()
        assert side.get_num_new_matched_tokens(_req("r3", 5 * 16 + 3, None), 0) == (0, False)
        assert time.perf_counter() - t < 0.1

        stall.release.set()  # the pool is healthy again, but lookups stay paused for the back-off
        assert side.get_num_new_matched_tokens(_req("r4", 5 * 16 + 3, None), 0) == (0, False)
        time.sleep(backoff_s)
        assert side.get_num_new_matched_tokens(_req("r5", 5 * 16 + 3, None), 0) == (5 * 16, False)
    finally:
        side.shutdown()
