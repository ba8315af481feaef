"""``ObjectReader``: the reading half of the ``Backend`` protocol on Mooncake (open, read, view of a
read handle, release); ``lookup`` is one ``StoreClient.exist``.

``open`` takes the objects' sizes from their replica descriptors. Then, by ``load``:
``"per_layer"`` -- each ``read`` is ranged gets of one layer of every object through get staging
(``read_lent``: straight into the get arena, lent to the pipeline), and ``view`` is None; ``"whole"`` -- ``open`` fetches the whole objects into local copies, which
``view`` and ``read`` then serve; ``"auto"`` -- ``"whole"`` when the opened objects together are at
most ``whole_max_bytes`` and each fits the staging, else ``"per_layer"`` (a ranged get costs about
as much per call as a whole get of 16 MiB over TCP: docs/bench/mooncake.md).

Invariants:

* Only complete objects are ever seen (Mooncake marks an object complete after its put), and
  bytes reach a caller only from a get that returned them whole (``StagedGets``).
* Every batch of gets fits ``staging_size``; an object or read larger than that is refused.
* The reader holds no state of its own: a read handle carries its fetched copy (``data``), which
  ``release`` drops (in the get arena, an extent is handed out again only once every handle
  holding it was released); Mooncake's own read lease is a TTL on the master.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from lw_core.backend import BackendError
from lw_mooncake.buffers import byte_view
from lw_mooncake.client import StoreClient
from lw_mooncake.get_arena import ArenaLend
from lw_mooncake.gets import Range, StagedGets
from lw_mooncake.handle import MooncakeHandle, MooncakeStreamHandle


class ObjectReader:
    """Reads through ``client`` and ``gets``; ``load`` is ``"auto"``, ``"per_layer"`` or ``"whole"``."""

    def __init__(self, client: StoreClient, gets: StagedGets, *, load: str, staging_size: int,
                 whole_max_bytes: int = 0) -> None:
        self.client = client
        self.gets = gets
        self.load = load
        self.staging_size = staging_size
        self.whole_max_bytes = whole_max_bytes

    def fetches_whole(self, sizes: dict[str, int]) -> bool:
        """Whether an open of objects of ``sizes`` fetches them whole (by ``load``)."""
        if self.load != "auto":
            return self.load == "whole"
        return (sum(sizes.values()) <= self.whole_max_bytes
                and all(n <= self.staging_size for n in sizes.values()))

    def lookup(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        n = 0
        for r in self.client.exist(list(keys)):
            if r != 1:
                break
            n += 1
        return n

    def open(self, keys: Sequence[str]) -> list[MooncakeHandle | None]:
        if not keys:
            return []
        self.client.check_open()
        sizes = self.client.sizes(list(dict.fromkeys(keys)))
        fetched = self._fetch_whole(sizes) if self.fetches_whole(sizes) else None
        out: list[MooncakeHandle | None] = []
        for k in keys:
            if k not in sizes or (fetched is not None and k not in fetched):
                out.append(None)
            else:
                out.append(MooncakeHandle(k, sizes[k], data=None if fetched is None else fetched[k]))
        if fetched:  # each handle holds its object's arena extent until release
            per_key = Counter(keys)
            for k, arr in fetched.items():
                self._hold(arr, per_key[k])
        return out

    def _hold(self, arr: np.ndarray, holders: int) -> None:
        """``GetArena.hold`` of a fetched copy that lies in the get arena (others are plain arrays)."""
        arena = self.gets.arena
        if arena is not None and arena.covers(arr):
            arena.hold(arr, holders)

    def _fetch_whole(self, sizes: dict[str, int]) -> dict[str, np.ndarray]:
        """The objects, fetched in batches that fit the staging; an object gone since its
        descriptor was read is left out (a miss). On an error, what was fetched is let go."""
        fetched: dict[str, np.ndarray] = {}
        batch: list[str] = []
        total = 0
        try:
            for k, n in sizes.items():
                if n > self.staging_size:
                    raise BackendError(f"open: {k!r} of {n} bytes exceeds mooncake_staging_size={self.staging_size}")
                if total + n > self.staging_size:
                    self.gets.whole(batch, sizes, fetched)
                    batch, total = [], 0
                batch.append(k)
                total += n
            if batch:
                self.gets.whole(batch, sizes, fetched)
        except BaseException:
            for arr in fetched.values():
                self._hold(arr, 0)
            raise
        return fetched

    def view(self, handle: MooncakeHandle, offset: int, nbytes: int) -> memoryview | None:
        """A read-only view of a read handle's fetched copy ("whole"); None without one."""
        if handle.data is None:
            return None  # the object lives in other hosts' segments
        if offset < 0 or offset + nbytes > handle.nbytes:
            raise ValueError(f"view: range [{offset}, {offset + nbytes}) outside {handle.key!r} of {handle.nbytes} bytes")
        return handle.data[offset : offset + nbytes].data.toreadonly()

    def read(self, handles: Sequence[MooncakeHandle], offsets: Sequence[int], dsts: Sequence[Any]) -> None:
        items: list[Range] = []
        for h, off, dst in zip(handles, offsets, dsts, strict=True):
            arr = byte_view(dst, writable=True, what="read")
            if off < 0 or off + arr.nbytes > h.nbytes:
                raise ValueError(f"read: range [{off}, {off + arr.nbytes}) outside {h.key!r} of {h.nbytes} bytes")
            if h.data is not None:
                arr[:] = h.data[off : off + arr.nbytes]
                continue
            if arr.nbytes > self.staging_size:
                raise BackendError(f"read: {arr.nbytes} bytes exceed mooncake_staging_size={self.staging_size}")
            items.append((h.key, off, arr))
        batch: list[Range] = []
        size = 0
        for it in items:
            if size + it[2].nbytes > self.staging_size:
                self.gets.ranges(batch)
                batch, size = [], 0
            batch.append(it)
            size += it[2].nbytes
        if batch:
            self.gets.ranges(batch)

    def read_lent(self, handles: Sequence[MooncakeHandle], offsets: Sequence[int], nbytes: int) -> ArenaLend | None:
        """``read`` of ``nbytes`` from each handle into the get arena, lent (``StagedGets.lent``):
        one call for the batch, no copy out of staging. None for fetched copies (``view`` serves
        them), a batch past the staging size (as ``read`` batches) or without room in the arena."""
        if not handles or any(h.data is not None for h in handles) or nbytes * len(handles) > self.staging_size:
            return None
        for h, off in zip(handles, offsets, strict=True):
            if off < 0 or off + nbytes > h.nbytes:
                raise ValueError(f"read: range [{off}, {off + nbytes}) outside {h.key!r} of {h.nbytes} bytes")
        return self.gets.lent([(h.key, off) for h, off in zip(handles, offsets)], nbytes)

    def release(self, handles: Sequence[MooncakeHandle | MooncakeStreamHandle]) -> None:
        """Drops fetched copies (an arena extent is free once its last handle is released); a
        streaming handle ends (it holds nothing, Mooncake's lease is a TTL)."""
        for h in handles:
            if isinstance(h, MooncakeStreamHandle):
                h.dead = True
            elif h.data is not None:
                data, h.data = h.data, None
                self._hold(data, -1)
