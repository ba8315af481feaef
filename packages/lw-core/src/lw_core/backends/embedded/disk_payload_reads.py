"""``PayloadReads``: how the disk tier reads a payload into the buffer a hit holds.

By default (``direct=False``, ``embedded_disk_direct_io: false``) a buffered ``preadv``: the
kernel's readahead and page cache serve it. With ``direct``, in order:

* **from the page cache** when every byte is there (a file demoted a moment ago, or read by a
  buffered reader): ``resident`` asks the kernel (``cachestat``), then a buffered ``preadv``;
* else **straight from the disk** (``O_DIRECT``, set on the handle's own descriptor for the one
  read, so the bytes come from the file the header was read from; the tier turns readahead off
  for that descriptor): no copy through the page cache, and the tier's reads do not fill it;
* else (a filesystem or kernel that refuses ``O_DIRECT``, learnt on the first refusal and logged
  once) a buffered read.

Direct I/O is off by default because on the one machine measured (a 2-core VM, virtio disk,
ext4) buffered reads were faster: a cold hit of 256 files of 768 KiB (a process's second or
later) took 0.09-0.11 s buffered against 0.12-0.19 s direct, for 0.05-0.09 s of CPU against
0.04-0.08 s (``scripts/disk_tier_read_probe.py``), and an engine's disk hit
read at 0.56-0.60 of the sequential read direct against 0.64-0.84 buffered
(docs/bench/serve.md). It is for disks whose direct reads are fast at depth (NVMe) and hosts that
should not spend page cache on the tier.

``O_DIRECT`` wants the buffer, the offset and the length aligned to the device's block: the
payload starts at ``HEADER_BYTES`` (4 KiB), buffers are anonymous maps (page-aligned) of
``aligned(n)`` bytes, and the read asks for all of them (the file ends after ``n``).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import platform
import threading
from collections import Counter

from lw_core.backends.embedded.records import log

ALIGN = 4096  # O_DIRECT's alignment of buffers, offsets and lengths (any block size up to a page)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long
_CACHESTAT = 451  # cachestat(2), Linux 6.5+: the same number on every architecture (the generic table)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_have_cachestat = platform.system() == "Linux"


def resident(fd: int, offset: int, n: int) -> bool:
    """Whether all ``n`` bytes at ``offset`` (page-aligned) of ``fd`` are in the page cache
    (``cachestat``). False where it cannot say (a kernel without it, a sandbox or filesystem that
    refuses it): the read then goes to the disk, never fails for it. Neither a read that must not block
    (``RWF_NOWAIT``: it starts reading what is missing into the page cache, which the direct read
    then reads again) nor ``mincore`` (a mapping per file: its unmapping stalls every thread of the
    process) would do."""
    global _have_cachestat
    if not _have_cachestat or n <= 0:
        return n <= 0
    rng, st = _Range(offset, n), _Stat()
    if _LIBC.syscall(_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a sandbox that forbids it
            _have_cachestat = False
        return False
    return bool(st.nr_cache >= -(-n // mmap.PAGESIZE))


def aligned(n: int) -> int:
    """``n`` rounded up to ``ALIGN``: the size of a payload buffer that ``O_DIRECT`` can fill."""
    return -(-n // ALIGN) * ALIGN


class PayloadReads:
    """Payload reads for the tier in ``path``; ``direct``: the page cache when the payload is all
    there, else ``O_DIRECT``; otherwise buffered reads."""

    def __init__(self, path: str, *, direct: bool) -> None:
        self.path = path
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.counts: Counter[str] = Counter()  # where payloads came from: cached, direct, buffered
        self._lock = threading.Lock()

    def opened(self, fd: int) -> None:
        """Set up a file just opened, before its header is read: with ``direct``, the kernel's
        readahead off (it would read into the page cache what the direct read then reads again); a
        filesystem that cannot is left as it is (an error here is no sign of a damaged file)."""
        if not self.direct:
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:
            pass

    def into(self, fd: int, offset: int, buf: mmap.mmap, n: int) -> int:
        """Read the ``n`` bytes at ``offset`` (a multiple of ``ALIGN``) of ``fd`` into the start of
        ``buf`` (an anonymous map of at least ``aligned(n)`` bytes); the bytes read (``n`` unless
        the file is shorter, or longer when read directly)."""
        if len(buf) < aligned(n) or offset % ALIGN:
            raise ValueError(f"disk tier: a read of {n} bytes at {offset} into a buffer of {len(buf)}")
        view = memoryview(buf)[:n]
        try:
            if not self.direct:
                return self._count("buffered", os.preadv(fd, [view], offset))
            if resident(fd, offset, n):
                return self._count("cached", os.preadv(fd, [view], offset))
            direct = self._direct(fd, offset, memoryview(buf)[: aligned(n)])
            if direct is not None:
                return self._count("direct", direct)
            return self._count("buffered", os.preadv(fd, [view], offset))
        finally:
            view.release()

    def _direct(self, fd: int, offset: int, view: memoryview) -> int | None:
        """One ``O_DIRECT`` read into ``view``; None when this filesystem refuses direct I/O."""
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        except OSError as e:
            self._refused(e)
            return None
        try:
            return os.preadv(fd, [view], offset)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._refused(e)
            return None
        finally:
            view.release()
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)

    def _refused(self, e: OSError) -> None:
        with self._lock:
            if not self.direct:
                return
            self.direct = False
        log.warning("embedded disk tier %r: the filesystem refuses direct I/O (%s); hits read through the page cache",
                    self.path, e)

    def _count(self, how: str, got: int) -> int:
        with self._lock:
            self.counts[how] += 1
        return got
