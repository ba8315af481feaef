"""An in-process dict backend with the embedded pool's semantics, for unit tests of other parts.

Same rules as the real backends (only committed objects visible, write-once, leases pin objects,
LRU eviction of unleased objects within ``capacity_bytes``), no sharing between processes and no
fault handling: it is a fake to test pipelines against, not a store. It offers the optional
streaming extension (``lw_core.backend``: ``publish``, ``open_streaming``, ``wait_published``) as
the in-process reference of its rules.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from lw_core.backend import BackendError, Buffer, ObjectMissing
from lw_core.backends.segment_stream.checks import check_timeout, check_upto


class MemoryHandle:
    __slots__ = ("key", "nbytes", "_buf", "_writable", "_leased", "_published", "_src")

    def __init__(self, key: str, buf: bytearray, writable: bool, src: MemoryHandle | None = None, stream: bool = False) -> None:
        self.key = key
        self.nbytes = len(buf)
        self._buf = buf
        self._writable = writable
        self._leased = not writable and not stream
        self._published = 0  # reservations: bytes [0, _published) are readable by streaming readers
        # Streaming handles: the reservation they follow (None: opened on a committed object);
        # ``self`` marks them apart from leases.
        self._src: MemoryHandle | None = src if stream else None
        if stream and src is None:
            self._src = self

    def __repr__(self) -> str:
        kind = "reserved" if self._writable else "streaming" if self._src is not None else "leased"
        return f"MemoryHandle({self.key!r}, nbytes={self.nbytes}, {kind})"


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
        self._cv = threading.Condition(self._lock)  # notified on publish, commit, abort
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
            self._cv.notify_all()
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
            self._cv.notify_all()

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
            if h._src is not None:
                with self._lock:
                    ready = self._ready(h)
                if ready < off + m.nbytes:
                    why = "its reservation is gone (aborted)" if ready < 0 else f"only {ready} bytes are published"
                    raise ObjectMissing(f"memory backend: streaming read of {h.key!r} up to {off + m.nbytes}: {why}")
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

    def intact(self, handles: Sequence[MemoryHandle]) -> list[bool]:
        """A leased handle keeps its own buffer alive, so its view bytes are always its own."""
        return [True] * len(handles)

    # ----------------------------------------------------------------- streaming extension

    def _ready(self, h: MemoryHandle) -> int:
        """Readable prefix of a streaming handle's own object, -1 when that object is gone (lock held)."""
        src = h._src
        e = self._objects.get(h.key)
        if src is h:  # opened on a committed object
            return h.nbytes if e is not None and e.buf is h._buf else -1
        assert src is not None
        if self._reserved.get(h.key) is src:
            return src._published
        return h.nbytes if e is not None and e.buf is src._buf else -1

    def publish(self, handles: Sequence[MemoryHandle], upto: int) -> None:
        lost = []
        with self._lock:
            self._check()
            for h in handles:
                if not isinstance(h, MemoryHandle) or h._src is not None or h._leased:
                    raise BackendError(f"memory backend: publish needs handles from reserve, got {h!r}")
                check_upto("memory backend", "publish", h, upto)
                e = self._objects.get(h.key)
                if self._reserved.get(h.key) is h:
                    h._published = max(h._published, upto)
                elif e is None or e.buf is not h._buf:  # committed already: all of it is readable
                    lost.append(h.key)
            self._cv.notify_all()
        if lost:
            raise ObjectMissing(f"memory backend: publish of reservations that are gone (aborted or committed): {lost[:3]}")

    def open_streaming(self, keys: Sequence[str]) -> list[MemoryHandle | None]:
        out: list[MemoryHandle | None] = []
        with self._lock:
            self._check()
            for k in keys:
                r = self._reserved.get(k)
                e = self._objects.get(k)
                if r is not None:
                    out.append(MemoryHandle(k, r._buf, False, src=r, stream=True))
                elif e is not None:
                    out.append(MemoryHandle(k, e.buf, False, stream=True))
                else:
                    out.append(None)
        return out

    def wait_published(self, handles: Sequence[MemoryHandle], upto: int, timeout_s: float) -> list[bool]:
        for h in handles:
            if not isinstance(h, MemoryHandle) or h._src is None:
                raise BackendError(f"memory backend: wait_published needs handles from open_streaming, got {h!r}")
            check_upto("memory backend", "wait_published", h, upto)
        check_timeout("memory backend", timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                self._check()
                got = [self._ready(h) for h in handles]
                if all(g < 0 or g >= upto for g in got):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
        return [g >= upto for g in got]

    def view(self, handle: MemoryHandle, offset: int, nbytes: int) -> memoryview | None:
        if handle._src is not None:
            return None  # streaming handles hold no lease: read() checks each copy
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
            self._cv.notify_all()  # streaming waiters end (with BackendError), not at their deadline
