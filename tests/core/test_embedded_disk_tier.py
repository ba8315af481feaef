"""The embedded pool's opt-in disk tier (embedded/disk_tier.py): demotion on DRAM pressure, disk
hits with the same bytes, restarts, capacity, damaged files, kills mid-demotion, a full disk, the
directory's ownership and the config keys' bounds."""

from __future__ import annotations

import errno
import glob
import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

from lw_core.backend import TIER_DISK, TIER_DRAM, BackendError, lookup_tiers
from lw_core.backends.embedded import EmbeddedBackend, disk_dir, disk_tier
from lw_core.backends.embedded import disk_format as fmt
from lw_core.backends.embedded.disk_tier import DiskHandle, DiskTier
from lw_core.config import ConfigError, parse_config
from lw_core.plan import ReqLoad
from lw_dev.backend_contract import LAYOUT, SAVES, BackendContract, ViewsContract, load_all, save_all, seeded_kv

DRAM = 1 << 20
DISK = 64 << 20
OBJ = 200_000  # five fit in the 1 MiB arena


def _open(tmp_path, **kw) -> EmbeddedBackend:
    return EmbeddedBackend(
        str(tmp_path / "pool"), capacity_bytes=DRAM, disk_path=str(tmp_path / "disk"), disk_capacity_bytes=DISK, **kw
    )


def _fill(b: EmbeddedBackend, n: int, seed: int = 0, prefix: str = "k") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        data = rng.integers(0, 256, OBJ, dtype=np.uint8)
        (h,) = b.reserve([f"{prefix}{i}"], OBJ)
        assert h is not None
        b.write([h], [0], [data])
        b.commit([h])
        out[f"{prefix}{i}"] = data
    assert b._disk is not None and b._disk.flush()
    return out


def _files(tmp_path) -> list[str]:
    return glob.glob(str(tmp_path / "disk" / ("*" + fmt.SUFFIX)))


def test_evicted_objects_are_demoted_and_hit_on_disk_with_the_same_bytes(tmp_path):
    with _open(tmp_path) as b:
        data = _fill(b, 12)
        st = b.stats()
        assert st["evictions"] == 7 and st["demotions"] == 7 and st["disk_objects"] == 7 and st["demotion_drops"] == 0
        assert st["disk_bytes"] == 7 * (fmt.HEADER_BYTES + OBJ) and len(_files(tmp_path)) == 7
        assert b.lookup(list(data)) == 12
        assert b.lookup_tiers(list(data)) == [TIER_DISK] * 7 + [TIER_DRAM] * 5  # what KV events name
        assert lookup_tiers(b, ["k0", "nope", "k1"]) == [TIER_DISK]
        hs = b.open(list(data))
        kinds = [type(h) is DiskHandle for h in hs]
        assert kinds == [True] * 7 + [False] * 5
        # Ranged reads (what the pipeline does per layer), mixed DRAM and disk handles in one call.
        for off, n in ((0, OBJ), (5000, 1000), (OBJ - 17, 17)):
            dsts = [np.zeros(n, np.uint8) for _ in hs]
            b.read(hs, [off] * len(hs), dsts)
            for k, d in zip(data, dsts):
                assert np.array_equal(d, data[k][off : off + n])
        v = b.view(hs[0], 100, 50)
        assert v is not None and v.readonly and bytes(v) == data["k0"][100:150].tobytes()
        assert b.intact(hs) == [True] * 12
        b.release(hs)
        st = b.stats()
        assert st["disk_hits"] == 7 and st["open_hits"] == 12 and st["open_misses"] == 0
        assert st["disk_bytes_read"] == 7 * (OBJ + 1000 + 17) + 50
        assert b.reserve(["k0"], OBJ) == [None]  # write-once: it is committed, on disk


def test_pipeline_loads_objects_from_disk_exactly(tmp_path):
    src, dst = seeded_kv(LAYOUT, 1), seeded_kv(LAYOUT, 2)
    with _open(tmp_path) as b:
        assert save_all(b, src, LAYOUT, SAVES).ok
        _fill(b, 6, prefix="filler")  # pushes a..d out of DRAM
        assert b.stats()["disk_objects"] >= 4
        loads = [ReqLoad("x", ["d", "b"], [1, 3]), ReqLoad("y", ["c", "a"], [6, 4])]
        assert [type(h) is DiskHandle for h in b.open(["a", "b", "c", "d"])] == [True] * 4
        res = load_all(b, dst, LAYOUT, loads, prefetch_depth=2)
        assert res.ok, res
    for layer in range(LAYOUT.num_layers):
        for s, d in ((0, 1), (5, 3), (7, 6), (2, 4)):
            assert np.array_equal(dst.kv[layer][d], src.kv[layer][s])


def test_a_new_backend_on_the_same_directories_finds_demoted_objects(tmp_path):
    with _open(tmp_path) as b:
        data = _fill(b, 10)
    with _open(tmp_path) as b:
        assert b._disk is not None and b._disk.flush()  # the directory is listed in the background
        assert b.stats()["disk_objects"] == 5
        assert b.lookup(list(data)) == 10
        hs = b.open(["k0", "k4"])
        assert all(type(h) is DiskHandle for h in hs)
        out = np.zeros(OBJ, np.uint8)
        b.read([hs[1]], [0], [out])
        assert np.array_equal(out, data["k4"])
        b.release(hs)


