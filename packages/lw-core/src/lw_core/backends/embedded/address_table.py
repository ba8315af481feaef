"""Per-step table of the handles whose windows a device copier moves by address.

A layerwise step moves the same objects once per layer. ``view_addresses`` used to turn each
batch's handles into arrays on every layer (half a microsecond per window, the largest host cost
per window on a device); the table does the fixed part once per step: the fields a handle keeps
for its life (where its object lies, its size, its pool attachment, lease entry, object id and
generation slot). What can change during a step (reserved, leased or streaming: a commit, an
abort, a release) is read from the handles again whenever the pool's ``StateClock`` has ticked
since the last reading, so a query never answers from a stale flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from lw_core.backends.embedded.records import EmbeddedHandle, StateClock, own_handle

# Columns of ``AddressTable.cols`` (int64).
OFF, NBYTES, EPOCH, LEASE, OID, SLOT = range(6)  # SLOT: the generation slot (leases.py)
# Bits of the per-query flags.
WRITABLE, LEASED, STREAM = 1, 2, 4


class Checked(NamedTuple):
    """What the last full check of a table's handles proved (``ObjectReader.table_addresses``):
    at pool-state clock reading ``clock`` and attachment ``epoch``, the rows in ``ok`` had their
    windows in the arena (read leases held, fresh, on their own objects), and every such lease
    stays more than half its time-to-live away from expiring until ``until`` (wall clock). While
    all of that still reads the same, the rows need no look at their handles or leases again: a
    leased object is not evicted before its lease expires, nothing but this process's own release
    ends its lease (which ticks the clock), and the caller checks ``intact`` after its copies."""

    clock: int
    epoch: int
    until: float
    ok: np.ndarray  # bool, one per row of the table


class AddressTable:
    """The fixed fields of a step's handles (``cols``) and, cached, their mutable state and what
    their last full check proved (``checked``)."""

    __slots__ = ("handles", "cols", "_clock", "_states", "checked")

    def __init__(self, handles: list[EmbeddedHandle | None], cols: np.ndarray, clock: StateClock):
        self.handles = handles  # None: no object (an item that failed before the copy)
        self.cols = cols  # int64 [n, 6]: the fixed fields above, zeros for None
        self._clock = clock
        self._states: tuple[int, np.ndarray] | None = None  # (clock reading, flags of every row)
        self.checked: Checked | None = None  # replaced whole, never changed in place

    @property
    def clock_now(self) -> int:
        return self._clock.now

    def proven(self, rows: np.ndarray, epoch: int, now: float, end: int) -> bool:
        """Whether the last full check still covers windows ``[.., end)`` of the handles at
        ``rows`` (``end``: offset + nbytes of the window) at wall time ``now`` (see ``Checked``)."""
        c = self.checked
        return (c is not None and c.clock == self._clock.now and c.epoch == epoch and now < c.until
                and bool(c.ok[rows].all()) and bool((self.cols[rows, NBYTES] >= end).all()))

    def flags(self, rows: np.ndarray) -> np.ndarray:
        """The mutable state of the handles at ``rows`` now (``WRITABLE | LEASED | STREAM`` bits).

        Read from every handle once, then again only after the pool's ``StateClock`` ticked (a
        commit, abort or release anywhere in the pool): the clock is read before the handles, and
        every change ticks after it is made, so a cached reading is never older than the clock
        value it is stored with. Stored as one tuple, so two threads refreshing it at once can
        only leave a reading that the next query refreshes again."""
        now = self._clock.now
        states = self._states
        if states is None or states[0] != now:
            states = (now, _read_flags(self.handles))
            self._states = states
        return states[1][rows]


def _read_flags(hs: list[EmbeddedHandle | None]) -> np.ndarray:
    return np.fromiter((0 if h is None else h._writable + 2 * h._leased + 4 * h._stream for h in hs),
                       dtype=np.int64, count=len(hs))


def build_table(handles: Sequence[Any], clock: StateClock) -> AddressTable:
    """The table of ``handles`` (this backend's handles, or None for an item with no object);
    ``clock``: their pool's ``StateClock``."""
    hs = [None if h is None else own_handle(h, "address_table") for h in handles]
    cols = np.zeros((len(hs), 6), dtype=np.int64)
    fixed = [(h._off, h.nbytes, h._epoch, h._lease, h._oid, h._pg) for h in hs if h is not None]
    if fixed:
        at = np.fromiter((i for i, h in enumerate(hs) if h is not None), dtype=np.int64, count=len(fixed))
        cols[at] = np.array(fixed, dtype=np.int64).reshape(len(fixed), 6)
    return AddressTable(hs, cols, clock)
