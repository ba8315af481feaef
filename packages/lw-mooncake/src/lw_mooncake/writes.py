"""Writes of ``MooncakeBackend``: reserve a local object, fill it layer by layer, put it whole at
commit (``batch_put_from`` from registered staging), so only complete objects are ever visible."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lw_core.backend import BackendError, BackendUnavailable, ObjectMissing
from lw_mooncake.buffers import Staging, byte_view
from lw_mooncake.calls import Deadlines
from lw_mooncake.errors import to_error
from lw_mooncake.handle import MooncakeHandle, MooncakeStreamHandle


class Writes:
    # From MooncakeBackend.
    store: Any
    calls: Deadlines
    staging_size: int
    stats_: Counter[str]
    _check_open: Callable[[], None]
    _lock: threading.Lock
    _pending: dict[str, MooncakeHandle]
    _puts: Staging
    _exist: Callable[[list[str]], list[int]]
    _streaming: bool
    _wstreams: dict[str, Any]
    _stream_start: Callable[[Sequence[MooncakeHandle | None]], None]
    _stream_end: Callable[..., None]
    _go_quiet: Callable[[], None]

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[MooncakeHandle | None]:
        if nbytes < 0:
            raise ValueError(f"reserve: nbytes={nbytes} must be >= 0")
        if nbytes > self.staging_size:
            raise BackendError(f"reserve: an object of {nbytes} bytes exceeds mooncake_staging_size={self.staging_size}")
        if not keys:
            return []
        exists = self._exist(list(keys))
        out: list[MooncakeHandle | None] = []
        with self._lock:
            for k, e in zip(keys, exists):
                if e == 1 or k in self._pending:
                    out.append(None)
                    continue
                h = MooncakeHandle(k, nbytes, np.zeros(nbytes, np.uint8), reserved=True)
                self._pending[k] = h
                out.append(h)
        self._stream_start(out)
        return out

    def _local(self, h: MooncakeHandle, off: int, n: int, what: str) -> np.ndarray:
        buf = h.buf
        if buf is None or self._pending.get(h.key) is not h:
            raise ObjectMissing(f"{what}: {h.key!r} is not reserved here (committed or aborted)")
        if off < 0 or off + n > h.nbytes:
            raise ValueError(f"{what}: range [{off}, {off + n}) outside {h.key!r} of {h.nbytes} bytes")
        if self._streaming and n:
            with self._lock:  # streaming: publish cuts segments where written ranges end
                ws = self._wstreams.get(h.key)
                if ws is not None:
                    ws.ends.add(off + n)
        return buf[off : off + n]

    def write(self, handles: Sequence[MooncakeHandle], offsets: Sequence[int], srcs: Sequence[Any]) -> None:
        n = 0
        for h, off, src in zip(handles, offsets, srcs, strict=True):
            data = byte_view(src, writable=False, what="write")
            self._local(h, off, data.nbytes, "write")[:] = data
            n += data.nbytes
        self.stats_["bytes_written"] += n

    def view(self, handle: MooncakeHandle, offset: int, nbytes: int) -> memoryview | None:
        if isinstance(handle, MooncakeStreamHandle):
            return None  # streaming reads copy (a segment proves its bytes only when fetched)
        if handle.data is not None:  # a read handle fetched whole
            if offset < 0 or offset + nbytes > handle.nbytes:
                raise ValueError(f"view: range [{offset}, {offset + nbytes}) outside {handle.key!r} of {handle.nbytes} bytes")
            return handle.data[offset : offset + nbytes].data.toreadonly()
        if handle.buf is None:
            return None  # a read handle: the object lives in other hosts' segments
        return self._local(handle, offset, nbytes, "view").data

    def commit(self, handles: Sequence[MooncakeHandle]) -> None:
        """Puts the objects; raises the first error (and how many more) when any put failed. A
        handle whose put succeeded, here or before, counts as committed: the layer pipeline, after
        a failed batch, commits each object again to find the failed ones. A failed one is dropped
        (nothing of it is visible) and committing it again raises its put's error again."""
        with self._lock:
            todo = [h for h in handles if not h.committed]
            again = [h.failed for h in todo if h.failed is not None]
            todo = [h for h in todo if h.failed is None]
            missing = [h.key for h in todo if h.buf is None or self._pending.get(h.key) is not h]
            live = [h for h in todo if h.key not in missing]
        errors: list[BackendError] = [type(e)(str(e)) for e in again]
        try:
            for batch in self._batches(live):
                errors += self._put(batch)
        except BackendError as e:  # e.g. a put past its deadline: this and any later batch failed
            for h in live:
                if not h.committed and h.failed is None:
                    h.failed = e
            if isinstance(e, BackendUnavailable) and self._streaming:
                self._go_quiet()  # no streaming clean-up calls into a store that does not answer
            raise
        finally:
            with self._lock:
                for h in live:
                    if self._pending.get(h.key) is h:
                        del self._pending[h.key]
                    h.buf = None
            if self._streaming:
                self._stream_end([h for h in live if h.committed], aborted=False)
                self._stream_end([h for h in live if not h.committed], aborted=True)
        if missing:
            errors.insert(0, ObjectMissing(f"commit: {', '.join(map(repr, missing))} not reserved (aborted)"))
        if errors:
            if len(errors) > 1:
                raise type(errors[0])(f"{errors[0]} (and {len(errors) - 1} more of {len(handles)})")
            raise errors[0]

    def _batches(self, hs: list[MooncakeHandle]) -> list[list[MooncakeHandle]]:
        out: list[list[MooncakeHandle]] = []
        size = self.staging_size + 1
        for h in hs:
            if size + h.nbytes > self.staging_size:
                out.append([])
                size = 0
            out[-1].append(h)
            size += h.nbytes
        return out

    def _put_parts(self, items: list[tuple[str, list[np.ndarray]]]) -> list[int]:
        """One ``batch_put_from`` of objects given as parts (concatenated in staging, which they
        must fit); Mooncake's status per object."""
        self._check_open()
        with self._puts.lock:
            buf = self._puts.get()
            base, ptrs, sizes, off = int(buf.ctypes.data), [], [], 0
            for _, parts in items:
                ptrs.append(base + off)
                for p in parts:
                    buf[off : off + p.nbytes] = p
                    off += p.nbytes
                sizes.append(base + off - ptrs[-1])
            try:
                return list(self.calls.call("batch_put_from", self.store.batch_put_from, [k for k, _ in items], ptrs, sizes))
            except BackendUnavailable:
                self._puts.retire()
                raise

    def _put_all(self, items: list[tuple[str, list[np.ndarray]]]) -> list[int]:
        """``_put_parts`` in batches that fit the staging (small objects: heads, segments, markers)."""
        res: list[int] = []
        batch: list[tuple[str, list[np.ndarray]]] = []
        size = 0
        for it in items:
            n = sum(p.nbytes for p in it[1])
            if n > self.staging_size:
                raise BackendError(f"put of {it[0]!r}: {n} bytes exceed mooncake_staging_size={self.staging_size}")
            if batch and size + n > self.staging_size:
                res += self._put_parts(batch)
                batch, size = [], 0
            batch.append(it)
            size += n
        if batch:
            res += self._put_parts(batch)
        return res

    def _put(self, batch: list[MooncakeHandle]) -> list[BackendError]:
        items = []
        for h in batch:
            assert h.buf is not None
            items.append((h.key, [h.buf]))
        res = self._put_parts(items)
        errors = []
        for h, r in zip(batch, res):
            h.committed = r == 0
            if r != 0:
                h.failed = to_error(r, f"put of {h.key!r}")
                errors.append(h.failed)
        self.stats_["objects_put"] += len(batch) - len(errors)
        self.stats_["bytes_put"] += sum(h.nbytes for h, r in zip(batch, res) if r == 0)
        return errors

    def abort(self, handles: Sequence[MooncakeHandle]) -> None:
        if self._streaming:
            self._stream_end(handles, aborted=True)
        with self._lock:
            for h in handles:
                if self._pending.get(h.key) is h:
                    del self._pending[h.key]
                h.buf = None
