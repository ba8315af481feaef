"""EmbeddedBackend.open's memory of keys it has looked up (``ObjectReader._known``): a key opened
before skips the index lookup, but only while its object still lives -- a key evicted and stored
again opens the new object, an evicted one is a miss, a re-created pool forgets everything, and bad
keys are still refused."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from lw_core.backends import embedded
from lw_core.backends.embedded import EmbeddedBackend

MiB = 1 << 20
N = 512 << 10  # 8 objects fill a 4 MiB pool


def store(b: EmbeddedBackend, key: str, n: int, fill: int) -> None:
    (h,) = b.reserve([key], n)
    assert h is not None
    b.write([h], [0], [np.full(n, fill, np.uint8)])
    b.commit([h])


def evict(b: EmbeddedBackend, key: str) -> None:
    """Store fillers until ``key``'s object is evicted (a read object gets CLOCK's second chance)."""
    for i in range(32):
        if b.lookup([key]) == 0:
            return
        store(b, f"filler{i}", N, 9)
    raise AssertionError(f"{key!r} was never evicted")


def load(b: EmbeddedBackend, key: str, n: int) -> np.ndarray | None:
    (h,) = b.open([key])
    if h is None:
        return None
    out = np.zeros(n, np.uint8)
    b.read([h], [0], [out])
    b.release([h])
    return out


@pytest.fixture
def pool(tmp_path):
    b = EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=4 * MiB)
    yield b
    b.close()


def test_a_known_key_opens_without_an_index_lookup(pool, monkeypatch):
    store(pool, "k", N, 3)
    assert (load(pool, "k", N) == 3).all()
    lookups = []
    real = pool._reader._lookup_into
    monkeypatch.setattr(pool._reader, "_lookup_into", lambda *a: lookups.append(a) or real(*a))
    assert (load(pool, "k", N) == 3).all()
    assert lookups == [], "a key whose object still lives was looked up again"
    assert load(pool, "never-stored", N) is None and len(lookups) == 1
    assert pool.stats()["open_hits"] == 2


def test_a_key_evicted_and_stored_again_opens_the_new_object(pool):
    store(pool, "k", N, 1)
    assert (load(pool, "k", N) == 1).all()  # now known
    evict(pool, "k")
    assert load(pool, "k", N) is None, "an evicted object was opened from memory"
    store(pool, "k", N, 2)  # the key again, another object (another id, maybe another place)
    out = load(pool, "k", N)
    assert out is not None and (out == 2).all()
    pool.verify()


def test_a_key_evicted_while_known_is_stored_again_before_its_next_open(pool):
    store(pool, "k", N, 1)
    assert (load(pool, "k", N) == 1).all()
    evict(pool, "k")
    store(pool, "k", N, 2)  # never opened as a miss in between: the memory still names the old object
    out = load(pool, "k", N)
    assert out is not None and (out == 2).all()


def test_one_open_of_live_evicted_stored_again_and_missing_keys_answers_each(pool):
    """One call mixing every case: a known key whose object lives, a known key evicted and stored
    again (looked up once more), one evicted for good and one never stored (misses); each hit's
    lease is its own and released once."""
    store(pool, "old", N, 1)
    store(pool, "gone", N, 3)
    assert load(pool, "old", N) is not None and load(pool, "gone", N) is not None  # both known now
    evict(pool, "old")
    evict(pool, "gone")
    store(pool, "old", N, 2)
    store(pool, "live", N, 4)
    assert load(pool, "live", N) is not None  # known and live
    hs = pool.open(["live", "old", "gone", "never"])
    assert [h is not None for h in hs] == [True, True, False, False]
    outs = [np.zeros(N, np.uint8) for _ in range(2)]
    pool.read(hs[:2], [0, 0], outs)
    assert (outs[0] == 4).all() and (outs[1] == 2).all()
    assert len({h._lease for h in hs[:2]}) == 2
    pool.release(hs)
    pool.release(hs)  # a second release of the same handles is a no-op
    assert pool.stats()["open_hits"] >= 2
    pool.verify()


def test_a_recreated_pool_forgets_known_keys(tmp_path, monkeypatch):
    # Ids restart in a new pool: the old pool's (id, offset) for "k" is (id 3, page 1); in the new
    # pool id 3 is "pad" on page 1. Remembered across the re-attach, "k" would read pad's bytes.
    monkeypatch.setattr(embedded.backend, "POOL_CHECK_S", 0.0)
    p = tmp_path / "p"
    a = EmbeddedBackend(str(p), capacity_bytes=4 * MiB)
    try:
        store(a, "pad", 4096, 5)
        store(a, "k", 4096, 1)
        assert (load(a, "k", 4096) == 1).all()
        shutil.rmtree(p)
        with EmbeddedBackend(str(p), capacity_bytes=4 * MiB) as b:
            store(b, "k", 4096, 2)
            store(b, "pad", 4096, 6)
            out = load(a, "k", 4096)
            assert a.stats()["reattached"] == 1
            assert out is not None and (out == 2).all(), "a key remembered from the deleted pool opened another object"
    finally:
        a.close()


def test_bad_keys_are_refused_when_others_are_known(pool):
    store(pool, "k", 4096, 1)
    assert load(pool, "k", 4096) is not None
    for bad in (5, ["x"], "", "x" * 600):
        with pytest.raises(ValueError):
            pool.open(["k", bad])


def test_the_memory_is_bounded_and_its_keys_still_open(pool, monkeypatch):
    monkeypatch.setattr(embedded.object_reader, "KNOWN_MAX", 4)
    keys = [f"k{i}" for i in range(6)]
    for i, k in enumerate(keys):
        store(pool, k, 4096, i)
    for _ in range(2):
        for i, k in enumerate(keys):
            out = load(pool, k, 4096)
            assert out is not None and (out == i).all()
            assert len(pool._reader._known[1]) <= 4
    hs = pool.open(keys)  # one batch larger than the bound: all open, the memory holds this batch
    assert all(h is not None for h in hs)
    pool.release(hs)
