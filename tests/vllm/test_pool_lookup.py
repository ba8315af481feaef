"""PoolLookup (lw_vllm.scheduler.pool_lookup) on its own, over a dict-backed backend stand-in: a chunk counts
only if every rank's object is there, the hit stops at the first miss, KV saved at another TP size
is found by that size's key space, and a failing lookup is counted and raised (the scheduler side
turns it into a miss). The deadline and back-off over a stalled store are
tests/pd/test_scheduler_lookup_deadline.py."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_core.backend import TIER_DISK, TIER_DRAM, BackendError  # noqa: E402
from lw_core.keys import KeySpace  # noqa: E402
from lw_vllm.metrics import Collector  # noqa: E402
from lw_vllm.scheduler.pool_lookup import PoolLookup  # noqa: E402

KS = KeySpace(model_fp="m", layout_fp="tp1")
KS2 = KeySpace(model_fp="m", layout_fp="tp2")
HASHES = [bytes([i]) * 16 for i in range(4)]


class _Backend:
    def __init__(self, held: list[str], fail: bool = False) -> None:
        self.held, self.fail = set(held), fail

    def lookup(self, keys: list[str]) -> int:
        if self.fail:
            raise BackendError("the store is down")
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return n


def _lookup(backend: _Backend, metrics: Collector | None = None) -> PoolLookup:
    other = {2: (KS2, ["a", "b"])}
    return PoolLookup(backend, KS, ["r0", "r1"], other, [2], 1.0, metrics or Collector())  # type: ignore[arg-type]


def test_a_chunk_counts_only_when_every_rank_holds_it() -> None:
    lk = _lookup(_Backend(KS.keys("r0", HASHES) + KS.keys("r1", HASHES[:2]) + KS.keys("r1", HASHES[3:])))
    try:
        assert lk(HASHES) == 2  # rank 1 lacks chunk 2: chunk 3 does not count either
        assert lk(HASHES, tags=["r0"]) == 4
        assert lk([]) == 0
    finally:
        lk.close()


def test_kv_saved_at_another_tp_is_found_by_that_sizes_keys() -> None:
    held = KS.keys("r0", HASHES[:1]) + KS.keys("r1", HASHES[:1]) + KS2.keys("a", HASHES[1:3]) + KS2.keys("b", HASHES[1:3])
    lk = _lookup(_Backend(held))
    try:
        assert lk(HASHES) == 1
        assert lk.at_other_tp(HASHES, 1, 4) == (3, 2)  # chunks 1 and 2, saved at TP 2
        assert lk.at_other_tp(HASHES, 3, 4) == (3, 0)  # nothing past them
    finally:
        lk.close()


def test_a_failing_lookup_is_counted_and_raised() -> None:
    metrics = Collector()
    lk = _lookup(_Backend([], fail=True), metrics)
    try:
        with pytest.raises(BackendError, match="the store is down"):
            lk(HASHES)
        stats = metrics.take()
        assert stats is not None and stats.data["lookup_errors"] == 1
    finally:
        lk.close()


class _TieredBackend(_Backend):
    """Keys in ``on_disk`` are held in the disk tier."""

    def __init__(self, held: list[str], on_disk: list[str]) -> None:
        super().__init__(held + on_disk)
        self.on_disk = set(on_disk)

    def lookup_tiers(self, keys: list[str]) -> list[str]:
        return [TIER_DISK if k in self.on_disk else TIER_DRAM for k in keys[: self.lookup(keys)]]


def test_tiers_name_disk_for_a_chunk_any_rank_holds_on_disk_and_stop_where_the_hit_does() -> None:
    held = KS.keys("r0", HASHES[:3]) + KS.keys("r1", HASHES[:2])
    lk = _lookup(_TieredBackend(held, KS.keys("r1", HASHES[2:3]) + KS.keys("r0", HASHES[3:])))
    try:
        # Chunk 2: rank 1's object is on disk; chunk 3: rank 1 has none, so the hit ends at 3.
        assert lk.tiers(HASHES) == [TIER_DRAM, TIER_DRAM, TIER_DISK] and lk(HASHES) == 3
        assert lk.tiers([]) == []
    finally:
        lk.close()
    lk = _lookup(_Backend(KS.keys("r0", HASHES) + KS.keys("r1", HASHES)))  # no tiers: host memory
    try:
        assert lk.tiers(HASHES) == [TIER_DRAM] * 4
    finally:
        lk.close()
