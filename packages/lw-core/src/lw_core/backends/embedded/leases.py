"""Read leases and object generations of the embedded pool, in one small shared file (``leases``).

Readers never take the pool's writer lock (a process stopped while holding it must not stop every
other process's reads), so nothing here is shared-written by readers:

* ``gen[page]`` -- the id of the committed object that starts at that arena page, 0 once it is
  evicted. Written only under the writer lock: set at commit, cleared (a tombstone) *before* an
  evicted extent is handed to a new writer. A reader checks it after every copy: an object whose
  generation changed while it was being read was evicted and its space may hold another object's
  bytes, so the read fails (``ObjectMissing``: the connector recomputes) instead of returning them.
* One *row* per attached backend (claimed under the writer lock at attach; its owner recorded as
  pid namespace, pid and start time as in lw_core/procs.py, and an open-file-description lock on
  one byte per row held while attached), holding that backend's leases: (object id, expiry)
  entries only it writes. ``open`` is a few stores into its own row; ``release`` clears them.
* ``hint[page]`` -- the latest lease expiry on that page (readers store it; a lost race between
  two readers costs a few microseconds of expiry), and ``ref[page]``, CLOCK's "read since" flag.

Eviction (under the writer lock) asks, per candidate object: is there an unexpired entry for its id
in a row whose owner is alive? A row is dead when its lock is free (the kernel drops it when the
process dies, in any pid namespace) or its pid no longer runs the process that claimed it (pid +
start time, so a reused pid does not count). Dead readers' rows are ignored at once and freed, so
a crashed reader's leases do not pin objects for ``lease_ttl_s``.

Ordering (the reader publishes its lease then checks ``gen``; the evictor tombstones ``gen`` then
checks the leases): each side separates its store from its load with a full fence
(``fences.fence``), so at least one side sees the other: the reader drops the object (a miss) or
the evictor keeps it. After its copies a reader fences and re-reads ``gen``: a copy that saw any
byte of a new object also sees the tombstone stored (and fenced) before the extent was handed on.
On weakly ordered CPUs (aarch64) these must be real barriers, not lock operations: fences.py.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import threading
import time

import numpy as np

from lw_core.backend import BackendError
from lw_core.backends.embedded import fences
from lw_core.backends.embedded.files import open_file, reserve_space
from lw_core.backends.embedded_defaults import LEASES_PER_PROCESS
from lw_core.procs import Owner, owner_alive

ROWS = 128  # attached backends at once
ENTRIES = LEASES_PER_PROCESS  # leases one backend holds at once; more opens return None (a miss)
FREE, REFERENCED, LEASED = 0, 1, 2
ALIVE_CACHE_S = 1.0  # a dead reader's leases count at most this long after it died

_FLOCK = struct.Struct("hhqqi")  # struct flock, native layout: type, whence, start, len, pid
_LOCK_BASE = 1 << 40  # row r's liveness lock: byte _LOCK_BASE + r of the file (past its end)


def table_bytes(slots: int) -> int:
    return slots * 17 + ROWS * 32 + ROWS * ENTRIES * 16


class LeaseTable:
    def __init__(self, path: str, slots: int) -> None:
        self.slots = s = slots
        # Kept open: this backend's row is locked through it (an open-file-description lock, which
        # the kernel drops when the process dies, in whatever pid namespace it ran).
        self._fd = fd = open_file(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != table_bytes(slots):
                raise ValueError(f"{path} has {size} bytes, expected {table_bytes(slots)}")
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        a = np.frombuffer(self._mm, dtype=np.uint8)
        o = 0

        def take(n: int, dt: type, shape: tuple[int, ...]) -> np.ndarray:
            nonlocal o
            v: np.ndarray = a[o : o + n].view(dt).reshape(shape)
            o += n
            return v

        self._gen = take(8 * s, np.uint64, (s,))
        self._hint = take(8 * s, np.float64, (s,))
        self.rows = take(32 * ROWS, np.uint64, (ROWS, 4))  # pidns, pid, start, high-water mark
        self.ent_oid = take(16 * ROWS * ENTRIES // 2, np.uint64, (ROWS, ENTRIES))
        self.ent_exp = take(16 * ROWS * ENTRIES // 2, np.float64, (ROWS, ENTRIES))
        self._ref = take(s, np.uint8, (s,))
        # Per-item access through memoryviews: numpy scalar indexing costs ~10x more.
        mv = memoryview(self._mm)
        self.gen = mv[0 : 8 * s].cast("Q")
        self.hint = mv[8 * s : 16 * s].cast("d")
        self.ref = mv[len(mv) - s :]
        o = 16 * s + 32 * ROWS
        self._oid = mv[o : o + 8 * ROWS * ENTRIES].cast("Q")  # ent_oid, flat
        o += 8 * ROWS * ENTRIES
        self._exp = mv[o : o + 8 * ROWS * ENTRIES].cast("d")  # ent_exp, flat
        self._views = (mv, self.gen, self.hint, self.ref, self._oid, self._exp)
        self._oid_np, self._exp_np = self.ent_oid.reshape(-1), self.ent_exp.reshape(-1)  # flat, for many at once
        self._base = 0  # this row's first entry in the flat views
        self.row = -1
        self._free: list[int] = []
        self._hw = 0
        self.lock = threading.Lock()  # this backend's row: one thread at a time
        self._alive: dict[tuple[int, int, int], float] = {}  # owner -> until when it counts as alive

    @staticmethod
    def create(path: str, slots: int) -> None:
        fd = open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            reserve_space(fd, table_bytes(slots), path)  # zeros: no leases, no generations
        finally:
            os.close(fd)

    # ---------------------------------------------------------------- this backend's row

    def _lock(self, r: int, kind: int) -> bool:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, _LOCK_BASE + r, 1, 0))
            return True
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise

    def _held(self, r: int) -> bool:
        """Whether another open file (a live backend, any pid namespace) holds row r's lock."""
        got = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, _LOCK_BASE + r, 1, 0))
        return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK

    def claim(self, me: Owner) -> None:
        """Take a row whose owner is gone (its lock is free); call under the writer lock."""
        for r in range(ROWS):
            if not self._lock(r, fcntl.F_WRLCK):
                continue  # a live backend's
            self.ent_oid[r] = 0
            self.ent_exp[r] = 0
            self.rows[r] = (me.pidns, me.pid, me.start, 0)
            self.row, self._free, self._hw, self._base = r, list(range(ENTRIES - 1, -1, -1)), 0, r * ENTRIES
            return
        raise BackendError(f"embedded pool: all {ROWS} lease rows are held by live processes (one per attached backend)")

    def unclaim(self) -> None:
        if self.row >= 0:
            self.ent_oid[self.row] = 0
            self.rows[self.row] = 0
            self._lock(self.row, fcntl.F_UNLCK)
            self.row = -1

    def take(self, oid: int, page: int, expiry: float) -> int:
        """Publish a lease (call under ``self.lock``); its entry index, or -1 when the row is full."""
        if not self._free:
            return -1
        i = self._free.pop()
        self._exp[self._base + i] = expiry
        self._oid[self._base + i] = oid
        if i >= self._hw:
            self._hw = i + 1
            self.rows[self.row, 3] = self._hw
        if self.hint[page] < expiry:
            self.hint[page] = expiry
        self.ref[page] = 1
        return i

    def take_many(self, oids: np.ndarray, pages: np.ndarray, expiry: float) -> np.ndarray:
        """``take`` of each (oid, page) at once (call under ``self.lock``; ``oids`` uint64, ``pages``
        int64): the entry indexes (int64), -1 where the row is full. As in ``take``, every entry's
        expiry is stored before its object id, and the high-water mark once, before the caller's
        fence; per-item Python work is what bounds opens of small objects, so none is done here."""
        out = np.full(len(oids), -1, dtype=np.int64)
        free = self._free
        k = min(len(oids), len(free))
        if not k:
            return out
        idx = np.array(free[len(free) - k :][::-1], dtype=np.int64)  # the entries k pop()s would give
        del free[len(free) - k :]
        at = self._base + idx
        self._exp_np[at] = expiry
        self._oid_np[at] = oids[:k]
        pg = pages[:k]
        self._hint[pg] = np.maximum(self._hint[pg], expiry)
        self._ref[pg] = 1
        out[:k] = idx
        hw = int(idx.max()) + 1
        if hw > self._hw:
            self._hw = hw
            self.rows[self.row, 3] = hw
        return out

    def renew(self, i: int, oid: int, page: int, expiry: float) -> bool:
        if i < 0 or self.row < 0 or self._oid[self._base + i] != oid:
            return False
        self._exp[self._base + i] = expiry
        if self.hint[page] < expiry:
            self.hint[page] = expiry
        return True

    def drop(self, i: int, oid: int) -> None:
        if i >= 0 and self.row >= 0 and self._oid[self._base + i] == oid:
            self._oid[self._base + i] = 0
            self._free.append(i)

    def drop_many(self, entries: np.ndarray, oids: np.ndarray) -> None:
        """``drop`` of each (entry, oid) at once (call under ``self.lock``; int64 and uint64 arrays)."""
        if self.row < 0 or not len(entries):
            return
        ok = entries >= 0
        entries = entries[ok]
        mine = self._oid_np[self._base + entries] == oids[ok]
        entries = entries[mine]
        self._oid_np[self._base + entries] = 0
        self._free.extend(entries.tolist())

    def expiry(self, i: int, oid: int) -> float:
        """When entry ``i`` (a lease on ``oid``) expires; 0 when it is not ours any more."""
        if i < 0 or self.row < 0 or self._oid[self._base + i] != oid:
            return 0.0
        return self._exp[self._base + i]

    def expiries(self, entries: np.ndarray, oids: np.ndarray) -> np.ndarray:
        """``expiry`` of many (entry, oid) pairs at once (int64 arrays): 0 where not ours."""
        out = np.zeros(len(entries))
        if self.row < 0 or not len(entries):
            return out
        ok = np.flatnonzero(entries >= 0)
        at = self._base + entries[ok]
        mine = np.frombuffer(self._oid, dtype=np.uint64)[at] == oids[ok].astype(np.uint64)
        out[ok[mine]] = np.frombuffer(self._exp.cast("B"), dtype=np.float64)[at[mine]]
        return out

    def generations(self, pages: np.ndarray) -> np.ndarray:
        """``gen`` of many pages at once (uint64)."""
        return np.frombuffer(self.gen, dtype=np.uint64)[pages]

    # ---------------------------------------------------------------- eviction (writer lock held)

    def set_gen(self, page: int, oid: int) -> None:
        self.gen[page] = oid

    def live_rows(self, me: Owner) -> np.ndarray:
        """Rows whose owner lives; dead owners' rows are freed. Dead = its row lock is free (the
        kernel dropped it: works across pid namespaces), or its pid is gone or now another
        process's (start time differs; catches a lock inherited by a forked child). A "lives"
        verdict from /proc is reused for ALIVE_CACHE_S (reading it per row costs ~15 us)."""
        live = []
        now = time.monotonic()
        for r in np.flatnonzero(self.rows[:, 1]):
            pidns, pid, start, _ = (int(x) for x in self.rows[r])
            key = (pidns, pid, start)
            if r != self.row and not self._held(int(r)):
                self.ent_oid[r] = 0
                self.rows[r] = 0
            elif self._alive.get(key, 0.0) > now:
                live.append(r)
            elif owner_alive(Owner(*key), me) is False:
                self.ent_oid[r] = 0
                self.rows[r] = 0
            else:
                self._alive[key] = now + ALIVE_CACHE_S
                live.append(r)
        if len(self._alive) > 4 * ROWS:
            self._alive = {k: t for k, t in self._alive.items() if t > now}
        return np.array(live, dtype=np.intp)

    def leased(self, oid: int, now: float, rows: np.ndarray) -> bool:
        if not len(rows):
            return False
        hw = int(self.rows[rows, 3].max())
        return bool(np.any((self.ent_oid[rows, :hw] == oid) & (self.ent_exp[rows, :hw] > now)))

    def evict(self, page: int, oid: int, now: float, rows: np.ndarray) -> int:
        """LEASED (someone reads it), REFERENCED (read since the last look; flag cleared: CLOCK's
        second chance), or FREE: then its generation is already cleared, so readers of the old
        object will notice, and its extent may be handed to a writer."""
        if self.hint[page] > now and self.leased(oid, now, rows):
            return LEASED
        if self.ref[page]:
            self.ref[page] = 0
            return REFERENCED
        self.gen[page] = 0
        fences.fence()  # the tombstone is visible before the leases are read
        if self.hint[page] > now and self.leased(oid, now, rows):
            self.gen[page] = oid  # a reader leased it just now: keep it
            return LEASED
        return FREE

    def reclaim(self, page: int, oid: int, now: float, rows: np.ndarray) -> bool:
        """``evict`` without CLOCK's second chance (a purge removes objects however recently read):
        False while someone holds a lease on it; True once its generation is cleared (readers of
        the old object will notice) and its extent may be freed."""
        if self.hint[page] > now and self.leased(oid, now, rows):
            return False
        self.gen[page] = 0
        fences.fence()  # the tombstone is visible before the leases are read
        if self.hint[page] > now and self.leased(oid, now, rows):
            self.gen[page] = oid  # a reader leased it just now: keep it
            return False
        self.ref[page] = 0
        return True

    def close(self, keep_mappings: bool = False) -> None:
        """Give up our row; unmap too unless another thread may still use the mappings."""
        self.unclaim()
        os.close(self._fd)
        if keep_mappings:
            return
        self._gen = self._hint = self.rows = self.ent_oid = self.ent_exp = self._ref = None  # type: ignore[assignment]
        for v in reversed(self._views):
            v.release()
        try:
            self._mm.close()
        except BufferError:
            pass
