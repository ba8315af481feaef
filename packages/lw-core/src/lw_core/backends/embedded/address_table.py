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
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from lw_core.backends.embedded.records import PAGE, EmbeddedHandle, StateClock, own_handle

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

    __slots__ = ("handles", "cols", "present", "_clock", "_states", "checked")

    def __init__(self, handles: list[EmbeddedHandle | None], cols: np.ndarray, clock: StateClock, present: np.ndarray):
        self.handles = handles  # None: no object (an item that failed before the copy)
        self.cols = cols  # int64 [n, 6]: the fixed fields above, zeros for None
        self.present = present  # bool [n]: which rows have a handle
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
    ``clock``: their pool's ``StateClock``. Column by column, and a column whose value every
    handle shares (the object size, the pool attachment: the usual step) is filled at once:
    turning Python ints into an array is what this costs."""
    hs = list(handles)
    if any(type(h) is not EmbeddedHandle for h in hs):
        hs = [None if h is None else own_handle(h, "address_table") for h in hs]
    cols = np.zeros((len(hs), 6), dtype=np.int64)
    gaps = None in hs
    present = np.array([h is not None for h in hs], dtype=bool) if gaps else np.ones(len(hs), dtype=bool)
    live: list[EmbeddedHandle] = [h for h in hs if h is not None] if gaps else hs
    if live:
        at: Any = slice(None) if len(live) == len(hs) else np.flatnonzero(present)
        for col, get in ((OFF, _OFF), (NBYTES, _NBYTES), (EPOCH, _EPOCH), (LEASE, _LEASE), (OID, _OID)):
            vals = set(map(get, live)) if col in (NBYTES, EPOCH) else None
            if vals is not None and len(vals) == 1:
                cols[at, col] = vals.pop()
            else:
                cols[at, col] = np.fromiter(map(get, live), dtype=np.int64, count=len(live))
        cols[at, SLOT] = cols[at, OFF] // PAGE  # the generation slot of an object at that offset
    return AddressTable(hs, cols, clock, present)


_OFF, _NBYTES, _EPOCH = attrgetter("_off"), attrgetter("nbytes"), attrgetter("_epoch")
_LEASE, _OID = attrgetter("_lease"), attrgetter("_oid")
