"""The torch copier's device path (cuda, npu): asynchronous block copies on side streams.

Streams and events (each arrow is a stream-wait-event, nothing blocks the host):

* loads: ``begin_load`` (forward thread, in ``start_load`` before the step's forward is enqueued)
  records the compute stream and makes the H2D stream wait for it, so no load lands in a block
  before the compute stream's earlier work on it (a previous owner's attention, vLLM zeroing it) is
  done. ``to_kv`` (load thread) enqueues the batch's DMA + scatter on the H2D stream and returns the
  event after it; the pipeline's ``wait_layer`` hands it to ``make_visible``, which makes the compute
  stream wait for it before that layer's attention.
* saves: ``compute_event`` (forward thread, right after a layer's attention) marks the compute
  stream; ``from_kv`` (save thread) makes the D2H stream wait for that mark, then enqueues the gather
  + DMA and returns the event after it; the pipeline host-waits that event before the pool write.

Staging: a batch whose host side is a pinned buffer from ``host_buffer`` (what the pipeline stages
reads through) is copied from / into that memory directly. Any other host memory (a backend's
zero-copy views, which are pageable) goes through the copier's own pinned buffers: one host memcpy,
then the DMA; such a buffer is reused only after its copy's event has completed. A save into
pageable memory cannot return before the DMA is done (the bytes must be in place when the pipeline
writes them), so ``from_kv`` host-waits it there, bounded by ``copy_timeout_s``.

Direct copies: a batch whose host side lies in pool memory registered with the device
(``register``: the backend's ``host_regions``) moves with no staging at all, by the device's own
gather/scatter or one batched DMA (``lw_vllm.device.direct_path``); its token is the event after it, and
the pool memory is read or written until that event completes (the pipeline holds the lease, or
commits, only after). A direct enqueue that raises may have left copies behind: their event is
made visible to the compute stream at the next ``begin_load``/``make_visible``, so no later
compute on those blocks runs before them.

Loads and saves use separate streams, so a load never queues behind a save that waits for compute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lw_vllm.device.device_streams import DeviceOps
from lw_vllm.device.direct_path import DirectPath
from lw_vllm.device.staging import PinnedStaging

log = logging.getLogger("lw_vllm.device")


class DevicePath:
    def __init__(self, layers: Sequence[torch.Tensor], ops: DeviceOps, copy_timeout_s: float = 10.0,
                 mechanism: str = "auto"):
        if not (0 < copy_timeout_s < float("inf")):
            raise ValueError(f"TorchCopier: copy_timeout_s={copy_timeout_s!r} must be a finite number of seconds > 0")
        self.layers = list(layers)  # uint8 [outer, num_blocks, inner] views of the device KV cache
        self.ops = ops
        self.copy_timeout_s = float(copy_timeout_s)
        self.h2d_stream = ops.new_stream()
        self.d2h_stream = ops.new_stream()
        self.staging = PinnedStaging(ops)
        self._h2d_lock = threading.Lock()  # one enqueuer at a time per stream (several load threads)
        self._d2h_lock = threading.Lock()
        self.direct = DirectPath(ops, mechanism)
        self._orphans: list[Any] = []  # events of direct copies whose enqueue raised (see the docstring)
        self._orphans_lock = threading.Lock()

    # --- registered pool memory ---
    def register(self, buffers: Sequence[Any]) -> None:
        """Register ``buffers`` (the pool's host memory); memory registered before that lies in none
        of them is unregistered once every copy enqueued so far has completed (copies are enqueued
        under the stream locks and refuse memory let go, so none enqueued later uses it); if they
        do not complete within ``copy_timeout_s`` it stays registered."""
        gone = self.direct.register(buffers)
        if not gone:
            return
        with self._h2d_lock, self._d2h_lock:
            evs = [self.ops.record(s) for s in (self.h2d_stream, self.d2h_stream)]
        if all(self.wait(ev, self.copy_timeout_s) for ev in evs):
            self.direct.registry.unregister(gone)
        else:
            log.warning("lw-vllm: %d bytes of pool memory that moved stay registered: copies of it still run",
                        sum(r.nbytes for r in gone))

    def close(self, timeout_s: float = 10.0) -> None:
        """Unregister the pool memory once every copy enqueued so far has completed; if they do not
        within ``timeout_s`` it stays registered (a copy may still use it)."""
        evs = [self.ops.record(s) for s in (self.h2d_stream, self.d2h_stream)]
        if all(self.wait(ev, timeout_s) for ev in evs):
            self.direct.close()

    def _orphan(self, stream: Any) -> None:
        ev = self.ops.record(stream)
        with self._orphans_lock:
            self._orphans.append(ev)

    def _fence_orphans(self) -> None:
        with self._orphans_lock:
            evs, self._orphans = self._orphans, []
        for ev in evs:
            self.ops.wait_event(self.ops.current_stream(), ev)

    def _shape(self, layer: int, k: int) -> tuple[int, int, int]:
        lay = self.layers[layer]
        return k, lay.shape[0], lay.shape[2]

    # --- loads ---
    def begin_load(self) -> None:
        self._fence_orphans()
        ev = self.ops.record(self.ops.current_stream())
        with self._h2d_lock:
            self.ops.wait_event(self.h2d_stream, ev)

    def to_kv(self, layer: int, block_ids: Sequence[int], srcs: Sequence[Any], n: int) -> Any:
        shape = self._shape(layer, len(block_ids))
        host = self.staging.find(srcs, n)
        plan = self.direct.plan(self.layers[layer], srcs, n) if host is None else None
        if plan is not None:  # registered pool memory: straight into the blocks
            with self._h2d_lock, self.ops.on(self.h2d_stream):
                try:
                    self.direct.h2d(plan, self.layers[layer], block_ids)
                except BaseException:
                    self._orphan(self.h2d_stream)  # later compute on these blocks waits for it
                    self.wait(self.ops.record(self.h2d_stream), self.copy_timeout_s)  # it may read the pool
                    raise
                return self.ops.record(self.h2d_stream)
        return self._staged_to_kv(layer, block_ids, srcs, n, shape, host)

    def to_kv_at(self, layer: int, block_ids: Sequence[int], addrs: Any, n: int) -> Any:
        """``to_kv`` of pool windows given by their host addresses (registered memory only)."""
        plan = self.direct.plan_addrs(self.layers[layer], addrs, n)
        if plan is None:
            raise ValueError(f"TorchCopier: {len(addrs)} windows of layer {layer} are not all in registered pool memory")
        with self._h2d_lock, self.ops.on(self.h2d_stream):
            try:
                self.direct.h2d(plan, self.layers[layer], block_ids)
            except BaseException:
                self._orphan(self.h2d_stream)
                self.wait(self.ops.record(self.h2d_stream), self.copy_timeout_s)
                raise
            return self.ops.record(self.h2d_stream)

    def from_kv_at(self, layer: int, block_ids: Sequence[int], addrs: Any, n: int, after: Any) -> Any:
        """``from_kv`` into pool windows given by their host addresses (registered memory only)."""
        plan = self.direct.plan_addrs(self.layers[layer], addrs, n)
        if plan is None:
            raise ValueError(f"TorchCopier: {len(addrs)} windows of layer {layer} are not all in registered pool memory")
        with self._d2h_lock, self.ops.on(self.d2h_stream):
            if after is not None:
                self.ops.wait_event(self.d2h_stream, after)
            try:
                self.direct.d2h(plan, self.layers[layer], block_ids)
            except BaseException:
                self.wait(self.ops.record(self.d2h_stream), self.copy_timeout_s)
                raise
            return self.ops.record(self.d2h_stream)

    def _staged_to_kv(self, layer: int, block_ids: Sequence[int], srcs: Sequence[Any], n: int,
                      shape: tuple[int, int, int], host: Any) -> Any:
        own = None
        if host is None:  # pageable sources: one memcpy into a pinned buffer of ours
            self.direct.staged()
            own = self.staging.acquire(len(srcs) * n)
            flat = own.numpy()
            for j, s in enumerate(srcs):
                np.copyto(flat[j * n : (j + 1) * n], np.frombuffer(s, dtype=np.uint8))
            host = own[: len(srcs) * n]
        try:
            with self._h2d_lock, self.ops.on(self.h2d_stream):
                self.ops.h2d(self.layers[layer], block_ids, host.view(shape))
                ev = self.ops.record(self.h2d_stream)
        except BaseException:
            if own is not None:  # whatever got enqueued may still read it: park it behind the stream
                self.staging.release(own, self.ops.record(self.h2d_stream))
            raise
        if own is not None:
            self.staging.release(own, ev)
        return ev

    # --- saves ---
    def compute_event(self) -> Any:
        return self.ops.record(self.ops.current_stream())

    def from_kv(self, layer: int, block_ids: Sequence[int], dsts: Sequence[Any], n: int, after: Any) -> Any:
        shape = self._shape(layer, len(block_ids))
        host = self.staging.find(dsts, n)
        plan = self.direct.plan(self.layers[layer], dsts, n) if host is None else None
        if plan is not None:  # registered pool memory: straight from the blocks
            with self._d2h_lock, self.ops.on(self.d2h_stream):
                if after is not None:
                    self.ops.wait_event(self.d2h_stream, after)
                try:
                    self.direct.d2h(plan, self.layers[layer], block_ids)
                except BaseException:  # what got enqueued may still write the objects: let it end first
                    self.wait(self.ops.record(self.d2h_stream), self.copy_timeout_s)
                    raise
                return self.ops.record(self.d2h_stream)
        own = None
        if host is None:
            self.direct.staged()
            own = self.staging.acquire(len(dsts) * n)
            host = own[: len(dsts) * n]
        with self._d2h_lock, self.ops.on(self.d2h_stream):
            if after is not None:
                self.ops.wait_event(self.d2h_stream, after)
            self.ops.d2h(self.layers[layer], block_ids, host.view(shape))
            ev = self.ops.record(self.d2h_stream)
        if own is None:
            return ev
        # Pageable destinations: the bytes must be there when this returns.
        if not self.wait(ev, self.copy_timeout_s):
            self.staging.release(own, ev)  # the DMA may still write into it
            raise TimeoutError(
                f"TorchCopier: copy of {len(block_ids)} blocks of layer {layer} out of the device KV cache "
                f"did not finish within copy_timeout_s={self.copy_timeout_s}"
            )
        flat = own.numpy()
        for j, d in enumerate(dsts):
            np.copyto(np.frombuffer(d, dtype=np.uint8), flat[j * n : (j + 1) * n])
        self.staging.release(own)
        return None

    # --- tokens ---
    def wait(self, token: Any, timeout_s: float) -> bool:
        """Poll ``token`` against a deadline (``Event.synchronize`` has none)."""
        if token is None:
            return True
        deadline = time.monotonic() + timeout_s
        delay = 1e-5
        while not self.ops.query(token):
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 2e-4)
        return True

    def make_visible(self, token: Any) -> None:
        self._fence_orphans()
        if token is not None:
            self.ops.wait_event(self.ops.current_stream(), token)
