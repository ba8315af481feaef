"""A disk tier in a test's directory holding ``n`` demoted objects of random bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lw_core.backends.embedded.disk_tier import DiskTier


def demoted_tier(tmp_path: Path, n: int, nbytes: int, *, seed: int, direct_io: bool = False) -> tuple[DiskTier, dict[bytes, bytes]]:
    """A tier in ``tmp_path / "disk"`` with objects ``k0``... of ``nbytes`` each, all written."""
    t = DiskTier(str(tmp_path / "disk"), 64 << 20, queue_bytes=32 << 20, direct_io=direct_io)
    rng = np.random.default_rng(seed)
    data = {f"k{i}".encode(): rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes() for i in range(n)}
    for k, v in data.items():
        t.offer(k, memoryview(v))
    assert t.flush()
    return t, data
