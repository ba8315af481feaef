"""Pinned host staging for the device path: buffers handed out for the pool to read into (or to
write from), and the copier's own reusable buffers for sources that are not pinned.

* ``host_buffer(nbytes)``: a page-locked buffer the layer pipeline takes its staging from (one per
  transfer batch, so sized by ``layerwise_max_transfer_blocks/bytes``); the pool's ``read`` fills it
  and the host->device DMA reads it directly: no host copy between the pool and the DMA.
* ``find(bufs, n)``: whether ``bufs`` are the consecutive ``n``-byte slices of one such buffer (the
  pipeline hands a batch over that way); then the DMA can use that memory as is.
* ``acquire`` / ``release``: the copier's own pinned buffers, for sources or destinations in
  pageable memory (a backend's zero-copy views). A released buffer carries the event of the copy
  that uses it and is handed out again only once that event has completed; sizes are rounded up to
  powers of two (>= 1 MiB) so a few buffers serve every batch size, and at most ``max_free_bytes``
  of free ones are kept.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lw_vllm.device.device_streams import DeviceOps

MIN_CLASS = 1 << 20


def size_class(nbytes: int) -> int:
    return max(MIN_CLASS, 1 << (max(1, nbytes) - 1).bit_length())


class PinnedStaging:
    def __init__(self, ops: DeviceOps, max_free_bytes: int = 256 << 20):
        self.ops = ops
        self.max_free_bytes = max_free_bytes
        self._lock = threading.Lock()
        # data address -> (nbytes, weak ref to the pinned array handed out); entries vanish with it
        self._known: dict[int, tuple[int, weakref.ref[np.ndarray]]] = {}
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._busy: list[tuple[Any, torch.Tensor]] = []  # (event of its last copy, buffer)
        self.allocated = 0  # pinned allocations made (tests and metrics)

    # --- buffers the pipeline stages through ---
    def host_buffer(self, nbytes: int) -> np.ndarray:
        arr = self._alloc(nbytes).numpy()  # the array keeps the pinned tensor (its base) alive
        self._register(arr)
        return arr

    def _alloc(self, nbytes: int) -> torch.Tensor:
        t = self.ops.pinned(nbytes)
        with self._lock:
            self.allocated += 1
        return t

    def _register(self, arr: np.ndarray) -> None:
        # Weakly: when the pipeline drops the buffer, the registry forgets it.
        addr = arr.ctypes.data
        with self._lock:
            self._known[addr] = (arr.nbytes, weakref.ref(arr, lambda _ref: self._forget(addr)))

    def _forget(self, addr: int) -> None:
        with self._lock:
            entry = self._known.get(addr)
            if entry is not None and entry[1]() is None:
                del self._known[addr]

    def find(self, bufs: Sequence[Any], n: int) -> torch.Tensor | None:
        """The pinned tensor ``[len(bufs) * n]`` that ``bufs`` are consecutive slices of, else None."""
        if not bufs:
            return None
        try:
            arrs = [np.frombuffer(b, dtype=np.uint8) for b in bufs]
        except (TypeError, ValueError):
            return None
        if any(a.size != n for a in arrs):
            return None
        start = arrs[0].ctypes.data
        if any(a.ctypes.data != start + i * n for i, a in enumerate(arrs)):
            return None
        end = start + len(arrs) * n
        with self._lock:
            known = list(self._known.items())
        for base, (size, ref) in known:
            if base <= start and end <= base + size:
                arr = ref()
                if arr is not None:  # a tensor over the same pinned memory (DMAs from it are async)
                    return torch.from_numpy(arr[start - base : end - base])
        return None

    # --- the copier's own buffers ---
    def acquire(self, nbytes: int) -> torch.Tensor:
        """A pinned buffer of at least ``nbytes`` that no enqueued copy still uses."""
        self._reclaim()
        cls = size_class(nbytes)
        with self._lock:
            lst = self._free.get(cls)
            if lst:
                self._free_bytes -= cls
                return lst.pop()
        return self._alloc(cls)

    def release(self, buf: torch.Tensor, event: Any = None) -> None:
        """Give ``buf`` back; with ``event`` it is reused only once that event has completed."""
        if event is not None:
            with self._lock:
                self._busy.append((event, buf))
            return
        n = buf.numel()
        with self._lock:
            if self._free_bytes + n <= self.max_free_bytes:
                self._free.setdefault(n, []).append(buf)
                self._free_bytes += n

    def _reclaim(self) -> None:
        with self._lock:
            busy, self._busy = self._busy, []
        keep = []
        for ev, buf in busy:
            try:
                done = self.ops.query(ev)
            except Exception:  # a broken event: never reuse its buffer
                continue
            if done:
                self.release(buf)
            else:
                keep.append((ev, buf))
        if keep:
            with self._lock:
                self._busy.extend(keep)
