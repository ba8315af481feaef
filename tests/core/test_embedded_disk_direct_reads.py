"""Where the disk tier's payload reads come from with ``direct_io`` (embedded/disk_payload_reads.py,
``embedded_disk_direct_io``): the page cache when the file is all there, else the disk with
``O_DIRECT``, else (a filesystem that refuses direct I/O) a buffered read; without it, buffered. Whichever it is, a hit hands out the file's exact bytes and a damaged
file is still a miss. The tests' files are on the test's temporary directory, a disk filesystem
here (ext4): dropping a synced file from the page cache sends its next read to the disk."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os

from disk_support import demoted_tier

from lw_core.backends.embedded import disk_format as fmt
from lw_core.backends.embedded import disk_payload_reads
from lw_core.backends.embedded.disk_tier import DiskTier

OBJ = 300_001  # not a multiple of 4 KiB: the direct read asks for whole blocks past the payload's end


def _tier(tmp_path, n: int, *, direct_io: bool = True) -> tuple[DiskTier, dict[bytes, bytes]]:
    return demoted_tier(tmp_path, n, OBJ, seed=11, direct_io=direct_io)


def _drop_cache(t: DiskTier) -> None:
    """Sync every file of the tier and drop it from the page cache."""
    for name in os.listdir(t.path):
        fd = os.open(os.path.join(t.path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _hit(t: DiskTier, data: dict[bytes, bytes]) -> None:
    """Open every key at once, check each handle's bytes through ``read`` and ``view``, release."""
    keys = list(data)
    hs = t.open_many([k.decode() for k in keys], keys)
    try:
        for k, h in zip(keys, hs):
            assert h is not None and h.nbytes == OBJ
            out = bytearray(OBJ)
            t.read(h, 0, out)
            assert out == data[k]
            assert bytes(t.view(h, OBJ - 1000, 1000)) == data[k][-1000:]
    finally:
        for h in hs:
            if h is not None:
                t.release(h)


def test_a_cold_file_is_read_straight_from_the_disk_and_a_cached_one_from_the_page_cache(tmp_path):
    t, data = _tier(tmp_path, 6)
    try:
        _hit(t, data)  # just written: every payload is in the page cache
        assert t.reads.counts == {"cached": 6}
        _drop_cache(t)
        _hit(t, data)  # the recycled buffers are read into, directly from the disk
        assert t.reads.counts == {"cached": 6, "direct": 6} and t.reads.direct
        assert t.stats()["disk_hits"] == 12 and t.stats()["disk_corrupt"] == 0
    finally:
        t.close()


def test_without_direct_io_every_payload_is_a_buffered_read(tmp_path):
    t, data = _tier(tmp_path, 4, direct_io=False)
    try:
        _drop_cache(t)
        _hit(t, data)
        assert t.reads.counts == {"buffered": 4} and not t.reads.direct
    finally:
        t.close()


def test_a_damaged_file_read_directly_is_a_miss(tmp_path):
    t, data = _tier(tmp_path, 3)
    try:
        bad = list(data)[1]
        p = os.path.join(t.path, fmt.file_name(bad))
        with open(p, "r+b") as f:
            f.seek(fmt.HEADER_BYTES + OBJ - 1)  # the payload's last byte, in the direct read's last block
            last = f.read(1)
            f.seek(fmt.HEADER_BYTES + OBJ - 1)
            f.write(bytes([last[0] ^ 0xFF]))
        _drop_cache(t)
        hs = t.open_many([k.decode() for k in data], list(data))
        assert [h is None for h in hs] == [k == bad for k in data]
        assert t.reads.counts["direct"] == 3 and t.stats()["disk_corrupt"] == 1
        assert not os.path.exists(p)
        for h in hs:
            if h is not None:
                t.release(h)
    finally:
        t.close()


class _NoDirect:
    """``fcntl`` of a filesystem that refuses ``O_DIRECT`` (as some network and FUSE ones do)."""

    def __init__(self) -> None:
        self.refused = 0

    def fcntl(self, fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            self.refused += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return fcntl.fcntl(fd, cmd, arg) if cmd == fcntl.F_SETFL else fcntl.fcntl(fd, cmd)


def test_a_filesystem_that_refuses_direct_io_is_read_through_the_page_cache_logged_once(tmp_path, monkeypatch, caplog):
    no_direct = _NoDirect()
    monkeypatch.setattr(disk_payload_reads, "fcntl", no_direct)
    monkeypatch.setattr(disk_payload_reads.fcntl, "F_GETFL", fcntl.F_GETFL, raising=False)
    monkeypatch.setattr(disk_payload_reads.fcntl, "F_SETFL", fcntl.F_SETFL, raising=False)
    t, data = _tier(tmp_path, 4)
    try:
        _drop_cache(t)
        with caplog.at_level(logging.WARNING):
            _hit(t, data)
            first = no_direct.refused  # the hit's reads run in parallel: one or more tried
            _drop_cache(t)
            _hit(t, data)
        assert not t.reads.direct and first >= 1 and no_direct.refused == first  # learnt, not tried again
        assert t.reads.counts["buffered"] == 8 and t.reads.counts["direct"] == 0
        assert sum("refuses direct I/O" in r.getMessage() for r in caplog.records) == 1
    finally:
        t.close()


class _NoCachestat:
    """libc whose ``cachestat`` fails as on a filesystem that does not support it."""

    def __init__(self) -> None:
        self.calls = 0

    def syscall(self, *args: object) -> int:
        self.calls += 1
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1


def test_a_page_cache_that_cannot_be_asked_about_sends_reads_to_the_disk_and_keeps_the_files(tmp_path, monkeypatch):
    libc = _NoCachestat()
    monkeypatch.setattr(disk_payload_reads, "_LIBC", libc)
    t, data = _tier(tmp_path, 3)  # just written: in the page cache, but nobody can tell
    try:
        _hit(t, data)
        assert libc.calls == 3 and t.reads.counts == {"direct": 3}
        assert t.stats()["disk_corrupt"] == 0 and len(os.listdir(t.path)) == 5  # three objects, the marker and the count
    finally:
        t.close()
