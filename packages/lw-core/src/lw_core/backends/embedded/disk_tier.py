"""``DiskTier``: the embedded pool's opt-in local-disk tier (``embedded_disk_path``).

Objects the DRAM pool evicts are demoted here instead of dropped: ``offer`` (called by the
``Sweeper`` inside its write transaction) copies the bytes into a bounded queue and returns; a
writer thread writes each one to a temporary file, fsyncs it and renames it into place
(``disk_format``), so a process killed mid-demotion leaves no visible object. A full queue, a full
disk (``ENOSPC``) or any write error drops the demotion (counted, logged once), never raising.

State: the index (file name -> file bytes, in LRU order; rebuilt by scanning headers at open, so
objects survive restarts), the queue, the counters, which files were read and checked whole in
this process, the queue of segment reads and the bytes of payloads open handles hold.

Hits: ``open_many`` reads and checks a hit's headers ``READERS`` at a time (identity, size, the
table of per-segment CRC-32s; no payload byte) and returns; each object (up to ``HOLD_MAX``, within
``KEEP_BYTES`` in all) gets a buffer, and ``READERS`` reader threads read the hit's segments into
those buffers in the order a layer pipeline asks for them (the first ``RUN`` segments of every
object, then the next ``RUN``, ...), each segment checked against its CRC-32 as it lands. ``read``/``view`` of a range wait for the
few segments under it (reading any no reader has taken yet themselves) and hand out only checked
bytes: so the first layers' ranges are ready after a fraction of the hit's I/O, and the rest is
read while earlier layers are copied. A segment that fails its check (or a short read) fails the
reads that want it with ``ObjectMissing`` (the caller recomputes those blocks) and removes the file
as damaged. A handle past the memory budget reads the segments under each range from the file, and
checks them, on every read. Payload buffers are recycled: ``release`` keeps a buffer no view still
points into (``FREE_BYTES`` in all) for the next hit, because faulting in fresh pages for every
payload a hit holds cost about as much CPU as reading and checking them (192 MiB: 0.16 s fresh,
0.11 s recycled, on 2 cores; ``scripts/disk_tier_read_probe.py``). A torn, foreign or damaged
header is a miss at open, and its file is removed. Files are evicted, least recently used first, to
stay under ``capacity``. Hits are not promoted back into DRAM (the page cache keeps hot files in
memory). Other processes' demotions are found by name on a miss, and the writer thread lists the
directory every ``RESCAN_S`` so the capacity holds for the whole directory.
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
from concurrent.futures import ThreadPoolExecutor

from lw_core.backend import BackendError, Buffer, ObjectMissing
from lw_core.backends.embedded import disk_format as fmt
from lw_core.backends.embedded import files
from lw_core.backends.embedded.disk_format import DiskHandle
from lw_core.backends.embedded.records import bytes_view, log

COUNTERS = ("disk_hits", "disk_bytes_read", "demotions", "demotion_drops", "disk_evictions", "disk_corrupt")
READERS = 16  # headers a hit reads at once (``open_many``), and segment readers: reads in flight on the disk
KEEP_BYTES = 1 << 30  # payloads open handles may hold in memory, all together; beyond, reads use the file
RUN = 4  # segments a reader reads in one call (256 KiB)
HOLD_MAX = 8 << 20  # larger objects are never held: each read reads (and checks) its segments from the file
FREE_BYTES = 256 << 20  # released payload buffers kept for the next hit (no fresh pages to fault in)
RESCAN_S = 30.0  # how often the writer thread lists the directory (other processes' demotions)
DISK_STATS = (*COUNTERS, "disk_objects", "disk_bytes")  # what ``stats`` reports


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` (tests replace this to simulate a full disk or a kill mid-write)."""
    m = memoryview(data)
    while m:
        m = m[os.write(fd, m) :]


