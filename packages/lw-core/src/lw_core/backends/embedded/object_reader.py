"""``ObjectReader``: the reading half of the ``Backend`` protocol on the embedded pool (lookup,
open, read, view, intact, release).

It takes no lock and holds no state of its own: an object is read through a lease (published in
this backend's row of the lease table, ``leases``) and its generation is checked after every copy,
with the fences ``fences`` describes; ``local`` is the backend's own counters, which it bumps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from lw_core.backend import Buffer, ObjectMissing
from lw_core.backends.embedded import fences
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
        for h, off, dst in zip(handles, offsets, dsts):
            if type(h) is not EmbeddedHandle or h._stream:
                raise TypeError(f"embedded pool: read needs handles from this backend (not mixed with streaming ones), got {h!r}")
            m = dst if type(dst) is memoryview else memoryview(dst)
            if m.ndim != 1 or m.format != "B" or m.readonly:
                m = bytes_view(m, writable=True, what=f"read {h.key!r}")
            n = m.nbytes
            if off < 0 or off + n > h.nbytes:
                raise ValueError(f"embedded pool: read of {n} bytes at offset {off} is outside object {h.key!r} of {h.nbytes} bytes")
            checked = not h._writable  # a reservation has no generation yet; its writer owns it
            if h._epoch != ep or (checked and gen[h._pg] != h._oid):
                bad.append(h.key)
                continue
            a = h._off + off
            if n < big:
                m[:] = mv[a : a + n]
            else:
                np.frombuffer(m, dtype=np.uint8)[:] = npa[a : a + n]
            if checked:
                copied.append(h)
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
        if offset < 0 or nbytes < 0 or offset + nbytes > h.nbytes:
            raise ValueError(f"embedded pool: view of {nbytes} bytes at offset {offset} is outside object {h.key!r} of {h.nbytes} bytes")
        if h._epoch != self.pool.epoch:
            raise ObjectMissing(f"embedded pool {self.pool.path!r}: {h.key!r} is from a pool directory that was deleted since")
        if not h._writable:
            lt = self.pool.leases
            now = time.time()
            renewed = h._leased and lt.expiry(h._lease, h._oid) - now > self.lease_ttl_s / 2
            if not renewed:  # expiring (or expired): renew, then check (fenced like open)
                with lt.lock:
                    renewed = h._leased and lt.renew(h._lease, h._oid, h._pg, now + self.lease_ttl_s)
                fences.fence()
            if not renewed or lt.gen[h._pg] != h._oid:
                self.local["reads_of_evicted_objects"] += 1
                why = "was evicted (its lease had expired)" if renewed or h._leased else "is not leased (released)"
                raise ObjectMissing(f"embedded pool {self.pool.path!r}: no view of {h.key!r}: it {why}")
        a = h._off + offset
        mv = self.pool.mv
        assert mv is not None, "the pool is attached (checked by usable)"
        v = mv[a : a + nbytes]
        return v if h._writable else v.toreadonly()

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

    def open(self, keys: Sequence[str]) -> list[EmbeddedHandle | None]:
        """Lease committed objects. Takes no pool-wide lock: the index is only read, and the
        lease is published in this backend's own row; an object evicted meanwhile (its generation
        changed) is a miss."""
        bkeys = encode_keys(keys)
        self.usable()
        self.check_pool()
        out: list[EmbeddedHandle | None] = [None] * len(bkeys)
        lt, ep = self.pool.leases, self.pool.epoch
        # Batched: look every key up, lease the live ones in one pass (take_many), fence once, check
        # again; per-key Python work is what bounds opens of small objects.
        hit: list[int] = []
        recs: list[tuple[int, int, int, int, int, int]] = []
        with self.pool.read() as txn, lt.lock:  # usable() was checked above
            expiry = time.time() + self.lease_ttl_s
            get, unpack, db, gen = txn.get, OBJ_REC.unpack, self.pool.obj, lt.gen
            for j, bk in enumerate(bkeys):
                v = get(bk, db=db)
                if v is None or v[0] != COMMITTED:
                    continue
                rec = unpack(v)
                if gen[rec[2] // PAGE] != rec[1]:
                    continue  # evicted after this read transaction began
                hit.append(j)
                recs.append(rec)
            oids = [r[1] for r in recs]
            pages = [r[2] // PAGE for r in recs]
            taken = lt.take_many(oids, pages, expiry)
            fences.fence()  # the leases are visible before the generations are checked again
            full = 0
            for j, (_, oid, off, alloc, nbytes, _), pg, i in zip(hit, recs, pages, taken):
                if i < 0:
                    full += 1
                elif gen[pg] != oid:
                    lt.drop(i, oid)
                else:
                    out[j] = EmbeddedHandle(keys[j], bkeys[j], nbytes, off, alloc, oid, False, ep, i)
        if full:
            self.local["lease_row_full"] += full
            log.warning("embedded pool %r: this process holds too many leases; %d opens were misses", self.pool.path, full)
        hits = sum(h is not None for h in out)
        self.local["open_hits"] += hits
        self.local["open_misses"] += len(out) - hits
        return out

    def release(self, handles: Sequence[EmbeddedHandle]) -> None:
        hs = [h for h in handles if isinstance(h, EmbeddedHandle) and h._leased]
        if not hs:
            return
        self.usable()
        lt, ep = self.pool.leases, self.pool.epoch
        stale = 0
        with lt.lock:
            for h in hs:
                h._leased = False
                if h._epoch != ep:
                    continue
                if lt.gen[h._pg] != h._oid:
                    stale += 1  # evicted while leased: a reader ran past its lease
                lt.drop(h._lease, h._oid)
        if stale:
            self.local["stale_views"] += stale
            log.warning(
                "embedded pool %r: %d object(s) were evicted before their reader released them (a reader ran past "
                "lease_ttl_s=%s); reads of them failed, and callers that copied from view() windows must check intact()",
                self.pool.path,
                stale,
                self.lease_ttl_s,
            )
