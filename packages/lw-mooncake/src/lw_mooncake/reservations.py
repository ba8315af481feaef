"""``Reservations``: this process's open reservations, key -> the handle holding its local object.

Invariants:

* At most one open reservation per key in this process; a key stored in Mooncake is never
  reserved (the caller passes ``batch_is_exist``'s answer).
* A handle is *held* while it is the table's entry for its key and still has its local buffer;
  ``end`` (commit, abort) drops the entry and the buffer together, so a held handle's buffer is
  the object that ``commit`` will put.
* Every change is under ``lock``; ``holds`` reads without it (one dict lookup).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from lw_mooncake.handle import MooncakeHandle


class Reservations:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, MooncakeHandle] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def reserve(self, keys: Sequence[str], stored: Sequence[int], nbytes: int) -> list[MooncakeHandle | None]:
        """A handle with a zeroed local object of ``nbytes`` per key neither ``stored`` (1) nor
        reserved here already; None for the others."""
        out: list[MooncakeHandle | None] = []
        with self._lock:
            for k, e in zip(keys, stored):
                if e == 1 or k in self._open:
                    out.append(None)
                    continue
                h = MooncakeHandle(k, nbytes, np.zeros(nbytes, np.uint8), reserved=True)
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

    def end(self, handles: Sequence[MooncakeHandle]) -> None:
        """The reservations of ``handles`` end: their entries (where still theirs) and buffers go."""
        with self._lock:
            for h in handles:
                if self._open.get(h.key) is h:
                    del self._open[h.key]
                h.buf = None

    def clear(self) -> None:
        with self._lock:
            self._open.clear()
