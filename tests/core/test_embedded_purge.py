"""Purging the embedded pool by key prefix (embedded/purge.py, the connector's prefix-cache reset and
``lw-pool purge``): one model's objects leave DRAM and the disk tier, other models' stay intact;
leased objects stay until released; reservations under the prefix are never published; the index
stays consistent; and the offline purge reaches a disk tier whose DRAM pool is gone (a reboot)."""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
import pytest

from lw_core.backend import BackendError, ObjectMissing, supports_purge
from lw_core.backends.embedded import EmbeddedBackend
from lw_core.backends.embedded import disk_format as fmt
from lw_core.pool_cli import main as lw_pool

DRAM = 1 << 20
DISK = 64 << 20
OBJ = 100_000  # ten fit in the 1 MiB arena
A, B = "lw1/aaaaaaaaaaaa/", "lw1/bbbbbbbbbbbb/"


def _open(tmp_path, **kw) -> EmbeddedBackend:
    return EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=DRAM, disk_path=str(tmp_path / "disk"),
                           disk_capacity_bytes=DISK, **kw)


def _put(b: EmbeddedBackend, keys: list[str], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for k in keys:
        data = rng.integers(0, 256, OBJ, dtype=np.uint8)
        (h,) = b.reserve([k], OBJ)
        assert h is not None
        b.write([h], [0], [data])
        b.commit([h])
        out[k] = data
    return out


def _disk_keys(tmp_path) -> list[bytes]:
    out = []
    for p in glob.glob(str(tmp_path / "disk" / ("*" + fmt.SUFFIX))):
        fd = os.open(p, os.O_RDONLY)
        try:
            out.append(fmt.read_header(fd).bkey)
        finally:
            os.close(fd)
    return sorted(out)


def _read(b: EmbeddedBackend, key: str) -> bytes:
    (h,) = b.open([key])
    assert h is not None, key
    dst = np.zeros(OBJ, np.uint8)
    b.read([h], [0], [dst])
    b.release([h])
    return dst.tobytes()


def test_a_models_objects_leave_dram_and_disk_and_other_models_stay(tmp_path) -> None:
    with _open(tmp_path) as b:
        assert supports_purge(b)
        # Ten fit in DRAM: B's first four and A's first two are demoted to disk.
        other = _put(b, [f"{B}x/{i}" for i in range(4)], seed=2)
        a = _put(b, [f"{A}x/{i}" for i in range(8)], seed=1)
        other.update(_put(b, [f"{B}y/{i}" for i in range(4)], seed=3))
        assert b._disk is not None and b._disk.flush()
        on_disk = _disk_keys(tmp_path)
        assert any(k.startswith(A.encode()) for k in on_disk) and any(k.startswith(B.encode()) for k in on_disk)
        in_dram_a = b.stats()["objects"] - sum(1 for k in other if b._reader.lookup([k]))

        got = b.purge(A)

        assert got["leased"] == 0 and got["reservations"] == 0
        assert got["objects"] == in_dram_a and got["bytes"] == in_dram_a * OBJ
        assert got["disk_objects"] == sum(1 for k in on_disk if k.startswith(A.encode()))
        assert all(b.lookup([k]) == 0 for k in a)
        assert b.open(list(a)) == [None] * len(a)
        assert not any(k.startswith(A.encode()) for k in _disk_keys(tmp_path))
        for k, v in other.items():  # the other model's objects, DRAM and disk, keep their bytes
            assert _read(b, k) == v.tobytes()
        assert b.verify()["objects"] == b.stats()["objects"]  # counters and index agree
        assert b.stats()["disk_objects"] == len(_disk_keys(tmp_path))
        _put(b, list(a)[:2], seed=9)  # the keys can be saved again
        assert b.lookup(list(a)[:2]) == 2
    with _open(tmp_path) as b:  # a restart: what was purged from disk does not come back
        assert b.lookup([list(a)[5]]) == 0
        assert b.purge("")["disk_objects"] + b.stats()["objects"] >= 1
        assert _disk_keys(tmp_path) == [] and b.stats()["objects"] == 0
        assert b.verify()["objects"] == 0


def test_a_leased_object_stays_until_released_and_reads_stay_true(tmp_path) -> None:
    with EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=DRAM) as b:
        data = _put(b, [f"{A}k0", f"{A}k1"], seed=4)
        (h,) = b.open([f"{A}k0"])
        got = b.purge(A, timeout_s=0.2)
        assert got["objects"] == 1 and got["leased"] == 1
        dst = np.zeros(OBJ, np.uint8)
        b.read([h], [0], [dst])  # the reader that held it still reads its own bytes
        assert dst.tobytes() == data[f"{A}k0"].tobytes()
        b.release([h])
        got = b.purge(A, timeout_s=0.2)
        assert got["objects"] == 1 and got["leased"] == 0 and b.lookup([f"{A}k0"]) == 0


