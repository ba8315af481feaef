"""``lw_vllm.pool.close_all``: a process that ends without vLLM's shutdown (the test and bench
engines end with ``os._exit``) closes its backends first, so the embedded pool's disk tier writes
every demotion still queued, and a later engine finds them on disk."""

from __future__ import annotations

import glob
import time

import numpy as np

from lw_core.backends.embedded import disk_format as fmt
from lw_core.backends.embedded import disk_tier
from lw_core.config import parse_config
from lw_vllm import pool

OBJ = 200_000  # five fit in the 1 MiB arena


def test_close_all_writes_the_queued_demotions_and_forgets_the_backends(tmp_path, monkeypatch):
    real_write = disk_tier.write_all

    def slow_write(fd, data):  # demotions queue up behind a slow disk
        time.sleep(0.05)
        real_write(fd, data)

    monkeypatch.setattr(disk_tier, "write_all", slow_write)
    cfg = parse_config({"embedded_path": str(tmp_path / "pool"), "embedded_capacity_bytes": 1 << 20,
                        "embedded_disk_path": str(tmp_path / "disk"), "embedded_disk_capacity_bytes": 64 << 20})
    b = pool.acquire_backend(cfg)
    rng = np.random.default_rng(0)
    for i in range(15):  # ten evicted from DRAM, each demoted
        (h,) = b.reserve([f"k{i}"], OBJ)
        b.write([h], [0], [rng.integers(0, 256, OBJ, dtype=np.uint8)])
        b.commit([h])
    queued = b.stats()["evictions"]
    assert queued == 10 and len(glob.glob(str(tmp_path / "disk" / ("*" + fmt.SUFFIX)))) < queued  # still queued
    pool.close_all()
    assert len(glob.glob(str(tmp_path / "disk" / ("*" + fmt.SUFFIX)))) == queued
    assert pool.acquire_backend(cfg) is not b  # closed and forgotten: the next acquire opens a new one
    pool.close_all()
