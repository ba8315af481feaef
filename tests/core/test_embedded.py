"""EmbeddedBackend in one process: protocol round trips, write-once, abort, eviction, leases, stats,
timeouts, bad input. Cross-process behaviour is in test_embedded_procs.py."""

from __future__ import annotations

import fcntl
import os
import time

import numpy as np
import pytest

from lw_core.backend import Backend, BackendError, BackendUnavailable, ObjectMissing
from lw_core.backends.embedded import PAGE, EmbeddedBackend
from lw_core.backends.registry import open_backend
from lw_core.config import parse_config

MiB = 1 << 20


def payload(key: str, n: int) -> np.ndarray:
    """Bytes that differ per key and per position, so a misplaced copy cannot pass."""
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def pool(tmp_path):
    b = EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=4 * MiB)
    yield b
    b.close()


def put(b: EmbeddedBackend, keys: list[str], n: int) -> None:
    hs = b.reserve(keys, n)
    assert all(h is not None for h in hs), hs
    b.write(hs, [0] * len(hs), [payload(k, n) for k in keys])
    b.commit(hs)


def get(b: EmbeddedBackend, key: str, n: int, offset: int = 0) -> np.ndarray | None:
    (h,) = b.open([key])
    if h is None:
        return None
    out = np.empty(n, np.uint8)
    b.read([h], [offset], [out])
    b.release([h])
    return out


def test_is_a_backend_and_open_backend_builds_it(tmp_path):
    cfg = parse_config({"embedded_path": str(tmp_path / "p"), "embedded_capacity_bytes": 2 * MiB})
    b = open_backend(cfg)
    try:
        assert isinstance(b, Backend) and isinstance(b, EmbeddedBackend)
        assert b.stats()["capacity_bytes"] == 2 * MiB
    finally:
        b.close()


@pytest.mark.parametrize("n", [1, 4095, 4096, 16 << 10, 100_001, 1 << 20])
def test_round_trip_exact_bytes(pool, n):
    put(pool, ["a", "b"], n)
    assert pool.lookup(["a", "b", "c"]) == 2
    for k in ("a", "b"):
        np.testing.assert_array_equal(get(pool, k, n), payload(k, n))
    pool.verify()


def test_layerwise_ranged_write_and_read(pool):
    layers, per = 6, 16 << 10
    keys = [f"obj{i}" for i in range(8)]
    hs = pool.reserve(keys, layers * per)
    full = {k: payload(k, layers * per) for k in keys}
    for layer in reversed(range(layers)):  # any order: each layer is a ranged write
        pool.write(hs, [layer * per] * len(hs), [full[k][layer * per : (layer + 1) * per] for k in keys])
    pool.commit(hs)
    rs = pool.open(keys)
    for layer in range(layers):
        dsts = [np.empty(per, np.uint8) for _ in keys]
        pool.read(rs, [layer * per] * len(rs), dsts)
        for k, d in zip(keys, dsts):
            np.testing.assert_array_equal(d, full[k][layer * per : (layer + 1) * per])
    pool.release(rs)


def test_accepts_typed_and_2d_buffers(pool):
    src = np.arange(2048, dtype=np.float16).reshape(32, 64)
    (h,) = pool.reserve(["f16"], src.nbytes)
    pool.write([h], [0], [src])
    pool.commit([h])
    (r,) = pool.open(["f16"])
    dst = np.zeros_like(src)
    pool.read([r], [0], [dst])
    np.testing.assert_array_equal(dst, src)
    with pytest.raises(ValueError, match="C-contiguous"):
        pool.read([r], [0], [np.zeros((64, 64), np.float16)[:, :32]])
    with pytest.raises(ValueError, match="read-only"):
        pool.read([r], [0], [bytes(16)])


def test_uncommitted_is_invisible_and_write_once(pool):
    (h,) = pool.reserve(["k"], 8192)
    assert pool.lookup(["k"]) == 0
    assert pool.open(["k"]) == [None]
    assert pool.reserve(["k"], 8192) == [None], "in-flight key must not be reserved twice"
    pool.write([h], [0], [payload("k", 8192)])
    pool.commit([h])
    assert pool.lookup(["k"]) == 1
    assert pool.reserve(["k"], 8192) == [None], "committed key is write-once"
    # duplicates inside one batch: only the first wins
    hs = pool.reserve(["d", "d", "e"], 4096)
    assert hs[0] is not None and hs[1] is None and hs[2] is not None
    st = pool.stats()
    assert st["reserve_rejected_exists"] == 3
    pool.abort(hs)


def test_lookup_counts_leading_hits_only(pool):
    put(pool, ["a", "c"], 4096)
    assert pool.lookup(["a", "b", "c"]) == 1
    assert pool.lookup(["b", "a"]) == 0
    assert pool.lookup([]) == 0


