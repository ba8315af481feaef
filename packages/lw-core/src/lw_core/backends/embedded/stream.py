"""The optional streaming extension of ``EmbeddedBackend`` (rules: ``lw_core.backend``).

The published prefix of a reservation lives in its object record: while the record is
``RESERVED`` its ``STAMP`` field (the LRU stamp, unused until commit) holds the number of bytes
the writer has published. So any process sees it with one LMDB read, and it goes with the record:
abort, the sweep that reclaims a dead writer's reservation, and the timeout that takes a slow
writer's key away all drop the record, and ``commit`` turns it into the whole object.

A streaming handle names its reservation by object id (ids are never reused). It holds no lease
and no generation: each ``read`` checks the record before the copy (the range is published, the
record is still this object id) and again after it (the extent was not freed and reused while
copying: an extent is only freed after its record is gone). ``wait_published`` polls the record
with a growing pause (0.5 ms up to 2 ms) and fails promptly when the record is gone or holds
another id, or when the reservation's owner is dead (``procs.owner_alive``) or timed out.

Cost: ``publish`` is one write transaction (the writer lock) per call; call it once per layer for
a whole batch of objects, like ``write``. A waiter's poll is one LMDB read transaction (tens of
µs for a step's chunks), so the 2 ms cap costs a waiting receive about 1-2 % of a core, and it
sees a published layer within 2 ms: with a 20 ms cap the decoder was ready 8-11 ms after the
prefiller's last layer at 2k-4k tokens, against a 0.25 ms copy (lw-bench pd, README).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lw_core.backend import BackendError, Buffer, ObjectMissing
from lw_core.backends.embedded import fences
from lw_core.backends.embedded.pool_files import PoolFiles
from lw_core.backends.embedded.records import (
    BE_U64,
    COMMITTED,
    NP_COPY_MIN,
    OBJ_REC,
    OID,
    RESERVED,
    ST,
    STAMP,
    EmbeddedHandle,
    bytes_view,
    own_handle,
    unpack_resv,
)
from lw_core.backends.embedded.txn import Tx
from lw_core.backends.embedded.writer_lock import WriterLock
from lw_core.backends.segment_stream.checks import check_timeout, check_upto
from lw_core.procs import Owner, owner_alive

_POLL_MIN_S, _POLL_MAX_S = 0.0005, 0.002
GONE = -1


class StreamIndex:
    """The published prefixes of the pool ``pool``'s reservations: ``publish`` (under ``lock``),
    ``open`` streaming handles, ``wait_published`` and reads through them. ``usable`` raises when
    the backend is closed or used in a forked process; ``local`` is the backend's own counters."""

    def __init__(
        self,
        pool: PoolFiles,
        lock: WriterLock,
        me: Owner,
        *,
        reservation_timeout_s: float,
        usable: Callable[[], None],
        local: dict[str, int],
    ) -> None:
        self.pool = pool
        self.lock = lock
        self.me = me
        self.reservation_timeout_s = reservation_timeout_s
        self.usable = usable
        self.local = local

    def publish(self, handles: Sequence[EmbeddedHandle], upto: int) -> None:
        hs = [own_handle(h, "publish") for h in handles]
        for h in hs:
            if h._stream or h._leased:
                raise BackendError(f"embedded pool: publish needs handles from reserve, got {h!r}")
            check_upto("embedded pool", "publish", h, upto)
        if not hs:
            return
        # A handle aborted meanwhile is reported below; one committed already is a no-op.
        ep = self.pool.epoch
        fences.fence()  # the writer's copies into the arena come before the published prefix

        def fn(t: Tx) -> list[str]:
            lost = []
            for h in hs:
                o = t.get_obj(h._bkey) if h._epoch == ep else None
                if o is None or o[OID] != h._oid:
                    lost.append(h.key)  # aborted, reclaimed, or the key was taken away (timeout)
                elif o[ST] == RESERVED and upto > o[STAMP]:
                    o[STAMP] = upto
                    t.put_obj(h._bkey, o)
            return lost

        self.usable()
        with self.lock.locked():
            lost = self.pool.write(fn)
        if lost:
            raise ObjectMissing(
                f"embedded pool: {len(lost)} reservation(s) cannot be published: aborted, or expired "
                f"(reservation_timeout_s={self.reservation_timeout_s}): {lost[:3]}"
            )

    def open(self, keys: Sequence[str], bkeys: Sequence[bytes]) -> list[EmbeddedHandle | None]:
        """Streaming handles on the records of ``keys`` (encoded: ``bkeys``), reserved or committed."""
        out: list[EmbeddedHandle | None] = []
        with self.pool.read() as txn:
            for k, bk in zip(keys, bkeys):
                v = txn.get(bk, db=self.pool.obj)
                if v is None:
                    out.append(None)
                    continue
                _, oid, off, alloc, nbytes, _ = OBJ_REC.unpack(v)
                h = EmbeddedHandle(k, bk, nbytes, off, alloc, oid, False, self.pool.epoch)
                h._leased, h._stream = False, True
                out.append(h)
        return out

    def _ready(self, txn: Any, h: EmbeddedHandle, upto: int = 0, judge: dict | None = None) -> int:
        """Published bytes of ``h``'s own object (all of them once committed), ``GONE`` when that
        object is gone; with ``judge`` (a cache of owners' liveness for one poll), also ``GONE``
        when it is short of ``upto`` and its writer is dead or timed out (it will never commit)."""
        if h._epoch != self.pool.epoch:
            return GONE
        v = txn.get(h._bkey, db=self.pool.obj)
        if v is None:
            return GONE
        o = OBJ_REC.unpack(v)
        if o[OID] != h._oid:
            return GONE
        if o[ST] == COMMITTED:
            return h.nbytes
        ready: int = o[STAMP]
        if judge is not None and ready < upto:
            rv = txn.get(BE_U64.pack(h._oid), db=self.pool.resv)
            if rv is None:
                return GONE
            r, _ = unpack_resv(rv)
            alive = judge[r.owner] if r.owner in judge else judge.setdefault(r.owner, owner_alive(r.owner, self.me))
            if r.orphan or alive is False or (alive is None and time.time() - r.t0 > self.reservation_timeout_s):
                return GONE
        return ready

    def _streams(self, handles: Sequence[Any], what: str) -> list[EmbeddedHandle]:
        for h in handles:
            if type(h) is not EmbeddedHandle or not h._stream:
                raise BackendError(f"embedded pool: {what} needs handles from open_streaming, got {h!r}")
        return list(handles)

    def wait_published(self, handles: Sequence[EmbeddedHandle], upto: int, timeout_s: float) -> list[bool]:
        hs = self._streams(handles, "wait_published")
        for h in hs:
            check_upto("embedded pool", "wait_published", h, upto)
        check_timeout("embedded pool", timeout_s)
        self.usable()
        deadline = time.monotonic() + timeout_s
        pause = _POLL_MIN_S
        while True:
            with self.pool.read() as txn:
                judge: dict = {}
                got = [self._ready(txn, h, upto, judge) for h in hs]
            left = deadline - time.monotonic()
            if left <= 0 or all(g == GONE or g >= upto for g in got):
                return [g >= upto for g in got]
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX_S)

    def read(self, handles: Sequence[Any], offsets: Sequence[int], dsts: Sequence[Buffer]) -> None:
        hs = self._streams(handles, "a streaming read")
        if not (len(hs) == len(offsets) == len(dsts)):
            raise ValueError(f"embedded pool: read got {len(hs)} handles, {len(offsets)} offsets, {len(dsts)} dsts")
        views = []
        for h, off, dst in zip(hs, offsets, dsts):
            m = bytes_view(dst, writable=True, what=f"read {h.key!r}")
            if off < 0 or off + m.nbytes > h.nbytes:
                raise ValueError(f"embedded pool: read of {m.nbytes} bytes at offset {off} is outside object {h.key!r} of {h.nbytes} bytes")
            views.append(m)
        with self.pool.read() as txn:
            short = [h.key for h, off, m in zip(hs, offsets, views) if self._ready(txn, h) < off + m.nbytes]
        fences.fence()  # the records are read before the bytes
        if short:
            raise ObjectMissing(
                f"embedded pool {self.pool.path!r}: streaming read of {len(short)} object(s) beyond their published "
                f"bytes, or their reservation is gone (aborted, writer dead, evicted): {short[:3]}"
            )
        mv, npa = self.pool.mv, self.pool.np
        assert mv is not None and npa is not None, "the pool is attached (records were read)"
        for h, off, m in zip(hs, offsets, views):
            a = h._off + off
            if m.nbytes < NP_COPY_MIN:
                m[:] = mv[a : a + m.nbytes]
            else:
                np.frombuffer(m, dtype=np.uint8)[:] = npa[a : a + m.nbytes]
        fences.fence()  # the copies are done before the records are read again
        with self.pool.read() as txn:
            gone = [h.key for h in hs if self._ready(txn, h) == GONE]
        if gone:
            self.local["reads_of_evicted_objects"] += len(gone)
            raise ObjectMissing(
                f"embedded pool {self.pool.path!r}: {len(gone)} object(s) went while being read (aborted, reclaimed "
                f"or evicted; their space may hold other objects): their bytes are not used: {gone[:3]}"
            )
