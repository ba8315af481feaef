"""Per-step table of the handles whose windows a device copier moves by address.

A layerwise step moves the same objects once per layer. ``view_addresses`` used to turn each
batch's handles into arrays on every layer (half a microsecond per window, the largest host cost
per window on a device); the table does the fixed part once per step: the fields a handle keeps
for its life (where its object lies, its size, its pool attachment, lease entry, object id and
generation slot). What can change during a step (reserved, leased or streaming: a commit, an
abort, a release, a switch to streaming) is read from the handles on every query, so a query never
answers from a stale flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lw_core.backends.embedded.records import EmbeddedHandle, own_handle

# Columns of ``AddressTable.cols`` (int64).
OFF, NBYTES, EPOCH, LEASE, OID, SLOT = range(6)  # SLOT: the generation slot (leases.py)
# Bits of the per-query flags.
WRITABLE, LEASED, STREAM = 1, 2, 4


@dataclass(frozen=True)
class AddressTable:
    handles: list[EmbeddedHandle | None]  # None: no object (an item that failed before the copy)
    cols: np.ndarray  # int64 [n, 6]: the fixed fields above, zeros for None

    def flags(self, rows: np.ndarray) -> np.ndarray:
        """The mutable state of the handles at ``rows`` now (``WRITABLE | LEASED | STREAM`` bits)."""
        hs = self.handles
        out = np.fromiter((h._writable + 2 * h._leased + 4 * h._stream for h in map(hs.__getitem__, rows.tolist())),  # type: ignore[union-attr]
                          dtype=np.int64, count=len(rows))
        return out


def build_table(handles: Sequence[Any]) -> AddressTable:
    """The table of ``handles`` (this backend's handles, or None for an item with no object)."""
    hs = [None if h is None else own_handle(h, "address_table") for h in handles]
    cols = np.zeros((len(hs), 6), dtype=np.int64)
    fixed = [(h._off, h.nbytes, h._epoch, h._lease, h._oid, h._pg) for h in hs if h is not None]
    if fixed:
        at = np.fromiter((i for i, h in enumerate(hs) if h is not None), dtype=np.int64, count=len(fixed))
        cols[at] = np.array(fixed, dtype=np.int64).reshape(len(fixed), 6)
    return AddressTable(hs, cols)