def test_abort_leaves_nothing_and_frees_space(pool):
    before = pool.stats()["free_bytes"]
    hs = pool.reserve(["x", "y"], 1 * MiB)
    assert pool.stats()["free_bytes"] == before - 2 * MiB
    pool.write(hs, [0, 0], [payload("x", MiB), payload("y", MiB)])
    pool.abort(hs)
    assert pool.lookup(["x"]) == 0 and pool.open(["x", "y"]) == [None, None]
    st = pool.stats()
    assert st["free_bytes"] == before and st["reserved_objects"] == 0 and st["aborts"] == 2
    with pytest.raises(BackendError, match="not a reserved handle"):
        pool.write(hs[:1], [0], [b"late"])
    with pytest.raises(ObjectMissing, match="not published"):
        pool.commit(hs[:1])
    pool.verify()
    # the key can be written again after an abort
    put(pool, ["x"], 4096)
    assert pool.lookup(["x"]) == 1


def test_eviction_is_lru_and_counted(pool):
    n = 512 << 10  # 8 fit in 4 MiB
    keys = [f"k{i}" for i in range(8)]
    put(pool, keys, n)
    get(pool, "k0", n)  # touch: k0 becomes most recently used, k1 the oldest
    put(pool, ["new0", "new1"], n)
    assert pool.lookup(["k1"]) == 0 and pool.lookup(["k2"]) == 0
    assert pool.lookup(["k0"]) == 1 and pool.lookup(["k3"]) == 1
    st = pool.stats()
    assert st["evictions"] == 2 and st["evicted_bytes"] == 2 * n
    assert st["objects"] == 8 and st["bytes"] == 8 * n
    np.testing.assert_array_equal(get(pool, "k0", n), payload("k0", n))
    np.testing.assert_array_equal(get(pool, "new1", n), payload("new1", n))
    pool.verify()


def test_leased_objects_are_not_evicted_until_lease_expires(tmp_path):
    b = EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=2 * MiB, lease_ttl_s=0.3)
    try:
        n = 1 * MiB
        put(b, ["old", "older"], n)
        held = b.open(["old", "older"])
        assert b.reserve(["new"], n) == [None], "both objects are leased: nothing may be evicted"
        assert b.stats()["reserve_rejected_full"] == 1
        b.release(held[1:])
        (h,) = b.reserve(["new"], n)
        assert h is not None and b.lookup(["older"]) == 0 and b.lookup(["old"]) == 1
        b.abort([h])
        # a reader that never releases: its lease expires, then the object is evictable
        hs = b.reserve(["a", "b"], n)
        assert hs[0] is not None and hs[1] is None
        b.abort(hs)
        time.sleep(0.35)
        hs = b.reserve(["c", "d"], n)
        assert all(hs) and b.lookup(["old"]) == 0
        b.abort(hs)
        b.verify()
    finally:
        b.close()


def test_too_big_or_full_returns_none(pool):
    assert pool.reserve(["huge"], 5 * MiB) == [None]
    hs = pool.reserve(["a", "b", "c", "d", "e"], 1 * MiB)
    assert sum(h is not None for h in hs) == 4 and hs[4] is None, "reserved (uncommitted) space is never evicted"
    pool.abort(hs)
    assert pool.stats()["reserve_rejected_full"] == 2


def test_view_zero_copy_writable_only_when_reserved(pool):
    (h,) = pool.reserve(["v"], 3 * PAGE)
    w = pool.view(h, PAGE, PAGE)
    assert not w.readonly
    w[:] = bytes(range(256)) * (PAGE // 256)
    pool.commit([h])
    (r,) = pool.open(["v"])
    v = pool.view(r, PAGE, 256)
    assert v.readonly and bytes(v) == bytes(range(256))
    with pytest.raises(TypeError):
        v[0] = 1
    with pytest.raises(ValueError, match="outside object"):
        pool.view(r, 2 * PAGE, PAGE + 1)
    del v, w
    pool.release([r])


def test_out_of_range_and_bad_arguments(pool):
    (h,) = pool.reserve(["r"], 100)
    with pytest.raises(ValueError, match="outside object"):
        pool.write([h], [90], [bytes(11)])
    with pytest.raises(ValueError, match="outside object"):
        pool.write([h], [-1], [bytes(1)])
    with pytest.raises(ValueError, match="2 offsets"):
        pool.write([h], [0, 0], [bytes(1)])
    with pytest.raises(ValueError, match="nbytes"):
        pool.reserve(["z"], 0)
    with pytest.raises(ValueError, match="non-empty str"):
        pool.lookup([""])
    with pytest.raises(ValueError, match="longer than"):
        pool.open(["x" * 600])
    with pytest.raises(TypeError, match="handles from this backend"):
        pool.commit([object()])
    pool.abort([h])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"capacity_bytes": 1000}, "capacity_bytes=1000 is not accepted; accepted: an integer >= 1048576"),
        ({"capacity_bytes": True}, "capacity_bytes=True"),
        ({"capacity_bytes": 4 * MiB, "lease_ttl_s": 0}, "lease_ttl_s"),
        ({"capacity_bytes": 4 * MiB, "lock_timeout_s": float("inf")}, "lock_timeout_s"),
        ({"capacity_bytes": 4 * MiB, "reservation_timeout_s": -1}, "reservation_timeout_s"),
    ],
)
def test_bad_settings_name_the_field(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EmbeddedBackend(str(tmp_path / "p"), **kwargs)


def test_unknown_option_is_rejected(tmp_path):
    with pytest.raises(TypeError, match="colour"):
        EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=4 * MiB, colour="red")


