"""``Copier``: copies between process memory and the pool's global space (``batch_copy``), for
MemcacheBackend's collaborators, and the buffers registered with the store.

Invariants:

* Copy direction comes from where the memory lives: host buffers use H2G/G2H; device memory
  (``DeviceRegion``, a non-CPU tensor, or a region registered with ``device=True``) uses L2G/G2L,
  which needs an Ascend NPU. Host and device memory in one batch make one ``batch_copy`` per
  direction.
* Every range lies within its handle's ``nbytes`` (checked before any copy); empty ranges copy
  nothing. One ``copy`` counts its calls and bytes on the ``StoreClient``.
* The Copier owns only the device regions registered through it (its own lock).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lw_core.backends.segment_stream.checks import check_lengths, check_range
from lw_memcache.client import StoreClient
from lw_memcache.handles import Placed

# Copy directions (memcache_hybrid's BmCopyType values; AUTO is rejected by batch_copy).
L2G, G2L, G2H, H2G = 0, 1, 2, 3

_addressof, _from_buffer = ctypes.addressof, ctypes.c_char.from_buffer


@dataclass(frozen=True, slots=True)
class DeviceRegion:
    """Device (NPU) memory handed to ``read``/``write``: copied with L2G/G2L."""

    ptr: int
    nbytes: int


def _memory(buf: Any, *, writable: bool, what: str) -> tuple[int, int, bool]:
    """(address, nbytes, on_device) of a buffer, DeviceRegion or tensor."""
    if isinstance(buf, DeviceRegion):
        return buf.ptr, buf.nbytes, True
    if not isinstance(buf, np.ndarray) and callable(getattr(buf, "data_ptr", None)):
        # A torch tensor (duck-typed: lw-memcache does not depend on torch).
        if not buf.is_contiguous():
            raise ValueError(f"{what}: tensor must be contiguous")
        on_device = getattr(getattr(buf, "device", None), "type", "cpu") != "cpu"
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size()), on_device
    if isinstance(buf, np.ndarray):
        arr = buf
        if not arr.flags.c_contiguous:
            raise ValueError(f"{what}: array must be C-contiguous")
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: needs a contiguous buffer (memoryview, bytearray, numpy array): {e}") from e
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what}: destination buffer is read-only")
    return int(arr.ctypes.data), int(arr.nbytes), False


class Copier:
    """Copies through the client ``client``; owns the device regions registered with the store."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._device_regions: list[tuple[int, int]] = []

    def _on_device(self, ptr: int, nbytes: int, flagged: bool) -> bool:
        if flagged:
            return True
        return any(s <= ptr and ptr + nbytes <= s + n for s, n in self._device_regions)

    def copy(self, handles: Sequence[Placed], offsets: Sequence[int], bufs: Sequence[Any], *, to_store: bool) -> None:
        """Copy ``bufs[i]`` to (``to_store``) or from ``handles[i]``'s object at ``offsets[i]``."""
        check_lengths(handles, offsets, bufs)
        store = self.client.live()
        what = "write" if to_store else "read"
        host_dir, dev_dir = (H2G, L2G) if to_store else (G2H, G2L)
        check_regions = bool(self._device_regions)
        gvas: list[int] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        dirs: list[int] = []
        total = 0
        for h, off, buf in zip(handles, offsets, bufs):
            # Per layer this loop runs once per block of a step: it is the backend's own cost on
            # top of the copy. ctypes' from_buffer takes a writable contiguous array's address
            # about 5x faster than ndarray.ctypes.data; anything else takes the general path.
            dev = False
            if type(buf) is np.ndarray:
                try:
                    ptr, n = _addressof(_from_buffer(buf)), buf.nbytes  # type: ignore[arg-type]  # ndarray is a buffer
                except (TypeError, ValueError):  # read-only, non-contiguous or empty
                    ptr, n, dev = _memory(buf, writable=not to_store, what=f"{what} of {h.key}")
            else:
                ptr, n, dev = _memory(buf, writable=not to_store, what=f"{what} of {h.key}")
            if off < 0 or off + n > h.nbytes:
                check_range(what, h, off, n)  # raises
            if n == 0:
                continue
            if check_regions:
                dev = self._on_device(ptr, n, dev)
            gvas.append(h.gva + off)
            ptrs.append(ptr)
            sizes.append(n)
            dirs.append(dev_dir if dev else host_dir)
            total += n
        calls = 0
        if gvas:
            if dirs.count(dirs[0]) == len(dirs):
                groups = {dirs[0]: (gvas, ptrs, sizes)}
            else:  # host and device memory in one call: one batch per direction
                groups = {}
                for d, g, p, n in zip(dirs, gvas, ptrs, sizes):
                    lg, lp, ln = groups.setdefault(d, ([], [], []))
                    lg.append(g)
                    lp.append(p)
                    ln.append(n)
            for direction, (g_, p_, n_) in groups.items():
                self.client.check(store.batch_copy(g_, p_, n_, direction, 0), f"batch_copy ({what}, {len(g_)} ranges)")
                calls += 1
        self.client.count(copy_calls=calls, **{"bytes_written" if to_store else "bytes_read": total})

    def register(self, buf: Any, *, device: bool = False) -> None:
        """Register memory the pipeline will copy to/from (KV cache or staging regions): the
        store maps it for its copy engines. ``device=True`` (or a non-CPU tensor /
        ``DeviceRegion``) marks it device memory, so copies touching it use L2G/G2L."""
        ptr, n, dev = _memory(buf, writable=False, what="register_buffer")
        self.client.check(self.client.live().register_buffer(ptr, n), f"register_buffer ({n} bytes at {ptr:#x})")
        if dev or device:
            with self._lock:
                self._device_regions.append((ptr, n))

    def unregister(self, buf: Any) -> None:
        ptr, n, _ = _memory(buf, writable=False, what="unregister_buffer")
        self.client.check(self.client.live().unregister_buffer(ptr, n), f"unregister_buffer ({n} bytes at {ptr:#x})")
        with self._lock:
            self._device_regions = [r for r in self._device_regions if r != (ptr, n)]
