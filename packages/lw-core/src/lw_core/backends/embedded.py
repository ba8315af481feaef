"""The embedded pool: a single-host object store shared by several processes, no server.

Layout of the pool directory (``embedded_path``; put it on tmpfs, e.g. ``/dev/shm/...``):

* ``arena``  -- the data: one file of ``capacity_bytes``, ``mmap``'d ``MAP_SHARED`` by every process.
  Objects are page-aligned extents of it, so a read or write is one memcpy between the caller's
  buffer and the mapping, and ``view()`` hands out the mapping itself (zero copy).
* ``index.lmdb`` -- the metadata, in LMDB: key -> object record (state, extent, LRU stamp), the
  LRU order, in-flight reservations (owner pid, start time, age) and the arena's free extents.
  Every call that changes metadata is ONE write transaction for the whole batch.
* ``leases`` -- read leases, one slot per arena page (embedded_leases.py): ``open`` is an LMDB
  read plus a few stores there, ``release`` touches no index at all.
* ``writer.lock`` / ``attach.lock`` / ``create.lock`` -- ``flock`` files: a bounded writer lock in
  front of LMDB's, a shared lock every attached process holds, so a process can tell it is alone,
  and one that openers take in turn, so one of them builds a new pool while the others wait for it
  (with a deadline that grows with the capacity) instead of for the writer lock.

Why this design (measured on the project's 2-core machine, see
shared/design/embedded-store-facts.md and ``lw-bench backend``):

* Library vs hand-made. Storing the *values* in LMDB (one library, nothing hand-made) puts them 16
  bytes into a page: small puts from page-aligned buffers ran at 0.33-0.46x memcpy, and LMDB has no
  eviction or leases anyway. A hand-made shared-memory arena copies at ~1x memcpy but needs a
  multi-process index: writing that by hand (shared hash table, robust locks, crash recovery) is
  exactly what LMDB already does well -- several processes, no daemon, a writer killed mid-
  transaction leaves nothing visible and does not keep the lock. So LMDB holds the small metadata
  (one short transaction per batch) and the bytes live in a page-aligned arena we only memcpy.
* LMDB settings: ``writemap`` (no copy of dirty pages), no sync (the pool is a cache in DRAM),
  fixed ``map_size`` computed from the capacity (never resized, so no ``MapResizedError``),
  ``reader_check()`` when the map fills (a killed reader pins pages).
* The arena is ``posix_fallocate``'d at creation and mapped with ``MAP_POPULATE``: first-touch page
  faults on tmpfs ran at ~2.8 GB/s against ~11 GB/s for mapped pages. Neither holds the writer
  lock (creating holds ``create.lock``, mapping holds no lock), so processes starting together
  do not fail on the writer lock's short ``lock_timeout_s``.
* Copies of >= 1 MiB go through numpy (it releases the GIL, so a transfer thread does not stall
  the engine); smaller ones through memoryview slice assignment (less per-call overhead).
* Measured with ``lw-bench backend`` (ratio to a numpy memcpy of the same bytes, same run):
  64 KiB objects put 0.41-0.46x / get 0.57-0.66x (one open+read+release per 32 objects; the
  index work, ~1.5 us per key, is what is left), 4 MiB objects put ~0.85-0.9x / get ~0.9x, per-layer
  ranged batches of 32 x 16 KiB put ~0.8x / get ~0.8x at ~0.1 ms per layer call; open+release of
  32 keys ~0.05 ms, reserve+commit of 32 keys ~0.2 ms (more when it must evict mixed sizes).

Rules kept (lw_core.backend's contract):

* Only committed objects are visible; objects are write-once; a batch's metadata is one
  transaction. ``reserve`` returns None for a committed or in-flight key, or when nothing fits.
* Eviction: CLOCK over the LRU order of committed objects (a read sets a flag instead of moving
  the object, which would cost an index write per read; a flagged object gets a second chance),
  skipping objects with a live lease; done inside ``reserve`` when the free list has no room. An
  evicted extent of the right size is handed straight to the new object. Counted in ``stats()``.
* Leases: ``open`` adds a lease that expires after ``lease_ttl_s`` (a dead reader cannot pin an
  object forever). A reader still copying after its lease expired may read a reused extent: keep
  ``lease_ttl_s`` far above one step's duration.
* Crashed writers: a reservation records its owner as (pid namespace, pid, start time). A
  reservation whose owner is dead (or a zombie, or its pid was reused) is reclaimed on the next
  sweep (when space runs out, when its key is reserved again, and every few seconds). One older
  than ``reservation_timeout_s`` whose owner still lives loses its key (others may write it) but
  keeps its extent until that owner ends or calls commit/abort -- it may still be copying into it.
  Owners in another pid namespace cannot be checked: they are reclaimed after the timeout only.
* Processes: open an ``EmbeddedBackend`` in each process (several in one process share one LMDB
  environment); using one across a fork raises, and py-lmdb cannot reopen a pool in a child forked
  from a process that has it open: use spawn. Processes sharing a pool must see the same ``/proc``
  pid namespace for fast reclaim.
* Nothing hangs: our writer lock is an ``flock`` taken with a deadline (``lock_timeout_s``,
  ``BackendUnavailable`` after it), so LMDB's own writer mutex -- which has no timeout -- is only
  ever taken uncontended. A process that dies holding either lock frees it (flock / LMDB's robust
  mutex). Remaining risk: a process *stopped* (SIGSTOP, debugger) inside a transaction holds the
  lock; others then fail with ``BackendUnavailable`` after ``lock_timeout_s`` instead of hanging.
* A pool whose capacity, format or boot differs from what a process asks for is rebuilt when no
  other process is attached (it is a cache), else attaching fails with a message naming both.
"""