def test_unusable_path_is_a_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(BackendError, match="embedded_path"):
        EmbeddedBackend(str(f / "pool"), capacity_bytes=4 * MiB)


def test_stuck_writer_lock_times_out_instead_of_hanging(tmp_path):
    path = str(tmp_path / "p")
    b = EmbeddedBackend(path, capacity_bytes=4 * MiB, lock_timeout_s=0.2)
    fd = os.open(os.path.join(path, "writer.lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: conflicts like another process would
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable, match="lock_timeout_s=0.2"):
            b.reserve(["k"], 4096)
        assert time.monotonic() - t0 < 5
        assert b.lookup(["k"]) == 0, "readers never need the writer lock"
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert b.reserve(["k"], 4096)[0] is not None
    finally:
        os.close(fd)
        b.close()


def test_timed_out_live_reservation_loses_its_key_but_not_its_space(tmp_path):
    path = str(tmp_path / "p")
    slow = EmbeddedBackend(path, capacity_bytes=4 * MiB, reservation_timeout_s=0.2)
    other = EmbeddedBackend(path, capacity_bytes=4 * MiB, reservation_timeout_s=0.2)
    try:
        (h,) = slow.reserve(["k"], MiB)
        assert other.reserve(["k"], MiB) == [None]
        time.sleep(0.25)
        (h2,) = other.reserve(["k"], MiB)
        assert h2 is not None, "a timed-out reservation gives its key to the next writer"
        st = other.stats()
        assert st["orphaned_reservations"] == 1 and st["reserved_objects"] == 2, "the slow writer's extent is kept"
        other.write([h2], [0], [payload("k", MiB)])
        other.commit([h2])
        slow.write([h], [0], [np.zeros(MiB, np.uint8)])  # the slow writer is still copying: harmless
        with pytest.raises(ObjectMissing, match="reservation expired"):
            slow.commit([h])
        np.testing.assert_array_equal(get(other, "k", MiB), payload("k", MiB))
        st = other.stats()
        assert st["reserved_objects"] == 0 and st["free_bytes"] == 3 * MiB
        other.verify()
    finally:
        slow.close()
        other.close()


def test_reattach_keeps_objects_and_capacity_mismatch(tmp_path):
    path = str(tmp_path / "p")
    a = EmbeddedBackend(path, capacity_bytes=4 * MiB)
    put(a, ["kept"], 10_000)
    b = EmbeddedBackend(path, capacity_bytes=4 * MiB)
    np.testing.assert_array_equal(get(b, "kept", 10_000), payload("kept", 10_000))
    with pytest.raises(BackendError, match="capacity_bytes=4194304.*asks capacity_bytes=8388608"):
        EmbeddedBackend(path, capacity_bytes=8 * MiB)
    a.close()
    b.close()
    c = EmbeddedBackend(path, capacity_bytes=4 * MiB)  # alone, same settings: contents survive
    assert c.lookup(["kept"]) == 1
    c.close()
    d = EmbeddedBackend(path, capacity_bytes=8 * MiB)  # alone, new capacity: rebuilt empty
    assert d.lookup(["kept"]) == 0 and d.stats()["capacity_bytes"] == 8 * MiB
    d.close()


def test_closed_backend_refuses_calls(tmp_path):
    b = EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=4 * MiB)
    b.close()
    b.close()
    with pytest.raises(BackendError, match="closed"):
        b.lookup(["a"])


def test_close_with_live_view_does_not_crash(tmp_path):
    b = EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=4 * MiB)
    (h,) = b.reserve(["a"], 4096)
    v = b.view(h, 0, 16)
    b.close()
    v[:4] = b"abcd"  # the mapping lives as long as the view
    assert bytes(v[:4]) == b"abcd"


def test_stale_release_does_not_drop_a_new_objects_lease(tmp_path):
    """A lease slot belongs to an extent; after the old object is evicted and its extent reused,
    releasing the old handle must not unpin the new object."""
    b = EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=2 * MiB, lease_ttl_s=0.2)
    try:
        n = 1 * MiB
        put(b, ["a", "b"], n)
        (stale,) = b.open(["a"])
        time.sleep(0.25)  # the reader's lease expires: "a" may go
        b.release(b.open(["b"]))
        put(b, ["c"], n)  # evicts "a" (b was read more recently), takes its extent
        assert b.lookup(["a"]) == 0 and b.lookup(["c"]) == 1
        b.lease_ttl_s = 60.0
        (hc,) = b.open(["c"])
        assert hc._off == stale._off, "test premise: c reuses a's extent"
        b.release([stale])  # late release of the evicted object's lease
        hs = b.reserve(["d", "e"], n)  # room for one: b's extent; c must stay pinned
        assert hs[0] is not None and hs[1] is None, "the stale release unpinned the new object"
        assert b.lookup(["c"]) == 1
        b.abort(hs)
        b.release([hc])
    finally:
        b.close()
