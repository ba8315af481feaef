"""``Arena``: host memory registered with Mooncake once, handed out in page-aligned extents, and
offered to the layer pipeline as the backend's ``host_regions`` (a device copier registers it too
and moves the KV between it and the KV cache by DMA, instead of through staging). Gets land in one
(``lw_mooncake.get_arena``), reservations' local objects live in another (``put``, the memory
their puts send from).

An extent is ``take``-n, then held by a count of holders (``hold_at``); the last holder dropping it
frees it.

Invariants:

* An extent is handed out to one user at a time: from ``take`` until its last holder dropped it.
* An extent given to a call that raised (past its deadline, or anything else) is never handed out
  again until that call has returned: ``hold_late`` holds it once more for the call, and ``prune``
  lets it go once the call returned, as Mooncake may read or write it until then.
* The memory is registered with Mooncake before any call uses it, and unregistered only at
  ``close`` when no late call can still use it; otherwise the arena stays referenced for the life
  of the process (``_KEPT``), as Mooncake may still use it.
* Without room (or when Mooncake refuses the registration), ``take`` answers None and the caller
  uses a buffer of its own, as before the arena: never a failed call.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import Counter
from concurrent.futures import Future
from typing import Any

import numpy as np

from lw_core.backend import BackendUnavailable
from lw_mooncake.calls import CallTimedOut, Deadlines

log = logging.getLogger(__name__)
ALIGN = 4096  # extents start page-aligned (DMA engines and Mooncake's transports like it)
_KEPT: list[Any] = []  # arenas a late call may still use at close: never freed


class Arena:
    """``nbytes`` of memory registered with ``store`` through ``calls``; ``what`` names it in counters
    (``{what}_arena_full``, ``{what}_arena_refused``) and logs."""

    def __init__(self, store: Any, calls: Deadlines, nbytes: int, what: str) -> None:
        self.store, self.calls, self.what = store, calls, what
        self.nbytes = nbytes // ALIGN * ALIGN
        raw = np.empty(self.nbytes + ALIGN, np.uint8)  # untouched pages cost no memory until used
        skip = -int(raw.ctypes.data) % ALIGN
        self.buf = raw[skip : skip + self.nbytes]
        self.base = int(self.buf.ctypes.data)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.nbytes)] if self.nbytes else []  # (offset, size), by offset
        self._held: dict[int, list[int]] = {}  # offset -> [size, holders]
        self._late_holds: list[tuple[list[int], Future[Any]]] = []  # extents a late call holds once more
        self._registered: bool | None = None  # None: not tried yet; False: refused (never retried)
        self._closed = False

    def ready(self) -> bool:
        """Register the arena with Mooncake if not tried yet (a store call: callers make it before
        taking locks of their own); whether it is registered."""
        return self._register()

    def region(self) -> memoryview:
        return memoryview(self.buf.data)

    def covers(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` lies in this arena."""
        p = int(arr.ctypes.data)
        return self.base <= p and p + arr.nbytes <= self.base + self.nbytes

    # ----------------------------------------------------------------- extents

    def take(self, sizes: list[int]) -> list[int] | None:
        """One extent per size (offsets into ``buf``), all or none; None without room, when the
        registration with Mooncake was refused, or after ``close``."""
        self.prune()
        if not self._register():
            return None
        got: list[tuple[int, int]] = []
        with self._lock:
            if self._closed:
                return None
            for n in sizes:
                size = -(-max(n, 1) // ALIGN) * ALIGN
                off = self._alloc(size)
                if off is None:
                    for o, sz in got:
                        self._insert(o, sz)
                    self.counts[f"{self.what}_arena_full"] += 1
                    return None
                got.append((off, size))
            for o, sz in got:
                self._held[o] = [sz, 0]
        return [o for o, _ in got]

    def hold(self, arr: np.ndarray, holders: int) -> None:
        """``holders`` more read handles hold the extent ``arr`` starts at (0: nobody will, it is
        free now; -1: one holder is done with it, ``release``)."""
        self.hold_at(int(arr.ctypes.data) - self.base, holders)

    def hold_at(self, off: int, holders: int) -> None:
        """``hold`` of the extent at offset ``off``."""
        with self._lock:
            h = self._held.get(off)
            if h is None:
                raise RuntimeError(f"mooncake {self.what} arena: the extent at {off} is not held")
            h[1] += holders
            if h[1] <= 0:
                self._insert(off, self._held.pop(off)[0])

    def hold_late(self, offs: list[int], error: BaseException) -> None:
        """The extents at ``offs`` were given to a call that raised ``error``: each is held once
        more until that call has returned (let go at the next ``prune`` after it did; not at all for
        an error it raised itself), so its holders dropping it does not free it before. One nobody
        holds (a get's buffer the call alone had) is freed here if the call has returned. One
        step under the lock: no ``prune`` sees an extent between the two."""
        pending = error.pending if isinstance(error, CallTimedOut) else None
        late = pending is not None and not pending.done()
        with self._lock:
            for o in offs:
                h = self._held[o]
                h[1] += late
                if h[1] <= 0:
                    self._insert(o, self._held.pop(o)[0])
            if late:
                assert pending is not None
                self._late_holds.append((list(offs), pending))

    def extents_of(self, arrs: list[np.ndarray]) -> list[int]:
        """The offsets of the held extents that ``arrs`` (arrays in this arena) lie in, once each."""
        with self._lock:
            starts = sorted(self._held)
        out: set[int] = set()
        for a in arrs:
            p = int(a.ctypes.data) - self.base
            i = bisect.bisect_right(starts, p) - 1
            if i >= 0 and p + a.nbytes <= starts[i] + self._held.get(starts[i], [0])[0]:
                out.add(starts[i])
        return sorted(out)

    def prune(self) -> None:
        with self._lock:
            held_done = [offs for offs, f in self._late_holds if f.done()]
            self._late_holds = [(offs, f) for offs, f in self._late_holds if not f.done()]
            for offs in held_done:
                for o in offs:
                    h = self._held[o]
                    h[1] -= 1
                    if h[1] <= 0:
                        self._insert(o, self._held.pop(o)[0])

    def free_bytes(self) -> int:
        with self._lock:
            return sum(s for _, s in self._free)

    def _alloc(self, n: int) -> int | None:
        for i, (o, s) in enumerate(self._free):  # first fit: few extents are free at a time
            if s >= n:
                if s == n:
                    del self._free[i]
                else:
                    self._free[i] = (o + n, s - n)
                return o
        return None

    def _insert(self, off: int, size: int) -> None:
        """Give ``[off, off + size)`` back, merged with free neighbours (call under the lock)."""
        i = bisect.bisect_left(self._free, (off, 0))
        if i < len(self._free) and self._free[i][0] < off + size or i and sum(self._free[i - 1]) > off:
            raise RuntimeError(f"mooncake {self.what} arena: extent {off}+{size} freed twice")
        if i < len(self._free) and self._free[i][0] == off + size:
            size += self._free.pop(i)[1]
        if i and sum(self._free[i - 1]) == off:
            o, s = self._free[i - 1]
            self._free[i - 1] = (o, s + size)
        else:
            self._free.insert(i, (off, size))

    # ----------------------------------------------------------------- registration

    def _register(self) -> bool:
        if self._registered is None:
            with self._lock:
                if self._registered is None and not self._closed and self.nbytes:
                    self._registered = self._call_register()
        return bool(self._registered)

    def _call_register(self) -> bool:
        try:
            rc = self.calls.call(f"register_buffer ({self.what} arena)", self.store.register_buffer, self.base, self.nbytes)
        except BackendUnavailable as e:
            _KEPT.append(self)  # a late registration may still complete: never freed
            log.warning("mooncake: registering the %s arena of %d bytes failed (%s); its users take buffers of their own", self.what, self.nbytes, e)
            self.counts[f"{self.what}_arena_refused"] += 1
            return False
        if rc != 0:
            log.warning("mooncake: register_buffer of the %s arena (%d bytes) answered %d; its users take buffers of their own", self.what, self.nbytes, rc)
            self.counts[f"{self.what}_arena_refused"] += 1
            return False
        return True

    def close(self) -> None:
        """Unregister (once no late call can still write the arena); extents still held stay
        readable (the memory lives while their arrays do)."""
        self.prune()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            registered, late = self._registered, bool(self._late_holds)
        if not registered:
            return
        if late:
            _KEPT.append(self)
            return
        try:
            rc = self.calls.call(f"unregister_buffer ({self.what} arena)", self.store.unregister_buffer, self.base)
        except BackendUnavailable:
            rc = -1
        if rc != 0:
            _KEPT.append(self)
