"""The backend contract checks every pool backend passes: plain functions of a backend
(``check_*``), and the base classes that run them as pytest tests, ``BackendContract`` (every
backend) and ``ViewsContract`` (backends whose read handles have views, which loads then use).

A test module subclasses them and defines the fixture ``backend``: tests/core on MemoryBackend and
EmbeddedBackend, tests/mooncake on MooncakeBackend against a real master. A check leaves the
objects it committed in the backend; a fixture that shares one backend between tests clears it in
between. Keys used: "a".."d" (the pipeline saves), "k" (write-once).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lw_core.backend import Backend, ObjectMissing
from lw_core.pipeline import LayerPipeline
from lw_core.pipeline.host_copier import HostCopier
from lw_core.plan import ObjectLayout, ReqLoad, ReqSave

__all__ = [
    "LAYOUT", "SAVES", "seeded_kv", "save_all", "load_all", "check_protocol", "check_write_once_and_abort",
    "check_round_trip_exact_bytes", "check_loads_use_zero_copy_views", "check_missing_key_fails_only_its_block",
    "BackendContract", "ViewsContract",
]

# Four layers of unequal size (a layer's bytes need not be equal), 28 KiB an object.
LAYOUT = ObjectLayout(layer_nbytes=(4096, 8192, 4096, 12288))
SAVES = [ReqSave("r0", ["a", "b", "c"], [2, 5, 7]), ReqSave("r1", ["d"], [0])]


def seeded_kv(layout: ObjectLayout, seed: int, num_blocks: int = 8) -> HostCopier:
    """A host KV cache of ``num_blocks`` blocks a layer, filled with seeded random bytes."""
    copier = HostCopier.allocate(layout.num_layers, num_blocks, list(layout.layer_nbytes), fill=None)
    rng = np.random.default_rng(seed)
    for a in copier.kv:
        a[:] = rng.integers(0, 256, a.shape, dtype=np.uint8)
    return copier


def save_all(backend: Any, copier: HostCopier, layout: ObjectLayout, saves: list[ReqSave], **kw: Any):
    with LayerPipeline(backend, copier, layout, **kw) as pipe:
        pipe.start_save(saves)
        for layer in range(layout.num_layers):
            pipe.save_layer(layer)
        return pipe.finish_save()


def load_all(backend: Any, copier: HostCopier, layout: ObjectLayout, loads: list[ReqLoad], **kw: Any):
    with LayerPipeline(backend, copier, layout, **kw) as pipe:
        pipe.start_load(loads)
        for layer in range(layout.num_layers):
            pipe.wait_layer(layer)
        return pipe.finish_load()


def check_protocol(backend: Any) -> None:
    assert isinstance(backend, Backend)


def check_write_once_and_abort(backend: Any) -> None:
    """A reserved key is nobody else's to reserve; an aborted reservation never becomes visible and
    cannot be committed; the key is free again after the abort."""
    (h,) = backend.reserve(["k"], 100)
    assert backend.reserve(["k"], 100) == [None]
    backend.abort([h])
    assert backend.lookup(["k"]) == 0
    try:
        backend.commit([h])
    except ObjectMissing:
        pass
    else:
        raise AssertionError("commit of an aborted reservation did not raise ObjectMissing")
    (h,) = backend.reserve(["k"], 100)
    backend.commit([h])
    assert backend.lookup(["k"]) == 1 and backend.reserve(["k"], 100) == [None]


def check_round_trip_exact_bytes(backend: Any, layerwise: bool) -> None:
    """The layer pipeline saves blocks into objects and loads them into other blocks, byte-exact;
    saving the same keys again skips them."""
    src, dst = seeded_kv(LAYOUT, 1), seeded_kv(LAYOUT, 2)
    res = save_all(backend, src, LAYOUT, SAVES, layerwise=layerwise, max_transfer_blocks=2)
    assert res.ok and sorted(res.committed_keys) == ["a", "b", "c", "d"], res
    assert backend.lookup(["a", "b", "c", "d"]) == 4
    again = save_all(backend, src, LAYOUT, SAVES, layerwise=layerwise)
    assert again.committed_keys == [] and sorted(again.skipped_keys) == ["a", "b", "c", "d"], again
    loads = [ReqLoad("x", ["d", "b"], [1, 3]), ReqLoad("y", ["c", "a"], [6, 4])]
    res = load_all(backend, dst, LAYOUT, loads, layerwise=layerwise, prefetch_depth=3, max_transfer_bytes=10000)
    assert res.ok, res
    for layer in range(LAYOUT.num_layers):
        for s, d in ((0, 1), (5, 3), (7, 6), (2, 4)):
            assert np.array_equal(dst.kv[layer][d], src.kv[layer][s])


def check_loads_use_zero_copy_views(backend: Any) -> None:
    """A backend whose read handles have views serves loads from them, never calling ``read``."""
    src, dst = seeded_kv(LAYOUT, 3), seeded_kv(LAYOUT, 4)
    assert save_all(backend, src, LAYOUT, SAVES).ok
    read = backend.read
    backend.read = lambda *a: (_ for _ in ()).throw(AssertionError("read() used although view() works"))
    try:
        assert load_all(backend, dst, LAYOUT, [ReqLoad("x", ["a"], [0])]).ok
    finally:
        backend.read = read
    assert np.array_equal(dst.kv[3][0], src.kv[3][2])


def check_missing_key_fails_only_its_block(backend: Any) -> None:
    src, dst = seeded_kv(LAYOUT, 5), seeded_kv(LAYOUT, 6)
    assert save_all(backend, src, LAYOUT, SAVES[:1]).ok
    res = load_all(backend, dst, LAYOUT, [ReqLoad("x", ["a", "zz"], [0, 1]), ReqLoad("y", ["b"], [2])])
    assert res.failed_block_ids == [1] and res.failed_req_ids == ["x"] and res.loaded_objects == 2


class BackendContract:
    """The contract's tests. A test module subclasses it (``class TestBackendContract(BackendContract)``)
    and defines the fixture ``backend``: a backend holding none of the contract's keys."""

    def test_protocol(self, backend: Any) -> None:
        check_protocol(backend)

    def test_write_once_and_abort(self, backend: Any) -> None:
        check_write_once_and_abort(backend)

    @pytest.mark.parametrize("layerwise", [True, False])
    def test_round_trip_exact_bytes(self, backend: Any, layerwise: bool) -> None:
        check_round_trip_exact_bytes(backend, layerwise)

    def test_missing_key_fails_only_its_block(self, backend: Any) -> None:
        check_missing_key_fails_only_its_block(backend)


class ViewsContract:
    """For backends whose read handles always have views: loads are served from them. Subclassed
    beside ``BackendContract``, over the same fixture ``backend``."""

    def test_loads_use_zero_copy_views(self, backend: Any) -> None:
        check_loads_use_zero_copy_views(backend)
