"""Sweep (reclaiming dead writers' reservations) and eviction (CLOCK over the LRU order)."""

from __future__ import annotations


from lw_core.backends.embedded.leases import FREE, LEASED
from lw_core.procs import owner_alive
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
    Resv,
    ST,
    STAMP,
    unpack_resv,
)
from lw_core.backends.embedded.txn import Tx


class SweepMixin:
    """Reclaiming reservations and making room."""

    def _sweep(self, t: Tx) -> None:
        """Reclaim reservations of dead owners; take keys away from timed-out live ones."""
        t.swept = True
        self._last_sweep = t.now
        for k, v in list(t.txn.cursor(db=self._pool.resv)):
            r, bkey = unpack_resv(v)
            self._judge(t, BE_U64.unpack(k)[0], r, bkey)

    def _judge(self, t: Tx, oid: int, r: Resv, bkey: bytes) -> bool:
        """Reclaim or orphan one reservation if its owner is gone or too slow; True if its key is free."""
        alive = owner_alive(r.owner, self._me)
        timed_out = t.now - r.t0 > self.reservation_timeout_s
        if alive is False or (alive is None and timed_out):
            if not r.orphan:
                self._drop_key_if(t, bkey, oid)
            t.drop_resv(oid, r)
            t.c[CIDX["reclaimed_reservations"]] += 1
            return True
        if timed_out:
            if not r.orphan:
                self._drop_key_if(t, bkey, oid)
                t.put_resv(oid, r._replace(orphan=1), bkey)
                t.c[CIDX["orphaned_reservations"]] += 1
            return True
        return False

    def _drop_key_if(self, t: Tx, bkey: bytes, oid: int) -> None:
        o = t.get_obj(bkey)
        if o is not None and o[OID] == oid and o[ST] == RESERVED:
            t.txn.delete(bkey, db=self._pool.obj)

    def _make_room(self, t: Tx, size: int) -> int | None:
        """Free space for ``size`` bytes: reclaim dead reservations, then evict (CLOCK over the LRU
        order) committed objects without a live lease. One cursor serves a whole batch."""
        if not t.swept:
            self._sweep(t)
            off = t.alloc(size)
            if off is not None:
                return off
        if t.lru_cur is None:
            t.lru_cur = t.txn.cursor(db=self._pool.lru)
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
                t.rows = self._pool.leases.live_rows(self._me)  # dead readers' leases do not count
            lease = self._pool.leases.evict(o[OFF] // PAGE, o[OID], t.now, t.rows)
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
                t.txn.put(BE_U64.pack(o[STAMP]), bkey, db=self._pool.lru)
                t.put_obj(bkey, o)
                if not cur.key():  # it was the last entry: the cursor fell off; resume at its new place
                    cur.set_key(BE_U64.pack(o[STAMP]))
                continue
            cur.delete()
            t.txn.delete(bkey, db=self._pool.obj)
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

    # ----------------------------------------------------------------- the protocol
