"""``ObjectWriter``: the writing half of the ``Backend`` protocol on the embedded pool (reserve,
write, commit, abort).

Every index change is one write transaction under the writer lock (``WriterLock``, then
``PoolFiles.write``); room is made by the ``Sweeper``. It holds no state of its own: the bytes go
straight into the arena mapping, and the handles carry the reservation."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from lw_core.backend import BackendError, Buffer, ObjectMissing
from lw_core.backends.embedded import fences
from lw_core.backends.embedded.pool_files import PoolFiles
from lw_core.backends.embedded.records import (
    ALLOC,
    BE_U64,
    CIDX,
    COMMITTED,
    NBYTES,
    NP_COPY_MIN,
    OBJ_REC,
    OFF,
    OID,
    PAGE,
    RESERVED,
    ST,
    STAMP,
    EmbeddedHandle,
    T,
    bytes_view,
    encode_keys,
    own_handle,
)
from lw_core.backends.embedded.sweep import Sweeper
from lw_core.backends.embedded.txn import Tx, resv_value
from lw_core.backends.embedded.writer_lock import WriterLock
from lw_core.procs import Owner


class ObjectWriter:
    """Writes to the pool ``pool`` under ``lock``, owned by ``me``; ``usable`` and ``check_pool`` are
    the backend's checks (closed or forked; the directory replaced)."""

    def __init__(
        self,
        pool: PoolFiles,
        lock: WriterLock,
        sweeper: Sweeper,
        me: Owner,
        *,
        reservation_timeout_s: float,
        usable: Callable[[], None],
        check_pool: Callable[[], None],
    ) -> None:
        self.pool = pool
        self.lock = lock
        self.sweeper = sweeper
        self.me = me
        self.reservation_timeout_s = reservation_timeout_s
        self.usable = usable
        self.check_pool = check_pool

    def _write(self, fn: Callable[[Tx], T]) -> T:
        self.usable()
        with self.lock.locked():
            return self.pool.write(fn)

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[EmbeddedHandle | None]:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"embedded pool: reserve nbytes={nbytes!r} must be an int > 0")
        bkeys = encode_keys(keys)
        alloc = -(-nbytes // PAGE) * PAGE
        self.usable()
        self.check_pool()
        epoch = self.pool.epoch

        def fn(t: Tx) -> list[EmbeddedHandle | None]:
            out: list[EmbeddedHandle | None] = [None] * len(bkeys)
            if self.sweeper.due(t):
                self.sweeper.sweep(t)
            eligible: list[int] = []
            seen: set[bytes] = set()
            for i, bk in enumerate(bkeys):
                o = None if bk in seen else t.get_obj(bk)
                if bk in seen or (o is not None and not self.sweeper.key_free(t, bk, o)):
                    t.c[CIDX["reserve_rejected_exists"]] += 1
                    continue
                seen.add(bk)
                eligible.append(i)
            if alloc > self.pool.capacity:
                t.c[CIDX["reserve_rejected_full"]] += len(eligible)
                return out
            # One extent for the whole batch when there is one: one free-list update, not n.
            base = t.alloc(alloc * len(eligible)) if len(eligible) > 1 else None
            off: int | None
            put, obj_db, resv_db = t.txn.put, self.pool.obj, self.pool.resv
            pack, u64, owner, made = OBJ_REC.pack, BE_U64.pack, self.me.pack(), 0
            for j, i in enumerate(eligible):
                if base is not None:
                    off = base + j * alloc
                else:
                    off = t.alloc(alloc)
                    if off is None:
                        off = self.sweeper.make_room(t, alloc)
                    if off is None:
                        t.c[CIDX["reserve_rejected_full"]] += len(eligible) - j
                        break
                oid = t.next_id()
                put(bkeys[i], pack(RESERVED, oid, off, alloc, nbytes, 0), db=obj_db)
                put(u64(oid), resv_value(owner, t.now, off, alloc, 0, bkeys[i]), db=resv_db)
                made += 1
                out[i] = EmbeddedHandle(keys[i], bkeys[i], nbytes, off, alloc, oid, True, epoch)
            t.c[CIDX["reserved_objects"]] += made
            t.c[CIDX["reserved_bytes"]] += alloc * made
            return out

        return self._write(fn)

    def write(self, handles: Sequence[EmbeddedHandle], offsets: Sequence[int], srcs: Sequence[Buffer]) -> None:
        self.usable()
        if not (len(handles) == len(offsets) == len(srcs)):
            raise ValueError(f"embedded pool: write got {len(handles)} handles, {len(offsets)} offsets, {len(srcs)} srcs")
        mv, npa, big, ep = self.pool.mv, self.pool.np, NP_COPY_MIN, self.pool.epoch
        assert mv is not None and npa is not None, "the pool is attached (checked by usable)"
        for h, off, src in zip(handles, offsets, srcs):
            if type(h) is not EmbeddedHandle or not h._writable:
                raise BackendError(f"embedded pool: write to {h!r}, which is not a reserved handle")
            if h._epoch != ep:
                raise ObjectMissing(f"embedded pool {self.pool.path!r}: {h.key!r} was reserved in a pool directory that was deleted since")
            m = src if type(src) is memoryview else memoryview(src)
            if m.ndim != 1 or m.format != "B":
                m = bytes_view(m, writable=False, what=f"write {h.key!r}")
            n = m.nbytes
            if off < 0 or off + n > h.nbytes:
                raise ValueError(f"embedded pool: write of {n} bytes at offset {off} is outside object {h.key!r} of {h.nbytes} bytes")
            a = h._off + off
            if n < big:
                mv[a : a + n] = m
            else:
                npa[a : a + n] = np.frombuffer(m, dtype=np.uint8)

    def commit(self, handles: Sequence[EmbeddedHandle]) -> None:
        hs = [own_handle(h, "commit") for h in handles]
        ep = self.pool.epoch
        fences.fence()  # the writer's copies into the arena come before the records and generations

        def fn(t: Tx) -> list[str]:
            lost = []
            # Per object: its record, its LRU entry, its reservation gone; the counters once at the
            # end (this loop is what a save pays per object in Python).
            get, put, delete = t.txn.get, t.txn.put, t.txn.delete
            obj_db, lru_db, resv_db, set_gen = self.pool.obj, self.pool.lru, self.pool.resv, self.pool.leases.set_gen
            unpack, pack, u64 = OBJ_REC.unpack, OBJ_REC.pack, BE_U64.pack
            n = nbytes = alloc = 0
            for h in hs:
                if h._epoch != ep:  # reserved in a pool directory deleted since: its ids mean nothing here
                    lost.append(h.key)
                    continue
                v = get(h._bkey, db=obj_db)
                o = None if v is None else list(unpack(v))
                if o is not None and o[OID] == h._oid:
                    if o[ST] == COMMITTED:
                        continue  # committed twice: the first one counted
                    stamp = t.next_id()
                    o[ST], o[STAMP] = COMMITTED, stamp
                    put(h._bkey, pack(*o), db=obj_db)
                    set_gen(o[OFF] // PAGE, o[OID])  # readers check it after each copy
                    put(u64(stamp), h._bkey, db=lru_db)
                    delete(u64(h._oid), db=resv_db)
                    n += 1
                    nbytes += o[NBYTES]
                    alloc += o[ALLOC]
                else:
                    # Aborted before, or our reservation timed out (its key went to others) and
                    # its extent was kept for us until now.
                    found = t.get_resv(h._oid) if h._writable else None
                    if found is not None:
                        t.drop_resv(h._oid, found[0])
                    lost.append(h.key)
            c = t.c
            c[CIDX["reserved_objects"]] -= n
            c[CIDX["reserved_bytes"]] -= alloc
            c[CIDX["objects"]] += n
            c[CIDX["bytes"]] += nbytes
            c[CIDX["committed_alloc_bytes"]] += alloc
            c[CIDX["commits"]] += n
            return lost

        lost = self._write(fn)
        for h in hs:
            h._writable = False
        self.pool.handle_states.tick()
        if lost:
            raise ObjectMissing(
                f"embedded pool: {len(lost)} object(s) not published: aborted, or the reservation expired "
                f"before commit (reservation_timeout_s={self.reservation_timeout_s}): {lost[:3]}"
            )

    def abort(self, handles: Sequence[EmbeddedHandle]) -> None:
        hs = [h for h in (own_handle(h, "abort") for h in handles if h is not None) if h._writable and h._epoch == self.pool.epoch]

        def fn(t: Tx) -> None:
            for h in hs:
                found = t.get_resv(h._oid)
                if found is None:
                    continue  # committed already, or reclaimed
                r, _ = found
                if not r.orphan:
                    self.sweeper.drop_key_if(t, h._bkey, h._oid)
                t.drop_resv(h._oid, r)
                t.c[CIDX["aborts"]] += 1

        if hs:
            self._write(fn)
        for h in hs:
            h._writable = False
        self.pool.handle_states.tick()
