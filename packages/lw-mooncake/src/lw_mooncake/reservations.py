"""``Reservations``: this process's open reservations, key -> the handle holding its local object.

A local object is an extent of the put arena (``lw_mooncake.arena``, registered with Mooncake and
offered to a device copier: puts send from it and a device writes into it with no staging in
between) when the arena has room, else a zeroed array of its own.

Invariants:

* At most one open reservation per key in this process; a key stored in Mooncake is never
  reserved (the caller passes ``batch_is_exist``'s answer).
* A handle is *held* while it is the table's entry for its key and still has its local buffer;
  ``end`` (commit, abort) drops the entry and the buffer together, so a held handle's buffer is
  the object that ``commit`` will put.
* An arena extent is held by its reservation and by every call using it (``pin``); it is freed
  only when the last of them let go, so a write or put still running when the reservation ends
  never finds its memory given to another reservation.
* An arena extent is not zeroed when taken: its writers zero what was never written (``zero``)
  before the object is put, so what is stored equals what a zeroed array would hold.
* Every change is under ``lock``; ``holds`` reads without it (one dict lookup).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from lw_mooncake.arena import Arena
from lw_mooncake.handle import MooncakeHandle


def uncovered(ranges: Sequence[tuple[int, int]], nbytes: int) -> list[tuple[int, int]]:
    """The ranges of ``[0, nbytes)`` that ``ranges`` do not cover."""
    out, at = [], 0
    for a, b in sorted(ranges):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < nbytes:
        out.append((at, nbytes))
    return out


class Reservations:
    def __init__(self, arena: Arena | None = None) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, MooncakeHandle] = {}
        self.arena = arena  # where local objects live when it has room

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def reserve(self, keys: Sequence[str], stored: Sequence[int], nbytes: int) -> list[MooncakeHandle | None]:
        """A handle with a local object of ``nbytes`` per key neither ``stored`` (1) nor reserved
        here already; None for the others."""
        out: list[MooncakeHandle | None] = []
        arena = self.arena if nbytes and self.arena is not None and self.arena.ready() else None  # registered outside the lock
        with self._lock:
            for k, e in zip(keys, stored):
                if e == 1 or k in self._open:
                    out.append(None)
                    continue
                got = arena.take([nbytes]) if arena is not None else None
                if got is None:
                    arena = None  # full: the rest of this batch takes arrays of their own
                    h = MooncakeHandle(k, nbytes, np.zeros(nbytes, np.uint8), reserved=True)
                else:
                    assert arena is not None
                    arena.hold_at(got[0], 1)
                    h = MooncakeHandle(k, nbytes, arena.buf[got[0] : got[0] + nbytes], reserved=True, extent=got[0])
                self._open[k] = h
                out.append(h)
        return out

    def is_open(self, key: str) -> bool:
        """``key`` has an open reservation here."""
        with self._lock:
            return key in self._open

    def holds(self, h: MooncakeHandle) -> bool:
        """``h`` is an open reservation here (not committed, aborted or dropped at close)."""
        return h.buf is not None and self._open.get(h.key) is h

    def held(self, handles: Sequence[MooncakeHandle]) -> list[bool]:
        """``holds`` of each handle, at one moment."""
        with self._lock:
            return [self.holds(h) for h in handles]

    def handles(self) -> list[MooncakeHandle]:
        with self._lock:
            return list(self._open.values())

    def pin(self, handles: Sequence[MooncakeHandle]) -> list[int]:
        """Hold the arena extents of the held ``handles`` for a call that uses their memory (a
        write, a put); ``unpin`` the answer when it returned."""
        if self.arena is None:
            return []
        out = []
        with self._lock:
            for h in handles:
                if h.extent is not None and self.holds(h):
                    self.arena.hold_at(h.extent, 1)
                    out.append(h.extent)
        return out

    def unpin(self, extents: Sequence[int]) -> None:
        if self.arena is not None:
            for off in extents:
                self.arena.hold_at(off, -1)

    @staticmethod
    def zero(h: MooncakeHandle, ranges: Sequence[tuple[int, int]]) -> None:
        """Zero ``ranges`` (never written) of an arena-held local object; a fresh array is zeroed
        already."""
        if h.extent is not None and h.buf is not None:
            for a, b in ranges:
                h.buf[a:b] = 0

    def end(self, handles: Sequence[MooncakeHandle]) -> None:
        """The reservations of ``handles`` end: their entries (where still theirs) and buffers go."""
        with self._lock:
            for h in handles:
                if self._open.get(h.key) is h:
                    del self._open[h.key]
                    if h.extent is not None and self.arena is not None:
                        self.arena.hold_at(h.extent, -1)
                h.buf = None

    def clear(self) -> None:
        with self._lock:
            self._open.clear()
