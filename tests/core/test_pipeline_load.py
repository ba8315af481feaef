"""Loads through the layer pipeline: exact bytes, prefetch window, batching, stagger, errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pipeline_support import DictBackend, RecordingCopier, expected_block, fill_pool, make_layout, wait_until

from lw_core.backend import BackendError
from lw_core.pipeline import LayerPipeline
from lw_core.pipeline.host_copier import HostCopier
from lw_core.plan import ReqLoad

SENTINEL = 0xEE


def kv_for(layout, num_blocks=32, log=None):
    kv = HostCopier.allocate(layout.num_layers, num_blocks, list(layout.layer_nbytes), fill=SENTINEL).kv
    return RecordingCopier(kv, log)


def three_requests():
    return [
        ReqLoad("r0", ["k0", "k1", "k2"], [5, 6, 7]),
        ReqLoad("r1", ["k3"], [1]),
        ReqLoad("r2", ["k4", "k5"], [20, 3]),
    ]


def assert_loaded(copier, layout, loads, layers=None):
    for r in loads:
        for k, b in zip(r.keys, r.block_ids):
            for layer in layers if layers is not None else range(layout.num_layers):
                assert np.array_equal(copier.kv[layer][b], expected_block(layout, k, layer)), (r.req_id, k, b, layer)


def run_step(pipe, loads, compute=None):
    pipe.start_load(loads)
    for layer in range(pipe.layout.num_layers):
        pipe.wait_layer(layer)
        if compute:
            compute(layer)
    return pipe.finish_load()


@pytest.mark.parametrize("views", [False, True], ids=["staged", "zero-copy"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_exact_bytes_land_in_the_right_blocks(views, depth):
    layout = make_layout(4, [64, 128, 64, 256])  # per-layer sizes differ (offsets matter)
    backend = DictBackend(views=views)
    loads = three_requests()
    fill_pool(backend, layout, [k for r in loads for k in r.keys])
    copier = kv_for(layout)
    with LayerPipeline(backend, copier, layout, prefetch_depth=depth) as pipe:
        res = run_step(pipe, loads)
    assert res.ok, res
    assert res.loaded_objects == 6 and res.loaded_bytes == 6 * layout.nbytes
    assert_loaded(copier, layout, loads)
    untouched = [b for b in range(32) if b not in {5, 6, 7, 1, 20, 3}]
    for layer in range(4):
        assert (copier.kv[layer][untouched] == SENTINEL).all()
    assert backend.leases == 0  # every lease released
    assert any(c[0] == ("view" if views else "read") for c in backend.calls)


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_prefetch_window_is_respected(depth):
    layout = make_layout(8, 32)
    backend = DictBackend()
    loads = [ReqLoad("r", ["a", "b"], [0, 1])]
    fill_pool(backend, layout, ["a", "b"])
    log: list = []
    copier = kv_for(layout, log=log)

    def transferred():
        return {e[1] for e in list(log) if e[0] == "to_kv"}

    with LayerPipeline(backend, copier, layout, prefetch_depth=depth) as pipe:
        pipe.start_load(loads)
        assert wait_until(lambda: set(range(min(depth, 8))) <= transferred())
        time.sleep(0.03)  # a worker that ran ahead of the window would show it now
        assert transferred() == set(range(min(depth, 8)))
        for layer in range(8):
            pipe.wait_layer(layer)
            window = set(range(min(layer + depth, 8)))
            assert wait_until(lambda w=window: w <= transferred())
            time.sleep(0.01)
            assert transferred() == window, f"after wait_layer({layer}) with depth {depth}"
        res = pipe.finish_load()
    assert res.ok
    assert_loaded(copier, layout, loads)


@pytest.mark.parametrize(
    "max_blocks,max_bytes,sizes",
    [(3, 0, [3, 3, 2]), (0, 250, [2, 2, 2, 2]), (3, 250, [2, 2, 2, 2]), (0, 0, [8]), (0, 50, [1] * 8)],
)
def test_batches_respect_block_and_byte_caps(max_blocks, max_bytes, sizes):
    layout = make_layout(3, 100)
    backend = DictBackend()
    keys = [f"k{i}" for i in range(8)]
    loads = [ReqLoad("r0", keys[:5], list(range(5))), ReqLoad("r1", keys[5:], [10, 11, 12])]
    fill_pool(backend, layout, keys)
    copier = kv_for(layout)
    with LayerPipeline(backend, copier, layout, prefetch_depth=2, max_transfer_blocks=max_blocks, max_transfer_bytes=max_bytes) as pipe:
        res = run_step(pipe, loads)
    assert res.ok
    for layer in range(3):
        reads = [c[1] for c in backend.calls if c[0] == "read" and c[2][0] == layout.offsets[layer]]
        copies = [len(e[2]) for e in copier.log if e[0] == "to_kv" and e[1] == layer]
        assert reads == sizes and copies == sizes  # batched across the two requests, per layer
    assert_loaded(copier, layout, loads)


def test_stagger_sleeps_per_rank_and_layer_before_the_copy():
    layout = make_layout(4, 16)
    backend = DictBackend()
    fill_pool(backend, layout, ["a"])
    log: list = []
    copier = kv_for(layout, log=log)
    sleep = lambda s: log.append(("sleep", round(s * 1e6)))  # noqa: E731
    with LayerPipeline(backend, copier, layout, prefetch_depth=2, h2d_stagger_us=700, tp_rank=1, tp_size=3, sleep=sleep) as pipe:
        res = run_step(pipe, [ReqLoad("r", ["a"], [2])])
    assert res.ok
    seq = [e for e in log if e[0] in ("sleep", "to_kv")]
    # ((rank + layer) % tp_size) * stagger: layers 0..3 -> 700, 1400, 0, 700 µs, each right before the copy
    assert seq == [
        ("sleep", 700), ("to_kv", 0, (2,)),
        ("sleep", 1400), ("to_kv", 1, (2,)),
        ("to_kv", 2, (2,)),
        ("sleep", 700), ("to_kv", 3, (2,)),
    ]  # fmt: skip


def test_stagger_really_delays():
    layout = make_layout(1, 16)
    backend = DictBackend()
    fill_pool(backend, layout, ["a"])
    copier = kv_for(layout)
    with LayerPipeline(backend, copier, layout, h2d_stagger_us=60_000, tp_rank=1, tp_size=2) as pipe:
        t0 = time.perf_counter()
        res = run_step(pipe, [ReqLoad("r", ["a"], [0])])
        assert time.perf_counter() - t0 >= 0.06
    assert res.ok


def test_stuck_read_misses_deadline_and_late_data_never_reaches_kv():
    layout = make_layout(4, 64)
    backend = DictBackend()
    loads = three_requests()
    fill_pool(backend, layout, [k for r in loads for k in r.keys])
    release = threading.Event()
    returned = threading.Event()

    def hook(handles, offsets):
        if offsets[0] == layout.offsets[1] and not release.is_set():
            release.wait(30)  # stuck until the test lets go
            returned.set()

    backend.read_hook = hook
    copier = kv_for(layout)
    pipe = LayerPipeline(backend, copier, layout, prefetch_depth=2, layer_timeout_s=0.3)
    try:
        pipe.start_load(loads)
        pipe.wait_layer(0)
        t0 = time.perf_counter()
        pipe.wait_layer(1)
        waited = time.perf_counter() - t0
        for layer in (2, 3):
            pipe.wait_layer(layer)  # every block already failed: no further waiting
        total = time.perf_counter() - t0
        res = pipe.finish_load()
        assert 0.25 <= waited < 1.5 and total < 1.5
        assert res.deadline_misses == [1]
        assert sorted(res.failed_block_ids) == [1, 3, 5, 6, 7, 20]
        assert sorted(res.failed_req_ids) == ["r0", "r1", "r2"] and res.loaded_objects == 0
        assert any("deadline" in e for e in res.errors)
        release.set()  # the stuck read now completes, long after its deadline
        assert returned.wait(5)
        time.sleep(0.05)
        assert (copier.kv[1] == SENTINEL).all(), "a late read wrote into the KV cache"
        assert_loaded(copier, layout, loads, layers=[0])

        # the pool replaced the stuck worker: the next step loads normally
        backend.read_hook = None
        res2 = run_step(pipe, loads)
        assert res2.ok, res2
        assert_loaded(copier, layout, loads)
    finally:
        release.set()
        pipe.close()


def test_stuck_zero_copy_view_is_also_bounded():
    layout = make_layout(2, 64)
    backend = DictBackend(views=True)
    fill_pool(backend, layout, ["a", "b"])
    release = threading.Event()
    backend.read_hook = lambda hs, offs: release.wait(30) if offs[0] == layout.offsets[0] else None
    copier = kv_for(layout)
    pipe = LayerPipeline(backend, copier, layout, layer_timeout_s=0.2)
    try:
        t0 = time.perf_counter()
        res = run_step(pipe, [ReqLoad("r", ["a", "b"], [0, 1])])
        assert time.perf_counter() - t0 < 1.0
        assert sorted(res.failed_block_ids) == [0, 1] and res.deadline_misses == [0]
        release.set()
        time.sleep(0.05)
        assert (copier.kv[0] == SENTINEL).all()
    finally:
        release.set()
        pipe.close()


@pytest.mark.parametrize("views", [False, True], ids=["staged", "zero-copy"])
def test_backend_error_on_one_layer_fails_only_affected_blocks(views):
    layout = make_layout(4, 64)
    backend = DictBackend(views=views)
    loads = three_requests()
    fill_pool(backend, layout, [k for r in loads for k in r.keys])

    def hook(handles, offsets):
        if offsets[0] == layout.offsets[2] and any(h.key in ("k1", "k4") for h in handles):
            raise BackendError("injected read failure")

    backend.read_hook = hook
    copier = kv_for(layout)
    with LayerPipeline(backend, copier, layout, prefetch_depth=2) as pipe:
        res = run_step(pipe, loads)
    assert sorted(res.failed_block_ids) == [6, 20]  # k1 -> block 6, k4 -> block 20
    assert sorted(res.failed_req_ids) == ["r0", "r2"]
    assert res.loaded_objects == 4 and res.deadline_misses == []
    assert any("injected read failure" in e for e in res.errors)
    good = [ReqLoad("r0", ["k0", "k2"], [5, 7]), ReqLoad("r1", ["k3"], [1]), ReqLoad("r2", ["k5"], [3])]
    assert_loaded(copier, layout, good)


def test_missing_objects_fail_without_touching_others():
    layout = make_layout(2, 32)
    backend = DictBackend()
    fill_pool(backend, layout, ["a", "c"])
    copier = kv_for(layout)
    with LayerPipeline(backend, copier, layout) as pipe:
        res = run_step(pipe, [ReqLoad("r0", ["a", "b"], [0, 1]), ReqLoad("r1", ["c"], [2])])
    assert res.failed_block_ids == [1] and res.failed_req_ids == ["r0"]
    assert (copier.kv[0][1] == SENTINEL).all()
    assert_loaded(copier, layout, [ReqLoad("r0", ["a"], [0]), ReqLoad("r1", ["c"], [2])])


def test_unexpected_exception_in_the_copier_is_reported_not_lost():
    layout = make_layout(3, 32)
    backend = DictBackend()
    fill_pool(backend, layout, ["a", "b"])
    copier = kv_for(layout)

    def boom(layer, blocks):
        if layer == 1:
            raise ZeroDivisionError("copier bug")

    copier.to_kv_hook = boom
    with LayerPipeline(backend, copier, layout, prefetch_depth=3) as pipe:
        res = run_step(pipe, [ReqLoad("r", ["a", "b"], [0, 1])])
    assert sorted(res.failed_block_ids) == [0, 1]
    assert any("unexpected ZeroDivisionError" in e and "copier bug" in e for e in res.errors)


def test_open_error_and_stuck_open_fail_the_step_within_the_deadline():
    layout = make_layout(2, 32)
    backend = DictBackend()
    fill_pool(backend, layout, ["a"])
    copier = kv_for(layout)
    release = threading.Event()
    with LayerPipeline(backend, copier, layout, layer_timeout_s=0.2) as pipe:
        backend.open = lambda keys: (_ for _ in ()).throw(BackendError("store down"))
        res = run_step(pipe, [ReqLoad("r", ["a"], [0])])
        assert res.failed_block_ids == [0] and "store down" in " ".join(res.errors)

        def stuck_open(keys):
            release.wait(30)
            return DictBackend.open(backend, keys)

        backend.open = stuck_open
        t0 = time.perf_counter()
        res = run_step(pipe, [ReqLoad("r", ["a"], [0])])
        assert time.perf_counter() - t0 < 1.0
        assert res.failed_block_ids == [0]
        release.set()
        assert wait_until(lambda: backend.leases == 0)  # the late lease is released, not leaked
    assert (copier.kv[0][0] == SENTINEL).all()


def test_bulk_mode_loads_everything_in_start_load():
    layout = make_layout(3, 48)
    backend = DictBackend(views=True)
    loads = three_requests()
    fill_pool(backend, layout, [k for r in loads for k in r.keys])
    copier = kv_for(layout)
    with LayerPipeline(backend, copier, layout, layerwise=False) as pipe:
        pipe.start_load(loads)
        assert_loaded(copier, layout, loads)  # before any wait_layer
        pipe.wait_layer(0)  # a no-op in bulk mode
        res = pipe.finish_load()
    assert res.ok and res.loaded_objects == 6


def test_layers_never_waited_count_as_failed():
    layout = make_layout(3, 16)
    backend = DictBackend()
    fill_pool(backend, layout, ["a"])
    copier = kv_for(layout)
    with LayerPipeline(backend, copier, layout, prefetch_depth=3) as pipe:
        pipe.start_load([ReqLoad("r", ["a"], [0])])
        pipe.wait_layer(0)
        pipe.wait_layer(1)  # layer 2's attention ran without waiting: its data may be missing
        res = pipe.finish_load()
    assert res.failed_block_ids == [0]
    assert any("layer 2 was never waited" in e for e in res.errors)


def test_no_loads_is_a_no_op_and_bad_calls_raise_clearly():
    layout = make_layout(2, 16)
    with LayerPipeline(DictBackend(), kv_for(layout), layout) as pipe:
        pipe.start_load([])
        pipe.wait_layer(1)
        assert pipe.finish_load().ok
        with pytest.raises(ValueError, match=r"layer=2 out of range; accepted 0..1"):
            pipe.wait_layer(2)
        with pytest.raises(ValueError, match="appear more than once"):
            pipe.start_load([ReqLoad("a", ["x"], [1]), ReqLoad("b", ["y"], [1])])
        pipe.start_load([ReqLoad("a", ["x"], [1])])
        with pytest.raises(RuntimeError, match="finish_load"):
            pipe.start_load([ReqLoad("a", ["x"], [1])])
        pipe.finish_load()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_layers=st.integers(1, 5),
    depth=st.integers(1, 4),
    max_blocks=st.integers(0, 4),
    max_bytes=st.sampled_from([0, 40, 100, 1000]),
    views=st.booleans(),
)
def test_any_plan_loads_exact_bytes(data, num_layers, depth, max_blocks, max_bytes, views):
    layout = make_layout(num_layers, data.draw(st.lists(st.sampled_from([8, 24, 40]), min_size=num_layers, max_size=num_layers)))
    n = data.draw(st.integers(0, 12))
    blocks = data.draw(st.lists(st.integers(0, 15), min_size=n, max_size=n, unique=True))
    keys = data.draw(st.lists(st.sampled_from([f"k{i}" for i in range(6)]), min_size=n, max_size=n))
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=3)))
    bounds = [0, *cuts, n]
    loads = [ReqLoad(f"r{j}", keys[a:b], blocks[a:b]) for j, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]
    backend = DictBackend(views=views)
    if keys:
        fill_pool(backend, layout, sorted(set(keys)))
    copier = kv_for(layout, num_blocks=16)
    with LayerPipeline(backend, copier, layout, prefetch_depth=depth, max_transfer_blocks=max_blocks, max_transfer_bytes=max_bytes) as pipe:
        res = run_step(pipe, loads)
    assert res.ok and res.loaded_objects == n
    assert_loaded(copier, layout, loads)
    for layer in range(num_layers):
        rest = [b for b in range(16) if b not in blocks]
        assert (copier.kv[layer][rest] == SENTINEL).all()
