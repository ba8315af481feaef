"""Saves into the reservations' own memory (``Backend.write_buffers``): where ``view`` is None
because ``write`` must send the bytes on (Mooncake's put sessions), the pipeline copies each
layer out of the KV cache straight into the buffers the backend names, then ``write`` sends them
with no staging in between; a copy still running at its deadline leaves its reservations alone
(never aborted, so never given to another object) until it completed."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
from test_pipeline_device import DeviceLikeCopier
from test_pipeline_support import DictBackend, make_layout

from lw_core.pipeline import LayerPipeline
from lw_core.pipeline.host_copier import HostCopier
from lw_core.plan import ReqSave


class OwnBuffersBackend(DictBackend):
    """``DictBackend`` without views whose reservations lend their memory to be filled
    (``write_buffers``); ``write`` counts the sources that were that memory already (no copy)."""

    def __init__(self) -> None:
        super().__init__(views=False)
        self.in_place = 0
        self.copied = 0
        self.aborted_at: dict[str, float] = {}

    def write_buffers(self, handles: Any, offsets: Any, nbytes: int) -> list[np.ndarray] | None:
        self.calls.append(("write_buffers", len(handles), tuple(offsets)))
        return [np.frombuffer(h.buf, np.uint8)[off : off + nbytes] for h, off in zip(handles, offsets)]

    def write(self, handles: Any, offsets: Any, srcs: Any) -> None:
        for h, off, s in zip(handles, offsets, srcs):
            own = np.frombuffer(h.buf, np.uint8)[off:]
            if isinstance(s, np.ndarray) and s.ctypes.data == own.ctypes.data:
                self.in_place += 1
            else:
                self.copied += 1
        super().write(handles, offsets, srcs)

    def abort(self, handles: Any) -> None:
        for h in handles:
            self.aborted_at[h.key] = time.monotonic()
        super().abort(handles)


class LateSaveCopier(DeviceLikeCopier):
    """Its copies out of the KV cache write their destinations only at ``complete`` (until then
    ``wait`` says they run), recording whether each destination's reservation was still open."""

    def __init__(self, kv: Any, backend: OwnBuffersBackend) -> None:
        super().__init__(kv, [])
        self.backend = backend
        self.done = threading.Event()
        self.pending: list[tuple[int, list[int], list[Any]]] = []
        self.wrote_into_aborted = 0

    def from_kv(self, layer: int, block_ids: Any, dsts: Any, after: Any = None) -> Any:
        self.pending.append((layer, list(block_ids), list(dsts)))
        return ("d2h", next(self._ids), layer)

    def complete(self) -> None:
        aborted = {k for k, h in self.backend.reserved.items() if h.aborted} | set(self.backend.aborted_at)
        for layer, blocks, dsts in self.pending:
            for b, d in zip(blocks, dsts):
                np.frombuffer(d, np.uint8)[:] = self.kv[layer][b].reshape(-1)
        self.wrote_into_aborted = len(aborted)
        self.pending.clear()
        self.done.set()

    def wait(self, token: Any, timeout_s: float) -> bool:
        if token is not None and token[0] == "d2h":
            return self.done.wait(timeout_s)
        return True


def _random_kv(layers: int, blocks: int, nbytes: int) -> list[np.ndarray]:
    kv = HostCopier.allocate(layers, blocks, nbytes, fill=None).kv
    for i, a in enumerate(kv):
        a[:] = np.random.default_rng(i).integers(0, 256, a.shape, dtype=np.uint8)
    return kv


def test_a_device_save_fills_the_reservations_own_memory_and_writes_it_with_no_copy():
    layout = make_layout(3, 64)
    backend = OwnBuffersBackend()
    kv = _random_kv(3, 8, 64)
    copier = DeviceLikeCopier(kv, [])
    with LayerPipeline(backend, copier, layout) as pipe:
        pipe.start_save([ReqSave("r", ["x", "y"], [2, 5])])
        for layer in range(3):
            pipe.save_layer(layer)
        res = pipe.finish_save()
    assert res.ok and sorted(res.committed_keys) == ["x", "y"], res.errors
    for key, b in (("x", 2), ("y", 5)):
        assert bytes(backend.objects[key]) == b"".join(kv[layer][b].tobytes() for layer in range(3))
    assert backend.in_place == 6 and backend.copied == 0  # two objects x three layers, none staged
    assert [op for op, _, _ in backend.calls].count("write_buffers") == 3


