"""Read leases of the embedded pool: one slot per arena page, in a small shared file.

Why not in LMDB: a lease is taken for every object a step loads and dropped after; as LMDB
records that cost a write transaction per ``open`` and per ``release``, each copying one B-tree
page per key (~2.5 us per key per open+release measured, about half of a 64 KiB memcpy). Here a
lease is four stores into a shared mapping, and ``open`` needs only an LMDB *read* transaction.

A slot is indexed by the object's first arena page (unique among live objects) and stamped with
the object's id, so a slot left over from an evicted object is recognised and reset. The table is
changed only while holding the pool's writer lock, so no atomics are needed. If a process dies
half-way through an update, the worst case is a count off by one on one object; the lease expiry
(wall clock) bounds how long that can pin it.
"""

from __future__ import annotations

import mmap
import os

_U32_MAX = 0xFFFFFFFF
SLOT_BYTES = 8 + 8 + 4 + 1  # oid, expiry, count, referenced

FREE, REFERENCED, LEASED = 0, 1, 2


class LeaseTable:
    def __init__(self, path: str, slots: int) -> None:
        self.slots = slots
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != slots * SLOT_BYTES:
                raise ValueError(f"{path} has {size} bytes, expected {slots * SLOT_BYTES}")
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        mv = memoryview(self._mm)
        s = slots
        self.oid = mv[0 : 8 * s].cast("Q")
        self.expiry = mv[8 * s : 16 * s].cast("d")
        self.count = mv[16 * s : 20 * s].cast("I")
        self.ref = mv[20 * s : 21 * s]
        self._views = (mv, self.oid, self.expiry, self.count, self.ref)

    @staticmethod
    def create(path: str, slots: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, slots * SLOT_BYTES)  # zeros: no leases
        finally:
            os.close(fd)

    def take(self, slot: int, oid: int, expiry: float) -> None:
        if self.oid[slot] != oid:
            self.oid[slot] = oid
            self.count[slot] = 1
        elif self.count[slot] < _U32_MAX:
            self.count[slot] += 1
        self.expiry[slot] = expiry
        self.ref[slot] = 1

    def drop(self, slot: int, oid: int) -> None:
        if self.oid[slot] == oid and self.count[slot] > 0:
            self.count[slot] -= 1

    def state(self, slot: int, oid: int, now: float) -> int:
        """LEASED (someone reads it), REFERENCED (read since the last look; the flag is cleared:
        CLOCK's second chance) or FREE (evictable)."""
        if self.oid[slot] != oid:
            return FREE
        if self.count[slot] > 0 and self.expiry[slot] > now:
            return LEASED
        if self.ref[slot]:
            self.ref[slot] = 0
            return REFERENCED
        return FREE

    def close(self) -> None:
        for v in reversed(self._views):
            v.release()
        self._mm.close()
