"""``Purger``: removing every object whose key starts with a prefix (one model's, or all) from the
DRAM pool and the disk tier. It serves vLLM's prefix-cache reset (the connector's ``reset_cache``)
and ``lw-pool purge``.

DRAM, in write transactions of at most ``BATCH`` keys under the writer lock (taken in turns, so
other processes' saves go on between batches):

* a committed object nobody leases is removed at once: its generation is cleared first (a reader
  still copying it notices, as after an eviction), then its record, its LRU entry and its extent;
* a committed object someone leases (a load copying it at this moment) stays and is counted in
  ``leased``; the purge tries again until its deadline (a load holds a lease for one step);
* a reservation (a save in flight) loses its key, like a reservation that timed out: its commit
  publishes nothing (its writer gets ``ObjectMissing``), its extent is freed when its writer ends.

Removed objects are not demoted to the disk tier. The disk tier comes after DRAM (``DiskTier.purge``):
this process's queued demotions of matching keys are dropped and matching files removed. State: none
beyond the collaborators it is given.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from lw_core.backends.embedded.disk_tier import DiskTier
from lw_core.backends.embedded.pool_files import PoolFiles
from lw_core.backends.embedded.records import (
    ALLOC,
    BE_U64,
    CIDX,
    COMMITTED,
    MAX_KEY_BYTES,
    NBYTES,
    OBJ_REC,
    OFF,
    OID,
    PAGE,
    ST,
    STAMP,
)
from lw_core.backends.embedded.txn import Tx
from lw_core.procs import Owner

BATCH = 1024  # keys per write transaction: other writers get the lock between batches
RETRY_S = 0.05  # pause before another pass over objects that were leased
COUNTS = ("objects", "bytes", "reservations", "leased", "disk_objects")

R = TypeVar("R")


class WriteTxn(Protocol):
    """Runs ``fn`` in one write transaction under the writer lock (``EmbeddedBackend._write``)."""

    def __call__(self, fn: Callable[[Tx], R]) -> R: ...


class Purger:
    """Purges the pool ``pool`` (and ``disk``, the tier, when on) for the backend owned by ``me``;
    ``write`` runs a function in one write transaction under the writer lock."""

    def __init__(self, pool: PoolFiles, me: Owner, write: WriteTxn) -> None:
        self.pool = pool
        self.me = me
        self.write = write

    def purge(self, prefix: str, timeout_s: float, disk: DiskTier | None) -> dict[str, int]:
        """Remove the objects under ``prefix`` ("" = all); counts of what went and of what stayed
        leased past ``timeout_s`` (``COUNTS``)."""
        if not isinstance(prefix, str):
            raise TypeError(f"embedded pool: purge prefix must be a str, got {type(prefix).__name__}")
        p = prefix.encode()
        if len(p) > MAX_KEY_BYTES:
            raise ValueError(f"embedded pool: purge prefix of {len(p)} bytes is longer than any key ({MAX_KEY_BYTES})")
        out = dict.fromkeys(COUNTS, 0)
        deadline = time.monotonic() + timeout_s
        while True:
            leased = [0]
            start: bytes | None = p
            while start is not None:
                batch: Callable[[Tx], bytes | None] = functools.partial(
                    self._batch, prefix=p, start=start, out=out, leased=leased)
                start = self.write(batch)
            out["leased"] = leased[0]
            if not leased[0] or time.monotonic() >= deadline:
                break
            time.sleep(RETRY_S)
        if disk is not None:
            out["disk_objects"] = disk.purge(p, max(deadline - time.monotonic(), 1.0))
        return out

    def _batch(self, t: Tx, prefix: bytes, start: bytes, out: dict[str, int], leased: list[int]) -> bytes | None:
        """Purge up to ``BATCH`` keys from ``start`` on; the key to resume at, or None when done."""
        pool = self.pool
        todo: list[tuple[bytes, list]] = []
        cur = t.txn.cursor(db=pool.obj)
        if cur.set_range(start):
            for k, v in cur.iternext():
                if not k.startswith(prefix):
                    break
                todo.append((bytes(k), list(OBJ_REC.unpack(v))))
                if len(todo) == BATCH:
                    break
        for bkey, o in todo:
            if o[ST] == COMMITTED:
                if t.rows is None:
                    t.rows = pool.leases.live_rows(self.me)  # dead readers' leases do not count
                page = o[OFF] // PAGE
                if not pool.leases.reclaim(page, o[OID], t.now, t.rows):
                    leased[0] += 1
                    continue
                t.tombs.append((page, o[OID]))  # restored should the transaction fail
                t.txn.delete(BE_U64.pack(o[STAMP]), db=pool.lru)
                t.txn.delete(bkey, db=pool.obj)
                t.free(o[OFF], o[ALLOC])
                t.c[CIDX["objects"]] -= 1
                t.c[CIDX["bytes"]] -= o[NBYTES]
                t.c[CIDX["committed_alloc_bytes"]] -= o[ALLOC]
                out["objects"] += 1
                out["bytes"] += o[NBYTES]
                continue
            t.txn.delete(bkey, db=pool.obj)  # a reservation: its key goes, its extent stays its writer's
            found = t.get_resv(o[OID])
            if found is not None and not found[0].orphan:
                r, rkey = found
                t.put_resv(o[OID], r._replace(orphan=1), rkey)
                t.c[CIDX["orphaned_reservations"]] += 1
            out["reservations"] += 1
        return todo[-1][0] + b"\0" if len(todo) == BATCH else None