def test_a_copy_into_the_reservations_still_running_at_its_deadline_aborts_them_only_once_it_completed():
    layout = make_layout(2, 64)
    backend = OwnBuffersBackend()
    kv = _random_kv(2, 8, 64)
    copier = LateSaveCopier(kv, backend)
    with LayerPipeline(backend, copier, layout, save_timeout_s=1.0) as pipe:
        pipe.start_save([ReqSave("r", ["x", "y"], [1, 6])])
        for layer in range(2):
            pipe.save_layer(layer)
        res = pipe.finish_save()
        assert not res.committed_keys and sorted(res.failed_keys) == ["x", "y"]
        assert any("did not finish" in e for e in res.errors), res.errors
        # The copies still run: their reservations are neither committed nor aborted (their memory
        # is not given to another object), and nothing was written from them.
        assert not backend.aborted_at and set(backend.reserved) == {"x", "y"}
        assert [op for op, _, _ in backend.calls].count("write") == 0
        copier.complete()
        deadline = time.monotonic() + 5
        while len(backend.aborted_at) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert copier.wrote_into_aborted == 0
    assert set(backend.aborted_at) == {"x", "y"} and not backend.reserved and not backend.objects


def test_a_backend_without_buffers_to_fill_is_written_from_staging():
    layout = make_layout(2, 64)
    backend = OwnBuffersBackend()
    backend.write_buffers = lambda handles, offsets, nbytes: None  # type: ignore[method-assign]
    kv = _random_kv(2, 8, 64)
    with LayerPipeline(backend, DeviceLikeCopier(kv, []), layout) as pipe:
        pipe.start_save([ReqSave("r", ["x"], [3])])
        for layer in range(2):
            pipe.save_layer(layer)
        res = pipe.finish_save()
    assert res.ok, res.errors
    assert bytes(backend.objects["x"]) == kv[0][3].tobytes() + kv[1][3].tobytes()
    assert backend.in_place == 0 and backend.copied == 2


class StalledWorkerCopier(LateSaveCopier):
    """The first wait for a save copy (a save worker's) blocks until ``complete`` whatever its
    timeout, as a worker descheduled past ``finish``'s deadline would; later waits keep theirs."""

    def __init__(self, kv: Any, backend: OwnBuffersBackend) -> None:
        super().__init__(kv, backend)
        self.first = True

    def wait(self, token: Any, timeout_s: float) -> bool:
        if token is not None and token[0] == "d2h" and self.first:
            self.first = False
            self.done.wait(30)
            return True
        return super().wait(token, timeout_s)


def test_a_step_that_gives_up_on_a_worker_still_waiting_for_its_copy_aborts_only_once_the_copy_completed():
    layout = make_layout(1, 64)
    backend = OwnBuffersBackend()
    copier = StalledWorkerCopier(_random_kv(1, 8, 64), backend)
    with LayerPipeline(backend, copier, layout, save_timeout_s=0.5) as pipe:
        pipe.start_save([ReqSave("r", ["x", "y"], [1, 6])])
        pipe.save_layer(0)
        res = pipe.finish_save()  # its deadline passes while the worker still waits for the copy
        assert not res.committed_keys and sorted(res.failed_keys) == ["x", "y"]
        assert any("missed" in e for e in res.errors) and any("did not finish" in e for e in res.errors), res.errors
        assert not backend.aborted_at and set(backend.reserved) == {"x", "y"}  # the copy may still write them
        copier.complete()
        deadline = time.monotonic() + 5
        while len(backend.aborted_at) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert copier.wrote_into_aborted == 0
    assert set(backend.aborted_at) == {"x", "y"} and not backend.objects
    assert [op for op, _, _ in backend.calls].count("write") == 0  # the worker did not write after the cancel
