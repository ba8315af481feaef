"""An in-process dict backend with the embedded pool's semantics, for unit tests of other parts.

Same rules as the real backends (only committed objects visible, write-once, leases pin objects,
LRU eviction of unleased objects within ``capacity_bytes``), no sharing between processes and no
fault handling: it is a fake to test pipelines against, not a store.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from lw_core.backend import BackendError, Buffer, ObjectMissing


class MemoryHandle:
    __slots__ = ("key", "nbytes", "_buf", "_writable", "_leased")

    def __init__(self, key: str, buf: bytearray, writable: bool) -> None:
        self.key = key
        self.nbytes = len(buf)
        self._buf = buf
        self._writable = writable
        self._leased = not writable

    def __repr__(self) -> str:
        return f"MemoryHandle({self.key!r}, nbytes={self.nbytes}, {'reserved' if self._writable else 'leased'})"


class _Entry:
    __slots__ = ("buf", "leases", "expiry")

    def __init__(self, buf: bytearray) -> None:
        self.buf = buf
        self.leases = 0
        self.expiry = 0.0


def _bytes(buf: Buffer) -> memoryview:
    m = memoryview(buf)
    return m if m.format == "B" and m.ndim == 1 else m.cast("B")


class MemoryBackend:
    name = "memory"

    def __init__(self, capacity_bytes: int = 1 << 30, *, lease_ttl_s: float = 60.0) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"MemoryBackend: capacity_bytes={capacity_bytes!r} must be an int > 0")
        if not lease_ttl_s > 0:
            raise ValueError(f"MemoryBackend: lease_ttl_s={lease_ttl_s!r} must be > 0")
        self.capacity = capacity_bytes
        self.lease_ttl_s = lease_ttl_s
        self._lock = threading.Lock()
        self._objects: OrderedDict[str, _Entry] = OrderedDict()  # committed, oldest use first
        self._reserved: dict[str, MemoryHandle] = {}
        self._used = 0
        self._closed = False
        self._counts = dict.fromkeys(("evictions", "evicted_bytes", "commits", "aborts", "reserve_rejected_full"), 0)

    def _check(self) -> None:
        if self._closed:
            raise BackendError("memory backend is closed")

    def lookup(self, keys: Sequence[str]) -> int:
        with self._lock:
            self._check()
            n = 0
            for k in keys:
                if k not in self._objects:
                    break
                n += 1
            return n

    def _evict_for(self, nbytes: int) -> bool:
        now = time.monotonic()
        for k in list(self._objects):
            if self._used + nbytes <= self.capacity:
                break
            e = self._objects[k]
            if e.leases > 0 and e.expiry > now:
                continue
            del self._objects[k]
            self._used -= len(e.buf)
            self._counts["evictions"] += 1
            self._counts["evicted_bytes"] += len(e.buf)
        return self._used + nbytes <= self.capacity

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[MemoryHandle | None]:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"memory backend: reserve nbytes={nbytes!r} must be an int > 0")
        out: list[MemoryHandle | None] = []
        with self._lock:
            self._check()
            for k in keys:
                if k in self._objects or k in self._reserved:
                    out.append(None)
                elif not self._evict_for(nbytes):
                    self._counts["reserve_rejected_full"] += 1
                    out.append(None)
                else:
                    h = MemoryHandle(k, bytearray(nbytes), True)
                    self._reserved[k] = h
                    self._used += nbytes
                    out.append(h)
        return out

    def write(self, handles: Sequence[MemoryHandle], offsets: Sequence[int], srcs: Sequence[Buffer]) -> None:
        self._check()
        for h, off, src in zip(handles, offsets, srcs, strict=True):
            if not h._writable:
                raise BackendError(f"memory backend: write to {h!r}, which is not reserved")
            m = _bytes(src)
            if off < 0 or off + m.nbytes > h.nbytes:
                raise ValueError(f"memory backend: write of {m.nbytes} bytes at {off} outside {h.key!r} ({h.nbytes} bytes)")
            h._buf[off : off + m.nbytes] = m

    def commit(self, handles: Sequence[MemoryHandle]) -> None:
        lost = []
        with self._lock:
            self._check()
            for h in handles:
                if self._reserved.get(h.key) is h:
                    del self._reserved[h.key]
                    self._objects[h.key] = _Entry(h._buf)
                    self._counts["commits"] += 1
                elif not (h.key in self._objects and self._objects[h.key].buf is h._buf):
                    lost.append(h.key)
                h._writable = False
        if lost:
            raise ObjectMissing(f"memory backend: not published (aborted before?): {lost[:3]}")

    def abort(self, handles: Sequence[MemoryHandle]) -> None:
        with self._lock:
            for h in handles:
                if h is not None and self._reserved.get(h.key) is h:
                    del self._reserved[h.key]
                    self._used -= h.nbytes
                    self._counts["aborts"] += 1
                if h is not None:
                    h._writable = False

    def open(self, keys: Sequence[str]) -> list[MemoryHandle | None]:
        out: list[MemoryHandle | None] = []
        with self._lock:
            self._check()
            now = time.monotonic()
            for k in keys:
                e = self._objects.get(k)
                if e is None:
                    out.append(None)
                    continue
                self._objects.move_to_end(k)
                e.leases += 1
                e.expiry = now + self.lease_ttl_s
                out.append(MemoryHandle(k, e.buf, False))
        return out

    def read(self, handles: Sequence[MemoryHandle], offsets: Sequence[int], dsts: Sequence[Buffer]) -> None:
        self._check()
        for h, off, dst in zip(handles, offsets, dsts, strict=True):
            m = _bytes(dst)
            if off < 0 or off + m.nbytes > h.nbytes:
                raise ValueError(f"memory backend: read of {m.nbytes} bytes at {off} outside {h.key!r} ({h.nbytes} bytes)")
            m[:] = h._buf[off : off + m.nbytes]

    def release(self, handles: Sequence[MemoryHandle]) -> None:
        with self._lock:
            for h in handles:
                if h is None or not h._leased:
                    continue
                h._leased = False
                e = self._objects.get(h.key)
                if e is not None and e.buf is h._buf and e.leases > 0:
                    e.leases -= 1

    def view(self, handle: MemoryHandle, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or nbytes < 0 or offset + nbytes > handle.nbytes:
            raise ValueError(f"memory backend: view of {nbytes} bytes at {offset} outside {handle.key!r}")
        v = memoryview(handle._buf)[offset : offset + nbytes]
        return v if handle._writable else v.toreadonly()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "objects": len(self._objects),
                "bytes": sum(len(e.buf) for e in self._objects.values()),
                "reserved_objects": len(self._reserved),
                "reserved_bytes": sum(h.nbytes for h in self._reserved.values()),
                "capacity_bytes": self.capacity,
                **self._counts,
            }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._objects.clear()
            self._reserved.clear()
            self._used = 0
