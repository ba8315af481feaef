"""Free-extent allocator of the embedded pool's data arena, kept inside LMDB.

Every process allocates from the same arena, so the free list lives in the shared index and is
changed only inside the caller's write transaction (which makes it atomic with the object records
that own the space). Two tables describe the same extents:

* ``by_off``:  offset (8 bytes big-endian) -> size (8 bytes little-endian): neighbours for
  coalescing on free;
* ``by_size``: size || offset (both big-endian) -> empty: best fit with one ``set_range``.

Extents are page multiples (the caller rounds), so every object starts page-aligned.
"""

from __future__ import annotations

import struct
from typing import Any

_BE = struct.Struct(">Q")
_BE2 = struct.Struct(">QQ")
_LE = struct.Struct("<Q")


class ArenaCorrupt(RuntimeError):
    """The free list contradicts itself (double free or overlap): a bug, never silently ignored."""


class ExtentAllocator:
    def __init__(self, by_off: Any, by_size: Any) -> None:
        self.by_off = by_off
        self.by_size = by_size

    def init(self, txn: Any, capacity: int) -> None:
        """Fresh arena: one free extent covering everything."""
        self._insert(txn, 0, capacity)

    def alloc(self, txn: Any, size: int) -> int | None:
        """Offset of a new extent of ``size`` bytes (best fit), or None when no free extent fits."""
        cur = txn.cursor(db=self.by_size)
        if not cur.set_range(_BE2.pack(size, 0)):
            return None
        have, off = _BE2.unpack(cur.key())
        cur.delete()
        if not txn.delete(_BE.pack(off), db=self.by_off):
            raise ArenaCorrupt(f"free extent {off}+{have} is in by_size but not in by_off")
        if have > size:
            self._insert(txn, off + size, have - size)
        return off

    def free(self, txn: Any, off: int, size: int) -> None:
        """Return ``[off, off+size)`` to the free list, merged with free neighbours."""
        if size <= 0:
            raise ArenaCorrupt(f"free of an empty extent at {off}")
        cur = txn.cursor(db=self.by_off)
        # Read both neighbours before changing anything: deletes move cursors.
        nxt = prv = None
        if cur.set_range(_BE.pack(off)):
            nxt = (_BE.unpack(cur.key())[0], _LE.unpack(cur.value())[0])
            found_prev = cur.prev()
        else:
            found_prev = cur.last()
        if found_prev:
            prv = (_BE.unpack(cur.key())[0], _LE.unpack(cur.value())[0])
        start, end = off, off + size
        if nxt is not None:
            if nxt[0] < end:
                raise ArenaCorrupt(f"free of {off}+{size} overlaps free extent {nxt[0]}+{nxt[1]}")
            if nxt[0] == end:
                self._remove(txn, *nxt)
                end = nxt[0] + nxt[1]
        if prv is not None:
            if prv[0] + prv[1] > off:
                raise ArenaCorrupt(f"free of {off}+{size} overlaps free extent {prv[0]}+{prv[1]}")
            if prv[0] + prv[1] == off:
                self._remove(txn, *prv)
                start = prv[0]
        self._insert(txn, start, end - start)

    def extents(self, txn: Any) -> list[tuple[int, int]]:
        """All free extents (offset, size) in offset order; for checks and stats."""
        return [(_BE.unpack(k)[0], _LE.unpack(v)[0]) for k, v in txn.cursor(db=self.by_off)]

    def _insert(self, txn: Any, off: int, size: int) -> None:
        txn.put(_BE.pack(off), _LE.pack(size), db=self.by_off)
        txn.put(_BE2.pack(size, off), b"", db=self.by_size)

    def _remove(self, txn: Any, off: int, size: int) -> None:
        txn.delete(_BE.pack(off), db=self.by_off)
        if not txn.delete(_BE2.pack(size, off), db=self.by_size):
            raise ArenaCorrupt(f"free extent {off}+{size} is in by_off but not in by_size")