class DiskTier:
    """The disk tier in directory ``path``, at most ``capacity`` bytes of files; demotions wait in
    a queue of at most ``queue_bytes``. ``fsync``: sync each file before it becomes visible."""

    def __init__(self, path: str, capacity: int, *, queue_bytes: int, fsync: bool = True) -> None:
        self.path = os.path.abspath(path)
        self.capacity = capacity
        self.queue_bytes = queue_bytes
        self.fsync = fsync
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._bytes = 0
        self._verified: dict[str, tuple[int, int]] = {}  # name -> (inode, generation) read and checked whole
        self._queue: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self._queued: set[str] = set()
        self._queued_bytes = 0
        self._busy = False
        self._logged: set[str] = set()
        self._cv = threading.Condition()
        self._closed = False
        self._next_rescan = 0.0
        self._openers: ThreadPoolExecutor | None = None  # ``open_many``'s header reads
        self._readers: ThreadPoolExecutor | None = None  # segment readers (``_drain``)
        self._rd = threading.Condition()  # handles' segment states, reads in flight, release
        self._jobs: collections.deque[tuple[DiskHandle, int, int]] = collections.deque()  # segments to read
        self._draining = 0  # readers running
        self._waiting = 0  # reads waiting for a segment (``_done`` wakes them)
        self._kept = 0  # bytes of payloads open handles hold (``KEEP_BYTES`` at most)
        self._free: dict[int, list[mmap.mmap]] = {}  # released payload buffers by size (``FREE_BYTES``)
        self._free_bytes = 0
        fmt.prepare_dir(self.path)
        self._scan()
        self._thread = threading.Thread(target=self._run, name="lw-disk-tier", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- demotion (any thread; writer thread)

    def offer(self, bkey: bytes, data: memoryview) -> None:
        """Queue a copy of an evicted object's bytes; drop it (counted) when the queue is full."""
        name, n = fmt.file_name(bkey), data.nbytes
        with self._cv:
            if self._closed or name in self._index or name in self._queued:
                return
            if self._queued_bytes + n > self.queue_bytes or fmt.file_bytes(len(bkey), n) > self.capacity:
                self.counters["demotion_drops"] += 1
                return
            self._queued.add(name)
            self._queued_bytes += n
        payload = bytes(data)  # the one copy the evicting call pays for
        with self._cv:
            self._queue.append((bkey, payload))
            self._cv.notify()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued demotion is written (or dropped); False at the deadline."""
        end = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def _run(self) -> None:
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
        size = fmt.file_bytes(len(bkey), len(payload))
        self._rescan()
        self._make_room(size)
        tmp = os.path.join(self.path, f"{fmt.TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        head = fmt.build_header(bkey, len(payload), secrets.randbits(63), fmt.segment_crcs(payload))
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
            os.rename(tmp, os.path.join(self.path, name))
        except OSError as e:
            fmt.unlink(tmp)
            self._drop(e, "ENOSPC, disk full" if e.errno == errno.ENOSPC else "write failed")
            return
        with self._cv:
            self._bytes -= self._index.pop(name, 0)
            self._index[name] = size
            self._bytes += size
            self.counters["demotions"] += 1

    def _drop(self, e: BaseException, why: str) -> None:
        with self._cv:
            self.counters["demotion_drops"] += 1
            first = why not in self._logged
            self._logged.add(why)
        if first:  # one line per kind of failure, not one per object
            log.warning("embedded disk tier %r: demotions are dropped (%s: %s)", self.path, why, e)

    def _make_room(self, size: int) -> None:
        while True:
            with self._cv:
                if self._bytes + size <= self.capacity or not self._index:
                    return
                name, n = self._index.popitem(last=False)
                self._bytes -= n
                self._verified.pop(name, None)
                self.counters["disk_evictions"] += 1
            fmt.unlink(os.path.join(self.path, name))

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

    def _open_file(self, key: str, bkey: bytes) -> DiskHandle | None:
        """A handle on ``key``'s file once its header checks out (no payload byte read yet)."""
        if not self.has(bkey):
            return None
        name = fmt.file_name(bkey)
        p = os.path.join(self.path, name)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # evicted meanwhile (by us or another process)
            self._forget(name)
            return None
        try:
            head = fmt.read_header(fd, bkey)
            ident = (os.fstat(fd).st_ino, head.generation)
        except (fmt.BadFile, OSError) as e:
            os.close(fd)
            self._corrupt(name, p, e)
            return None
        check = self._verified.get(name) != ident
        data = self._take(head.nbytes) if head.nbytes <= HOLD_MAX and self._keep(head.nbytes) else None
        if data is None:  # read on demand: have the kernel read the file ahead
            os.posix_fadvise(fd, head.head_bytes, head.nbytes, os.POSIX_FADV_WILLNEED)
        with self._cv:
            if name in self._index:
                self._index.move_to_end(name)
            self.counters["disk_hits"] += 1
        try:
            os.utime(fd)  # the LRU order survives restarts (scan sorts by mtime)
        except OSError:
            pass
        return DiskHandle(key, head, fd, name, ident, check, data)

    def open(self, key: str, bkey: bytes) -> DiskHandle | None:
        """A handle on ``key``'s file once its header checks out; its segments are read (and
        checked) in the background from here on, reads wait for the ones they need."""
        h = self._open_file(key, bkey)
        if h is not None:
            self._schedule([h])
        return h

    def open_many(self, keys: Sequence[str], bkeys: Sequence[bytes]) -> list[DiskHandle | None]:
        """``open`` of each key, in order: the headers are read ``READERS`` at once, then the
        hits' segments are queued for the readers in the order a layer pipeline reads them
        (``_schedule``), so the first layers' ranges are read and checked first and later ones
        are read while earlier layers are copied."""
        if len(keys) <= 1:
            return [self.open(k, bk) for k, bk in zip(keys, bkeys)]
        with self._cv:
            if self._openers is None:
                self._openers = ThreadPoolExecutor(READERS, thread_name_prefix="lw-disk-open")
            pool = self._openers
        out = list(pool.map(self._open_file, keys, bkeys))
        self._schedule([h for h in out if h is not None])
        return out

    # ----------------------------------------------------------------- segment reads (readers, callers)

    def _schedule(self, handles: Sequence[DiskHandle]) -> None:
        """Queue the held handles' segments, ``RUN`` at a time, run-major (the first run of every
        handle, then the second, ...), and start readers for them."""
        held = [h for h in handles if h.state is not None]
        if not held:
            return
        most = max(h.head.nsegs for h in held)
        jobs = [(h, s, min(s + RUN, h.head.nsegs)) for s in range(0, most, RUN) for h in held if s < h.head.nsegs]
        with self._rd:
            if self._closed:
                return  # reads read the segments themselves
            self._jobs.extend(jobs)
            start = min(READERS, len(self._jobs)) - self._draining
            self._draining += max(0, start)
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="lw-disk-read")
            pool = self._readers
        for _ in range(start):
            pool.submit(self._drain)

    def _drain(self) -> None:
        """A reader: take queued runs of segments until none is left (of a run, the segments up
        to the first one a read has taken already)."""
        while True:
            with self._rd:
                if not self._jobs:
                    self._draining -= 1
                    return
                h, first, end = self._jobs.popleft()
                if h._fd < 0 or h.state is None:
                    continue
                while first < end and h.state[first] != DiskHandle.PENDING:
                    first += 1
                stop = first
                while stop < end and h.state[stop] == DiskHandle.PENDING:
                    h.state[stop] = DiskHandle.READING
                    stop += 1
                if stop == first:
                    continue
                h.inflight += 1
                fd, buf = h._fd, h.data
            try:
                self._read_segments(h, first, stop, fd, buf)
            except BaseException as e:  # never lose a segment: it fails, the reads that want it fail
                self._done(h, first, stop, e)

    def _read_segments(self, h: DiskHandle, first: int, end: int, fd: int, buf: mmap.mmap | None) -> None:
        """Read segments ``first..end-1`` of held handle ``h`` (claimed: ``READING``, one read in
        flight, so ``fd`` and ``buf``, taken with the claim, stay open and unrecycled) into
        ``buf`` in one read, and check each."""
        lo, hi = h.head.span(first)[0], h.head.span(end - 1)[1]
        assert buf is not None
        err: BaseException | None = None
        m = memoryview(buf)[lo:hi]
        try:
            if os.preadv(fd, [m], h.head.head_bytes + lo) != hi - lo:
                err = fmt.BadFile(f"segments {first}..{end - 1} are short (torn)")
            elif h.check:
                for s in range(first, end):
                    a, b = h.head.span(s)
                    if not fmt.check_segment(h.head, s, m[a - lo : b - lo]):
                        err = fmt.BadFile(f"segment {s} checksum mismatch")
                        break
        except OSError as e:
            err = e
        finally:
            m.release()
        self._done(h, first, end, err)

    def _done(self, h: DiskHandle, first: int, end: int, err: BaseException | None) -> None:
        """The read of segments ``first..end-1`` is over: mark them (all failed when ``err``: the
        object is a miss from then on), wake the reads waiting, close a released handle whose
        last read this was, and remove a damaged file (first: a read that fails finds it gone)."""
        if isinstance(err, fmt.BadFile):
            self._corrupt(h.name, os.path.join(self.path, h.name), err, ino=h.ident[0])
        with self._rd:
            assert h.state is not None
            h.state[first:end] = bytes([DiskHandle.BAD if err is not None else DiskHandle.OK]) * (end - first)
            if err is None:
                h.left -= end - first
            elif h.bad is None:
                h.bad = str(err)
            whole = err is None and h.left == 0 and h.check
            closing = self._end_read(h)
            if self._waiting:
                self._rd.notify_all()
        if whole:  # every segment checked: later opens of this file skip the checksums
            with self._cv:
                self._verified[h.name] = h.ident
        if closing is not None:
            self._finish(h, *closing)

    def _end_read(self, h: DiskHandle) -> tuple[int, mmap.mmap | None] | None:
        """(Under ``_rd``.) One read fewer in flight on ``h``; what to close if it was the last
        one after ``release``."""
        h.inflight -= 1
        if h.inflight or h.closing is None:
            return None
        closing, h.closing = h.closing, None
        return closing

    def _missing(self, h: DiskHandle, why: str) -> ObjectMissing:
        return ObjectMissing(f"embedded disk tier {self.path!r}: reading {h.key!r} failed: {why}")

    def _ready(self, h: DiskHandle, offset: int, n: int) -> memoryview:
        """A read-only view of ``n`` checked bytes at ``offset`` of held handle ``h``, once the
        segments under them are read and checked (a segment no reader has taken yet is read
        here); counted as read. ObjectMissing if one of them failed or ``h`` was released."""
        seg = h.head.seg
        first, last = offset // seg, max(offset, offset + n - 1) // seg
        while True:
            mine: list[int] = []
            with self._rd:
                if h._fd < 0 or h.state is None or h.data is None:
                    raise ObjectMissing(f"embedded disk tier: {h.key!r} was released")
                if h.bad is not None:
                    raise self._missing(h, h.bad)
                waiting = False
                for s in range(first, min(last, h.head.nsegs - 1) + 1):
                    st = h.state[s]
                    if st == DiskHandle.PENDING:
                        h.state[s] = DiskHandle.READING
                        h.inflight += 1
                        mine.append(s)
                    elif st != DiskHandle.OK:
                        waiting = True
                fd, buf = h._fd, h.data
                if not mine and not waiting:
                    with self._cv:
                        self.counters["disk_bytes_read"] += n
                    return memoryview(h.data)[offset : offset + n].toreadonly()
                if not mine:
                    self._waiting += 1
                    try:
                        self._rd.wait()
                    finally:
                        self._waiting -= 1
                    continue
            for k, s in enumerate(mine):
                try:
                    self._read_segments(h, s, s + 1, fd, buf)
                except BaseException as e:
                    self._done(h, s, s + 1, e)
                    for rest in mine[k + 1 :]:  # claimed: fail them
                        self._done(h, rest, rest + 1, e)
                    raise

    def _read_file(self, h: DiskHandle, offset: int, m: memoryview) -> None:
        """Read ``m.nbytes`` bytes at ``offset`` of a handle not held in memory: the segments
        under them are read (straight into ``m`` when the range is whole segments, else into a
        scratch buffer) and checked before ``m`` is filled."""
        n, head = m.nbytes, h.head
        with self._rd:
            if h._fd < 0:
                raise ObjectMissing(f"embedded disk tier: {h.key!r} was released")
            if h.bad is not None:
                raise self._missing(h, h.bad)
            h.inflight += 1
            fd = h._fd
        err: BaseException | None = None
        try:
            lo = offset - offset % head.seg
            hi = min(-(-(offset + n) // head.seg) * head.seg, head.nbytes)
            direct = lo == offset and hi == offset + n
            buf = m if direct else memoryview(bytearray(hi - lo))
            try:
                got = os.preadv(fd, [buf], head.head_bytes + lo)
            except OSError as e:  # an I/O error is a failed read of this object, as for any store
                raise self._missing(h, str(e)) from e
            if got != hi - lo:
                err = fmt.BadFile(f"{h.key!r} is short (truncated under us)")
            elif h.check:
                for s in range(lo // head.seg, -(-hi // head.seg)):
                    a, b = head.span(s)
                    if not fmt.check_segment(head, s, buf[a - lo : b - lo]):
                        err = fmt.BadFile(f"segment {s} checksum mismatch")
                        break
            if err is None and not direct:
                m[:] = buf[offset - lo : offset - lo + n]
        finally:
            if err is not None:  # removed before any read can fail for it
                self._corrupt(h.name, os.path.join(self.path, h.name), err, ino=h.ident[0])
            with self._rd:
                if err is not None and h.bad is None:
                    h.bad = str(err)
                closing = self._end_read(h)
            if closing is not None:
                self._finish(h, *closing)
        if err is not None:  # ``m`` may hold unchecked bytes: the read fails, they are never used
            raise self._missing(h, str(err))
        with self._cv:
            self.counters["disk_bytes_read"] += n

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
        """A buffer of ``n`` bytes: a released one when there is one (its pages already mapped),
        else fresh anonymous memory, whose pages the kernel maps as the reads fill them (no zeroing
        pass under the GIL, as ``bytearray(n)`` would make)."""
        with self._cv:
            free = self._free.get(n)
            if free:
                self._free_bytes -= n
                return free.pop()
        return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)

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

    def read(self, handle: DiskHandle, offset: int, dst: Buffer) -> None:
        m = bytes_view(dst, writable=True, what=f"read {handle.key!r}")
        n = m.nbytes
        if offset < 0 or offset + n > handle.nbytes:
            raise ValueError(f"embedded disk tier: read of {n} bytes at offset {offset} is outside object {handle.key!r} of {handle.nbytes} bytes")
        if handle.state is not None:
            held = self._ready(handle, offset, n)
            m[:] = held  # a copy: no view of the buffer stays
            held.release()
            return
        self._read_file(handle, offset, m)

    def view(self, handle: DiskHandle, offset: int, nbytes: int) -> memoryview:
        """The range of the payload held in memory once checked (zero-copy; the view keeps its
        buffer from being recycled), else read into a new buffer (the file is not mapped: a
        truncated file must not SIGBUS)."""
        if handle.state is not None and 0 <= offset and 0 <= nbytes and offset + nbytes <= handle.nbytes:
            return self._ready(handle, offset, nbytes)
        buf = bytearray(nbytes)
        self.read(handle, offset, buf)
        return memoryview(buf).toreadonly()

    def release(self, handle: DiskHandle) -> None:
        with self._rd:
            fd, handle._fd = handle._fd, -1
            buf, handle.data = handle.data, None
            if fd < 0:
                return
            if handle.inflight:  # the last read in flight closes it
                handle.closing = (fd, buf)
                self._rd.notify_all()
                return
            self._rd.notify_all()
        self._finish(handle, fd, buf)

    def _finish(self, handle: DiskHandle, fd: int, buf: mmap.mmap | None) -> None:
        os.close(fd)
        if buf is not None:
            self._unkeep(handle.nbytes)
            self._give(buf)  # views handed out keep their bytes: such a buffer is not recycled

    def _forget(self, name: str) -> None:
        with self._cv:
            self._bytes -= self._index.pop(name, 0)
            self._verified.pop(name, None)

    def _corrupt(self, name: str, p: str, e: BaseException, ino: int | None = None) -> None:
        """Remove a damaged file (when ``ino`` is given, only that file, once: not a newer one
        under the same name, nor one another failed read removed already)."""
        with self._cv:  # an RLock: ``_forget`` takes it too
            if ino is not None:
                try:
                    if os.stat(p, follow_symlinks=False).st_ino != ino:
                        return
                except OSError:
                    return
            self._forget(name)
            fmt.unlink(p)
            self.counters["disk_corrupt"] += 1
        log.warning("embedded disk tier %r: removed %s, a miss: %s", self.path, name, e)

    # ----------------------------------------------------------------- open, stats, close

    def _scan(self) -> None:
        """Rebuild the index from the files' headers (oldest first); remove damaged files."""
        found, bad = fmt.scan_dir(self.path, headers=True)
        for name, e in bad:
            self._corrupt(name, os.path.join(self.path, name), e)
        for _, name, size in sorted(found):
            self._index[name] = size
            self._bytes += size
        self._next_rescan = time.monotonic() + RESCAN_S
        self._make_room(0)

    def _rescan(self) -> None:
        """Every RESCAN_S (writer thread): rebuild the LRU order from the files' modification times
        (set at demotion and on every hit, by any process), so other processes' files count against
        ``capacity`` and their hits keep files alive; files gone drop out."""
        if time.monotonic() < self._next_rescan:
            return
        self._next_rescan = time.monotonic() + RESCAN_S
        found, _ = fmt.scan_dir(self.path, headers=False)
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
            openers, self._openers = self._openers, None
            self._free.clear()
            self._free_bytes = 0
        with self._rd:  # queued segments stay PENDING: reads of open handles read them themselves
            self._jobs.clear()
            readers, self._readers = self._readers, None
        self._thread.join(flush_s)
        for pool in (openers, readers):
            if pool is not None:
                pool.shutdown(wait=True)