def test_a_reservation_under_the_prefix_is_never_published(tmp_path) -> None:
    with EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=DRAM) as b:
        (h,) = b.reserve([f"{A}late"], OBJ)
        assert h is not None
        got = b.purge(A)
        assert got["reservations"] == 1 and got["objects"] == 0
        b.write([h], [0], [np.ones(OBJ, np.uint8)])
        with pytest.raises(ObjectMissing, match="not published"):
            b.commit([h])
        assert b.lookup([f"{A}late"]) == 0
        st = b.verify()
        assert st["reserved_objects"] == 0 and st["objects"] == 0
        (h2,) = b.reserve([f"{A}late"], OBJ)  # the key is free for a new save
        assert h2 is not None
        b.abort([h2])


def test_purge_all_and_many_batches(tmp_path, monkeypatch) -> None:
    from lw_core.backends.embedded import purge

    monkeypatch.setattr(purge, "BATCH", 3)  # several transactions, resumed at the right key
    with EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=DRAM) as b:
        keys = [f"{p}{i}" for p in (A, B) for i in range(4)]
        _put(b, keys, seed=5)
        assert b.purge(A)["objects"] == 4
        assert [b.lookup([k]) for k in keys] == [0] * 4 + [1] * 4
        assert b.purge("")["objects"] == 4
        assert b.verify()["objects"] == 0 and b.stats()["free_bytes"] == b.capacity


def test_lw_pool_purge_offline_and_its_errors(tmp_path, capsys) -> None:
    extra = {"embedded_path": str(tmp_path / "pool"), "embedded_capacity_bytes": DRAM,
             "embedded_disk_path": str(tmp_path / "disk"), "embedded_disk_capacity_bytes": DISK}
    with _open(tmp_path) as b:
        _put(b, [f"{B}x/{i}" for i in range(2)], seed=7)  # demoted to disk by A's
        _put(b, [f"{A}x/{i}" for i in range(12)], seed=6)
        assert b._disk is not None and b._disk.flush()
    capsys.readouterr()
    assert lw_pool(["purge", "--config", json.dumps(extra), "--model", "aaaaaaaaaaaa"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prefix"] == A and out["objects"] + out["disk_objects"] == 12 and out["leased"] == 0
    assert all(k.startswith(B.encode()) for k in _disk_keys(tmp_path))
    with _open(tmp_path) as b:
        assert b._disk is not None and b._disk.flush()  # the tier lists its directory in the background
        assert b.stats()["objects"] + b.stats()["disk_objects"] == 2

    # A reboot: the DRAM pool (tmpfs) is gone, the disk tier is not; purging it creates no pool.
    left = _disk_keys(tmp_path)
    assert left, "the other model's objects are on disk"
    shutil.rmtree(tmp_path / "pool")
    cfg = tmp_path / "extra.json"
    cfg.write_text(json.dumps(extra))
    assert lw_pool(["purge", "--config", f"@{cfg}", "--all"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["disk_objects"] == len(left) and out["objects"] == 0
    assert _disk_keys(tmp_path) == [] and not (tmp_path / "pool").exists()

    # Errors: exit 2 with a message naming what is wrong.
    for argv, needle in (
        (["purge", "--config", json.dumps(extra), "--model", "XYZ"], "model fingerprint"),
        (["purge", "--config", '{"embedded_capacity_bytes": 1}', "--all"], "embedded_capacity_bytes"),
        (["purge", "--config", "not json", "--all"], "lw-pool:"),
        (["purge", "--config", json.dumps(extra), "--all", "--timeout-s", "0"], "--timeout-s"),
    ):
        assert lw_pool(argv) == 2, argv
        assert needle in capsys.readouterr().err


def test_attaching_without_create_never_builds_or_rebuilds(tmp_path) -> None:
    with pytest.raises(BackendError, match="no pool"):
        EmbeddedBackend(str(tmp_path / "none"), capacity_bytes=DRAM, create=False)
    assert not (tmp_path / "none").exists()
    with EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=DRAM) as b:
        _put(b, [f"{A}k"], seed=8)
    with pytest.raises(BackendError, match="capacity"):
        EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=2 * DRAM, create=False)
    with EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=DRAM, create=False) as b:
        assert b.lookup([f"{A}k"]) == 1  # still there: nothing was rebuilt
