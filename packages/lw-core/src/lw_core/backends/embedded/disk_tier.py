"""``DiskTier``: the embedded pool's opt-in local-disk tier (``embedded_disk_path``).

Objects the DRAM pool evicts are demoted here instead of dropped: ``offer`` (called by the
``Sweeper`` inside its write transaction) copies the bytes into a bounded queue and returns; a
writer thread writes each one to a temporary file, fsyncs it and renames it into place
(``disk_format``), so a process killed mid-demotion leaves no visible object. A full queue, a full
disk (``ENOSPC``) or any write error drops the demotion (counted, logged once), never raising.

State: the index (file name -> file bytes, in LRU order; rebuilt from a listing of the directory
by the writer thread once started, so objects survive restarts and start-up never waits for the
disk), the queue, the counters, which files' payloads were verified, and the
bytes of payloads open handles hold. ``open_many`` opens a hit's files ``READERS`` at a time; each
small object's payload is read whole, in one read, checked (its checksum, on the file's first open
in this process) and kept on the handle, which serves every range from those bytes (``KEEP_BYTES``
in all; past that, or for objects over ``CHUNK``, a handle reads the file with ``pread``). Those
payload buffers are recycled: ``release`` keeps a buffer no view still points into (``FREE_BYTES``
in all) for the next hit, because faulting in fresh pages for every payload a hit holds cost about
as much CPU as reading and checking them (192 MiB: 0.16 s fresh, 0.11 s recycled, on 2 cores;
``scripts/disk_tier_read_probe.py``). A torn,
foreign or damaged file (``BadFile``: bad magic, format, header checksum, key, size or payload
checksum) is removed and is a miss; any other failure to read one (an I/O error, no memory for its
buffer) is a miss that keeps the file (counted, logged once). Files are evicted, least recently
used first, to keep the whole directory under ``capacity``: against the byte count every process
sharing it keeps (``TierDir``), so other processes' new files count at once. Hits are not promoted back into DRAM (the page cache keeps hot files in
memory), unless ``direct_io``: then a held payload comes from the page cache only when it is all
there, else straight from the disk (``O_DIRECT``: ``PayloadReads``). Other processes' demotions
are found by name on a miss, and the writer thread lists the directory every ``RESCAN_S`` (the LRU
order other processes' hits set, and the byte count set again from the files themselves).
"""

from __future__ import annotations

import collections
import errno
import mmap
import os
import secrets
import stat
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from lw_core.backend import BackendError, Buffer, ObjectMissing
from lw_core.backends.embedded import disk_format as fmt
from lw_core.backends.embedded import files
from lw_core.backends.embedded.disk_dir import TierDir, purge_dir, unlink
from lw_core.backends.embedded.disk_format import DiskHandle
from lw_core.backends.embedded.disk_payload_reads import PayloadReads, aligned
from lw_core.backends.embedded.records import bytes_view, log

COUNTERS = ("disk_hits", "disk_bytes_read", "demotions", "demotion_drops", "disk_evictions", "disk_corrupt",
            "disk_read_errors")
