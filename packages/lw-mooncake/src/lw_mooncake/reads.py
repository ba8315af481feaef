"""Reads of ``MooncakeBackend``: open (sizes from the replica descriptors), then per-layer ranged
gets (``mooncake_load: "per_layer"``) or whole objects fetched at open (``"whole"``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lw_core.backend import BackendError, BackendUnavailable, ObjectMissing
from lw_mooncake.buffers import Staging, byte_view
from lw_mooncake.calls import Deadlines
from lw_mooncake.errors import OBJECT_NOT_FOUND, to_error
from lw_mooncake.handle import MooncakeHandle, MooncakeStreamHandle


class Reads:
    # From MooncakeBackend.
    store: Any
    calls: Deadlines
    staging_size: int
    stats_: Counter[str]
    _check_open: Callable[[], None]
    load: str
    _gets: Staging
    _read_stream: Callable[[Sequence[Any], Sequence[int], Sequence[Any]], None]

    def open(self, keys: Sequence[str]) -> list[MooncakeHandle | None]:
        if not keys:
            return []
        self._check_open()
        sizes = self._sizes(list(dict.fromkeys(keys)))
        fetched = self._fetch_whole(sizes) if self.load == "whole" else None
        out: list[MooncakeHandle | None] = []
        for k in keys:
            if k not in sizes or (fetched is not None and k not in fetched):
                out.append(None)
            else:
                out.append(MooncakeHandle(k, sizes[k], data=None if fetched is None else fetched[k]))
        return out

    def _sizes(self, keys: list[str]) -> dict[str, int]:
        """The sizes of the stored objects among ``keys`` (from their replica descriptors)."""
        self._check_open()
        desc = self.calls.call("batch_get_replica_desc", self.store.batch_get_replica_desc, keys)
        sizes: dict[str, int] = {}
        for k, replicas in desc.items():
            for r in replicas:
                if r.is_memory_replica():
                    sizes[k] = int(r.get_memory_descriptor().buffer_descriptor.size)
                    break
        return sizes

    def _fetch_whole(self, sizes: dict[str, int]) -> dict[str, np.ndarray]:
        """The objects, fetched with ``batch_get_into`` through staging in batches; an object gone
        since its descriptor was read is left out (a miss)."""
        fetched: dict[str, np.ndarray] = {}
        batch: list[str] = []
        total = 0
        for k, n in sizes.items():
            if n > self.staging_size:
                raise BackendError(f"open: {k!r} of {n} bytes exceeds mooncake_staging_size={self.staging_size}")
            if total + n > self.staging_size:
                self._get_whole(batch, sizes, fetched)
                batch, total = [], 0
            batch.append(k)
            total += n
        if batch:
            self._get_whole(batch, sizes, fetched)
        return fetched

    def _get_whole(self, keys: list[str], sizes: dict[str, int], fetched: dict[str, np.ndarray]) -> None:
        self._check_open()
        with self._gets.lock:
            buf = self._gets.get()
            offs = np.cumsum([0] + [sizes[k] for k in keys[:-1]]).tolist()
            base = int(buf.ctypes.data)
            try:
                res = self.calls.call("batch_get_into", self.store.batch_get_into, keys, [base + o for o in offs],
                                      [sizes[k] for k in keys])
            except BackendUnavailable:
                self._gets.retire()
                raise
            for k, o, n in zip(keys, offs, res):
                if n == sizes[k]:
                    fetched[k] = buf[o : o + n].copy()
                    self.stats_["bytes_read"] += n
                elif n != OBJECT_NOT_FOUND:
                    raise to_error(n, f"get of {k!r}") if n < 0 else BackendError(
                        f"get of {k!r}: {n} of {sizes[k]} bytes")

    def read(self, handles: Sequence[MooncakeHandle], offsets: Sequence[int], dsts: Sequence[Any]) -> None:
        if any(isinstance(h, MooncakeStreamHandle) for h in handles):
            self._read_stream(handles, offsets, dsts)
            return
        items = []
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
        batch: list[tuple[str, int, np.ndarray]] = []
        size = 0
        for it in items:
            if size + it[2].nbytes > self.staging_size:
                self._get(batch)
                batch, size = [], 0
            batch.append(it)
            size += it[2].nbytes
        if batch:
            self._get(batch)

    def _get(self, batch: list[tuple[str, int, np.ndarray]], *, missing_ok: bool = False) -> set[str]:
        """Ranged gets of ``(key, offset, into)`` through staging. ``missing_ok``: keys whose object
        is missing or too short are returned (their ``into`` is left as it was) instead of raised."""
        self._check_open()
        missing: set[str] = set()
        by_key: dict[str, list[tuple[int, int, np.ndarray]]] = {}
        pos = 0
        for key, off, arr in batch:
            by_key.setdefault(key, []).append((pos, off, arr))
            pos += arr.nbytes
        keys = list(by_key)
        with self._gets.lock:
            buf = self._gets.get()
            try:
                res = self.calls.call(
                    "get_into_ranges", self.store.get_into_ranges, [int(buf.ctypes.data)], [keys],
                    [[[p for p, _, _ in by_key[k]] for k in keys]], [[[o for _, o, _ in by_key[k]] for k in keys]],
                    [[[a.nbytes for _, _, a in by_key[k]] for k in keys]])
            except BackendUnavailable:
                self._gets.retire()
                raise
            for k, got in zip(keys, res[0]):
                if missing_ok and any(n != arr.nbytes and not (n <= -900 or n == -1)
                                      for (_, _, arr), n in zip(by_key[k], got)):
                    missing.add(k)
                    continue
                for (p, _, arr), n in zip(by_key[k], got):
                    if n < 0:
                        raise to_error(n, f"ranged get of {k!r}") if n != OBJECT_NOT_FOUND else ObjectMissing(
                            f"ranged get of {k!r}: the object is gone (evicted, or the master restarted)")
                    if n != arr.nbytes:
                        raise BackendError(f"ranged get of {k!r}: {n} of {arr.nbytes} bytes")
                    arr[:] = buf[p : p + n]
        self.stats_["bytes_read"] += pos
        return missing

    def release(self, handles: Sequence[MooncakeHandle]) -> None:
        """Drops fetched copies; Mooncake's own read lease is a TTL on the master (``--default_kv_lease_ttl``)."""
        for h in handles:
            if isinstance(h, MooncakeStreamHandle):
                h.dead = True  # ended: it holds nothing, Mooncake's lease is a TTL
            else:
                h.data = None