from __future__ import annotations

import errno
import fcntl
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

import lmdb
import numpy as np

from lw_core.backend import BackendError, BackendUnavailable, Buffer, ObjectMissing, PoolFull
from lw_core.backends._arena_alloc import ArenaCorrupt, ExtentAllocator
from lw_core.backends.embedded_leases import FREE, LEASED, LeaseTable
from lw_core.backends.embedded_proc import OWNER_SIZE, Owner, current_owner, owner_alive

FORMAT = b"lw-embedded/3"
PAGE = mmap.PAGESIZE
_NP_COPY_MIN = 1 << 20  # numpy copies release the GIL (worth it for long copies); memoryview costs less per call
_MAX_KEY_BYTES = 500  # LMDB's default key limit is 511
_SWEEP_INTERVAL_S = 5.0
# Assumed pace of creating an arena, for how long openers wait on a creator: far below tmpfs's
# ~10 GB/s posix_fallocate, so only a stopped or stuck creator runs past it.
_CREATE_BYTES_PER_S = 128 << 20

_BE = struct.Struct(">Q")
_CAP = struct.Struct("<QQ")  # capacity, page size

COMMITTED, RESERVED = 1, 2


# Object record, kept as a plain list on the hot paths (a NamedTuple per record cost more than the
# LMDB operations): state, object id, arena offset, allocated bytes, object bytes, LRU stamp (0
# while reserved). Leases live in the lease table (embedded_leases.py), not here.
_OBJ = struct.Struct("<B7xQQQQQ")
ST, OID, OFF, ALLOC, NBYTES, STAMP = range(6)


class _Resv(NamedTuple):
    owner: Owner
    t0: float
    off: int
    alloc: int
    orphan: int  # 1: key taken away after the timeout; extent kept until the owner ends


_RESV_TAIL = struct.Struct("<dQQB")

COUNTERS = (
    "next_id",
    "objects",
    "bytes",
    "committed_alloc_bytes",
    "reserved_objects",
    "reserved_bytes",
    "free_bytes",
    "evictions",
    "evicted_bytes",
    "reclaimed_reservations",
    "orphaned_reservations",
    "reserve_rejected_exists",
    "reserve_rejected_full",
    "commits",
    "aborts",
)
_C = {name: i for i, name in enumerate(COUNTERS)}
_COUNTERS = struct.Struct("<" + "q" * len(COUNTERS))

T = TypeVar("T")


class EmbeddedHandle:
    """A reservation (writable) or a lease (read-only) on one object; valid in its process only."""

    __slots__ = ("key", "nbytes", "_bkey", "_off", "_alloc", "_oid", "_writable", "_leased")

    def __init__(self, key: str, bkey: bytes, nbytes: int, off: int, alloc: int, oid: int, writable: bool) -> None:
        self.key = key
        self.nbytes = nbytes
        self._bkey = bkey
        self._off = off
        self._alloc = alloc
        self._oid = oid
        self._writable = writable
        self._leased = not writable

    def __repr__(self) -> str:
        kind = "reserved" if self._writable else "leased" if self._leased else "closed"
        return f"EmbeddedHandle({self.key!r}, nbytes={self.nbytes}, {kind})"


def _bytes_view(buf: Buffer, *, writable: bool, what: str) -> memoryview:
    m = buf if isinstance(buf, memoryview) else memoryview(buf)
    if m.format != "B" or m.ndim != 1:
        if not m.c_contiguous:
            raise ValueError(f"{what}: buffer must be C-contiguous (got shape {m.shape}, strides {m.strides})")
        m = m.cast("B")
    if writable and m.readonly:
        raise ValueError(f"{what}: destination buffer is read-only")
    return m


def _positive(name: str, v: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0) or math.isinf(v):
        raise ValueError(f"EmbeddedBackend: {name}={v!r} must be a finite number > 0")
    return float(v)


