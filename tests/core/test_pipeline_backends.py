"""The pipeline over the real backends: in-process MemoryBackend and the multi-process embedded pool."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest
from lw_core.host_copier import HostCopier
from lw_core.pipeline import LayerPipeline
from lw_core.plan import ObjectLayout, ReqLoad, ReqSave
from test_pipeline_support import make_layout

LAYOUT = make_layout(4, [4096, 8192, 4096, 12288])
SAVES = [ReqSave("r0", ["a", "b", "c"], [2, 5, 7]), ReqSave("r1", ["d"], [0])]


def seeded_kv(layout: ObjectLayout, seed: int, num_blocks: int = 8) -> HostCopier:
    copier = HostCopier.allocate(layout.num_layers, num_blocks, list(layout.layer_nbytes), fill=None)
    rng = np.random.default_rng(seed)
    for a in copier.kv:
        a[:] = rng.integers(0, 256, a.shape, dtype=np.uint8)
    return copier


def save_all(backend, copier, layout, saves, **kw):
    with LayerPipeline(backend, copier, layout, **kw) as pipe:
        pipe.start_save(saves)
        for layer in range(layout.num_layers):
            pipe.save_layer(layer)
        return pipe.finish_save()


def load_all(backend, copier, layout, loads, **kw):
    with LayerPipeline(backend, copier, layout, **kw) as pipe:
        pipe.start_load(loads)
        for layer in range(layout.num_layers):
            pipe.wait_layer(layer)
        return pipe.finish_load()


@pytest.fixture(params=["memory", "embedded"])
def backend(request, tmp_path):
    if request.param == "memory":
        mod = pytest.importorskip("lw_core.backends.memory")
        b = mod.MemoryBackend(capacity_bytes=64 << 20)
    else:
        mod = pytest.importorskip("lw_core.backends.embedded")
        b = mod.EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=16 << 20)
    yield b
    b.close()


@pytest.mark.parametrize("layerwise", [True, False])
def test_round_trip_exact_bytes(backend, layerwise):
    src, dst = seeded_kv(LAYOUT, 1), seeded_kv(LAYOUT, 2)
    res = save_all(backend, src, LAYOUT, SAVES, layerwise=layerwise, max_transfer_blocks=2)
    assert res.ok and sorted(res.committed_keys) == ["a", "b", "c", "d"]
    assert backend.lookup(["a", "b", "c", "d"]) == 4
    again = save_all(backend, src, LAYOUT, SAVES, layerwise=layerwise)
    assert again.committed_keys == [] and sorted(again.skipped_keys) == ["a", "b", "c", "d"]
    loads = [ReqLoad("x", ["d", "b"], [1, 3]), ReqLoad("y", ["c", "a"], [6, 4])]
    res = load_all(backend, dst, LAYOUT, loads, layerwise=layerwise, prefetch_depth=3, max_transfer_bytes=10000)
    assert res.ok, res
    for layer in range(LAYOUT.num_layers):
        for s, d in ((0, 1), (5, 3), (7, 6), (2, 4)):
            assert np.array_equal(dst.kv[layer][d], src.kv[layer][s])


def test_loads_use_zero_copy_views(backend):
    src, dst = seeded_kv(LAYOUT, 3), seeded_kv(LAYOUT, 4)
    assert save_all(backend, src, LAYOUT, SAVES).ok
    read = backend.read
    backend.read = lambda *a: (_ for _ in ()).throw(AssertionError("read() used although view() works"))
    try:
        assert load_all(backend, dst, LAYOUT, [ReqLoad("x", ["a"], [0])]).ok
    finally:
        backend.read = read
    assert np.array_equal(dst.kv[3][0], src.kv[3][2])


def test_missing_key_fails_only_its_block(backend):
    src, dst = seeded_kv(LAYOUT, 5), seeded_kv(LAYOUT, 6)
    assert save_all(backend, src, LAYOUT, SAVES[:1]).ok
    res = load_all(backend, dst, LAYOUT, [ReqLoad("x", ["a", "zz"], [0, 1]), ReqLoad("y", ["b"], [2])])
    assert res.failed_block_ids == [1] and res.failed_req_ids == ["x"] and res.loaded_objects == 2


def _save_in_child(path: str, ready) -> None:
    from lw_core.backends.embedded import EmbeddedBackend

    with EmbeddedBackend(path, capacity_bytes=16 << 20) as b:
        res = save_all(b, seeded_kv(LAYOUT, 7), LAYOUT, SAVES)
        ready.put(res.committed_keys)


def test_objects_saved_by_another_process_load_exactly(tmp_path):
    embedded = pytest.importorskip("lw_core.backends.embedded")
    path = str(tmp_path / "pool")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_save_in_child, args=(path, q))
    p.start()
    try:
        committed = q.get(timeout=60)
    finally:
        p.join(60)
    assert sorted(committed) == ["a", "b", "c", "d"]
    src, dst = seeded_kv(LAYOUT, 7), seeded_kv(LAYOUT, 8)
    with embedded.EmbeddedBackend(path, capacity_bytes=16 << 20) as b:
        res = load_all(b, dst, LAYOUT, [ReqLoad("x", ["c", "d"], [0, 1])], prefetch_depth=2)
    assert res.ok
    for layer in range(LAYOUT.num_layers):
        assert np.array_equal(dst.kv[layer][0], src.kv[layer][7])
        assert np.array_equal(dst.kv[layer][1], src.kv[layer][0])


def test_prefetched_layers_land_before_they_are_waited_for(tmp_path):
    """Layers inside the prefetch window load in the background, before any wait_layer call."""
    embedded = pytest.importorskip("lw_core.backends.embedded")
    layout = make_layout(6, 1 << 16)
    keys = [f"k{i}" for i in range(16)]
    with embedded.EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=32 << 20) as b:
        src, dst = seeded_kv(layout, 9, num_blocks=16), seeded_kv(layout, 10, num_blocks=16)
        assert save_all(b, src, layout, [ReqSave("r", keys, list(range(16)))]).ok
        with LayerPipeline(b, dst, layout, prefetch_depth=6) as pipe:
            pipe.start_load([ReqLoad("r", keys, list(range(16)))])
            # all six layers were submitted at start; they complete without any wait_layer call
            t_end = time.monotonic() + 5
            while time.monotonic() < t_end and not all(np.array_equal(dst.kv[i], src.kv[i]) for i in range(6)):
                time.sleep(0.005)
            assert all(np.array_equal(dst.kv[i], src.kv[i]) for i in range(6))
            for layer in range(6):
                pipe.wait_layer(layer)
            assert pipe.finish_load().ok
        for i in range(6):
            assert np.array_equal(dst.kv[i], src.kv[i])
