"""Direct copies between registered pool memory and the device KV cache: no staging, one
submission per batch.

When every source (load) or destination (save) of a batch lies in one range the device has
registered (``lw_vllm.device.host_register``), the batch moves by one of two mechanisms, chosen by the
copier's ``mechanism`` (the ``device_copy_mechanism`` key):

* ``kernel``: the device's own gather/scatter over a zero-copy view of the registered range
  (``lw_vllm.device.zero_copy``; torch indexing ops). Measured on an H200 (docs/bench/device.md) it is
  the faster one alone below 256 KiB segments, but its SMs wait on PCIe for as long as the copy
  runs, next to the model's kernels (layerwise loads hide less).
* ``batch_dma``: one ``cuMemcpyBatchAsync`` of every segment of the batch (the copy engines, no
  SMs): faster from 256 KiB segments, and it leaves the model alone.
* ``auto`` (default): ``batch_dma`` for segments of at least ``BATCH_DMA_MIN_SEGMENT`` bytes when
  the device offers it, else ``kernel``; ``staged``: never direct (nothing is registered).

A mechanism the device lacks (no batched DMA without cuda-python's driver bindings; no zero-copy
view) falls to the other, then to the staged path. ``counts`` tallies batches per mechanism.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lw_vllm.device.device_streams import DeviceOps
from lw_vllm.device.host_register import Region, registry_for
from lw_vllm.device.zero_copy import word_size

MECHANISMS = ("auto", "kernel", "batch_dma", "staged")
BATCH_DMA_MIN_SEGMENT = 256 << 10


def check_mechanism(mechanism: str) -> str:
    if mechanism not in MECHANISMS:
        raise ValueError(f"TorchCopier: mechanism={mechanism!r} is not accepted; accepted: {', '.join(MECHANISMS)}")
    return mechanism


@dataclass(frozen=True)
class Plan:
    how: str  # "kernel" or "batch_dma"
    region: Region
    offsets: np.ndarray  # int64 byte offset of each block in the region


class DirectPath:
    def __init__(self, ops: DeviceOps, mechanism: str = "auto"):
        self.ops = ops
        self.mechanism = check_mechanism(mechanism)
        self.registry = registry_for(ops)
        self.counts = {"kernel": 0, "batch_dma": 0, "staged": 0}
        self.register_failures = 0
        self._lock = threading.Lock()  # registrations (on a thread of their own) against close
        self._closed = False
        self._last_located: tuple[np.ndarray, int, tuple[Region, np.ndarray] | None] | None = None

    def register(self, buffers: Sequence[Any]) -> list[Region]:
        """Register ``buffers`` for this path. Ranges it held that lie in none of them (memory that
        moved: a pool re-attached) are let go: the ones nobody else holds are returned, still
        registered, for the caller to unregister once none of its enqueued copies can use them;
        from now on no batch is planned in them, and one planned before is refused (``_run``)."""
        if self.mechanism == "staged":
            return []
        with self._lock:
            if self._closed:
                return []
            self.register_failures += self.registry.register(buffers, id(self))
            return self.registry.detach(id(self), lambda r: not self.registry.covers(r, buffers))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.registry.release(id(self))

    def _how(self, region: Region, segment: int) -> str | None:
        can_dma = bool(getattr(self.ops, "can_batch_copy", False))
        want = self.mechanism
        if want == "auto":
            want = "batch_dma" if segment >= BATCH_DMA_MIN_SEGMENT and can_dma else "kernel"
        order = ["batch_dma", "kernel"] if want == "batch_dma" else ["kernel", "batch_dma"]
        for how in order:
            if how == "batch_dma" and can_dma:
                return how
            if how == "kernel" and region.device_view(self.ops) is not None:
                return how
        return None

    def plan(self, layer: torch.Tensor, bufs: Sequence[Any], n: int) -> Plan | None:
        """How a batch of ``n``-byte host buffers moves directly, or None (staged path)."""
        if self.mechanism == "staged":
            return None
        return self._plan(layer, self.registry.locate(bufs, n, id(self)))

    def plan_addrs(self, layer: torch.Tensor, addrs: np.ndarray, n: int) -> Plan | None:
        """The same for ``n``-byte windows given by their host addresses."""
        if self.mechanism == "staged":
            return None
        return self._plan(layer, self._locate_addrs(addrs, n))

    def addressable(self, addrs: np.ndarray, n: int) -> bool:
        """Whether windows at these addresses can move directly (registered, not ``staged``)."""
        return self.mechanism != "staged" and self._locate_addrs(addrs, n) is not None

    def _locate_addrs(self, addrs: np.ndarray, n: int) -> tuple[Region, np.ndarray] | None:
        """``locate_addrs``, once per batch: the pipeline asks ``addressable`` and then plans the
        same array. The answer is kept with the array itself (compared by identity, held, so its
        id cannot be reused meanwhile); a region let go since is refused when the plan runs."""
        last = self._last_located  # one read: other threads may replace it
        if last is not None and last[0] is addrs and last[1] == n:
            return last[2]
        found = self.registry.locate_addrs(addrs, n, id(self))
        self._last_located = (addrs, n, found)
        return found

    def _plan(self, layer: torch.Tensor, found: tuple[Region, np.ndarray] | None) -> Plan | None:
        if found is None:
            return None
        region, offsets = found
        how = self._how(region, layer.shape[2])
        return None if how is None else Plan(how, region, offsets)

    def staged(self) -> None:
        self.counts["staged"] += 1

    def h2d(self, plan: Plan, layer: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Enqueue the batch's host -> KV copies on the current stream."""
        self._run(plan, layer, block_ids, to_device=True)

    def d2h(self, plan: Plan, layer: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Enqueue the batch's KV -> host copies on the current stream."""
        self._run(plan, layer, block_ids, to_device=False)

    def _run(self, plan: Plan, layer: torch.Tensor, block_ids: Sequence[int], to_device: bool) -> None:
        if id(self) not in plan.region.holders:  # let go since the plan (registered anew): never enqueue
            raise RuntimeError("the pool memory of this batch was registered anew meanwhile; its blocks are recomputed")
        ids = np.asarray(block_ids, dtype=np.int64)
        if plan.how == "batch_dma":
            from lw_vllm.device.zero_copy import segments

            kv, host, size = segments(layer, ids, plan.offsets + plan.region.addr)
            if to_device:
                self.ops.batch_copy(kv, host, size, True)
            else:
                self.ops.batch_copy(host, kv, size, False)
        else:
            view = plan.region.device_view(self.ops)
            assert view is not None, "planned only with a view"
            g = int(np.gcd.reduce(plan.offsets)) if len(plan.offsets) else 0
            word = word_size(layer.data_ptr(), layer.shape[2], plan.region.nbytes, g)
            ids_t = self.ops.index(ids)
            woffs = self.ops.index(plan.offsets // word)
            if to_device:
                self.ops.kernel_h2d(layer, ids_t, view, woffs, word)
            else:
                self.ops.kernel_d2h(layer, ids_t, view, woffs, word)
        self.counts[plan.how] += 1
