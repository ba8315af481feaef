"""The backend's own counters (evictions; the embedded disk tier's) become connector metrics as
increments: no figure on the first look (but for counters this process keeps from 0), none
when the pool was recreated (counters went down)."""

from __future__ import annotations

from typing import Any

from lw_vllm.metrics import PoolCounters


class Backend:
    def __init__(self) -> None:
        self.counts: dict[str, Any] = {"evictions": 5, "objects": 9}

    def stats(self) -> dict[str, Any]:
        return dict(self.counts)


def test_increments_per_counter_from_the_second_look_on() -> None:
    be = Backend()
    pc = PoolCounters(be, period_s=0.0)
    assert pc.poll() == {}  # baseline
    be.counts.update(evictions=7, disk_hits=3, demotions=1)
    assert pc.poll() == {"evictions": 2}  # the disk counters appeared: their baseline
    be.counts.update(disk_hits=5, demotions=1, objects=20)
    assert pc.poll() == {"disk_hits": 2}
    be.counts.update(evictions=1)  # the pool was recreated
    assert pc.poll() == {}
    be.counts.update(evictions=4)
    assert pc.poll() == {"evictions": 3}


def test_polls_at_most_once_a_period_and_survives_a_failing_pool() -> None:
    be = Backend()
    pc = PoolCounters(be, period_s=3600.0)
    pc.poll()
    be.counts["evictions"] = 50
    assert pc.poll() == {}  # not due yet

    class Broken:
        def stats(self) -> dict[str, Any]:
            raise OSError("gone")

    assert PoolCounters(Broken(), period_s=0.0).poll() == {}


def test_a_counter_of_this_process_counts_from_its_first_look() -> None:
    be = Backend()
    be.counts["store_register_refusals"] = 1  # refused before the first poll
    pc = PoolCounters(be, period_s=0.0)
    assert pc.poll() == {"store_register_refusals": 1}  # evictions: a pool-wide baseline
    be.counts.update(store_register_refusals=2, evictions=6)
    assert pc.poll() == {"store_register_refusals": 1, "evictions": 1}