def test_capacity_is_kept_by_evicting_least_recently_used_files(tmp_path):
    t = DiskTier(str(tmp_path / "disk"), 3 * (fmt.HEADER_BYTES + OBJ), queue_bytes=8 << 20)
    try:
        payload = np.arange(OBJ, dtype=np.uint8)
        for i in range(3):
            t.offer(f"k{i}".encode(), memoryview(payload))
        assert t.flush()
        h = t.open("k0", b"k0")  # k0 used: k1 is now the least recently used
        assert h is not None
        t.release(h)
        t.offer(b"k3", memoryview(payload))
        assert t.flush()
        st = t.stats()
        assert st["disk_objects"] == 3 and st["disk_evictions"] == 1 and st["disk_bytes"] <= t.capacity
        assert [t.has(k) for k in (b"k0", b"k1", b"k2", b"k3")] == [True, False, True, True]
        assert len(_files(tmp_path)) == 3
    finally:
        t.close()


def test_a_full_queue_drops_demotions_and_counts_them(tmp_path):
    t = DiskTier(str(tmp_path / "disk"), DISK, queue_bytes=OBJ - 1)
    try:
        t.offer(b"big", memoryview(bytes(OBJ)))
        assert t.flush() and t.stats()["demotion_drops"] == 1 and not t.has(b"big")
    finally:
        t.close()


def test_offer_never_waits_for_the_disk(tmp_path, monkeypatch):
    """The evicting call only copies into the queue: with the disk stuck, offers return at once and
    what does not fit the queue is dropped (counted); the queued ones are written once it moves."""
    stuck = threading.Event()
    real = disk_tier.write_all

    def slow(fd: int, data) -> None:
        assert stuck.wait(30)
        real(fd, data)

    monkeypatch.setattr(disk_tier, "write_all", slow)
    t = DiskTier(str(tmp_path / "disk"), DISK, queue_bytes=3 * OBJ)
    try:
        t0 = time.monotonic()
        for i in range(5):
            t.offer(f"k{i}".encode(), memoryview(bytes(OBJ)))
        assert time.monotonic() - t0 < 2.0
        assert t.stats()["demotion_drops"] == 2
        stuck.set()
        assert t.flush()
        assert t.stats()["demotions"] == 3 and [t.has(f"k{i}".encode()) for i in range(5)] == [True] * 3 + [False] * 2
    finally:
        stuck.set()
        t.close()


def test_another_process_files_are_found_and_counted_against_the_capacity(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "RESCAN_S", 0.0)
    one_file = fmt.HEADER_BYTES + OBJ
    a = DiskTier(str(tmp_path / "disk"), 3 * one_file, queue_bytes=8 << 20)
    b = DiskTier(str(tmp_path / "disk"), 3 * one_file, queue_bytes=8 << 20)
    try:
        for i in range(2):
            a.offer(f"a{i}".encode(), memoryview(bytes(OBJ)))
        assert a.flush()
        time.sleep(0.02)  # modification times order the files
        h = b.open("a1", b"a1")  # b never wrote it: found by name
        assert h is not None and b.stats()["disk_hits"] == 1
        b.release(h)
        for i in range(2):
            b.offer(f"b{i}".encode(), memoryview(bytes(OBJ)))
        assert b.flush()
        # a0, the least recently used file (by any process), made room; a1 was hit, so it stays.
        assert len(_files(tmp_path)) == 3 and b.stats()["disk_bytes"] <= b.capacity
        assert [os.path.exists(os.path.join(str(tmp_path / "disk"), fmt.file_name(k))) for k in (b"a0", b"a1")] == [False, True]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("damage", ["truncate", "garble_payload", "garble_header", "other_key"])
def test_a_damaged_file_is_a_miss_and_removed_never_wrong_bytes(tmp_path, damage):
    with _open(tmp_path) as b:
        _fill(b, 7)  # k0 and k1 are demoted
    p = os.path.join(str(tmp_path / "disk"), fmt.file_name(b"k0"))
    raw = bytearray(open(p, "rb").read())
    if damage == "truncate":
        raw = raw[: len(raw) - 1000]
    elif damage == "garble_payload":
        raw[fmt.HEADER_BYTES + 12345] ^= 0xFF
    elif damage == "garble_header":
        raw[0] ^= 0xFF
    else:  # a whole, intact file, but another key's: renamed under k0's name
        raw = bytearray(open(os.path.join(str(tmp_path / "disk"), fmt.file_name(b"k1")), "rb").read())
    with open(p, "wb") as f:
        f.write(raw)
    with _open(tmp_path) as b:
        assert b.open(["k0"]) == [None]
        assert b.stats()["disk_corrupt"] == 1 and not os.path.exists(p)
        assert b.lookup(["k0"]) == 0


