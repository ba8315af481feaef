"""Loads from memory a backend lends (``Backend.read_lent``, ``lw_core.backend.Lent``): the pipeline
copies from the lent views into the KV cache with no staging buffer, and gives each lend back only
once the copy that reads it is done (never while a device-like copy may still read it)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from test_pipeline_device import DeviceLikeCopier
from test_pipeline_support import DictBackend, expected_block, fill_pool, make_layout

from lw_core.backend import ObjectMissing
from lw_core.pipeline import LayerPipeline
from lw_core.pipeline.host_copier import HostCopier
from lw_core.pipeline.pool import StagingPool
from lw_core.plan import ReqLoad


class _Lend:
    def __init__(self, owner: LendingBackend, views: list[np.ndarray]) -> None:
        self.owner, self.views = owner, views

    def give_back(self) -> None:
        with self.owner.lock:
            assert self in self.owner.out, "given back twice"
            self.owner.out.remove(self)
            self.owner.given_back += 1
            for v in self.views:  # the store reuses its memory at once: a late reader would see this
                v[:] = 0xEE


class LendingBackend(DictBackend):
    """``DictBackend`` whose reads land in memory of its own, lent to the caller. ``room``: whether
    it has memory to lend (else ``read_lent`` answers None)."""

    def __init__(self, room: bool = True) -> None:
        super().__init__(views=False)
        self.room = room
        self.out: list[_Lend] = []
        self.lent = self.given_back = 0

    def read_lent(self, handles: Any, offsets: Any, nbytes: int) -> _Lend | None:
        self.calls.append(("read_lent", len(handles), tuple(offsets)))
        if not self.room:
            return None
        views = []
        for h, off in zip(handles, offsets):
            if self.objects.get(h.key) is not h.buf:
                raise ObjectMissing(f"{h.key} is gone")
            views.append(np.frombuffer(bytes(h.buf[off : off + nbytes]), dtype=np.uint8).copy())
        lend = _Lend(self, views)
        with self.lock:
            self.out.append(lend)
            self.lent += 1
        return lend


class SlowDeviceCopier(DeviceLikeCopier):
    """Its copies are still running until ``done`` is set (``wait`` says so), and each reads its
    sources only then: bytes a lend gave back before that would be the store's 0xEE."""

    def __init__(self, kv: Any, log: list) -> None:
        super().__init__(kv, log)
        self.done = threading.Event()
        self.pending: list[tuple[int, list[int], list[np.ndarray]]] = []

    def to_kv(self, layer: int, block_ids: Any, srcs: Any) -> Any:
        self.pending.append((layer, list(block_ids), list(srcs)))
        tok = ("h2d", next(self._ids), layer)
        self.log.append(("token", tok))
        return tok

    def complete(self) -> None:
        for layer, blocks, srcs in self.pending:
            for b, s in zip(blocks, srcs):
                self.kv[layer][b] = np.frombuffer(s, dtype=np.uint8).reshape(self.kv[layer][b].shape)
        self.pending.clear()
        self.done.set()

    def wait(self, token: Any, timeout_s: float) -> bool:
        self.waited.append(token)
        return self.done.is_set()


def test_a_load_reads_lent_memory_with_no_staging_and_gives_every_lend_back():
    layout = make_layout(3, 64)
    backend = LendingBackend()
    fill_pool(backend, layout, ["a", "b", "c"])
    copier = HostCopier.allocate(3, 8, 64)
    with LayerPipeline(backend, copier, layout, prefetch_depth=2) as pipe:
        pipe.start_load([ReqLoad("r", ["a", "b", "c"], [5, 1, 3])])
        for layer in range(3):
            pipe.wait_layer(layer)
        res = pipe.finish_load()
    assert res.ok, res.errors
    for key, b in (("a", 5), ("b", 1), ("c", 3)):
        for layer in range(3):
            assert np.array_equal(copier.kv[layer][b], expected_block(layout, key, layer))
    assert not any(op == "read" for op, _, _ in backend.calls)  # nothing went through staging
    assert backend.lent == 3 and backend.given_back == 3 and not backend.out  # one batch a layer


