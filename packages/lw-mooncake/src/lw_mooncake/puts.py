"""``StagedPuts``: whole objects put with ``batch_put_from`` from registered put staging.

Invariants:

* One batch at a time uses the staging (its lock is held from the copy in to the put's return).
* A batch never exceeds ``staging_size`` bytes; an object larger than that is refused
  (``BackendError``) before anything is put.
* A put past its deadline retires the staging (``lw_mooncake.buffers.Staging``): the late call
  may still read it, so it is never reused.
* Mooncake's put allocates, transfers, then marks the object complete: none of a failed put is
  visible. The status per object is returned as Mooncake gave it (0: stored).
* ``put_ranges`` (put sessions, ``lw_mooncake.put_sessions``) writes byte ranges into objects
  whose sessions this client started.
* Bytes are sent only from registered memory: an object or range that lies in the put arena
  (``arena``, where reservations' local objects live) goes from there as it is, anything else is
  copied into the staging first. A call that raised (past its deadline) holds the arena extents it
  was given until it returns (``Arena.hold_late``), as it does the staging (retired).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from lw_core.backend import BackendError, BackendUnavailable
from lw_mooncake.arena import Arena
from lw_mooncake.buffers import Staging
from lw_mooncake.client import StoreClient
from lw_mooncake.put_sessions import PutSessions

# An object to put: its key, and its bytes as parts (concatenated in staging).
Item = tuple[str, list[np.ndarray]]
# A range to write into a put session's object: its key, its offset there, its bytes.
Range = tuple[str, int, np.ndarray]
SHORT_WRITE = -1  # a ranged put that reported fewer bytes than sent (not a Mooncake code)


class StagedPuts:
    def __init__(self, client: StoreClient, staging_size: int, arena: Arena | None = None) -> None:
        self.client = client
        self.staging_size = staging_size
        self.arena = arena
        self.counts: Counter[str] = Counter()  # put_direct_bytes (from the arena), put_staged_bytes
        self._staging = Staging(client.store, staging_size, client.calls, "put")

    def _direct(self, data: np.ndarray) -> bool:
        return self.arena is not None and data.nbytes > 0 and self.arena.covers(data)

    def _place(self, parts: list[np.ndarray], buf: np.ndarray, off: int, direct: list[np.ndarray]) -> tuple[int, int]:
        """Where Mooncake reads ``parts`` (one source) from: a single part in the arena as it lies
        (added to ``direct``), else copied into the staging ``buf`` at ``off``. (address, next off)"""
        if len(parts) == 1 and self._direct(parts[0]):
            direct.append(parts[0])
            return int(parts[0].ctypes.data), off
        at = int(buf.ctypes.data) + off
        for p in parts:
            buf[off : off + p.nbytes] = p
            off += p.nbytes
        return at, off

    def _count(self, direct: list[np.ndarray], staged: int) -> None:
        self.counts["put_direct_bytes"] += sum(d.nbytes for d in direct)
        self.counts["put_staged_bytes"] += staged

    def _late(self, e: BackendUnavailable, direct: list[np.ndarray]) -> None:
        self._staging.retire(e)
        if direct and self.arena is not None:
            self.arena.hold_late(self.arena.extents_of(direct), e)

    def put_parts(self, items: list[Item]) -> list[int]:
        """One ``batch_put_from`` of ``items`` (which must fit the staging together); Mooncake's
        status per object."""
        self.client.check_open()
        with self._staging.lock:
            buf = self._staging.get()
            ptrs, sizes, off = [], [], 0
            direct: list[np.ndarray] = []
            for _, parts in items:
                ptr, off = self._place(parts, buf, off, direct)
                ptrs.append(ptr)
                sizes.append(sum(p.nbytes for p in parts))
            self._count(direct, off)
            try:
                return list(self.client.calls.call("batch_put_from", self.client.store.batch_put_from,
                                                   [k for k, _ in items], ptrs, sizes, *self.client.put_args()))
            except BackendUnavailable as e:
                self._late(e, direct)
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

    def put_ranges(self, sessions: PutSessions, ranges: list[Range]) -> list[int]:
        """Writes ``ranges`` into their session objects: one ``batch_put_from_multi_buffer_ranges``
        per staging-full (a key's ranges in one batch go as one entry of several buffers). Status
        per range: 0 when its key's entry landed whole, else Mooncake's code (``SHORT_WRITE`` when
        it reported fewer bytes)."""
        out: list[int] = []
        batch: list[Range] = []
        size = 0
        for r in ranges:
            if r[2].nbytes > self.staging_size:
                raise BackendError(f"ranged put into {r[0]!r}: {r[2].nbytes} bytes exceed mooncake_staging_size="
                                   f"{self.staging_size}")
            n = 0 if self._direct(r[2]) else r[2].nbytes  # only copies take staging room
            if batch and size + n > self.staging_size:
                out += self._ranges(sessions, batch)
                batch, size = [], 0
            batch.append(r)
            size += n
        if batch:
            out += self._ranges(sessions, batch)
        return out

    def _ranges(self, sessions: PutSessions, batch: list[Range]) -> list[int]:
        self.client.check_open()
        entries: dict[str, tuple[list[int], list[int], list[int]]] = {}
        with self._staging.lock:
            buf = self._staging.get()
            off = 0
            direct: list[np.ndarray] = []
            for key, dst, data in batch:
                ptrs, sizes, dsts = entries.setdefault(key, ([], [], []))
                ptr, off = self._place([data], buf, off, direct)
                ptrs.append(ptr)
                sizes.append(data.nbytes)
                dsts.append(dst)
            self._count(direct, off)
            keys = list(entries)
            try:
                res = sessions.ranges(keys, [entries[k][0] for k in keys], [entries[k][1] for k in keys],
                                      [entries[k][2] for k in keys])
            except BackendUnavailable as e:
                self._late(e, direct)
                raise
        status = {k: (r if r < 0 else 0 if r == sum(entries[k][1]) else SHORT_WRITE) for k, r in zip(keys, res)}
        return [status[k] for k, _, _ in batch]