class _Tx:
    """One write transaction plus the counter record, read once and written once."""

    def __init__(self, be: "EmbeddedBackend", txn: Any) -> None:
        self.be = be
        self.txn = txn
        self.now = time.time()
        raw = txn.get(b"counters", db=be._meta)
        self.c = list(_COUNTERS.unpack(raw))
        self.swept = False
        self.lru_cur: Any = None

    def flush(self) -> None:
        self.txn.put(b"counters", _COUNTERS.pack(*self.c), db=self.be._meta)

    def next_id(self) -> int:
        self.c[0] += 1
        return self.c[0]

    def alloc(self, size: int) -> int | None:
        off = self.be._alloc.alloc(self.txn, size)
        if off is not None:
            self.c[_C["free_bytes"]] -= size
        return off

    def free(self, off: int, size: int) -> None:
        self.be._alloc.free(self.txn, off, size)
        self.c[_C["free_bytes"]] += size

    def get_obj(self, bkey: bytes) -> list | None:
        v = self.txn.get(bkey, db=self.be._obj)
        return None if v is None else list(_OBJ.unpack(v))

    def put_obj(self, bkey: bytes, o: list) -> None:
        self.txn.put(bkey, _OBJ.pack(*o), db=self.be._obj)

    def get_resv(self, oid: int) -> tuple[_Resv, bytes] | None:
        v = self.txn.get(_BE.pack(oid), db=self.be._resv)
        return None if v is None else _unpack_resv(v)

    def put_resv(self, oid: int, r: _Resv, bkey: bytes) -> None:
        self.txn.put(_BE.pack(oid), r.owner.pack() + _RESV_TAIL.pack(r.t0, r.off, r.alloc, r.orphan) + bkey, db=self.be._resv)

    def drop_resv(self, oid: int, r: _Resv) -> None:
        """Forget a reservation and free its extent."""
        self.txn.delete(_BE.pack(oid), db=self.be._resv)
        self.free(r.off, r.alloc)
        self.c[_C["reserved_objects"]] -= 1
        self.c[_C["reserved_bytes"]] -= r.alloc


def _unpack_resv(v: bytes) -> tuple[_Resv, bytes]:
    owner = Owner.unpack(v)
    t0, off, alloc, orphan = _RESV_TAIL.unpack_from(v, OWNER_SIZE)
    return _Resv(owner, t0, off, alloc, orphan), bytes(v[OWNER_SIZE + _RESV_TAIL.size :])