def test_a_backend_without_room_to_lend_is_read_into_staging():
    layout = make_layout(2, 64)
    backend = LendingBackend(room=False)
    fill_pool(backend, layout, ["a", "b"])
    copier = HostCopier.allocate(2, 8, 64)
    with LayerPipeline(backend, copier, layout) as pipe:
        pipe.start_load([ReqLoad("r", ["a", "b"], [2, 6])])
        for layer in range(2):
            pipe.wait_layer(layer)
        res = pipe.finish_load()
    assert res.ok, res.errors
    assert [op for op, _, _ in backend.calls].count("read") == 2
    for key, b in (("a", 2), ("b", 6)):
        for layer in range(2):
            assert np.array_equal(copier.kv[layer][b], expected_block(layout, key, layer))


def test_a_lend_goes_back_only_once_the_device_copy_reading_it_is_done():
    layout = make_layout(2, 64)
    backend = LendingBackend()
    fill_pool(backend, layout, ["a", "b", "c", "d"])
    copier = SlowDeviceCopier(HostCopier.allocate(2, 8, 64).kv, [])
    with LayerPipeline(backend, copier, layout) as pipe:
        pipe.start_load([ReqLoad("r", ["a", "b"], [1, 2])])
        for layer in range(2):
            pipe.wait_layer(layer)
        assert pipe.finish_load().ok
        assert backend.lent == 2 and backend.given_back == 0  # both copies are still running
        # A later load lends more; the earlier lends stay out while their copies run.
        pipe.start_load([ReqLoad("r2", ["c"], [3])])
        for layer in range(2):
            pipe.wait_layer(layer)
        assert pipe.finish_load().ok
        assert backend.lent == 4 and backend.given_back == 0
        copier.complete()  # the copies read their sources now: still the objects' bytes
        for key, b in (("a", 1), ("b", 2), ("c", 3)):
            for layer in range(2):
                assert np.array_equal(copier.kv[layer][b], expected_block(layout, key, layer))
        pipe.start_load([ReqLoad("r3", ["d"], [4])])  # the next lend gives the finished ones back first
        for layer in range(2):
            pipe.wait_layer(layer)
        assert pipe.finish_load().ok
        # Every earlier lend went back (and r3's first layer's too, if its copy was parked before
        # the second layer's read).
        assert backend.lent == 6 and backend.given_back >= 4


def test_staging_pool_gives_a_lend_back_when_its_copy_is_done_and_never_behind_a_broken_token():
    class Tok:
        def __init__(self) -> None:
            self.done, self.broken = False, False

    def wait(tok: Tok, timeout_s: float) -> bool:
        if tok.broken:
            raise RuntimeError("the device lost this event")
        return tok.done

    backend = LendingBackend()
    pool = StagingPool(wait)
    lends = [_Lend(backend, [np.zeros(4, np.uint8)]) for _ in range(3)]
    backend.out.extend(lends)
    pool.put(lends[0])  # no copy in flight: back at once
    assert backend.given_back == 1
    running, broken = Tok(), Tok()
    pool.put(lends[1], running)
    pool.put(lends[2], broken)
    broken.broken = True
    pool.reclaim()
    assert backend.given_back == 1
    running.done = True
    pool.reclaim()
    assert backend.given_back == 2
    pool.reclaim()
    assert backend.out == [lends[2]]  # a copy that cannot be waited for may still read it: kept


@pytest.mark.parametrize("views", [1, 3])
def test_a_lend_of_the_wrong_size_is_given_back_and_its_items_recomputed(views: int):
    layout = make_layout(1, 64)
    backend = LendingBackend()
    fill_pool(backend, layout, ["a", "b"])
    real = backend.read_lent

    def wrong(handles: Any, offsets: Any, nbytes: int) -> _Lend | None:
        lend = real(handles, offsets, nbytes)
        assert lend is not None
        lend.views = (lend.views * 3)[:views]
        return lend

    backend.read_lent = wrong  # type: ignore[method-assign]
    copier = HostCopier.allocate(1, 8, 64)
    with LayerPipeline(backend, copier, layout) as pipe:
        pipe.start_load([ReqLoad("r", ["a", "b"], [1, 2])])
        pipe.wait_layer(0)
        res = pipe.finish_load()
    # The batch of two is refused; item by item, one view each is right.
    assert res.ok == (views == 1), res.errors
    assert backend.lent == backend.given_back and not backend.out
