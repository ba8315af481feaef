"""``Verifier``: the pool's shared counters, its open reservations and the full-index consistency
check, all read from one read transaction of the pool files each (no lock, no state of its own)."""

from __future__ import annotations

from lw_core.backend import BackendError
from lw_core.backends.embedded.pool_files import PoolFiles
from lw_core.backends.embedded.records import (
    ALLOC,
    BE_U64,
    COMMITTED,
    COUNTERS,
    COUNTERS_REC,
    NBYTES,
    OBJ_REC,
    OFF,
    OID,
    RESERVED,
    ST,
    STAMP,
    unpack_resv,
)


class Verifier:
    """Reads of the whole pool ``pool`` (its index and its capacity)."""

    def __init__(self, pool: PoolFiles) -> None:
        self.pool = pool

    def counters(self) -> dict[str, int]:
        """The counters every process shares (``COUNTERS`` less ``next_id``) and ``capacity_bytes``."""
        with self.pool.read() as txn:
            c = COUNTERS_REC.unpack(txn.get(b"counters", db=self.pool.meta))
        out = {name: int(v) for name, v in zip(COUNTERS, c) if name != "next_id"}
        out["capacity_bytes"] = self.pool.capacity
        return out

    def open_reservations(self) -> dict[int, tuple[str, int, int]]:
        """Every reservation not yet committed: object id -> (key, published bytes, size). A
        reservation that was never published (a non-streaming writer) shows 0 published bytes."""
        out: dict[int, tuple[str, int, int]] = {}
        with self.pool.read() as txn:
            for k, v in txn.cursor(db=self.pool.obj):
                o = OBJ_REC.unpack(v)
                if o[ST] == RESERVED:
                    out[o[OID]] = (bytes(k).decode(errors="replace"), o[STAMP], o[NBYTES])
        return out

    def verify(self) -> dict[str, int]:
        """Walk the whole index and check that objects, reservations and free extents tile the arena
        exactly and that the counters agree; raises ``BackendError`` on any contradiction."""
        extents: list[tuple[int, int, str]] = []
        n_obj = n_bytes = n_resv = 0
        with self.pool.read() as txn:
            for k, v in txn.cursor(db=self.pool.obj):
                o = OBJ_REC.unpack(v)
                if o[ST] == COMMITTED:
                    extents.append((o[OFF], o[ALLOC], f"object {bytes(k)!r}"))
                    n_obj += 1
                    n_bytes += o[NBYTES]
                    if bytes(txn.get(BE_U64.pack(o[STAMP]), db=self.pool.lru) or b"") != bytes(k):
                        raise BackendError(f"embedded pool: object {bytes(k)!r} is missing from the LRU order")
            for k, v in txn.cursor(db=self.pool.resv):
                r, _ = unpack_resv(v)
                extents.append((r.off, r.alloc, f"reservation {BE_U64.unpack(k)[0]}"))
                n_resv += 1
            extents += [(o, s, "free") for o, s in self.pool.alloc.extents(txn)]
            c = dict(zip(COUNTERS, COUNTERS_REC.unpack(txn.get(b"counters", db=self.pool.meta))))
            n_lru = txn.stat(self.pool.lru)["entries"]
        pos = 0
        for off, size, what in sorted(extents):
            if off != pos:
                raise BackendError(f"embedded pool: arena {'gap' if off > pos else 'overlap'} at {pos} before {what} at {off}")
            pos = off + size
        if pos != self.pool.capacity:
            raise BackendError(f"embedded pool: extents end at {pos}, capacity is {self.pool.capacity}")
        got = {"objects": n_obj, "bytes": n_bytes, "reserved_objects": n_resv}
        for name, v in got.items():
            if c[name] != v:
                raise BackendError(f"embedded pool: counter {name}={c[name]} but the index holds {v}")
        if n_lru != n_obj:
            raise BackendError(f"embedded pool: {n_lru} LRU entries for {n_obj} objects")
        return got
