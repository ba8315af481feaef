"""``Tx``: one LMDB write transaction of the pool plus its counter record, read once and written
once (run by ``PoolFiles.write``, under the writer lock: writer_lock.py)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from lw_core.backends.embedded.arena_alloc import ExtentAllocator
from lw_core.backends.embedded.records import (
    BE_U64,
    CIDX,
    COUNTERS_REC,
    OBJ_REC,
    RESV_TAIL,
    Resv,
    unpack_resv,
)


class TxPool(Protocol):
    """What a transaction uses of the pool's files (``PoolFiles``, which runs it): the LMDB
    databases it reads and writes, and the arena's extent allocator. A protocol, so this module
    does not import ``pool_files`` (which imports it)."""

    meta: Any
    obj: Any
    resv: Any

    @property
    def alloc(self) -> ExtentAllocator: ...


class Tx:
    """One write transaction plus the counter record, read once and written once."""

    def __init__(self, pool: TxPool, txn: Any) -> None:
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
        self.txn.put(BE_U64.pack(oid), resv_value(r.owner.pack(), r.t0, r.off, r.alloc, r.orphan, bkey), db=self.pool.resv)

    def drop_resv(self, oid: int, r: Resv) -> None:
        """Forget a reservation and free its extent."""
        self.txn.delete(BE_U64.pack(oid), db=self.pool.resv)
        self.free(r.off, r.alloc)
        self.c[CIDX["reserved_objects"]] -= 1
        self.c[CIDX["reserved_bytes"]] -= r.alloc


def resv_value(owner: bytes, t0: float, off: int, alloc: int, orphan: int, bkey: bytes) -> bytes:
    """A reservation's record (``unpack_resv`` reads it): its owner (packed), when it began, its
    extent, whether it is an orphan, then the object's key."""
    return owner + RESV_TAIL.pack(t0, off, alloc, orphan) + bkey
