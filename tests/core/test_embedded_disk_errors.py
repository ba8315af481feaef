"""The disk tier's reads under injected failures (embedded/disk_tier.py ``open``/``open_many``): only a
file proven bad (bad magic, format, checksum or size: ``BadFile``) is removed; no memory for a
payload buffer, an I/O error or an interrupted read is a miss that keeps the file, gives back the
bytes reserved for its payload and closes its descriptor; when one open of many raises, every other
handle is released (descriptors, reserved bytes, the DRAM handles' leases) before the error goes up."""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np
import pytest
from disk_support import demoted_tier

from lw_core.backends.embedded import EmbeddedBackend
from lw_core.backends.embedded import disk_format as fmt
from lw_core.backends.embedded.disk_tier import DiskTier

OBJ = 100_000


def _open_files(t: DiskTier) -> int:
    """Descriptors this process holds on the tier's object files."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(t.path + os.sep) and target.endswith(fmt.SUFFIX)
    return n


def _path(t: DiskTier, bkey: bytes) -> str:
    return os.path.join(t.path, fmt.file_name(bkey))


def _hit_ok(t: DiskTier, data: dict[bytes, bytes], k: bytes) -> None:
    h = t.open(k.decode(), k)
    assert h is not None
    out = bytearray(OBJ)
    t.read(h, 0, out)
    assert out == data[k]
    t.release(h)


def test_no_memory_for_a_payload_buffer_is_a_miss_that_keeps_the_file_and_its_reservation(tmp_path, monkeypatch):
    t, data = demoted_tier(tmp_path, 2, OBJ, seed=3)
    try:
        real = mmap.mmap

        def no_memory(*a, **kw):
            raise OSError(errno.ENOMEM, "Cannot allocate memory")

        monkeypatch.setattr(mmap, "mmap", no_memory)
        assert t.open("k0", b"k0") is None
        monkeypatch.setattr(mmap, "mmap", real)
        assert os.path.exists(_path(t, b"k0")) and t.has(b"k0")
        assert t._kept == 0 and _open_files(t) == 0
        st = t.stats()
        assert st["disk_read_errors"] == 1 and st["disk_corrupt"] == 0
        _hit_ok(t, data, b"k0")  # the file was good: the next hit serves it
    finally:
        t.close()


@pytest.mark.parametrize(
    ("where", "err"),
    [("header", errno.EIO), ("payload", errno.EIO), ("payload", errno.EINTR), ("big payload", errno.EIO)],
)
def test_an_io_error_reading_a_file_is_a_miss_that_keeps_it(tmp_path, monkeypatch, where, err):
    if where == "big payload":  # past CHUNK: checked with pread, not held in memory
        monkeypatch.setattr(fmt, "CHUNK", 4096)
    t, data = demoted_tier(tmp_path, 2, OBJ, seed=4)
    try:
        pread, preadv = os.pread, os.preadv

        def failing_pread(fd: int, n: int, off: int) -> bytes:
            if (off == 0) == (where == "header"):
                raise OSError(err, os.strerror(err))
            return pread(fd, n, off)

        def failing_preadv(fd: int, bufs, off: int) -> int:
            raise OSError(err, os.strerror(err))

        monkeypatch.setattr(os, "pread", failing_pread)
        monkeypatch.setattr(os, "preadv", failing_preadv)
        assert t.open("k0", b"k0") is None
        monkeypatch.setattr(os, "pread", pread)
        monkeypatch.setattr(os, "preadv", preadv)
        assert os.path.exists(_path(t, b"k0")) and t._kept == 0 and _open_files(t) == 0
        st = t.stats()
        assert st["disk_read_errors"] == 1 and st["disk_corrupt"] == 0 and st["disk_hits"] == 0
        _hit_ok(t, data, b"k0")
    finally:
        t.close()


def test_open_many_releases_every_other_handle_when_one_open_raises(tmp_path, monkeypatch):
    t, data = demoted_tier(tmp_path, 12, OBJ, seed=5)
    try:
        keys = list(data)
        real = fmt.read_header

        def broken(fd: int, bkey: bytes | None = None) -> fmt.Header:
            if bkey == keys[5]:
                raise RuntimeError("a bug in one open")
            return real(fd, bkey)

        monkeypatch.setattr(fmt, "read_header", broken)
        with pytest.raises(RuntimeError, match="a bug in one open"):
            t.open_many([k.decode() for k in keys], keys)
        assert _open_files(t) == 0 and t._kept == 0  # the eleven other opens' descriptors and bytes came back
        assert all(os.path.exists(_path(t, k)) for k in keys) and t.stats()["disk_corrupt"] == 0
        monkeypatch.setattr(fmt, "read_header", real)
        hs = t.open_many([k.decode() for k in keys], keys)
        assert all(h is not None and h.data is not None and h.data[:OBJ] == data[k] for k, h in zip(keys, hs))
        for h in hs:
            assert h is not None
            t.release(h)
    finally:
        t.close()


def test_an_open_of_dram_and_disk_objects_that_raises_releases_the_dram_handles(tmp_path, monkeypatch):
    with EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=1 << 20, disk_path=str(tmp_path / "disk"),
                         disk_capacity_bytes=64 << 20) as b:
        rng = np.random.default_rng(6)
        for i in range(8):  # five fit in DRAM: k0..k2 are demoted
            (h,) = b.reserve([f"k{i}"], 200_000)
            b.write([h], [0], [rng.integers(0, 256, 200_000, dtype=np.uint8)])
            b.commit([h])
        assert b._disk is not None and b._disk.flush()
        keys = [f"k{i}" for i in range(8)]
        assert b.stats()["disk_objects"] == 3
        released: list[object] = []
        real_release = b._reader.release
        monkeypatch.setattr(b._reader, "release", lambda hs: (released.extend(hs), real_release(hs)))

        def broken(keys, bkeys):
            raise RuntimeError("disk open failed")

        monkeypatch.setattr(b._disk, "open_many", broken)
        with pytest.raises(RuntimeError, match="disk open failed"):
            b.open(keys)
        assert len(released) == 5  # the five DRAM handles' leases went back
