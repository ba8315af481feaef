"""The Backend protocol operations of ``EmbeddedBackend`` (lookup, reserve, write, read, view,
intact, commit, abort, open, release)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from lw_core.backend import BackendError, Buffer, ObjectMissing
from lw_core.backends.embedded import fences
from lw_core.backends.embedded.records import (
    ALLOC,
    BE_U64,
    CIDX,
    COMMITTED,
    EmbeddedHandle,
    NBYTES,
    NP_COPY_MIN,
    OBJ_REC,
    OFF,
    OID,
    PAGE,
    RESERVED,
    Resv,
    ST,
    STAMP,
    bytes_view,
    encode_keys,
    own_handle,
    log,
)
from lw_core.backends.embedded.txn import Tx


class OpsMixin:
    """The protocol operations."""

    def lookup(self, keys: Sequence[str]) -> int:
        bkeys = encode_keys(keys)
        self._usable()
        self._check_pool()
        n = 0
        with self._read() as txn:
            for bk in bkeys:
                v = txn.get(bk, db=self._pool.obj)
                if v is None or v[ST] != COMMITTED:
                    break
                n += 1
        return n

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[EmbeddedHandle | None]:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"embedded pool: reserve nbytes={nbytes!r} must be an int > 0")
        bkeys = encode_keys(keys)
        alloc = -(-nbytes // PAGE) * PAGE
        self._usable()
        self._check_pool()
        epoch = self._pool.epoch

        def fn(t: Tx) -> list[EmbeddedHandle | None]:
            out: list[EmbeddedHandle | None] = [None] * len(bkeys)
            if self._sweeper.due(t):
                self._sweeper.sweep(t)
            eligible: list[int] = []
            seen: set[bytes] = set()
            for i, bk in enumerate(bkeys):
                o = None if bk in seen else t.get_obj(bk)
                if bk in seen or (o is not None and not self._sweeper.key_free(t, bk, o)):
                    t.c[CIDX["reserve_rejected_exists"]] += 1
                    continue
                seen.add(bk)
                eligible.append(i)
            if alloc > self.capacity:
                t.c[CIDX["reserve_rejected_full"]] += len(eligible)
                return out
            # One extent for the whole batch when there is one: one free-list update, not n.
            base = t.alloc(alloc * len(eligible)) if len(eligible) > 1 else None
            for j, i in enumerate(eligible):
                if base is not None:
                    off = base + j * alloc
                else:
                    off = t.alloc(alloc)
                    if off is None:
                        off = self._sweeper.make_room(t, alloc)
                    if off is None:
                        t.c[CIDX["reserve_rejected_full"]] += len(eligible) - j
                        break
                oid = t.next_id()
                t.put_obj(bkeys[i], [RESERVED, oid, off, alloc, nbytes, 0])
                t.put_resv(oid, Resv(self._me, t.now, off, alloc, 0), bkeys[i])
                t.c[CIDX["reserved_objects"]] += 1
                t.c[CIDX["reserved_bytes"]] += alloc
                out[i] = EmbeddedHandle(keys[i], bkeys[i], nbytes, off, alloc, oid, True, epoch)
            return out

        return self._write(fn)

    # write/read are the per-layer hot path (one call per layer for a whole batch): the loops are
    # kept tight -- per-item Python overhead is comparable to a 16 KiB memcpy.

    def write(self, handles: Sequence[EmbeddedHandle], offsets: Sequence[int], srcs: Sequence[Buffer]) -> None:
        self._usable()
        if not (len(handles) == len(offsets) == len(srcs)):
            raise ValueError(f"embedded pool: write got {len(handles)} handles, {len(offsets)} offsets, {len(srcs)} srcs")
        mv, npa, big, ep = self._pool.mv, self._pool.np, NP_COPY_MIN, self._pool.epoch
        for h, off, src in zip(handles, offsets, srcs):
            if type(h) is not EmbeddedHandle or not h._writable:
                raise BackendError(f"embedded pool: write to {h!r}, which is not a reserved handle")
            if h._epoch != ep:
                raise ObjectMissing(f"embedded pool {self.path!r}: {h.key!r} was reserved in a pool directory that was deleted since")
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

    def read(self, handles: Sequence[EmbeddedHandle], offsets: Sequence[int], dsts: Sequence[Buffer]) -> None:
        """Copy, fence, then check that each object is still the one leased (its generation): a
        reader stalled past its lease may find its extent reused, and those bytes must not be used.
        The fence keeps the re-reads after the copies on weakly ordered CPUs (fences.py)."""
        if handles and getattr(handles[0], "_stream", False):
            return self._streams.read(handles, offsets, dsts)  # type: ignore[attr-defined, no-any-return]
        self._usable()
        if not (len(handles) == len(offsets) == len(dsts)):
            raise ValueError(f"embedded pool: read got {len(handles)} handles, {len(offsets)} offsets, {len(dsts)} dsts")
        mv, npa, big, gen, ep = self._pool.mv, self._pool.np, NP_COPY_MIN, self._pool.leases.gen, self._pool.epoch
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
            self._local["reads_of_evicted_objects"] += len(bad)
            raise ObjectMissing(
                f"embedded pool {self.path!r}: {len(bad)} object(s) were evicted (their space may hold other objects) "
                f"while leased past lease_ttl_s={self.lease_ttl_s}, or the pool was re-created; their bytes are "
                f"not used: {bad[:3]}"
            )

    def view(self, handle: EmbeddedHandle, offset: int, nbytes: int) -> memoryview | None:
        """A window into the arena. A leased object's window holds its bytes while the lease lasts:
        view() renews the lease (lease_ttl_s from now) and checks the object was not evicted, so a
        caller must finish with the window within lease_ttl_s; ``release`` re-checks and counts
        windows whose object was evicted meanwhile (``stale_views``)."""
        self._usable()
        h = own_handle(handle, "view")
        if h._stream:
            return None  # no lease pins a streaming handle's space: read() checks each copy
        if offset < 0 or nbytes < 0 or offset + nbytes > h.nbytes:
            raise ValueError(f"embedded pool: view of {nbytes} bytes at offset {offset} is outside object {h.key!r} of {h.nbytes} bytes")
        if h._epoch != self._pool.epoch:
            raise ObjectMissing(f"embedded pool {self.path!r}: {h.key!r} is from a pool directory that was deleted since")
        if not h._writable:
            lt = self._pool.leases
            now = time.time()
            renewed = h._leased and lt.expiry(h._lease, h._oid) - now > self.lease_ttl_s / 2
            if not renewed:  # expiring (or expired): renew, then check (fenced like open)
                with lt.lock:
                    renewed = h._leased and lt.renew(h._lease, h._oid, h._pg, now + self.lease_ttl_s)
                fences.fence()
            if not renewed or lt.gen[h._pg] != h._oid:
                self._local["reads_of_evicted_objects"] += 1
                why = "was evicted (its lease had expired)" if renewed or h._leased else "is not leased (released)"
                raise ObjectMissing(f"embedded pool {self.path!r}: no view of {h.key!r}: it {why}")
        a = h._off + offset
        v = self._pool.mv[a : a + nbytes]
        return v if h._writable else v.toreadonly()

    def intact(self, handles: Sequence[EmbeddedHandle]) -> list[bool]:
        """Whether each handle's object still owns its space (not evicted, not reused, same pool
        directory): the check a caller makes after copying from ``view`` windows."""
        self._usable()
        gen, ep = self._pool.leases.gen, self._pool.epoch
        fences.fence()  # the caller's copies are ordered before the generations are read
        out = [isinstance(h, EmbeddedHandle) and h._epoch == ep and gen[h._pg] == h._oid for h in handles]
        bad = out.count(False)
        if bad:
            self._local["stale_views"] += bad
        return out

    def commit(self, handles: Sequence[EmbeddedHandle]) -> None:
        hs = [own_handle(h, "commit") for h in handles]
        ep = self._pool.epoch
        fences.fence()  # the writer's copies into the arena come before the records and generations

        def fn(t: Tx) -> list[str]:
            lost = []
            for h in hs:
                if h._epoch != ep:  # reserved in a pool directory deleted since: its ids mean nothing here
                    lost.append(h.key)
                    continue
                o = t.get_obj(h._bkey)
                if o is not None and o[OID] == h._oid:
                    if o[ST] == COMMITTED:
                        continue  # committed twice: the first one counted
                    stamp = t.next_id()
                    o[ST], o[STAMP] = COMMITTED, stamp
                    t.put_obj(h._bkey, o)
                    self._pool.leases.set_gen(o[OFF] // PAGE, o[OID])  # readers check it after each copy
                    t.txn.put(BE_U64.pack(stamp), h._bkey, db=self._pool.lru)
                    t.txn.delete(BE_U64.pack(h._oid), db=self._pool.resv)
                    t.c[CIDX["reserved_objects"]] -= 1
                    t.c[CIDX["reserved_bytes"]] -= o[ALLOC]
                    t.c[CIDX["objects"]] += 1
                    t.c[CIDX["bytes"]] += o[NBYTES]
                    t.c[CIDX["committed_alloc_bytes"]] += o[ALLOC]
                    t.c[CIDX["commits"]] += 1
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
        hs = [h for h in (own_handle(h, "abort") for h in handles if h is not None) if h._writable and h._epoch == self._pool.epoch]

        def fn(t: Tx) -> None:
            for h in hs:
                found = t.get_resv(h._oid)
                if found is None:
                    continue  # committed already, or reclaimed
                r, _ = found
                if not r.orphan:
                    self._sweeper.drop_key_if(t, h._bkey, h._oid)
                t.drop_resv(h._oid, r)
                t.c[CIDX["aborts"]] += 1

        if hs:
            self._write(fn)
        for h in hs:
            h._writable = False

    def open(self, keys: Sequence[str]) -> list[EmbeddedHandle | None]:
        """Lease committed objects. Takes no pool-wide lock: the index is only read, and the
        lease is published in this backend's own row; an object evicted meanwhile (its generation
        changed) is a miss."""
        bkeys = encode_keys(keys)
        self._usable()
        self._check_pool()
        out: list[EmbeddedHandle | None] = []
        lt, ep, full = self._pool.leases, self._pool.epoch, 0
        with self._read() as txn, lt.lock:
            expiry = time.time() + self.lease_ttl_s
            get, unpack, db, take, gen = txn.get, OBJ_REC.unpack, self._pool.obj, lt.take, lt.gen
            for k, bk in zip(keys, bkeys):
                v = get(bk, db=db)
                if v is None or v[0] != COMMITTED:
                    out.append(None)
                    continue
                _, oid, off, alloc, nbytes, _ = unpack(v)
                if gen[off // PAGE] != oid:
                    out.append(None)  # evicted after this read transaction began
                    continue
                i = take(oid, off // PAGE, expiry)
                if i < 0:
                    full += 1
                    out.append(None)
                    continue
                out.append(EmbeddedHandle(k, bk, nbytes, off, alloc, oid, False, ep, i))
            fences.fence()  # the leases are visible before the generations are checked again
            for j, h in enumerate(out):
                if h is not None and gen[h._pg] != h._oid:
                    lt.drop(h._lease, h._oid)
                    out[j] = None
        if full:
            self._local["lease_row_full"] += full
            log.warning("embedded pool %r: this process holds too many leases; %d opens were misses", self.path, full)
        hits = sum(h is not None for h in out)
        self._local["open_hits"] += hits
        self._local["open_misses"] += len(out) - hits
        return out

    def release(self, handles: Sequence[EmbeddedHandle]) -> None:
        hs = [h for h in handles if isinstance(h, EmbeddedHandle) and h._leased]
        if not hs:
            return
        self._usable()
        lt, ep = self._pool.leases, self._pool.epoch
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
            self._local["stale_views"] += stale
            log.warning(
                "embedded pool %r: %d object(s) were evicted before their reader released them (a reader ran past "
                "lease_ttl_s=%s); reads of them failed, and callers that copied from view() windows must check intact()",
                self.path,
                stale,
                self.lease_ttl_s,
            )
