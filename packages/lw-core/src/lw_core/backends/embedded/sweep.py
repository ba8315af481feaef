"""``Sweeper``: reclaiming dead writers' reservations and eviction (CLOCK over the LRU order).

Every method runs inside a write transaction (``Tx``, the writer lock held). State: when this
backend last swept (``last_sweep``, so ``reserve`` sweeps at most every ``SWEEP_INTERVAL_S``).
A reservation whose owner (``lw_core.procs``) is dead is reclaimed at once; a live owner's that
is older than ``reservation_timeout_s`` loses its key (orphaned) but keeps its extent until it
commits or aborts."""

from __future__ import annotations

from collections.abc import Callable

from lw_core.backends.embedded.leases import FREE, LEASED
from lw_core.backends.embedded.pool_files import PoolFiles
from lw_core.backends.embedded.records import (
    ALLOC,
    BE_U64,
    CIDX,
    COMMITTED,
    NBYTES,
    OFF,
    OID,
    PAGE,
    RESERVED,
    ST,
    STAMP,
    SWEEP_INTERVAL_S,
    Resv,
    unpack_resv,
)
from lw_core.backends.embedded.txn import Tx
from lw_core.procs import Owner, owner_alive


class Sweeper:
    """Reclaims reservations and makes room in the pool ``pool`` for the backend owned by ``me``."""

    def __init__(
        self,
        pool: PoolFiles,
        me: Owner,
        *,
        reservation_timeout_s: float,
        on_evict: Callable[[bytes, int, int], None] | None = None,
    ) -> None:
        self.pool = pool
        self.me = me
        self.reservation_timeout_s = reservation_timeout_s
        # Called with (key, arena offset, bytes) of each object evicted, while its bytes are still
        # in place (the disk tier copies them out: disk_tier.py); must not block on I/O.
        self.on_evict = on_evict
        self.last_sweep = 0.0

    def due(self, t: Tx) -> bool:
        """Whether ``reserve`` should sweep in this transaction (at most every SWEEP_INTERVAL_S)."""
        return t.now - self.last_sweep > SWEEP_INTERVAL_S

    def key_free(self, t: Tx, bkey: bytes, o: list) -> bool:
        """An existing record blocks a new reservation unless it is a dead writer's."""
        if o[ST] == COMMITTED:
            return False
        found = t.get_resv(o[OID])
        if found is None:  # record without reservation: a bug; drop it rather than pin the key
            t.txn.delete(bkey, db=self.pool.obj)
            return True
        return self.judge(t, o[OID], *found)

    def sweep(self, t: Tx) -> None:
        """Reclaim reservations of dead owners; take keys away from timed-out live ones."""
        t.swept = True
        self.last_sweep = t.now
        for k, v in list(t.txn.cursor(db=self.pool.resv)):
            r, bkey = unpack_resv(v)
            self.judge(t, BE_U64.unpack(k)[0], r, bkey)

    def judge(self, t: Tx, oid: int, r: Resv, bkey: bytes) -> bool:
        """Reclaim or orphan one reservation if its owner is gone or too slow; True if its key is free."""
        alive = owner_alive(r.owner, self.me)
        timed_out = t.now - r.t0 > self.reservation_timeout_s
        if alive is False or (alive is None and timed_out):
            if not r.orphan:
                self.drop_key_if(t, bkey, oid)
            t.drop_resv(oid, r)
            t.c[CIDX["reclaimed_reservations"]] += 1
            return True
        if timed_out:
            if not r.orphan:
                self.drop_key_if(t, bkey, oid)
                t.put_resv(oid, r._replace(orphan=1), bkey)
                t.c[CIDX["orphaned_reservations"]] += 1
            return True
        return False

    def drop_key_if(self, t: Tx, bkey: bytes, oid: int) -> None:
        o = t.get_obj(bkey)
        if o is not None and o[OID] == oid and o[ST] == RESERVED:
            t.txn.delete(bkey, db=self.pool.obj)

    def make_room(self, t: Tx, size: int) -> int | None:
        """Free space for ``size`` bytes: reclaim dead reservations, then evict (CLOCK over the LRU
        order) committed objects without a live lease. One cursor serves a whole batch."""
        if not t.swept:
            self.sweep(t)
            off = t.alloc(size)
            if off is not None:
                return off
        if t.lru_cur is None:
            t.lru_cur = t.txn.cursor(db=self.pool.lru)
            if not t.lru_cur.first():
                return None
        cur = t.lru_cur
        # Terminates: each entry is evicted, skipped (leased) or re-queued at most once (its
        # reference flag is cleared, and nobody can set it while we hold the writer lock).
        while True:
            k = cur.key()
            if not k:  # past the last entry
                return None
            stamp = BE_U64.unpack(k)[0]
            bkey = cur.value()
            o = t.get_obj(bkey)
            if o is None or o[STAMP] != stamp or o[ST] != COMMITTED:
                cur.delete()  # stale entry (a bug if ever): drop it, go on
                continue
            if t.rows is None:
                t.rows = self.pool.leases.live_rows(self.me)  # dead readers' leases do not count
            lease = self.pool.leases.evict(o[OFF] // PAGE, o[OID], t.now, t.rows)
            if lease == FREE:
                t.tombs.append((o[OFF] // PAGE, o[OID]))
            if lease == LEASED:
                if not cur.next():
                    return None
                continue
            if lease != FREE:
                # Read since it was queued: second chance at the tail (CLOCK).
                cur.delete()
                o[STAMP] = t.next_id()
                t.txn.put(BE_U64.pack(o[STAMP]), bkey, db=self.pool.lru)
                t.put_obj(bkey, o)
                if not cur.key():  # it was the last entry: the cursor fell off; resume at its new place
                    cur.set_key(BE_U64.pack(o[STAMP]))
                continue
            if self.on_evict is not None:
                self.on_evict(bytes(bkey), o[OFF], o[NBYTES])
            cur.delete()
            t.txn.delete(bkey, db=self.pool.obj)
            t.c[CIDX["objects"]] -= 1
            t.c[CIDX["bytes"]] -= o[NBYTES]
            t.c[CIDX["committed_alloc_bytes"]] -= o[ALLOC]
            t.c[CIDX["evictions"]] += 1
            t.c[CIDX["evicted_bytes"]] += o[NBYTES]
            if o[ALLOC] >= size:
                # Usual case (one object size per pool): hand the extent over, free only the rest.
                if o[ALLOC] > size:
                    t.free(o[OFF] + size, o[ALLOC] - size)
                return o[OFF]
            t.free(o[OFF], o[ALLOC])
            off = t.alloc(size)
            if off is not None:
                return off
