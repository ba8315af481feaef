"""Write transactions: ``Tx`` (one LMDB write transaction plus the counter record) and the
read/write runners (the writer lock itself: writer_lock.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lmdb

from lw_core.backend import BackendError, PoolFull
from lw_core.backends.embedded.arena_alloc import ArenaCorrupt
from lw_core.backends.embedded import files
from lw_core.backends.embedded.records import (
    BE_U64,
    CIDX,
    COUNTERS_REC,
    OBJ_REC,
    RESV_TAIL,
    Resv,
    T,
    unpack_resv,
)

if TYPE_CHECKING:
    from lw_core.backends.embedded.pool_files import PoolFiles


class Tx:
    """One write transaction plus the counter record, read once and written once."""

    def __init__(self, pool: PoolFiles, txn: Any) -> None:
        self.pool = pool
        self.txn = txn
        self.now = time.time()
        raw = txn.get(b"counters", db=pool.meta)
        self.c = list(COUNTERS_REC.unpack(raw))
        self.swept = False
        self.lru_cur: Any = None
        self.rows: Any = None
        self.tombs: list[tuple[int, int]] = []  # (page, object id) of objects evicted here

    def flush(self) -> None:
        self.txn.put(b"counters", COUNTERS_REC.pack(*self.c), db=self.pool.meta)

    def next_id(self) -> int:
        self.c[0] += 1
        return self.c[0]

    def alloc(self, size: int) -> int | None:
        off = self.pool.alloc.alloc(self.txn, size)
        if off is not None:
            self.c[CIDX["free_bytes"]] -= size
        return off

    def free(self, off: int, size: int) -> None:
        self.pool.alloc.free(self.txn, off, size)
        self.c[CIDX["free_bytes"]] += size

    def get_obj(self, bkey: bytes) -> list | None:
        v = self.txn.get(bkey, db=self.pool.obj)
        return None if v is None else list(OBJ_REC.unpack(v))

    def put_obj(self, bkey: bytes, o: list) -> None:
        self.txn.put(bkey, OBJ_REC.pack(*o), db=self.pool.obj)

    def get_resv(self, oid: int) -> tuple[Resv, bytes] | None:
        v = self.txn.get(BE_U64.pack(oid), db=self.pool.resv)
        return None if v is None else unpack_resv(v)

    def put_resv(self, oid: int, r: Resv, bkey: bytes) -> None:
        self.txn.put(BE_U64.pack(oid), r.owner.pack() + RESV_TAIL.pack(r.t0, r.off, r.alloc, r.orphan) + bkey, db=self.pool.resv)

    def drop_resv(self, oid: int, r: Resv) -> None:
        """Forget a reservation and free its extent."""
        self.txn.delete(BE_U64.pack(oid), db=self.pool.resv)
        self.free(r.off, r.alloc)
        self.c[CIDX["reserved_objects"]] -= 1
        self.c[CIDX["reserved_bytes"]] -= r.alloc


class TxnMixin:
    """Locks and transactions of ``EmbeddedBackend``."""

    def _usable(self) -> None:
        if self._closed:
            raise BackendError(f"embedded pool {self.path!r}: backend is closed")
        if os.getpid() != self._pid:
            raise BackendError(
                f"embedded pool {self.path!r}: opened in pid {self._pid}, used in forked pid {os.getpid()}; "
                "open a new EmbeddedBackend in each process"
            )

    def _write(self, fn: Callable[[Tx], T]) -> T:
        self._usable()
        with self._lock.locked():
            return self._write_unlocked(fn)

    def _write_unlocked(self, fn: Callable[[Tx], T]) -> T:
        for attempt in range(2):
            t = None
            try:
                try:
                    with self._pool.env.begin(write=True) as txn:
                        t = Tx(self._pool, txn)
                        out = fn(t)
                        t.flush()
                    return out
                except BaseException:
                    if t is not None:  # the evictions did not happen: their objects stay readable
                        for page, oid in t.tombs:
                            self._pool.leases.set_gen(page, oid)
                    raise
            except lmdb.MapFullError:
                if attempt:
                    raise PoolFull(
                        f"embedded pool {self.path!r}: index map of {self._pool.map_size()} bytes is full "
                        "(too many tiny objects, or readers pinning old pages)"
                    ) from None
                self._pool.env.reader_check()  # pages pinned by dead readers are the usual cause
            except ArenaCorrupt as e:
                raise BackendError(f"embedded pool {self.path!r}: index is inconsistent: {e}") from e
            except lmdb.Error as e:
                raise BackendError(f"embedded pool {self.path!r}: index error: {e}{files.full_hint(self.path)}") from e
        raise AssertionError("unreachable")

    @contextmanager
    def _read(self) -> Iterator[Any]:
        self._usable()
        try:
            try:
                txn = self._pool.env.begin(buffers=True)
            except lmdb.ReadersFullError:
                self._pool.env.reader_check()
                txn = self._pool.env.begin(buffers=True)
            with txn:
                yield txn
        except lmdb.Error as e:
            raise BackendError(f"embedded pool {self.path!r}: index error: {e}") from e

    # ----------------------------------------------------------------- reclaiming
