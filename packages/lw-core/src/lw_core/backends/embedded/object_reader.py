"""``ObjectReader``: the reading half of the ``Backend`` protocol on the embedded pool (lookup,
open, read, view, intact, release).

It takes no lock and holds no state of its own but a memory of the keys it looked up (which object
each named; ``open`` trusts it only while that object's generation says it still lives): an object
is read through a lease (published in this backend's row of the lease table, ``leases``) and its
generation is checked after every copy, with the fences ``fences`` describes; ``local`` is the
backend's own counters, which it bumps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from operator import itemgetter
from typing import Any

import numpy as np

from lw_core.backend import Buffer, ObjectMissing
from lw_core.backends.embedded import fences
from lw_core.backends.embedded.address_table import (
    EPOCH,
    LEASE,
    LEASED,
    NBYTES,
    OFF,
    OID,
    SLOT,
    STREAM,
    WRITABLE,
    AddressTable,
    Checked,
    build_table,
)
from lw_core.backends.embedded.pool_files import PoolFiles
from lw_core.backends.embedded.records import (
    COMMITTED,
    NP_COPY_MIN,
    OBJ_REC,
    PAGE,
    ST,
    EmbeddedHandle,
    bytes_view,
    encode_keys,
    log,
    own_handle,
)

KNOWN_MAX = 1 << 16  # keys open() remembers (self._known), about 200 bytes each


# The object id and the generation slot of a known record (``ObjectReader._lookup_into``).
_OID, _PAGE = itemgetter(1), itemgetter(5)


class ObjectReader:
    """Reads of the pool ``pool``; ``usable`` and ``check_pool`` are the backend's checks (closed or
    forked; the directory replaced), ``local`` its own counters."""

    def __init__(
        self,
        pool: PoolFiles,
        *,
        lease_ttl_s: float,
        usable: Callable[[], None],
        check_pool: Callable[[], None],
        local: dict[str, int],
    ) -> None:
        self.pool = pool
        self.lease_ttl_s = lease_ttl_s
        self.usable = usable
        self.check_pool = check_pool
        self.local = local
        # Key -> (key bytes, object id, offset, allocated bytes, object bytes, generation slot) of
        # a committed object this backend has seen in the index: open() uses it in place of an
        # index lookup while the object's generation is still that id. Sound because keys are
        # write-once and ids never reused in a pool: a key gets another object only after its
        # object was evicted, and eviction clears the generation before anything else (leases.py);
        # a pool re-attached (another epoch) gets a new one. Kept with its epoch, and replaced (never
        # emptied in place), so an open still running on the old epoch fills only the old one.
        # At most KNOWN_MAX entries.
        self._known: tuple[int, dict[str, tuple[bytes, int, int, int, int, int]]] = (-1, {})

    @contextmanager
    def _read(self) -> Iterator[Any]:
        self.usable()
        with self.pool.read() as txn:
            yield txn

    def lookup(self, keys: Sequence[str]) -> int:
        bkeys = encode_keys(keys)
        self.usable()
        self.check_pool()
        n = 0
        with self._read() as txn:
            for bk in bkeys:
                v = txn.get(bk, db=self.pool.obj)
                if v is None or v[ST] != COMMITTED:
                    break
                n += 1
        return n

    # write/read are the per-layer hot path (one call per layer for a whole batch): the loops are
    # kept tight -- per-item Python overhead is comparable to a 16 KiB memcpy.

    def read(self, handles: Sequence[EmbeddedHandle], offsets: Sequence[int], dsts: Sequence[Buffer]) -> None:
        """Copy, fence, then check that each object is still the one leased (its generation): a
        reader stalled past its lease may find its extent reused, and those bytes must not be used.
        The fence keeps the re-reads after the copies on weakly ordered CPUs (fences.py)."""
        self.usable()
        if not (len(handles) == len(offsets) == len(dsts)):
            raise ValueError(f"embedded pool: read got {len(handles)} handles, {len(offsets)} offsets, {len(dsts)} dsts")
        mv, npa, big, gen, ep = self.pool.mv, self.pool.np, NP_COPY_MIN, self.pool.leases.gen, self.pool.epoch
        assert mv is not None and npa is not None, "the pool is attached (checked by usable)"
        bad: list[str] = []
        copied: list[EmbeddedHandle] = []  # leased handles whose generation is checked again
        append = copied.append
        for h, off, dst in zip(handles, offsets, dsts):
            if type(h) is not EmbeddedHandle or h._stream:
                raise TypeError(f"embedded pool: read needs handles from this backend (not mixed with streaming ones), got {h!r}")
            m = dst if type(dst) is memoryview else memoryview(dst)
            if m.ndim != 1 or m.format != "B" or m.readonly:
                m = bytes_view(m, writable=True, what=f"read {h.key!r}")
            n = m.nbytes
            if off < 0 or off + n > h.nbytes:
                raise ValueError(f"embedded pool: read of {n} bytes at offset {off} is outside object {h.key!r} of {h.nbytes} bytes")
            if h._epoch != ep:
                bad.append(h.key)
                continue
            if h._writable:  # a reservation has no generation yet; its writer owns it
                a = h._off + off
                m[:] = mv[a : a + n]
                continue
            if gen[h._pg] != h._oid:
                bad.append(h.key)
                continue
            a = h._off + off
            if n < big:
                m[:] = mv[a : a + n]
            else:
                np.frombuffer(m, dtype=np.uint8)[:] = npa[a : a + n]
            append(h)
        if copied:
            fences.fence()  # the copies are done before the generations are read again
            bad += [h.key for h in copied if gen[h._pg] != h._oid]
        if bad:
            self.local["reads_of_evicted_objects"] += len(bad)
            raise ObjectMissing(
                f"embedded pool {self.pool.path!r}: {len(bad)} object(s) were evicted (their space may hold other objects) "
                f"while leased past lease_ttl_s={self.lease_ttl_s}, or the pool was re-created; their bytes are "
                f"not used: {bad[:3]}"
            )

    def view(self, handle: EmbeddedHandle, offset: int, nbytes: int) -> memoryview | None:
        """A window into the arena. A leased object's window holds its bytes while the lease lasts:
        view() renews the lease (lease_ttl_s from now) and checks the object was not evicted, so a
        caller must finish with the window within lease_ttl_s; ``release`` re-checks and counts
        windows whose object was evicted meanwhile (``stale_views``)."""
        self.usable()
        h = own_handle(handle, "view")
        if h._stream:
            return None  # no lease pins a streaming handle's space: read() checks each copy
        a = self._window(h, offset, nbytes, time.time())
        mv = self.pool.mv
        assert mv is not None, "the pool is attached (checked by usable)"
        v = mv[a : a + nbytes]
        return v if h._writable else v.toreadonly()

    def view_addresses(self, handles: Sequence[EmbeddedHandle], offset: int, nbytes: int) -> np.ndarray | None:
        """The host addresses of ``view(h, offset, nbytes)``'s windows, with the same checks and
        lease renewals, for a device copier that moves them by address (int64); ``None`` when a
        handle has no window (streaming)."""
        hs = [own_handle(h, "view") for h in handles]
        return self.table_addresses(build_table(hs, self.pool.handle_states), np.arange(len(hs)), offset, nbytes)

    def address_table(self, handles: Sequence[Any]) -> AddressTable:
        """A step's table of ``handles`` (``lw_core.backends.embedded.address_table``): build it once,
        then ``table_addresses`` answers each batch of each layer with array work only."""
        return build_table(handles, self.pool.handle_states)

    def table_addresses(self, table: AddressTable, rows: np.ndarray, offset: int, nbytes: int) -> np.ndarray | None:
        """``view_addresses`` of the table's handles at ``rows``. The checks run on arrays; a handle
        that fails one, or whose lease needs renewing, goes through ``view``'s own path (which
        renews or raises)."""
        self.usable()
        npa = self.pool.np
        assert npa is not None, "the pool is attached (checked by usable)"
        rows = np.asarray(rows, dtype=np.int64)
        now = time.time()
        if offset >= 0 and nbytes >= 0 and table.proven(rows, self.pool.epoch, now, offset + nbytes):
            return table.cols[rows, OFF] + (offset + int(npa.ctypes.data))  # the layers after the first
        clock = table.clock_now  # read before the handles: a change after it shows as a tick
        flags = table.flags(rows)
        if (flags & STREAM).any():
            return None
        a = table.cols[rows]
        offs = a[:, OFF]
        slow = (a[:, NBYTES] < offset + nbytes) | (a[:, EPOCH] != self.pool.epoch) | (offset < 0) | (nbytes < 0)
        r = np.flatnonzero((flags & WRITABLE) == 0)  # leased (read) handles
        if len(r):
            lt = self.pool.leases
            oids = a[r, OID]
            fresh = ((flags[r] & LEASED) != 0) & (lt.expiries(a[r, LEASE], oids) - now > self.lease_ttl_s / 2)
            slow[r] |= ~fresh | (lt.generations(a[r, SLOT]) != oids.astype(np.uint64))
        for i in np.flatnonzero(slow):
            self._window(table.handles[rows[i]], offset, nbytes, now)  # renews the lease, or raises what view would
        table.checked = self._check_all(table, clock)
        return offs + (offset + int(npa.ctypes.data))

    def _check_all(self, table: AddressTable, clock: int) -> Checked:
        """What holds now for every row of ``table`` (``Checked``): read after ``clock`` was."""
        now = time.time()
        a = table.cols
        flags = table.flags(np.arange(len(a)))
        ok = table.present & (a[:, EPOCH] == self.pool.epoch) & ((flags & STREAM) == 0)
        r = np.flatnonzero(ok & ((flags & WRITABLE) == 0))
        until = float("inf")
        if len(r):
            lt = self.pool.leases
            oids = a[r, OID]
            left = lt.expiries(a[r, LEASE], oids) - now
            fresh = ((flags[r] & LEASED) != 0) & (left > self.lease_ttl_s / 2)
            fresh &= lt.generations(a[r, SLOT]) == oids.astype(np.uint64)
            ok[r] = fresh
            if fresh.any():
                until = now + float(left[fresh].min()) - self.lease_ttl_s / 2
        return Checked(clock, self.pool.epoch, until, ok)

    def _window(self, h: EmbeddedHandle, offset: int, nbytes: int, now: float) -> int:
        """Where ``h``'s bytes ``[offset, offset + nbytes)`` start in the arena, once checked (and a
        leased object's lease renewed when it is half gone)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > h.nbytes:
            raise ValueError(f"embedded pool: view of {nbytes} bytes at offset {offset} is outside object {h.key!r} of {h.nbytes} bytes")
        if h._epoch != self.pool.epoch:
            raise ObjectMissing(f"embedded pool {self.pool.path!r}: {h.key!r} is from a pool directory that was deleted since")
        if not h._writable:
            lt = self.pool.leases
            renewed = h._leased and lt.expiry(h._lease, h._oid) - now > self.lease_ttl_s / 2
            if not renewed:  # expiring (or expired): renew, then check (fenced like open)
                with lt.lock:
                    renewed = h._leased and lt.renew(h._lease, h._oid, h._pg, now + self.lease_ttl_s)
                fences.fence()
            if not renewed or lt.gen[h._pg] != h._oid:
                self.local["reads_of_evicted_objects"] += 1
                why = "was evicted (its lease had expired)" if renewed or h._leased else "is not leased (released)"
                raise ObjectMissing(f"embedded pool {self.pool.path!r}: no view of {h.key!r}: it {why}")
        return int(h._off + offset)

    def intact(self, handles: Sequence[EmbeddedHandle]) -> list[bool]:
        """Whether each handle's object still owns its space (not evicted, not reused, same pool
        directory): the check a caller makes after copying from ``view`` windows."""
        self.usable()
        gen, ep = self.pool.leases.gen, self.pool.epoch
        fences.fence()  # the caller's copies are ordered before the generations are read
        out = [isinstance(h, EmbeddedHandle) and h._epoch == ep and gen[h._pg] == h._oid for h in handles]
        bad = out.count(False)
        if bad:
            self.local["stale_views"] += bad
        return out

    def table_intact(self, table: AddressTable, rows: np.ndarray) -> np.ndarray:
        """``intact`` of the table's handles at ``rows``, on arrays (bool per row; a row with no
        handle is False)."""
        self.usable()
        rows = np.asarray(rows, dtype=np.int64)
        a = table.cols[rows]
        fences.fence()  # the caller's copies are ordered before the generations are read
        ok = (a[:, EPOCH] == self.pool.epoch) & (self.pool.leases.generations(a[:, SLOT]) == a[:, OID].astype(np.uint64))
        ok &= table.present[rows]
        bad = len(ok) - int(ok.sum())
        if bad:
            self.local["stale_views"] += bad
        return ok

    def open(self, keys: Sequence[str]) -> list[EmbeddedHandle | None]:
        """Lease committed objects. Takes no pool-wide lock: the index is only read, and the
        lease is published in this backend's own row; an object evicted meanwhile (its generation
        changed) is a miss.

        Keys are looked up in ``self._known`` first (key -> the committed record last seen for it,
        see there) and only the others in the index; either way the lease is published, fenced and
        the generation checked again, as for an index lookup, and a known record whose object was
        evicted since is looked up in the index once more (the key may have been stored again)."""
        self.usable()
        self.check_pool()
        lt, ep = self.pool.leases, self.pool.epoch
        kep, known = self._known
        if kep != ep:  # a re-attached pool: its object ids mean something else
            known = {}
            self._known = (ep, known)
        try:
            recs: list[Any] = [known.get(k) for k in keys]
        except TypeError:  # an unhashable key: encode_keys below says what is wrong with it
            recs = [None] * len(keys)
        if None in recs:
            self._lookup_into(keys, recs, lt.gen, known)
        out: list[EmbeddedHandle | None] = [None] * len(recs)
        full, gone = self._lease_into(keys, recs, range(len(recs)), out, ep)
        if gone:  # known records of objects evicted since: the key may have been stored again
            for j in gone:
                recs[j] = None
                known.pop(keys[j], None)
            self._lookup_into(keys, recs, lt.gen, known)
            more, _ = self._lease_into(keys, recs, gone, out, ep)
            full += more
        if full:
            self.local["lease_row_full"] += full
            log.warning("embedded pool %r: this process holds too many leases; %d opens were misses", self.pool.path, full)
        hits = len(out) - out.count(None)
        self.local["open_hits"] += hits
        self.local["open_misses"] += len(out) - hits
        return out

    def _lease_into(self, keys: Sequence[str], recs: list[Any], idx: Sequence[int], out: list[EmbeddedHandle | None],
                    ep: int) -> tuple[int, list[int]]:
        """Lease the objects ``recs`` names at ``idx`` (None there: a miss) in one pass
        (``LeaseTable.take_many``), fence once, check their generations again, and put a handle in
        ``out`` for each that still lives. Returns how many found the lease row full and the
        indexes whose object was evicted meanwhile (their leases dropped again)."""
        if len(idx) == len(recs) and None not in recs:  # every key of the call (the usual case)
            sel: Sequence[int] = idx
            rs = recs
        else:
            sel = [j for j in idx if recs[j] is not None]
            if not sel:
                return 0, []
            rs = [recs[j] for j in sel]
        n = len(rs)
        oids = np.fromiter(map(_OID, rs), np.uint64, n)
        pages = np.fromiter(map(_PAGE, rs), np.int64, n)
        lt = self.pool.leases
        with lt.lock:  # usable() was checked by the caller
            taken = lt.take_many(oids, pages, time.time() + self.lease_ttl_s)
            fences.fence()  # the leases are visible before the generations are checked again
            got = taken >= 0
            live = got & (lt.generations(pages) == oids)
            lost = got & ~live
            if lost.any():
                lt.drop_many(taken[lost], oids[lost])
        tk = taken.tolist()
        if sel is idx and len(out) == n and live.all():  # the usual case, in one comprehension
            out[:] = [EmbeddedHandle(k, r[0], r[4], r[2], r[3], r[1], False, ep, t) for k, r, t in zip(keys, rs, tk)]
            return 0, []
        for p in (range(n) if live.all() else np.flatnonzero(live).tolist()):
            j = sel[p]
            bk, oid, off, alloc, nbytes, _ = rs[p]
            out[j] = EmbeddedHandle(keys[j], bk, nbytes, off, alloc, oid, False, ep, tk[p])
        return n - int(got.sum()), [sel[p] for p in np.flatnonzero(lost).tolist()]

    def _lookup_into(self, keys: Sequence[str], recs: list[Any], gen: Any, known: dict[str, Any]) -> None:
        """Fill ``recs[j]`` (None there) with key j's committed, live record from the index, as
        (key bytes, object id, offset, allocated bytes, object bytes, generation slot); remember
        each in ``known`` (this epoch's ``self._known``). Checks every key (encode_keys), known or not."""
        bkeys = encode_keys(keys)
        if len(known) + len(bkeys) > KNOWN_MAX:
            known.clear()
        with self.pool.read() as txn:
            get, unpack, db = txn.get, OBJ_REC.unpack, self.pool.obj
            for j, bk in enumerate(bkeys):
                if recs[j] is not None:
                    continue
                v = get(bk, db=db)
                if v is None or v[0] != COMMITTED:
                    known.pop(keys[j], None)
                    continue
                _, oid, off, alloc, nbytes, _ = unpack(v)
                pg = off // PAGE
                if gen[pg] != oid:
                    continue  # evicted after this read transaction began
                recs[j] = known[keys[j]] = (bk, oid, off, alloc, nbytes, pg)

    def release(self, handles: Sequence[EmbeddedHandle]) -> None:
        hs = [h for h in handles if isinstance(h, EmbeddedHandle) and h._leased]
        if not hs:
            return
        self.usable()
        lt, ep = self.pool.leases, self.pool.epoch
        stale = 0
        try:
            with lt.lock:
                gen = lt.gen
                lease: list[int] = []
                oids: list[int] = []
                for h in hs:
                    h._leased = False
                    if h._epoch != ep:
                        continue
                    if gen[h._pg] != h._oid:
                        stale += 1  # evicted while leased: a reader ran past its lease
                    lease.append(h._lease)
                    oids.append(h._oid)
                lt.drop_many(np.array(lease, dtype=np.int64), np.array(oids, dtype=np.uint64))
        finally:
            self.pool.handle_states.tick()
        if stale:
            self.local["stale_views"] += stale
            log.warning(
                "embedded pool %r: %d object(s) were evicted before their reader released them (a reader ran past "
                "lease_ttl_s=%s); reads of them failed, and callers that copied from view() windows must check intact()",
                self.pool.path,
                stale,
                self.lease_ttl_s,
            )
