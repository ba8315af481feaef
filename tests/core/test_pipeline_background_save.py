"""Saves finished in the background (``LayerPipeline.finish_save_in_background``): the step returns
before the store has the data, the result comes back later with its tag, steps overlap, and the
same rules hold as for a step that waits (only complete objects are committed, deadlines bound it)."""

from __future__ import annotations

import threading
import time

from test_pipeline_save import SAVES, object_bytes, random_kv
from test_pipeline_support import DictBackend, make_layout, wait_until

from lw_core.pipeline import LayerPipeline
from lw_core.plan import ReqSave


def start(pipe, saves, tag):
    pipe.start_save(saves)
    for layer in range(pipe.layout.num_layers):
        pipe.save_layer(layer)
    pipe.finish_save_in_background(tag)


def test_step_returns_before_the_writes_and_the_result_comes_back_with_its_tag():
    layout = make_layout(2, 64)
    backend = DictBackend()
    gate = threading.Event()
    backend.write_hook = lambda hs, offs: gate.wait(10)
    copier = random_kv(layout)
    with LayerPipeline(backend, copier, layout) as pipe:
        t0 = time.perf_counter()
        start(pipe, SAVES, "step-1")
        assert time.perf_counter() - t0 < 0.5  # the writes are held: nothing waited for them
        assert pipe.pending_background_saves() == ["step-1"]
        assert pipe.take_background_saves() == [] and not backend.objects
        # The next step's saves start while the first is still running.
        start(pipe, [ReqSave("r2", ["d"], [11])], "step-2")
        assert pipe.pending_background_saves() == ["step-1", "step-2"]
        assert not pipe.wait_background_saves(0.1)
        gate.set()
        assert pipe.wait_background_saves(5.0)
        done = pipe.take_background_saves()
        assert [tag for _, tag in done] == ["step-1", "step-2"]
        assert sorted(done[0][0].committed_keys) == ["a", "b", "c"] and done[1][0].committed_keys == ["d"]
        assert pipe.pending_background_saves() == [] and pipe.take_background_saves() == []
    for key, block in (("a", 3), ("b", 4), ("c", 9), ("d", 11)):
        assert bytes(backend.objects[key]) == object_bytes(copier, layout, block)


def test_a_late_layer_is_aborted_in_the_background_too():
    layout = make_layout(2, 16)
    backend = DictBackend()
    release = threading.Event()
    backend.write_hook = lambda hs, offs: release.wait(30) if offs[0] == layout.offsets[1] else None
    pipe = LayerPipeline(backend, random_kv(layout), layout, save_timeout_s=0.3)
    try:
        start(pipe, SAVES, "t")
        assert pipe.wait_background_saves(3.0)
        [(res, tag)] = pipe.take_background_saves()
        assert tag == "t" and res.committed_keys == [] and res.deadline_misses == [1]
        release.set()
        assert wait_until(lambda: not backend.reserved)
        assert not backend.objects
    finally:
        release.set()
        pipe.close()


def test_bulk_mode_copies_every_layer_when_handed_over():
    layout = make_layout(3, 32)
    backend = DictBackend()
    copier = random_kv(layout)
    with LayerPipeline(backend, copier, layout, layerwise=False) as pipe:
        pipe.start_save(SAVES)
        pipe.finish_save_in_background(None)
        assert pipe.wait_background_saves(5.0)
        [(res, _)] = pipe.take_background_saves()
    assert res.ok and sorted(res.committed_keys) == ["a", "b", "c"]
    assert bytes(backend.objects["b"]) == object_bytes(copier, layout, 4)


def test_close_finishes_what_was_handed_over():
    layout = make_layout(2, 32)
    backend = DictBackend()
    gate = threading.Event()
    backend.write_hook = lambda hs, offs: gate.wait(10)
    pipe = LayerPipeline(backend, random_kv(layout), layout)
    start(pipe, SAVES, "t")
    threading.Timer(0.2, gate.set).start()
    pipe.close()
    assert sorted(backend.objects) == ["a", "b", "c"]
