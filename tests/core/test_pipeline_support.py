"""Fakes for the layer pipeline tests: a dict backend with fault hooks and a recording copier.

Kept in a ``test_``-named module so it is importable from its sibling test files; the tests at the
bottom check that the fakes themselves keep the Backend rules the pipeline relies on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from lw_core.backend import BackendError, ObjectMissing
from lw_core.pipeline.host_copier import HostCopier
from lw_core.plan import ObjectLayout


class FakeHandle:
    def __init__(self, key: str, nbytes: int, buf: bytearray, writable: bool):
        self.key, self.nbytes, self.buf, self.writable = key, nbytes, buf, writable
        self.aborted = False


class DictBackend:
    """In-process store. ``views``: whether ``view`` gives zero-copy windows (else ``None``).
    ``read_hook(handles, offsets)`` / ``write_hook(handles, offsets)`` run before each call and
    may block or raise, to simulate a stuck or failing store."""

    name = "dict"

    def __init__(self, views: bool = False):
        self.views = views
        self.objects: dict[str, bytearray] = {}
        self.reserved: dict[str, FakeHandle] = {}
        self.leases = 0
        self.calls: list[tuple[str, int, tuple[int, ...]]] = []  # (op, n handles, offsets)
        self.read_hook: Callable[[Sequence[FakeHandle], Sequence[int]], None] | None = None
        self.write_hook: Callable[[Sequence[FakeHandle], Sequence[int]], None] | None = None
        self.lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        self.objects[key] = bytearray(data)

    def lookup(self, keys: Sequence[str]) -> int:
        n = 0
        for k in keys:
            if k not in self.objects:
                break
            n += 1
        return n

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[FakeHandle | None]:
        out: list[FakeHandle | None] = []
        with self.lock:
            for k in keys:
                if k in self.objects or k in self.reserved:
                    out.append(None)
                else:
                    h = FakeHandle(k, nbytes, bytearray(nbytes), True)
                    self.reserved[k] = h
                    out.append(h)
        return out

    def write(self, handles, offsets, srcs) -> None:
        self.calls.append(("write", len(handles), tuple(offsets)))
        if self.write_hook:
            self.write_hook(handles, offsets)
        for h, off, s in zip(handles, offsets, srcs):
            if h.aborted or self.reserved.get(h.key) is not h:
                raise BackendError(f"write to {h.key}: not reserved (aborted?)")
            mv = memoryview(s).cast("B")
            h.buf[off : off + len(mv)] = mv

    def commit(self, handles) -> None:
        with self.lock:
            for h in handles:
                if self.reserved.get(h.key) is not h:
                    raise BackendError(f"commit of {h.key}: not reserved")
                del self.reserved[h.key]
                self.objects[h.key] = h.buf

    def abort(self, handles) -> None:
        with self.lock:
            for h in handles:
                h.aborted = True
                if self.reserved.get(h.key) is h:
                    del self.reserved[h.key]

    def open(self, keys) -> list[FakeHandle | None]:
        out = []
        for k in keys:
            b = self.objects.get(k)
            out.append(None if b is None else FakeHandle(k, len(b), b, False))
            self.leases += b is not None
        return out

    def read(self, handles, offsets, dsts) -> None:
        self.calls.append(("read", len(handles), tuple(offsets)))
        if self.read_hook:
            self.read_hook(handles, offsets)
        for h, off, d in zip(handles, offsets, dsts):
            mv = memoryview(d).cast("B")
            if self.objects.get(h.key) is not h.buf:
                raise ObjectMissing(f"{h.key} is gone")
            mv[:] = h.buf[off : off + len(mv)]

    def release(self, handles) -> None:
        self.leases -= len(handles)

    def view(self, handle, offset, nbytes):
        if not self.views:
            return None
        self.calls.append(("view", 1, (offset,)))
        if self.read_hook and not handle.writable:
            self.read_hook([handle], [offset])
        mv = memoryview(handle.buf)[offset : offset + nbytes]
        return mv if handle.writable else mv.toreadonly()

    def stats(self) -> dict[str, int]:
        return {"objects": len(self.objects)}

    def close(self) -> None:
        pass


class RecordingCopier(HostCopier):
    """HostCopier that logs every call into ``log`` (shared with the test driver)."""

    def __init__(self, kv, log: list | None = None):
        super().__init__(kv)
        self.log: list[tuple] = [] if log is None else log
        self.to_kv_hook: Callable[[int, Sequence[int]], None] | None = None

    def to_kv(self, layer, block_ids, srcs):
        if self.to_kv_hook:
            self.to_kv_hook(layer, block_ids)
        self.log.append(("to_kv", layer, tuple(block_ids)))
        return super().to_kv(layer, block_ids, srcs)

    def from_kv(self, layer, block_ids, dsts, after=None):
        self.log.append(("from_kv", layer, tuple(block_ids)))
        return super().from_kv(layer, block_ids, dsts, after)

    def make_visible(self, token):
        self.log.append(("visible",))


def pattern(key: str, nbytes: int) -> bytes:
    """Distinct, reproducible bytes per key."""
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little") % (2**32)
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def make_layout(num_layers: int, block_nbytes: int | Sequence[int]) -> ObjectLayout:
    sizes = [block_nbytes] * num_layers if isinstance(block_nbytes, int) else list(block_nbytes)
    return ObjectLayout(layer_nbytes=tuple(sizes))


def fill_pool(backend: Any, layout: ObjectLayout, keys: Sequence[str]) -> None:
    """Write and commit ``keys`` through the Backend protocol (works for any backend)."""
    hs = backend.reserve(list(keys), layout.nbytes)
    assert all(h is not None for h in hs)
    backend.write(hs, [0] * len(hs), [pattern(k, layout.nbytes) for k in keys])
    backend.commit(hs)


def expected_block(layout: ObjectLayout, key: str, layer: int) -> np.ndarray:
    data = np.frombuffer(pattern(key, layout.nbytes), dtype=np.uint8)
    off = layout.offsets[layer]
    return data[off : off + layout.layer_nbytes[layer]]


def wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return cond()


# --- the fakes keep the rules the pipeline depends on ---


@pytest.mark.parametrize("views", [False, True])
def test_dict_backend_commit_is_the_only_way_to_visibility(views):
    b = DictBackend(views=views)
    (h,) = b.reserve(["k"], 8)
    assert b.reserve(["k"], 8) == [None]
    b.write([h], [0], [b"abcdefgh"])
    assert b.open(["k"]) == [None] and b.lookup(["k"]) == 0
    b.commit([h])
    (r,) = b.open(["k"])
    out = bytearray(4)
    b.read([r], [2], [out])
    assert out == b"cdef" and b.lookup(["k", "x"]) == 1


def test_dict_backend_refuses_writes_after_abort():
    b = DictBackend()
    (h,) = b.reserve(["k"], 4)
    b.abort([h])
    with pytest.raises(BackendError, match="not reserved"):
        b.write([h], [0], [b"abcd"])
    assert b.lookup(["k"]) == 0
