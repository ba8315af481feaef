"""Host memory registered with the device: the pool's own memory as a DMA source and target.

``HostRegistry.register(buffers)`` takes the host ranges a backend's views come from
(``host_regions()``, e.g. the embedded pool's arena mapping) and registers each once with the
device (CUDA: ``cudaHostRegister``, portable and mapped), in page-aligned pieces of at most 64 GiB.
The registry keeps a numpy array over each range: the mapping cannot be unmapped while it is
registered (the embedded pool's ``close`` leaves a mapping that still has users), so a new mapping
can never appear at a registered address. Registration pins (faults in) every page.

A failed registration is logged once per range, counted by the copier that asked
(``register_failures``; the connector reports it as ``vllm:lw_pool_device_register_failures_total``)
and leaves that range's copies on the staged path; the range is not tried again (its array is kept,
so no other mapping can take its address meanwhile). ``locate`` says whether every buffer of a batch lies in one registered range, and where.

A range can be registered only once per process, so on a real device every copier of the process
shares one registry per device (``registry_for``; ops with ``process_wide`` set): each copier
holds the ranges it registered, and ``release(holder)`` unregisters a range once no copier holds
it. Test fakes get a registry of their own.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lw_vllm.device.device_streams import DeviceOps

log = logging.getLogger("lw_vllm.device")

PIECE_MAX = 64 << 30
PAGE = mmap.PAGESIZE


@dataclass
class Region:
    """One registered host range (page-aligned) and what the device sees of it."""

    addr: int
    nbytes: int
    arr: np.ndarray  # keeps the mapping alive while registered
    pieces: list[tuple[int, int]]
    holders: set[int] = field(default_factory=set)  # ids of the copiers (direct paths) using it
    _view: torch.Tensor | None = None
    _view_tried: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def device_view(self, ops: DeviceOps) -> torch.Tensor | None:
        """A uint8 tensor on the device over this range (zero-copy), or None where the device
        cannot address it; built once."""
        with self._lock:
            if not self._view_tried:
                self._view_tried = True
                try:
                    self._view = ops.host_tensor(self.arr)
                except Exception as e:
                    log.warning("lw-vllm: no device view of %d registered pool bytes (%s): the GPU gather is off "
                                "for them", self.nbytes, e)
            return self._view


def address(buf: Any) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class HostRegistry:
    def __init__(self, ops: DeviceOps):
        self.ops = ops
        self._lock = threading.Lock()
        self._regions: list[Region] = []
        self._failed: dict[tuple[int, int], np.ndarray] = {}  # ranges refused: not tried again

    def register(self, buffers: Sequence[Any], holder: int) -> int:
        """Register each buffer's page-aligned range (once per process) for ``holder``; returns how
        many ranges could not be registered now."""
        failed = 0
        for buf in buffers:
            arr = np.frombuffer(buf, dtype=np.uint8)
            addr, n = int(arr.ctypes.data), int(arr.nbytes)
            start = -(-addr // PAGE) * PAGE
            end = (addr + n) // PAGE * PAGE
            if end <= start:
                continue
            with self._lock:
                if (start, end) in self._failed:
                    continue  # refused before: not tried again
                known = [r for r in self._regions if r.addr <= start < r.addr + r.nbytes]
                if known:  # registered already (another pipeline or copier over the same pool)
                    known[0].holders.add(holder)
                    continue
                pieces = [(a, min(PIECE_MAX, end - a)) for a in range(start, end, PIECE_MAX)]
                done: list[int] = []
                try:
                    for a, m in pieces:
                        self.ops.register_host(a, m)
                        done.append(a)
                except Exception as e:
                    for a in done:
                        self._unregister(a)
                    self._failed[(start, end)] = arr
                    failed += 1
                    log.warning("lw-vllm: could not register %d bytes of pool memory with %s (%s); its copies go "
                                "through pinned staging", end - start, self.ops.device, e)
                    continue
                region = Region(start, end - start, arr[start - addr : end - addr], pieces, {holder})
                self._regions.append(region)
            region.device_view(self.ops)  # built now, on the registering thread, not at a first copy
        return failed

    def _unregister(self, addr: int) -> None:
        try:
            self.ops.unregister_host(addr)
        except Exception as e:
            log.warning("lw-vllm: unregistering pool memory at %#x failed: %s", addr, e)

    def regions(self, holder: int) -> list[Region]:
        with self._lock:
            return [r for r in self._regions if holder in r.holders]

    def locate(self, bufs: Sequence[Any], n: int, holder: int) -> tuple[Region, np.ndarray] | None:
        """The range ``holder`` registered that holds every ``n``-byte buffer of ``bufs``, and
        their offsets in it."""
        if not bufs:
            return None
        try:
            addrs = np.fromiter((address(b) for b in bufs), dtype=np.int64, count=len(bufs))
        except (TypeError, ValueError):
            return None
        return self.locate_addrs(addrs, n, holder)

    def locate_addrs(self, addrs: np.ndarray, n: int, holder: int) -> tuple[Region, np.ndarray] | None:
        """The same for windows given by their host addresses (int64 array)."""
        regions = self.regions(holder)
        if not regions or not len(addrs):
            return None
        lo, hi = int(addrs.min()), int(addrs.max()) + n
        for r in regions:
            if r.addr <= lo and hi <= r.addr + r.nbytes:
                return r, np.asarray(addrs, dtype=np.int64) - r.addr
        return None

    def release(self, holder: int) -> None:
        """``holder`` is done with its ranges: unregister those nobody else holds."""
        self.unregister(self.detach(holder, lambda r: True))

    def detach(self, holder: int, which: Callable[[Region], bool]) -> list[Region]:
        """``holder`` lets go of its ranges for which ``which`` is true. Those nobody else holds
        are no longer found by ``locate`` and are returned, still registered: the caller
        unregisters them (``unregister``) once no copy it enqueued can use them."""
        with self._lock:
            for r in self._regions:
                if holder in r.holders and which(r):
                    r.holders.discard(holder)
            gone = [r for r in self._regions if not r.holders]
            self._regions = [r for r in self._regions if r.holders]
        return gone

    def unregister(self, regions: Sequence[Region]) -> None:
        for r in regions:
            for a, _ in r.pieces:
                self._unregister(a)

    def covers(self, region: Region, buffers: Sequence[Any]) -> bool:
        """Whether ``region`` lies in one of ``buffers`` (the ranges a registration asked for)."""
        for buf in buffers:
            arr = np.frombuffer(buf, dtype=np.uint8)
            addr = int(arr.ctypes.data)
            if addr <= region.addr and region.addr + region.nbytes <= addr + int(arr.nbytes):
                return True
        return False


_SHARED: dict[str, HostRegistry] = {}
_SHARED_LOCK = threading.Lock()


def registry_for(ops: DeviceOps) -> HostRegistry:
    """The process's registry of ``ops.device`` (real devices), or a registry of its own (fakes)."""
    if not getattr(ops, "process_wide", False):
        return HostRegistry(ops)
    with _SHARED_LOCK:
        key = str(ops.device)
        if key not in _SHARED:
            _SHARED[key] = HostRegistry(ops)
        return _SHARED[key]