READERS = 16  # files a hit opens and checks at once (``open_many``): reads in flight on the disk
KEEP_BYTES = 1 << 30  # payloads open handles may hold in memory, all together; beyond, reads use the file
FREE_BYTES = 256 << 20  # released payload buffers kept for the next hit (no fresh pages to fault in)
RESCAN_S = 30.0  # how often the writer thread lists the directory (other processes' demotions and hits)
RELIST_S = 1.0  # at most this often, an eviction lists the directory first when others wrote files since
DISK_STATS = (*COUNTERS, "disk_objects", "disk_bytes")  # what ``stats`` reports


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` (tests replace this to simulate a full disk or a kill mid-write)."""
    m = memoryview(data)
    while m:
        m = m[os.write(fd, m) :]


class DiskTier:
    """The disk tier in directory ``path``, at most ``capacity`` bytes of files (the capacity its
    marker records: ``TierDir``); demotions wait in a queue of at most ``queue_bytes``. ``fsync``:
    sync each file before it becomes visible. ``direct_io``: a held payload not in the page cache is read with ``O_DIRECT`` (``PayloadReads``)."""

    def __init__(self, path: str, capacity: int, *, queue_bytes: int, fsync: bool = True, direct_io: bool = False) -> None:
        self.path = os.path.abspath(path)
        self.capacity = capacity
        self.queue_bytes = queue_bytes
        self.fsync = fsync
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._bytes = 0
        self._verified: dict[str, tuple[int, int]] = {}  # name -> (inode, generation) checked
        self._queue: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self._queued: set[str] = set()
        self._queued_bytes = 0
        self._busy = False
        self._scanned = False  # the writer thread's first listing is done
        self._logged: set[str] = set()
        self._cv = threading.Condition()
        self._closed = False
        self._next_rescan = 0.0
        self._next_relist = 0.0
        self._readers: ThreadPoolExecutor | None = None
        self._kept = 0  # bytes of payloads open handles hold (``KEEP_BYTES`` at most)
        self._free: dict[int, list[mmap.mmap]] = {}  # released payload buffers by size (``FREE_BYTES``)
        self._free_bytes = 0
        self.reads = PayloadReads(self.path, direct=direct_io)  # payloads: buffered, or the page cache else direct I/O
        self.dir = TierDir(self.path, capacity)  # checked and marked; listed by the writer thread
        self._thread = threading.Thread(target=self._run, name="lw-disk-tier", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- demotion (any thread; writer thread)

    def offer(self, bkey: bytes, data: memoryview) -> None:
        """Queue a copy of an evicted object's bytes; drop it (counted) when the queue is full."""
        name, n = fmt.file_name(bkey), data.nbytes
        with self._cv:
            if self._closed or name in self._index or name in self._queued:
                return
            if self._queued_bytes + n > self.queue_bytes or fmt.HEADER_BYTES + n > self.capacity:
                self.counters["demotion_drops"] += 1
                return
            self._queued.add(name)
            self._queued_bytes += n
        payload = bytes(data)  # the one copy the evicting call pays for
        with self._cv:
            self._queue.append((bkey, payload))
            self._cv.notify()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the first listing is done and every queued demotion is written (or
        dropped); False at the deadline."""
        end = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy or not (self._scanned or self._closed):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def _run(self) -> None:
        self._first_scan()
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                bkey, payload = self._queue.popleft()
                self._busy = True
            try:
                self._demote(bkey, payload)
            except Exception as e:  # never let the writer thread die: the demotion is dropped
                self._drop(e, "unexpected error")
            finally:
                with self._cv:
                    self._queued.discard(fmt.file_name(bkey))
                    self._queued_bytes -= len(payload)
                    self._busy = False
                    self._cv.notify_all()

    def _demote(self, bkey: bytes, payload: bytes) -> None:
        name = fmt.file_name(bkey)
        size = fmt.HEADER_BYTES + len(payload)
        self._rescan()
        tmp = self.dir.tmp_name()
        head = fmt.build_header(bkey, len(payload), secrets.randbits(63), fmt.payload_digest(payload))
        try:
            fd = files.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what="disk tier file")
        except BackendError as e:
            self._drop(e.__cause__ or e, "cannot create a file")
            return
        try:
            try:
                write_all(fd, head)
                write_all(fd, payload)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self.dir.lock():  # room made and the file renamed in against every process's count
                placed = self._place(tmp, name, size)
        except OSError as e:
            unlink(tmp)
            self._drop(e, "ENOSPC, disk full" if e.errno == errno.ENOSPC else "write failed")
            return
        if not placed:
            unlink(tmp)
            self._drop(OSError(errno.ENOSPC, "no file left to evict"), "no room under the capacity")
            return
        with self._cv:
            self._bytes -= self._index.pop(name, 0)
            self._index[name] = size
            self._bytes += size
            self.counters["demotions"] += 1

    def _place(self, tmp: str, name: str, size: int) -> bool:
        """Under the directory's lock: evict least recently used files until ``size`` more bytes
        fit the directory's count, then rename ``tmp`` in as ``name``; False when nothing is left
        to evict (even after listing the directory again). When the count holds files this
        process has not listed (other processes' new ones), the directory is listed first (at
        most every ``RELIST_S``), so the files evicted are the least recently used of all."""
        total = self.dir.total()
        listed = False
        try:
            if total + size > self.capacity and total > self._bytes and time.monotonic() >= self._next_relist:
                listed = True
                self._replace_index(self.dir.recount())
                total = self.dir.total()
            while total + size > self.capacity:
                with self._cv:
                    victim = self._index.popitem(last=False) if self._index else None
                    if victim is not None:
                        self._bytes -= victim[1]
                        self._verified.pop(victim[0], None)
                if victim is None:
                    if listed:  # every file listed is gone, and still no room: the count was off
                        return False
                    listed = True  # files other processes wrote since the last listing
                    self._replace_index(self.dir.recount())
                    total = self.dir.total()
                    continue
                total -= self._evict(victim[0])
            p = os.path.join(self.path, name)
            total -= _size(p)  # the same key demoted by another process meanwhile: replaced
            os.rename(tmp, p)
            total += size
            return True
        finally:
            self.dir.set_total(total)

    def _evict(self, name: str) -> int:
        """Remove ``name`` (under the directory's lock); the bytes this freed (0: gone already)."""
        p = os.path.join(self.path, name)
        n = _size(p)
        if not n or not unlink(p):
            return 0
        with self._cv:
            self.counters["disk_evictions"] += 1
        return n

    def _drop(self, e: BaseException, why: str) -> None:
        with self._cv:
            self.counters["demotion_drops"] += 1
        self._warn_once(why, "demotions are dropped", e)

    def _warn_once(self, why: str, what: str, e: BaseException) -> None:
        with self._cv:
            first = why not in self._logged
            self._logged.add(why)
        if first:  # one line per kind of failure, not one per object
            log.warning("embedded disk tier %r: %s (%s: %s)", self.path, what, why, e)

    # ----------------------------------------------------------------- reading (caller threads)

    def has(self, bkey: bytes) -> bool:
        """Whether the tier holds ``bkey`` (a file another process demoted is adopted)."""
        name = fmt.file_name(bkey)
        with self._cv:
            if name in self._index:
                return True
        try:
            st = os.stat(os.path.join(self.path, name), follow_symlinks=False)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return False
        with self._cv:
            if name not in self._index:
                self._index[name] = st.st_size
                self._bytes += st.st_size
        return True

    def known(self, bkey: bytes) -> bool:
        """Whether this process's index holds ``bkey`` (no file system call)."""
        return fmt.file_name(bkey) in self._index

    def open(self, key: str, bkey: bytes) -> DiskHandle | None:
        """A handle on ``key``'s file once its header (and, the first time, its payload) checks out.
        A file proven bad (``BadFile``) is removed; any other failure is a miss that keeps it."""
        if not self.has(bkey):
            return None
        name = fmt.file_name(bkey)
        p = os.path.join(self.path, name)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ENOENT:  # evicted meanwhile (by us or another process)
                self._forget(name)
            else:
                self._read_failed(e)
            return None
        kept = 0  # bytes of ``KEEP_BYTES`` reserved for this handle's payload
        ino = -1
        done = False
        try:
            ino = os.fstat(fd).st_ino
            self.reads.opened(fd)
            head = fmt.read_header(fd, bkey)
            ident = (ino, head.generation)
            check = self._verified.get(name) != ident
            data = None
            if head.nbytes <= fmt.CHUNK and self._keep(head.nbytes):
                kept = head.nbytes
                buf = self._take(head.nbytes)
                try:
                    fmt.read_payload_into(fd, head, buf, check=check, reads=self.reads)
                except BaseException:
                    self._give(buf)
                    raise
                data = buf
            elif check:
                fmt.check_payload(fd, head)
            else:  # checked before: have the kernel read it ahead for the ranged reads to come
                try:
                    os.posix_fadvise(fd, fmt.HEADER_BYTES, head.nbytes, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass  # advice only
            self._verified[name] = ident
            done = True
        except fmt.BadFile as e:
            self._corrupt(name, p, ino, e)
            return None
        except OSError as e:  # an I/O error, no memory for the buffer: the file is not proven bad
            self._read_failed(e)
            return None
        finally:
            if not done:
                os.close(fd)
                if kept:
                    self._unkeep(kept)
        with self._cv:
            if name in self._index:
                self._index.move_to_end(name)
            self.counters["disk_hits"] += 1
        try:
            os.utime(fd)  # the LRU order survives restarts (the listing sorts by mtime)
        except OSError:
            pass
        return DiskHandle(key, head.nbytes, fd, data)

    def _read_failed(self, e: OSError) -> None:
        with self._cv:
            self.counters["disk_read_errors"] += 1
        self._warn_once(f"read failed, errno {e.errno}", "a file that cannot be read is a miss, kept", e)

    def _keep(self, n: int) -> bool:
        """Reserve ``n`` bytes of the ``KEEP_BYTES`` that open handles may hold in memory."""
        with self._cv:
            if self._kept + n > KEEP_BYTES:
                return False
            self._kept += n
            return True

    def _unkeep(self, n: int) -> None:
        with self._cv:
            self._kept -= n

    def _take(self, n: int) -> mmap.mmap:
        """A buffer for a payload of ``n`` bytes (``aligned(n)`` long, page-aligned: direct I/O
        fills it): a released one when there is one (its pages already mapped), else fresh
        anonymous memory, whose pages the kernel maps as the read fills them (no zeroing pass
        under the GIL, as ``bytearray(n)`` would make)."""
        size = aligned(n)
        with self._cv:
            free = self._free.get(size)
            if free:
                self._free_bytes -= size
                return free.pop()
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)

    def _give(self, buf: mmap.mmap) -> None:
        """Keep ``buf`` for a later hit, unless a view still points into it (then it stays that
        view's, never overwritten) or ``FREE_BYTES`` are kept already."""
        n = len(buf)
        try:  # a map with live exports (memoryviews, numpy arrays over it) cannot be resized
            buf.resize(n)
        except BufferError:
            return
        with self._cv:
            if self._closed or self._free_bytes + n > FREE_BYTES:
                return
            self._free.setdefault(n, []).append(buf)
            self._free_bytes += n

    def open_many(self, keys: Sequence[str], bkeys: Sequence[bytes]) -> list[DiskHandle | None]:
        """``open`` of each key, in order, up to ``READERS`` at once: a hit's files are checked
        (each one's header, and the payload on its first open) in parallel, so the disk sees many
        reads in flight rather than one file at a time. When an open raises, every other one is
        waited for and its handle released (no descriptor or reserved byte is left), then the
        first error is raised."""
        if len(keys) <= 1:
            return [self.open(k, bk) for k, bk in zip(keys, bkeys)]
        with self._cv:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="lw-disk-read")
            pool = self._readers
        futs: list[Future[DiskHandle | None]] = [pool.submit(self.open, k, bk) for k, bk in zip(keys, bkeys)]
        wait(futs)
        errors = [e for e in (f.exception() for f in futs) if e is not None]
        if errors:
            for f in futs:
                if f.exception() is None and (h := f.result()) is not None:
                    self.release(h)
            raise errors[0]
        return [f.result() for f in futs]

    def _held(self, handle: DiskHandle, offset: int, n: int) -> memoryview | None:
        """A view of ``n`` checked bytes at ``offset`` of the payload ``handle`` holds (None when it
        holds none), counted as read. Taken under the lock ``release`` recycles under, so a buffer
        is never handed to another hit while this view is being made."""
        with self._cv:
            data = handle.data
            if data is None or handle._fd < 0:
                return None
            self.counters["disk_bytes_read"] += n
            return memoryview(data)[offset : offset + n].toreadonly()

    def read(self, handle: DiskHandle, offset: int, dst: Buffer) -> None:
        m = bytes_view(dst, writable=True, what=f"read {handle.key!r}")
        n = m.nbytes
        if offset < 0 or offset + n > handle.nbytes:
            raise ValueError(f"embedded disk tier: read of {n} bytes at offset {offset} is outside object {handle.key!r} of {handle.nbytes} bytes")
        if handle._fd < 0:
            raise ObjectMissing(f"embedded disk tier: {handle.key!r} was released")
        held = self._held(handle, offset, n)
        if held is not None:  # the bytes checked at open
            m[:] = held  # a copy: no view of the buffer stays
            return
        if handle._fd < 0:
            raise ObjectMissing(f"embedded disk tier: {handle.key!r} was released")
        try:
            got = os.preadv(handle._fd, [m], fmt.HEADER_BYTES + offset)
        except OSError as e:  # an I/O error is a failed read of this object, as for any store
            raise ObjectMissing(f"embedded disk tier {self.path!r}: reading {handle.key!r} failed: {e}") from e
        if got != n:
            raise ObjectMissing(f"embedded disk tier {self.path!r}: {handle.key!r} is short (truncated under us)")
        with self._cv:
            self.counters["disk_bytes_read"] += n

    def view(self, handle: DiskHandle, offset: int, nbytes: int) -> memoryview:
        """The range of the payload read at open (zero-copy; the view keeps its buffer from being
        recycled), else read into a new buffer (the file is not mapped: a truncated file must not
        SIGBUS)."""
        if 0 <= offset and 0 <= nbytes and offset + nbytes <= handle.nbytes:
            held = self._held(handle, offset, nbytes)
            if held is not None:
                return held
        buf = bytearray(nbytes)
        self.read(handle, offset, buf)
        return memoryview(buf).toreadonly()

    def release(self, handle: DiskHandle) -> None:
        with self._cv:
            fd, handle._fd = handle._fd, -1
            buf, handle.data = handle.data, None
        if fd < 0:
            return
        try:
            os.close(fd)
        finally:
            if buf is not None:
                self._unkeep(handle.nbytes)
                self._give(buf)  # views handed out keep their bytes: such a buffer is not recycled

    def _forget(self, name: str) -> None:
        with self._cv:
            self._bytes -= self._index.pop(name, 0)
            self._verified.pop(name, None)

    def _corrupt(self, name: str, p: str, ino: int, e: BaseException) -> None:
        """Remove the file ``name`` proven bad (``e``), unless ``p`` is another file by now (a new
        demotion of the key: the inode read, ``ino``, is not there any more)."""
        with self.dir.lock():  # so a listing never puts it back in the index
            try:
                st = os.stat(p, follow_symlinks=False)
            except OSError:
                st = None
            if st is not None and st.st_ino == ino and unlink(p):
                self.dir.set_total(self.dir.total() - st.st_size)
            self._forget(name)
        with self._cv:
            self.counters["disk_corrupt"] += 1
        log.warning("embedded disk tier %r: removed %s, a miss: %s", self.path, name, e)

    # ----------------------------------------------------------------- purge (lw_core.backends.embedded.purge)

    def purge(self, prefix: bytes, timeout_s: float = 30.0) -> int:
        """Remove the objects whose key starts with ``prefix`` ("" = all): queued demotions of
        them are dropped, the one being written is waited for (at most ``timeout_s``), then their
        files go (other processes' too). The number of files removed."""
        with self._cv:
            keep = [(bk, data) for bk, data in self._queue if not bk.startswith(prefix)]
            for bk, data in self._queue:
                if bk.startswith(prefix):
                    self._queued.discard(fmt.file_name(bk))
                    self._queued_bytes -= len(data)
            self._queue.clear()
            self._queue.extend(keep)
            end = time.monotonic() + timeout_s
            while self._busy and time.monotonic() < end:
                self._cv.wait(end - time.monotonic())
        with self.dir.lock():  # against every process's count of the directory's bytes
            removed = purge_dir(self.path, prefix)
            self.dir.set_total(max(0, self.dir.total() - sum(size for _, size in removed)))
        with self._cv:
            for name, _ in removed:
                self._bytes -= self._index.pop(name, 0)
                self._verified.pop(name, None)
        return len(removed)

    # ----------------------------------------------------------------- listing, stats, close

    def _first_scan(self) -> None:
        """The writer thread's first job: the index and the directory's count from one listing (a
        stat per file, no header read: a damaged file is found when it is opened), then room made
        for the capacity; demotions queued meanwhile wait."""
        try:
            with self.dir.lock():
                self._replace_index(self.dir.recount())
                self.dir.set_total(self.dir.total() - self._make_room())
        except Exception as e:  # the writer thread lives on: files are still found by name
            self._warn_once("listing failed", "the directory cannot be listed; files are found by name", e)
        finally:
            with self._cv:
                self._scanned = True
                self._next_rescan = time.monotonic() + RESCAN_S
                self._cv.notify_all()

    def _make_room(self) -> int:
        """Evict least recently used files while the directory's count is over the capacity
        (under the directory's lock); the bytes freed."""
        freed = 0
        while self.dir.total() - freed > self.capacity:
            with self._cv:
                if not self._index:
                    break
                name, n = self._index.popitem(last=False)
                self._bytes -= n
                self._verified.pop(name, None)
            freed += self._evict(name)
        return freed

    def _rescan(self) -> None:
        """Every RESCAN_S (writer thread): rebuild the LRU order from the files' modification times
        (set at demotion and on every hit, by any process), so other processes' hits keep files
        alive, and set the directory's count from the files (a process killed between a change
        and its count); files gone drop out."""
        if time.monotonic() < self._next_rescan:
            return
        self._next_rescan = time.monotonic() + RESCAN_S
        try:
            with self.dir.lock():
                self._replace_index(self.dir.recount())
        except OSError as e:
            self._warn_once("listing failed", "the directory cannot be listed; files are found by name", e)

    def _replace_index(self, found: list[tuple[int, str, int]]) -> None:
        self._next_relist = time.monotonic() + RELIST_S
        with self._cv:
            self._index = collections.OrderedDict((name, size) for _, name, size in sorted(found))
            self._bytes = sum(self._index.values())

    def stats(self) -> dict[str, int]:
        with self._cv:
            out = dict(self.counters)
            out["disk_objects"] = len(self._index)
            out["disk_bytes"] = self._bytes
        return out

    def close(self, flush_s: float = 30.0) -> None:
        """Write what is queued (at most ``flush_s``), then stop the writer thread."""
        if self._closed:
            return
        self.flush(flush_s)
        with self._cv:
            self._closed = True
            dropped = len(self._queue)
            self._queue.clear()
            self.counters["demotion_drops"] += dropped
            self._cv.notify_all()
            readers, self._readers = self._readers, None
            self._free.clear()
            self._free_bytes = 0
        self._thread.join(flush_s)
        if readers is not None:
            readers.shutdown(wait=True)
        if not self._thread.is_alive():  # else it may still use the directory's lock
            self.dir.close()


def _size(p: str) -> int:
    """The size of the file at ``p``; 0 when there is none."""
    try:
        return os.stat(p, follow_symlinks=False).st_size
    except OSError:
        return 0
