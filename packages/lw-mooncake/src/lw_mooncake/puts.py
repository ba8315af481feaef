"""``StagedPuts``: whole objects put with ``batch_put_from`` from registered put staging.

Invariants:

* One batch at a time uses the staging (its lock is held from the copy in to the put's return).
* A batch never exceeds ``staging_size`` bytes; an object larger than that is refused
  (``BackendError``) before anything is put.
* A put past its deadline retires the staging (``lw_mooncake.buffers.Staging``): the late call
  may still read it, so it is never reused.
* Mooncake's put allocates, transfers, then marks the object complete: none of a failed put is
  visible. The status per object is returned as Mooncake gave it (0: stored).
"""

from __future__ import annotations

import numpy as np

from lw_core.backend import BackendError, BackendUnavailable
from lw_mooncake.buffers import Staging
from lw_mooncake.client import StoreClient

# An object to put: its key, and its bytes as parts (concatenated in staging).
Item = tuple[str, list[np.ndarray]]


class StagedPuts:
    def __init__(self, client: StoreClient, staging_size: int) -> None:
        self.client = client
        self.staging_size = staging_size
        self._staging = Staging(client.store, staging_size, client.calls, "put")

    def put_parts(self, items: list[Item]) -> list[int]:
        """One ``batch_put_from`` of ``items`` (which must fit the staging together); Mooncake's
        status per object."""
        self.client.check_open()
        with self._staging.lock:
            buf = self._staging.get()
            base, ptrs, sizes, off = int(buf.ctypes.data), [], [], 0
            for _, parts in items:
                ptrs.append(base + off)
                for p in parts:
                    buf[off : off + p.nbytes] = p
                    off += p.nbytes
                sizes.append(base + off - ptrs[-1])
            try:
                return list(self.client.calls.call("batch_put_from", self.client.store.batch_put_from,
                                                   [k for k, _ in items], ptrs, sizes))
            except BackendUnavailable:
                self._staging.retire()
                raise

    def put_all(self, items: list[Item]) -> list[int]:
        """``put_parts`` in batches that fit the staging (small objects: heads, segments, markers)."""
        res: list[int] = []
        batch: list[Item] = []
        size = 0
        for it in items:
            n = sum(p.nbytes for p in it[1])
            if n > self.staging_size:
                raise BackendError(f"put of {it[0]!r}: {n} bytes exceed mooncake_staging_size={self.staging_size}")
            if batch and size + n > self.staging_size:
                res += self.put_parts(batch)
                batch, size = [], 0
            batch.append(it)
            size += n
        if batch:
            res += self.put_parts(batch)
        return res
