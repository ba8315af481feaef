"""MemoryBackend: the in-process fake others test against must keep the Backend contract, and the
same checks run on EmbeddedBackend so the fake cannot drift from the real thing. The contract
itself (lw_dev.backend_contract) runs on both in test_pipeline_backends.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from lw_core.backends.embedded import EmbeddedBackend
from lw_core.backends.memory import MemoryBackend

MiB = 1 << 20


@pytest.fixture(params=["memory", "embedded"])
def backend(request, tmp_path):
    if request.param == "memory":
        b = MemoryBackend(4 * MiB, lease_ttl_s=0.3)
    else:
        b = EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=4 * MiB, lease_ttl_s=0.3)
    yield b
    b.close()


def test_round_trip_layerwise(backend):
    per, layers = 4096, 3
    keys = ["a", "b"]
    hs = backend.reserve(keys, per * layers)
    data = {k: np.frombuffer((k * per * layers).encode(), np.uint8).copy() for k in keys}
    for layer in range(layers):
        backend.write(hs, [layer * per] * 2, [data[k][layer * per : (layer + 1) * per] for k in keys])
    assert backend.lookup(keys) == 0
    backend.commit(hs)
    assert backend.lookup(keys + ["c"]) == 2
    rs = backend.open(keys + ["c"])
    assert rs[2] is None
    out = [np.empty(per, np.uint8) for _ in keys]
    backend.read(rs[:2], [per] * 2, out)
    for k, o in zip(keys, out):
        np.testing.assert_array_equal(o, data[k][per : 2 * per])
    assert bytes(backend.view(rs[0], 0, 3)) == b"aaa" and backend.view(rs[0], 0, 3).readonly
    backend.release(rs[:2])


def test_lru_eviction_spares_leases(backend):
    n = 1 * MiB
    for k in ("a", "b", "c", "d"):
        (h,) = backend.reserve([k], n)
        backend.commit([h])
    held = backend.open(["a"])  # a: leased and most recent
    (h,) = backend.reserve(["e"], n)
    assert h is not None
    assert backend.lookup(["a"]) == 1 and backend.lookup(["b"]) == 0
    assert backend.stats()["evictions"] == 1
    backend.abort([h])
    backend.release(held)


def test_expired_lease_stops_pinning(backend):
    n = 2 * MiB
    for k in ("a", "b"):
        (h,) = backend.reserve([k], n)
        backend.commit([h])
    backend.open(["a", "b"])  # never released: a dead reader
    assert backend.reserve(["c"], n) == [None]
    time.sleep(0.35)
    assert backend.reserve(["c"], n)[0] is not None


def test_memory_backend_bad_arguments():
    with pytest.raises(ValueError, match="capacity_bytes"):
        MemoryBackend(0)
    b = MemoryBackend(MiB)
    with pytest.raises(ValueError, match="nbytes"):
        b.reserve(["a"], -1)
    (h,) = b.reserve(["a"], 10)
    with pytest.raises(ValueError, match="outside"):
        b.write([h], [5], [bytes(6)])
    assert b.reserve(["big"], 2 * MiB) == [None]
