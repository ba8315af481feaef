"""The pool's files, opened and mapped: ``PoolFiles`` creates, checks and attaches to them.

State (one attachment; ``close`` lets go of all of it, ``attach`` builds it again, as after the
directory was replaced): ``attach.lock``'s descriptor (held shared while attached), the
directory's identity (device, inode), the LMDB environment and its tables (``obj``, ``lru``,
``resv``, ``meta``, the arena's free extents ``alloc``), the arena's mapping (``mm``, and ``mv``
/ ``np`` over it) and the lease table. The writer lock is the caller's (``WriterLock``): it is
taken here only around the checks and the attach, never while the arena is pre-faulted.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lmdb
import numpy as np

from lw_core.backend import BackendError, PoolFull
from lw_core.backends.embedded import files
from lw_core.backends.embedded.arena_alloc import ArenaCorrupt, ExtentAllocator
from lw_core.backends.embedded.env import acquire_env, boot_id, release_env
from lw_core.backends.embedded.leases import LeaseTable, table_bytes
from lw_core.backends.embedded.records import CAP_REC, CIDX, COUNTERS, COUNTERS_REC, FORMAT, PAGE, StateClock, T, log
from lw_core.backends.embedded.txn import Tx
from lw_core.backends.embedded.writer_lock import WriterLock
from lw_core.procs import Owner


class PoolFiles:
    """The pool directory ``path``'s files for one backend: index, arena mapping, lease table."""

    def __init__(self, path: str, capacity: int, *, populate: bool, create: bool = True) -> None:
        self.path = path
        self.capacity = capacity
        self.populate = populate  # pre-fault the arena mapping at attach
        self.create = create  # False: attach to an existing, matching pool only (never build one)
        self.ident: tuple[int, int] | None = None
        self.env: Any = None
        self.obj: Any = None
        self.lru: Any = None
        self.resv: Any = None
        self.meta: Any = None
        self._alloc: ExtentAllocator | None = None
        self.mm: mmap.mmap | None = None
        self.mv: memoryview | None = None
        self.np: np.ndarray | None = None
        self._leases: LeaseTable | None = None
        self._attach_fd: int | None = None
        self.epoch = 0  # which attachment of the pool (the backend counts re-attaches): handles carry it
        self.handle_states = StateClock()  # ticks when a handle of this pool changes state (records.py)

    @property
    def leases(self) -> LeaseTable:
        """The lease table (while attached)."""
        lt = self._leases
        if lt is None:
            raise BackendError(f"embedded pool {self.path!r}: not attached (closed, or re-attaching)")
        return lt

    @property
    def alloc(self) -> ExtentAllocator:
        """The arena's free extents (while the index is open)."""
        a = self._alloc
        if a is None:
            raise BackendError(f"embedded pool {self.path!r}: its index is not open")
        return a

    def replaced(self) -> bool:
        """Whether the directory at ``path`` is no longer the one attached (deleted or replaced)."""
        return files.identity(self.path) != self.ident

    def attach(self, lock: WriterLock, me: Owner, on_attached: Callable[[], None]) -> None:
        """Create the pool if needed, attach (a lease row for ``me``) and map the arena.
        ``on_attached`` runs under the writer lock once attached (the backend sweeps there)."""
        self._attach_fd = None
        if not self.create and not os.path.isdir(self.path):
            raise BackendError(f"embedded pool: there is no pool at {self.path!r} (no such directory)")
        files.prepare_dir(self.path)
        lock.open_files()
        self._attach_fd = files.open_file(os.path.join(self.path, "attach.lock"), os.O_RDWR | os.O_CREAT)
        self.ident = files.identity(self.path)
        arena_fd = None
        try:
            # Openers take turns on create.lock, so only one of them can build the pool; the slow
            # part of building (allocating the arena) and mapping it run without the writer lock,
            # whose short lock_timeout_s would otherwise fail everyone who opens at the same time.
            with lock.create_locked():
                with lock.locked():
                    try:
                        fcntl.flock(self._attach_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        alone = True
                    except BlockingIOError:
                        alone = False
                    reason = self._check_existing(alone)
                if reason and not self.create:
                    raise BackendError(
                        f"embedded pool at {self.path!r}: not attaching, and not building one: "
                        + ("there is no pool there" if reason == "new" else f"{reason}; give the engines' "
                           "embedded_capacity_bytes")
                    )
                if reason:
                    # Nobody is attached (alone, or the files are gone) and other openers wait on
                    # create.lock; the index gets its format mark last, so a creator killed here
                    # leaves a pool the next opener rebuilds.
                    if reason != "new":
                        log.warning("embedded pool %r: rebuilding it: %s", self.path, reason)
                    self._create(*self._files())
                with lock.locked():
                    arena_fd = self._attach_files()
                    self.leases.claim(me)
                    # Every attacher holds this shared until it closes or dies; taken under the
                    # create lock, so the EX->SH conversion cannot race another attacher's check.
                    fcntl.flock(self._attach_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    on_attached()
            # Pre-faulting the mapping takes ~1 s per few GiB: done holding no lock. The shared
            # attach lock keeps anyone from rebuilding the arena meanwhile.
            self._map_arena(arena_fd, self.populate)
        except BaseException:
            self.close()
            lock.close_files()
            raise
        finally:
            if arena_fd is not None:
                os.close(arena_fd)

    def close(self, keep_mappings: bool = False) -> None:
        """Let go of the pool. ``keep_mappings``: other threads may still copy through the old
        arena mapping, so it is only dropped (it goes when its last user does)."""
        self.np = None
        if self._leases is not None:
            self._leases.close(keep_mappings)
            self._leases = None
        if self.mv is not None and not keep_mappings:
            self.mv.release()
        self.mv = None
        if self.mm is not None and not keep_mappings:
            try:
                self.mm.close()
            except BufferError:
                pass  # a caller still holds a view(): the mapping goes when that view does
        self.mm = None
        if self.env is not None:
            release_env(self.env)
            self.env = None
        if self._attach_fd is not None:
            os.close(self._attach_fd)  # also drops our shared attach lock
            self._attach_fd = None

    # ----------------------------------------------------------------- setup

    def _files(self) -> tuple[str, str, str]:
        return tuple(os.path.join(self.path, f) for f in ("index.lmdb", "arena", "leases"))  # type: ignore[return-value]

    def map_size(self) -> int:
        # Worst case one object per page; ~1 KiB of index per object covers records, LRU and free
        # lists at half-full B-tree pages. Virtual only: tmpfs allocates touched pages.
        return max(64 << 20, self.capacity // PAGE * 1024)

    def _open_env(self, idx: str) -> None:
        # Both LMDB files are made here (0600, not through a symlink, ours) before LMDB opens them.
        # No writemap: LMDB then writes the index with pwrite, so a full filesystem is an error
        # (BackendError), never a SIGBUS on a sparse page; only the lock file is written through a
        # mapping, and its space is allocated below.
        ident = files.touch(idx)
        files.touch(idx + "-lock")
        self.env = acquire_env(
            idx,
            ident,
            map_size=self.map_size(),
            max_dbs=8,
            max_readers=1024,
            writemap=False,
            mode=0o600,
            sync=False,
            metasync=False,
            readahead=False,
            meminit=False,
            lock=True,
        )
        self.obj = self.env.open_db(b"obj")
        self.lru = self.env.open_db(b"lru")
        self.resv = self.env.open_db(b"resv")
        self.meta = self.env.open_db(b"meta")
        self._alloc = ExtentAllocator(self.env.open_db(b"free_off"), self.env.open_db(b"free_size"))
        fd = files.open_file(idx + "-lock", os.O_RDWR)
        try:
            files.reserve_space(fd, os.fstat(fd).st_size, idx + "-lock")
        finally:
            os.close(fd)

    def _mismatch(self) -> str | None:
        """Why the existing pool does not fit this process's settings, or None when it does."""
        with self.env.begin(db=self.meta) as txn:
            fmt, cap, boot = txn.get(b"format"), txn.get(b"capacity"), txn.get(b"boot_id")
        if fmt != FORMAT:
            return f"format {fmt!r} (expected {FORMAT!r})"
        if CAP_REC.unpack(cap) != (self.capacity, PAGE):
            rec = CAP_REC.unpack(cap)
            return f"capacity_bytes={rec[0]} page={rec[1]} (this process asks capacity_bytes={self.capacity} page={PAGE})"
        if boot != boot_id():
            return "it was created before the last reboot"
        _, arena, leases = self._files()
        for p, want in ((arena, self.capacity), (leases, table_bytes(self.capacity // PAGE))):
            have = os.stat(p, follow_symlinks=False).st_size
            if have != want:
                return f"{p!r} has {have} bytes, expected {want} (truncated or damaged)"
        return None

    def _check_existing(self, alone: bool) -> str | None:
        """Open the existing pool's index; why it must be (re)built, or None when it can be used."""
        idx, arena, leases = self._files()
        if not all(map(os.path.exists, (idx, arena, leases))):
            return "new"
        try:
            self._open_env(idx)
            reason = self._mismatch()
        except (lmdb.Error, struct.error, TypeError, OSError) as e:
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
        fd = files.open_file(arena, os.O_RDWR)
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
        self.mm = mmap.mmap(fd, self.capacity, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.mv = memoryview(self.mm)
        self.np = np.frombuffer(self.mm, dtype=np.uint8)

    def _create(self, idx: str, arena: str, leases: str) -> None:
        if self.env is not None:
            release_env(self.env)
            self.env = None
        for p in (idx, idx + "-lock", arena, leases):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        index_bytes = max(1 << 20, self.capacity // 64)
        files.check_free_space(self.path, self.capacity + table_bytes(self.capacity // PAGE) + index_bytes)
        fd = files.open_file(arena, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            # Allocate every tmpfs page now: first-touch faults copy at a fraction of memcpy speed,
            # and a sparse page written after the filesystem fills would be a SIGBUS.
            files.reserve_space(fd, self.capacity, arena)
        except BaseException:
            os.close(fd)
            os.unlink(arena)
            raise
        os.close(fd)
        LeaseTable.create(leases, self.capacity // PAGE)
        # Room for the index's first pages (~1 KiB per 64 KiB object), so a full filesystem does
        # not stop the pool at once; past it, LMDB's ENOSPC is a BackendError.
        self._open_env(idx)  # LMDB writes its meta pages first: it refuses a file of zeros
        assert self.env is not None
        fd = files.open_file(idx, os.O_RDWR)
        try:
            files.reserve_space(fd, index_bytes, idx)
        finally:
            os.close(fd)
        with self.env.begin(write=True) as txn:
            c = [0] * len(COUNTERS)
            c[CIDX["free_bytes"]] = self.capacity
            txn.put(b"counters", COUNTERS_REC.pack(*c), db=self.meta)
            txn.put(b"capacity", CAP_REC.pack(self.capacity, PAGE), db=self.meta)
            txn.put(b"boot_id", boot_id(), db=self.meta)
            self.alloc.init(txn, self.capacity)
            txn.put(b"format", FORMAT, db=self.meta)  # last: a half-made pool has no format

    # ----------------------------------------------------------------- transactions

    def write(self, fn: Callable[[Tx], T]) -> T:
        """Run ``fn`` in one write transaction (the caller holds the writer lock); LMDB errors
        become ``BackendError`` (``PoolFull`` when the index map stays full)."""
        for attempt in range(2):
            t = None
            try:
                try:
                    with self.env.begin(write=True) as txn:
                        t = Tx(self, txn)
                        out = fn(t)
                        t.flush()
                    return out
                except BaseException:
                    if t is not None:  # the evictions did not happen: their objects stay readable
                        for page, oid in t.tombs:
                            self.leases.set_gen(page, oid)
                    raise
            except lmdb.MapFullError:
                if attempt:
                    raise PoolFull(
                        f"embedded pool {self.path!r}: index map of {self.map_size()} bytes is full "
                        "(too many tiny objects, or readers pinning old pages)"
                    ) from None
                self.env.reader_check()  # pages pinned by dead readers are the usual cause
            except ArenaCorrupt as e:
                raise BackendError(f"embedded pool {self.path!r}: index is inconsistent: {e}") from e
            except lmdb.Error as e:
                raise BackendError(f"embedded pool {self.path!r}: index error: {e}{files.full_hint(self.path)}") from e
        raise AssertionError("unreachable")

    @contextmanager
    def read(self) -> Iterator[Any]:
        """One read transaction (no lock; ``buffers=True``: values are views valid inside it)."""
        try:
            try:
                txn = self.env.begin(buffers=True)
            except lmdb.ReadersFullError:
                self.env.reader_check()
                txn = self.env.begin(buffers=True)
            with txn:
                yield txn
        except lmdb.Error as e:
            raise BackendError(f"embedded pool {self.path!r}: index error: {e}") from e