def _demote_then_hang(disk: str, q) -> None:
    from lw_core.backends.embedded import disk_tier as dt

    def half_then_hang(fd: int, data) -> None:
        m = memoryview(data)
        os.write(fd, m[: max(1, len(m) // 2)])
        q.put("writing")
        signal.pause()

    dt.write_all = half_then_hang
    t = dt.DiskTier(disk, 64 << 20, queue_bytes=32 << 20)
    t.offer(b"victim", memoryview(bytes(8 << 20)))
    signal.pause()


def test_a_process_killed_mid_demotion_leaves_no_visible_object(tmp_path):
    disk = str(tmp_path / "disk")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_demote_then_hang, args=(disk, q))
    p.start()
    try:
        assert q.get(timeout=60) == "writing"
        assert glob.glob(os.path.join(disk, disk_dir.TMP_PREFIX + "*"))  # the half-written temporary exists
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    assert _files(tmp_path) == []
    t = DiskTier(disk, DISK, queue_bytes=OBJ)
    try:
        assert t.flush()  # the directory is listed (and dead writers' temporaries removed) in the background
        assert not t.has(b"victim") and t.open("victim", b"victim") is None
        assert glob.glob(os.path.join(disk, disk_dir.TMP_PREFIX + "*")) == []  # a dead writer's temporary is removed
        assert t.stats()["disk_objects"] == 0
    finally:
        t.close()


def test_a_full_disk_drops_demotions_counted_never_raising(tmp_path, monkeypatch, caplog):
    def enospc(fd: int, data) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "write_all", enospc)
    with _open(tmp_path) as b:
        data = _fill(b, 9)  # four evictions, each demotion fails
        st = b.stats()
        assert st["demotions"] == 0 and st["demotion_drops"] == 4 and st["disk_objects"] == 0
        assert b.lookup(list(data)) == 0 and b.open(["k0"]) == [None]
    assert sorted(os.listdir(tmp_path / "disk")) == [disk_dir.MARKER, disk_dir.COUNT]  # no temporaries left
    assert sum("ENOSPC" in r.getMessage() for r in caplog.records) == 1  # one line, not one per object


def test_a_foreign_non_empty_directory_is_refused_naming_the_key(tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "precious.txt").write_text("mine")
    with pytest.raises(BackendError, match="embedded_disk_path"):
        _open(tmp_path)
    assert (tmp_path / "disk" / "precious.txt").read_text() == "mine"
    with pytest.raises(BackendError, match="embedded_disk_path.*embedded_path"):
        EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=DRAM, disk_path=str(tmp_path / "pool"))
    b = EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=DRAM)  # the pool itself is still usable
    b.close()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"embedded_disk_capacity_bytes": 10}, ["embedded_disk_capacity_bytes", "64 MiB to 16 TiB"]),
        ({"embedded_disk_capacity_bytes": 2**60}, ["embedded_disk_capacity_bytes", "<= 17592186044416"]),
        ({"embedded_disk_path": ""}, ["embedded_disk_path", "directory path"]),
        ({"embedded_disk_path": 3}, ["embedded_disk_path"]),
        ({"embedded_disk_direct_io": "yes"}, ["embedded_disk_direct_io", "bool"]),
        ({"embedded_path": "/x/pool", "embedded_disk_path": "/x/pool"}, ["embedded_disk_path", "embedded_path"]),
    ],
)
def test_config_bounds(extra, words):
    with pytest.raises(ConfigError) as e:
        parse_config(extra)
    for w in words:
        assert w in str(e.value)


def test_config_keys_default_off_and_reach_the_backend(tmp_path):
    assert parse_config({}).backend_keys.embedded_disk_path is None
    keys = parse_config(
        {"embedded_path": str(tmp_path / "pool"), "embedded_capacity_bytes": DRAM,
         "embedded_disk_path": str(tmp_path / "disk"), "embedded_disk_capacity_bytes": DISK}
    ).backend_keys
    with EmbeddedBackend.from_keys(keys) as b:
        assert b._disk is not None and b._disk.capacity == DISK and b.stats()["disk_objects"] == 0
        assert not b._disk.reads.direct  # embedded_disk_direct_io is off by default
    keys = parse_config({"embedded_path": str(tmp_path / "pool"), "embedded_capacity_bytes": DRAM,
                         "embedded_disk_path": str(tmp_path / "disk2"), "embedded_disk_direct_io": True}).backend_keys
    with EmbeddedBackend.from_keys(keys) as b:
        assert b._disk is not None and b._disk.reads.direct
    with pytest.raises(ValueError, match="disk_capacity_bytes=1 is not accepted"):
        EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=DRAM, disk_path=str(tmp_path / "d2"), disk_capacity_bytes=1)


def test_tier_off_reports_zero_disk_counters(tmp_path):
    with EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=DRAM) as b:
        st = b.stats()
        assert all(st[k] == 0 for k in disk_tier.DISK_STATS)
    assert not (tmp_path / "disk").exists()


@pytest.fixture
def backend(tmp_path):
    b = EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=16 << 20, disk_path=str(tmp_path / "disk"), disk_capacity_bytes=DISK)
    yield b
    b.close()


class TestContractWithDiskTier(BackendContract, ViewsContract):
    """The whole backend contract with the disk tier on (objects still in DRAM serve views)."""