class EmbeddedBackend:
    """Single-host pool shared by every process that opens the same ``path`` (a directory)."""

    name = "embedded"

    def __init__(
        self,
        path: str,
        *,
        capacity_bytes: int,
        lease_ttl_s: float = 60.0,
        reservation_timeout_s: float = 600.0,
        lock_timeout_s: float = 10.0,
        populate: bool = True,
    ) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError(f"EmbeddedBackend: path={path!r} must be a non-empty directory path")
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < (1 << 20):
            raise ValueError(f"EmbeddedBackend: capacity_bytes={capacity_bytes!r} must be an int >= 1048576 (1 MiB)")
        self.path = os.path.abspath(path)
        self.capacity = capacity_bytes // PAGE * PAGE
        self.lease_ttl_s = _positive("lease_ttl_s", lease_ttl_s)
        self.reservation_timeout_s = _positive("reservation_timeout_s", reservation_timeout_s)
        self.lock_timeout_s = _positive("lock_timeout_s", lock_timeout_s)
        self._pid = os.getpid()
        self._me = current_owner()
        self._tlock = threading.Lock()
        self._closed = False
        self._env: Any = None
        self._mm: mmap.mmap | None = None
        self._mv: memoryview | None = None
        self._np: np.ndarray | None = None
        self._last_sweep = 0.0
        self._leases: LeaseTable | None = None
        self._local = {"open_hits": 0, "open_misses": 0}
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self.path, "writer.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            self._attach_fd = os.open(os.path.join(self.path, "attach.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            self._create_fd = os.open(os.path.join(self.path, "create.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise BackendError(f"embedded pool: cannot use embedded_path={self.path!r}: {e}") from e
        arena_fd = None
        try:
            # Openers take turns on create.lock, so only one of them can build the pool; the slow
            # part of building (allocating the arena) and mapping it run without the writer lock,
            # whose short lock_timeout_s would otherwise fail everyone who opens at the same time.
            with self._create_locked():
                with self._locked():
                    try:
                        fcntl.flock(self._attach_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        alone = True
                    except BlockingIOError:
                        alone = False
                    reason = self._check_existing(alone)
                if reason:
                    # Nobody is attached (alone, or the files are gone) and other openers wait on
                    # create.lock; the index gets its format mark last, so a creator killed here
                    # leaves a pool the next opener rebuilds.
                    self._create(*self._files())
                with self._locked():
                    arena_fd = self._attach_files()
                    # Every attacher holds this shared until it closes or dies; taken under the
                    # create lock, so the EX->SH conversion cannot race another attacher's check.
                    fcntl.flock(self._attach_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    self._write_unlocked(self._sweep)
            # Pre-faulting the mapping takes ~1 s per few GiB: done holding no lock. The shared
            # attach lock keeps anyone from rebuilding the arena meanwhile.
            self._map_arena(arena_fd, populate)
        except BaseException:
            self._teardown()
            raise
        finally:
            if arena_fd is not None:
                os.close(arena_fd)

    # ----------------------------------------------------------------- setup

    def _files(self) -> tuple[str, str, str]:
        return tuple(os.path.join(self.path, f) for f in ("index.lmdb", "arena", "leases"))  # type: ignore[return-value]

    def _map_size(self) -> int:
        # Worst case one object per page; ~1 KiB of index per object covers records, LRU and free
        # lists at half-full B-tree pages. Virtual only: tmpfs allocates touched pages.
        return max(64 << 20, self.capacity // PAGE * 1024)

    def _open_env(self, idx: str) -> None:
        self._env = _acquire_env(
            idx,
            map_size=self._map_size(),
            max_dbs=8,
            max_readers=1024,
            writemap=True,
            sync=False,
            metasync=False,
            readahead=False,
            meminit=False,
            lock=True,
        )
        self._obj = self._env.open_db(b"obj")
        self._lru = self._env.open_db(b"lru")
        self._resv = self._env.open_db(b"resv")
        self._meta = self._env.open_db(b"meta")
        self._alloc = ExtentAllocator(self._env.open_db(b"free_off"), self._env.open_db(b"free_size"))

    def _mismatch(self) -> str | None:
        """Why the existing pool does not fit this process's settings, or None when it does."""
        with self._env.begin(db=self._meta) as txn:
            fmt, cap, boot = txn.get(b"format"), txn.get(b"capacity"), txn.get(b"boot_id")
        if fmt != FORMAT:
            return f"format {fmt!r} (expected {FORMAT!r})"
        if _CAP.unpack(cap) != (self.capacity, PAGE):
            have = _CAP.unpack(cap)
            return f"capacity_bytes={have[0]} page={have[1]} (this process asks capacity_bytes={self.capacity} page={PAGE})"
        if boot != _boot_id():
            return "it was created before the last reboot"
        return None

    def _check_existing(self, alone: bool) -> str | None:
        """Open the existing pool's index; why it must be (re)built, or None when it can be used."""
        idx, arena, leases = self._files()
        if not all(map(os.path.exists, (idx, arena, leases))):
            return "new"
        try:
            self._open_env(idx)
            reason = self._mismatch()
        except (lmdb.Error, struct.error, TypeError) as e:
            reason = f"its index is unreadable ({e})"
        if reason and not alone:
            raise BackendError(
                f"embedded pool at {self.path!r} does not match: {reason}; other processes use it, so it "
                "cannot be rebuilt now: use the same embedded_capacity_bytes or another embedded_path"
            )
        return reason

    def _attach_files(self) -> int:
        """Open the arena (its fd, to map later) and map the lease table."""
        _, arena, leases = self._files()
        try:
            fd = os.open(arena, os.O_RDWR)
        except OSError as e:
            raise BackendError(f"embedded pool: cannot open {arena!r}: {e}") from e
        try:
            if os.fstat(fd).st_size != self.capacity:
                raise BackendError(f"embedded pool: {arena!r} has {os.fstat(fd).st_size} bytes, expected {self.capacity}")
            self._leases = LeaseTable(leases, self.capacity // PAGE)
        except (OSError, ValueError) as e:
            os.close(fd)
            raise BackendError(f"embedded pool: cannot map the lease table: {e}") from e
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _map_arena(self, fd: int, populate: bool) -> None:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self._mm = mmap.mmap(fd, self.capacity, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._mv = memoryview(self._mm)
        self._np = np.frombuffer(self._mm, dtype=np.uint8)

    def _create(self, idx: str, arena: str, leases: str) -> None:
        if self._env is not None:
            _release_env(self._env)
            self._env = None
        for p in (idx, idx + "-lock", arena, leases):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        fd = os.open(arena, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.capacity)
            # Allocate every tmpfs page now: first-touch faults copy at a fraction of memcpy speed.
            os.posix_fallocate(fd, 0, self.capacity)
        except OSError as e:
            os.close(fd)
            os.unlink(arena)
            hint = " (not enough free space: lower embedded_capacity_bytes or free the filesystem)" if e.errno == errno.ENOSPC else ""
            raise BackendError(f"embedded pool: cannot allocate {self.capacity} bytes at {arena!r}: {e}{hint}") from e
        os.close(fd)
        LeaseTable.create(leases, self.capacity // PAGE)
        self._open_env(idx)
        with self._env.begin(write=True) as txn:
            c = [0] * len(COUNTERS)
            c[_C["free_bytes"]] = self.capacity
            txn.put(b"counters", _COUNTERS.pack(*c), db=self._meta)
            txn.put(b"capacity", _CAP.pack(self.capacity, PAGE), db=self._meta)
            txn.put(b"boot_id", _boot_id(), db=self._meta)
            self._alloc.init(txn, self.capacity)
            txn.put(b"format", FORMAT, db=self._meta)  # last: a half-made pool has no format

    # ----------------------------------------------------------------- locking and transactions

    def _usable(self) -> None:
        if self._closed:
            raise BackendError(f"embedded pool {self.path!r}: backend is closed")
        if os.getpid() != self._pid:
            raise BackendError(
                f"embedded pool {self.path!r}: opened in pid {self._pid}, used in forked pid {os.getpid()}; "
                "open a new EmbeddedBackend in each process"
            )

    @contextmanager
    def _locked(self) -> Iterator[None]:
        deadline = time.monotonic() + self.lock_timeout_s
        if not self._tlock.acquire(timeout=self.lock_timeout_s):
            raise BackendUnavailable(f"embedded pool {self.path!r}: writer lock busy in this process for {self.lock_timeout_s}s")
        try:
            _flock_by(
                self._lock_fd,
                deadline,
                lambda: f"embedded pool {self.path!r}: another process held the index writer lock for more "
                f"than lock_timeout_s={self.lock_timeout_s}s (stopped or stuck?)",
            )
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            self._tlock.release()

    @contextmanager
    def _create_locked(self) -> Iterator[None]:
        """Held while opening: another opener may be building the pool, which takes time that
        grows with the arena, so the wait is lock_timeout_s plus a generous allowance for it."""
        wait_s = self.lock_timeout_s + self.capacity / _CREATE_BYTES_PER_S
        lock = os.path.join(self.path, "create.lock")
        _flock_by(
            self._create_fd,
            time.monotonic() + wait_s,
            lambda: f"embedded pool {self.path!r}: another process held {lock!r} for more than {wait_s:.1f}s "
            f"(lock_timeout_s={self.lock_timeout_s} plus time to create {self.capacity} bytes); it is "
            "stopped or stuck while creating or opening the pool",
        )
        try:
            yield
        finally:
            fcntl.flock(self._create_fd, fcntl.LOCK_UN)

    def _write(self, fn: Callable[[_Tx], T]) -> T:
        self._usable()
        with self._locked():
            return self._write_unlocked(fn)

    def _write_unlocked(self, fn: Callable[[_Tx], T]) -> T:
        for attempt in range(2):
            try:
                with self._env.begin(write=True) as txn:
                    t = _Tx(self, txn)
                    out = fn(t)
                    t.flush()
                return out
            except lmdb.MapFullError:
                if attempt:
                    raise PoolFull(
                        f"embedded pool {self.path!r}: index map of {self._map_size()} bytes is full "
                        "(too many tiny objects, or readers pinning old pages)"
                    ) from None
                self._env.reader_check()  # pages pinned by dead readers are the usual cause
            except ArenaCorrupt as e:
                raise BackendError(f"embedded pool {self.path!r}: index is inconsistent: {e}") from e
            except lmdb.Error as e:
                raise BackendError(f"embedded pool {self.path!r}: index error: {e}") from e
        raise AssertionError("unreachable")

    @contextmanager
    def _read(self) -> Iterator[Any]:
        self._usable()
        try:
            try:
                txn = self._env.begin(buffers=True)
            except lmdb.ReadersFullError:
                self._env.reader_check()
                txn = self._env.begin(buffers=True)
            with txn:
                yield txn
        except lmdb.Error as e:
            raise BackendError(f"embedded pool {self.path!r}: index error: {e}") from e

    # ----------------------------------------------------------------- reclaiming

    def _sweep(self, t: _Tx) -> None:
        """Reclaim reservations of dead owners; take keys away from timed-out live ones."""
        t.swept = True
        self._last_sweep = t.now
        for k, v in list(t.txn.cursor(db=self._resv)):
            r, bkey = _unpack_resv(v)
            self._judge(t, _BE.unpack(k)[0], r, bkey)

    def _judge(self, t: _Tx, oid: int, r: _Resv, bkey: bytes) -> bool:
        """Reclaim or orphan one reservation if its owner is gone or too slow; True if its key is free."""
        alive = owner_alive(r.owner, self._me)
        timed_out = t.now - r.t0 > self.reservation_timeout_s
        if alive is False or (alive is None and timed_out):
            if not r.orphan:
                self._drop_key_if(t, bkey, oid)
            t.drop_resv(oid, r)
            t.c[_C["reclaimed_reservations"]] += 1
            return True
        if timed_out:
            if not r.orphan:
                self._drop_key_if(t, bkey, oid)
                t.put_resv(oid, r._replace(orphan=1), bkey)
                t.c[_C["orphaned_reservations"]] += 1
            return True
        return False

    def _drop_key_if(self, t: _Tx, bkey: bytes, oid: int) -> None:
        o = t.get_obj(bkey)
        if o is not None and o[OID] == oid and o[ST] == RESERVED:
            t.txn.delete(bkey, db=self._obj)

    def _make_room(self, t: _Tx, size: int) -> int | None:
        """Free space for ``size`` bytes: reclaim dead reservations, then evict (CLOCK over the LRU
        order) committed objects without a live lease. One cursor serves a whole batch."""
        if not t.swept:
            self._sweep(t)
            off = t.alloc(size)
            if off is not None:
                return off
        if t.lru_cur is None:
            t.lru_cur = t.txn.cursor(db=self._lru)
            if not t.lru_cur.first():
                return None
        cur = t.lru_cur
        # Terminates: each entry is evicted, skipped (leased) or re-queued at most once (its
        # reference flag is cleared, and nobody can set it while we hold the writer lock).
        while True:
            k = cur.key()
            if not k:  # past the last entry
                return None
            stamp = _BE.unpack(k)[0]
            bkey = cur.value()
            o = t.get_obj(bkey)
            if o is None or o[STAMP] != stamp or o[ST] != COMMITTED:
                cur.delete()  # stale entry (a bug if ever): drop it, go on
                continue
            lease = self._leases.state(o[OFF] // PAGE, o[OID], t.now)
            if lease == LEASED:
                if not cur.next():
                    return None
                continue
            if lease != FREE:
                # Read since it was queued: second chance at the tail (CLOCK).
                cur.delete()
                o[STAMP] = t.next_id()
                t.txn.put(_BE.pack(o[STAMP]), bkey, db=self._lru)
                t.put_obj(bkey, o)
                if not cur.key():  # it was the last entry: the cursor fell off; resume at its new place
                    cur.set_key(_BE.pack(o[STAMP]))
                continue
            cur.delete()
            t.txn.delete(bkey, db=self._obj)
            t.c[_C["objects"]] -= 1
            t.c[_C["bytes"]] -= o[NBYTES]
            t.c[_C["committed_alloc_bytes"]] -= o[ALLOC]
            t.c[_C["evictions"]] += 1
            t.c[_C["evicted_bytes"]] += o[NBYTES]
            if o[ALLOC] >= size:
                # Usual case (one object size per pool): hand the extent over, free only the rest.
                if o[ALLOC] > size:
                    t.free(o[OFF] + size, o[ALLOC] - size)
                return o[OFF]
            t.free(o[OFF], o[ALLOC])
            off = t.alloc(size)
            if off is not None:
                return off

    # ----------------------------------------------------------------- the protocol

    def _bkeys(self, keys: Sequence[str]) -> list[bytes]:
        out = []
        for k in keys:
            if not isinstance(k, str) or not k:
                raise ValueError(f"embedded pool: keys must be non-empty str, got {k!r}")
            b = k.encode()
            if len(b) > _MAX_KEY_BYTES:
                raise ValueError(f"embedded pool: key of {len(b)} bytes is longer than {_MAX_KEY_BYTES}: {k[:60]!r}...")
            out.append(b)
        return out

    def lookup(self, keys: Sequence[str]) -> int:
        bkeys = self._bkeys(keys)
        n = 0
        with self._read() as txn:
            for bk in bkeys:
                v = txn.get(bk, db=self._obj)
                if v is None or v[ST] != COMMITTED:
                    break
                n += 1
        return n

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[EmbeddedHandle | None]:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"embedded pool: reserve nbytes={nbytes!r} must be an int > 0")
        bkeys = self._bkeys(keys)
        alloc = -(-nbytes // PAGE) * PAGE

        def fn(t: _Tx) -> list[EmbeddedHandle | None]:
            out: list[EmbeddedHandle | None] = [None] * len(bkeys)
            if t.now - self._last_sweep > _SWEEP_INTERVAL_S:
                self._sweep(t)
            eligible: list[int] = []
            seen: set[bytes] = set()
            for i, bk in enumerate(bkeys):
                o = None if bk in seen else t.get_obj(bk)
                if bk in seen or (o is not None and not self._key_free(t, bk, o)):
                    t.c[_C["reserve_rejected_exists"]] += 1
                    continue
                seen.add(bk)
                eligible.append(i)
            if alloc > self.capacity:
                t.c[_C["reserve_rejected_full"]] += len(eligible)
                return out
            # One extent for the whole batch when there is one: one free-list update, not n.
            base = t.alloc(alloc * len(eligible)) if len(eligible) > 1 else None
            for j, i in enumerate(eligible):
                if base is not None:
                    off = base + j * alloc
                else:
                    off = t.alloc(alloc)
                    if off is None:
                        off = self._make_room(t, alloc)
                    if off is None:
                        t.c[_C["reserve_rejected_full"]] += len(eligible) - j
                        break
                oid = t.next_id()
                t.put_obj(bkeys[i], [RESERVED, oid, off, alloc, nbytes, 0])
                t.put_resv(oid, _Resv(self._me, t.now, off, alloc, 0), bkeys[i])
                t.c[_C["reserved_objects"]] += 1
                t.c[_C["reserved_bytes"]] += alloc
                out[i] = EmbeddedHandle(keys[i], bkeys[i], nbytes, off, alloc, oid, True)
            return out

        return self._write(fn)

    def _key_free(self, t: _Tx, bkey: bytes, o: list) -> bool:
        """An existing record blocks a new reservation unless it is a dead writer's."""
        if o[ST] == COMMITTED:
            return False
        found = t.get_resv(o[OID])
        if found is None:  # record without reservation: a bug; drop it rather than pin the key
            t.txn.delete(bkey, db=self._obj)
            return True
        return self._judge(t, o[OID], *found)

    def _own(self, h: Any, what: str) -> EmbeddedHandle:
        if not isinstance(h, EmbeddedHandle):
            raise TypeError(f"embedded pool: {what} needs handles from this backend, got {type(h).__name__}")
        return h

    # write/read are the per-layer hot path (one call per layer for a whole batch): the loops are
    # kept tight -- per-item Python overhead is comparable to a 16 KiB memcpy.

    def write(self, handles: Sequence[EmbeddedHandle], offsets: Sequence[int], srcs: Sequence[Buffer]) -> None:
        self._usable()
        if not (len(handles) == len(offsets) == len(srcs)):
            raise ValueError(f"embedded pool: write got {len(handles)} handles, {len(offsets)} offsets, {len(srcs)} srcs")
        mv, npa, big = self._mv, self._np, _NP_COPY_MIN
        for h, off, src in zip(handles, offsets, srcs):
            if type(h) is not EmbeddedHandle or not h._writable:
                raise BackendError(f"embedded pool: write to {h!r}, which is not a reserved handle")
            m = src if type(src) is memoryview else memoryview(src)
            if m.ndim != 1 or m.format != "B":
                m = _bytes_view(m, writable=False, what=f"write {h.key!r}")
            n = m.nbytes
            if off < 0 or off + n > h.nbytes:
                raise ValueError(f"embedded pool: write of {n} bytes at offset {off} is outside object {h.key!r} of {h.nbytes} bytes")
            a = h._off + off
            if n < big:
                mv[a : a + n] = m
            else:
                npa[a : a + n] = np.frombuffer(m, dtype=np.uint8)

    def read(self, handles: Sequence[EmbeddedHandle], offsets: Sequence[int], dsts: Sequence[Buffer]) -> None:
        self._usable()
        if not (len(handles) == len(offsets) == len(dsts)):
            raise ValueError(f"embedded pool: read got {len(handles)} handles, {len(offsets)} offsets, {len(dsts)} dsts")
        mv, npa, big = self._mv, self._np, _NP_COPY_MIN
        for h, off, dst in zip(handles, offsets, dsts):
            if type(h) is not EmbeddedHandle:
                raise TypeError(f"embedded pool: read needs handles from this backend, got {type(h).__name__}")
            m = dst if type(dst) is memoryview else memoryview(dst)
            if m.ndim != 1 or m.format != "B" or m.readonly:
                m = _bytes_view(m, writable=True, what=f"read {h.key!r}")
            n = m.nbytes
            if off < 0 or off + n > h.nbytes:
                raise ValueError(f"embedded pool: read of {n} bytes at offset {off} is outside object {h.key!r} of {h.nbytes} bytes")
            a = h._off + off
            if n < big:
                m[:] = mv[a : a + n]
            else:
                np.frombuffer(m, dtype=np.uint8)[:] = npa[a : a + n]

    def view(self, handle: EmbeddedHandle, offset: int, nbytes: int) -> memoryview:
        self._usable()
        h = self._own(handle, "view")
        if offset < 0 or nbytes < 0 or offset + nbytes > h.nbytes:
            raise ValueError(f"embedded pool: view of {nbytes} bytes at offset {offset} is outside object {h.key!r} of {h.nbytes} bytes")
        a = h._off + offset
        v = self._mv[a : a + nbytes]
        return v if h._writable else v.toreadonly()

    def commit(self, handles: Sequence[EmbeddedHandle]) -> None:
        hs = [self._own(h, "commit") for h in handles]

        def fn(t: _Tx) -> list[str]:
            lost = []
            for h in hs:
                o = t.get_obj(h._bkey)
                if o is not None and o[OID] == h._oid:
                    if o[ST] == COMMITTED:
                        continue  # committed twice: the first one counted
                    stamp = t.next_id()
                    o[ST], o[STAMP] = COMMITTED, stamp
                    t.put_obj(h._bkey, o)
                    t.txn.put(_BE.pack(stamp), h._bkey, db=self._lru)
                    t.txn.delete(_BE.pack(h._oid), db=self._resv)
                    t.c[_C["reserved_objects"]] -= 1
                    t.c[_C["reserved_bytes"]] -= o[ALLOC]
                    t.c[_C["objects"]] += 1
                    t.c[_C["bytes"]] += o[NBYTES]
                    t.c[_C["committed_alloc_bytes"]] += o[ALLOC]
                    t.c[_C["commits"]] += 1
                else:
                    # Aborted before, or our reservation timed out (its key went to others) and
                    # its extent was kept for us until now.
                    found = t.get_resv(h._oid) if h._writable else None
                    if found is not None:
                        t.drop_resv(h._oid, found[0])
                    lost.append(h.key)
            return lost

        lost = self._write(fn)
        for h in hs:
            h._writable = False
        if lost:
            raise ObjectMissing(
                f"embedded pool: {len(lost)} object(s) not published: aborted, or the reservation expired "
                f"before commit (reservation_timeout_s={self.reservation_timeout_s}): {lost[:3]}"
            )

    def abort(self, handles: Sequence[EmbeddedHandle]) -> None:
        hs = [h for h in (self._own(h, "abort") for h in handles if h is not None) if h._writable]

        def fn(t: _Tx) -> None:
            for h in hs:
                found = t.get_resv(h._oid)
                if found is None:
                    continue  # committed already, or reclaimed
                r, _ = found
                if not r.orphan:
                    self._drop_key_if(t, h._bkey, h._oid)
                t.drop_resv(h._oid, r)
                t.c[_C["aborts"]] += 1

        if hs:
            self._write(fn)
        for h in hs:
            h._writable = False

    def open(self, keys: Sequence[str]) -> list[EmbeddedHandle | None]:
        bkeys = self._bkeys(keys)
        self._usable()
        out: list[EmbeddedHandle | None] = []
        # Under the writer lock, so no eviction can run between reading a record and leasing it;
        # the index itself is only read.
        with self._locked(), self._read() as txn:
            expiry = time.time() + self.lease_ttl_s
            get, unpack, db, take = txn.get, _OBJ.unpack, self._obj, self._leases.take
            for k, bk in zip(keys, bkeys):
                v = get(bk, db=db)
                if v is None or v[0] != COMMITTED:
                    out.append(None)
                    continue
                _, oid, off, alloc, nbytes, _ = unpack(v)
                take(off // PAGE, oid, expiry)
                out.append(EmbeddedHandle(k, bk, nbytes, off, alloc, oid, False))
        hits = sum(h is not None for h in out)
        self._local["open_hits"] += hits
        self._local["open_misses"] += len(out) - hits
        return out

    def release(self, handles: Sequence[EmbeddedHandle]) -> None:
        hs = [h for h in handles if isinstance(h, EmbeddedHandle) and h._leased]
        if not hs:
            return
        self._usable()
        with self._locked():
            drop = self._leases.drop
            for h in hs:
                drop(h._off // PAGE, h._oid)
                h._leased = False

    def stats(self) -> dict[str, int]:
        with self._read() as txn:
            c = _COUNTERS.unpack(txn.get(b"counters", db=self._meta))
        out = {name: int(v) for name, v in zip(COUNTERS, c) if name != "next_id"}
        out["capacity_bytes"] = self.capacity
        out.update(self._local)  # this process's own counters
        return out

    def verify(self) -> dict[str, int]:
        """Walk the whole index and check that objects, reservations and free extents tile the arena
        exactly and that the counters agree; raises ``BackendError`` on any contradiction."""
        extents: list[tuple[int, int, str]] = []
        n_obj = n_bytes = n_resv = 0
        with self._read() as txn:
            for k, v in txn.cursor(db=self._obj):
                o = _OBJ.unpack(v)
                if o[ST] == COMMITTED:
                    extents.append((o[OFF], o[ALLOC], f"object {bytes(k)!r}"))
                    n_obj += 1
                    n_bytes += o[NBYTES]
                    if bytes(txn.get(_BE.pack(o[STAMP]), db=self._lru) or b"") != bytes(k):
                        raise BackendError(f"embedded pool: object {bytes(k)!r} is missing from the LRU order")
            for k, v in txn.cursor(db=self._resv):
                r, _ = _unpack_resv(v)
                extents.append((r.off, r.alloc, f"reservation {_BE.unpack(k)[0]}"))
                n_resv += 1
            extents += [(o, s, "free") for o, s in self._alloc.extents(txn)]
            c = dict(zip(COUNTERS, _COUNTERS.unpack(txn.get(b"counters", db=self._meta))))
            n_lru = txn.stat(self._lru)["entries"]
        pos = 0
        for off, size, what in sorted(extents):
            if off != pos:
                raise BackendError(f"embedded pool: arena {'gap' if off > pos else 'overlap'} at {pos} before {what} at {off}")
            pos = off + size
        if pos != self.capacity:
            raise BackendError(f"embedded pool: extents end at {pos}, capacity is {self.capacity}")
        got = {"objects": n_obj, "bytes": n_bytes, "reserved_objects": n_resv}
        for name, v in got.items():
            if c[name] != v:
                raise BackendError(f"embedded pool: counter {name}={c[name]} but the index holds {v}")
        if n_lru != n_obj:
            raise BackendError(f"embedded pool: {n_lru} LRU entries for {n_obj} objects")
        return got

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            self._teardown()

    def _teardown(self) -> None:
        self._np = None
        if self._leases is not None:
            self._leases.close()
            self._leases = None
        if self._mv is not None:
            self._mv.release()
            self._mv = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a view(): the mapping goes when that view does
            self._mm = None
        if self._env is not None:
            _release_env(self._env)
            self._env = None
        for name in ("_lock_fd", "_attach_fd", "_create_fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                os.close(fd)  # also drops our flocks
                setattr(self, name, None)

    def __enter__(self) -> "EmbeddedBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmbeddedBackend({self.path!r}, capacity_bytes={self.capacity})"


# py-lmdb refuses to open one environment twice in a process, yet a process may hold several
# backends on one pool (vLLM without multiprocessing runs scheduler and worker in one process):
# they share the environment. Our flock files are per backend, so they still take turns to write.
_ENV_LOCK = threading.Lock()
_ENVS: dict[tuple[int, str], list[Any]] = {}  # (pid, real path) -> [environment, users]


def _acquire_env(idx: str, **kwargs: Any) -> Any:
    key = (os.getpid(), os.path.realpath(idx))
    with _ENV_LOCK:
        entry = _ENVS.get(key)
        if entry is None:
            try:
                env = lmdb.open(idx, subdir=False, **kwargs)
            except lmdb.Error as e:
                if "already open" in str(e):  # opened by the process we were forked from
                    raise BackendError(
                        f"embedded pool: {idx!r} was open in the parent of this forked process and py-lmdb "
                        "cannot reopen it here; start workers with spawn, or open the pool only after fork"
                    ) from e
                raise
            entry = _ENVS[key] = [env, 0]
        entry[1] += 1
        return entry[0]


def _release_env(env: Any) -> None:
    with _ENV_LOCK:
        for key, entry in list(_ENVS.items()):
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] == 0:
                    del _ENVS[key]
                    env.close()
                return


def _flock_by(fd: int, deadline: float, message: Callable[[], str]) -> None:
    """Take an exclusive flock, polling until ``deadline`` (flock itself has no timeout)."""
    delay = 20e-6
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise BackendUnavailable(message()) from None
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:
        return b"unknown"
