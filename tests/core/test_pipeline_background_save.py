"""Saves finished in the background (``LayerPipeline.finish_save_in_background``): the step returns
before the store has the data, the result comes back later with its tag, steps overlap, and the
same rules hold as for a step that waits (only complete objects are committed, deadlines bound it)."""

from __future__ import annotations

import threading
import time

import pytest
from test_pipeline_save import SAVES, object_bytes, random_kv
from test_pipeline_support import DictBackend, RecordingCopier, make_layout, wait_until

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


def _writes_held_on(gate, seen, keys=None, offset=None):
    """A write hook that records (key, offset) of each write and holds those of ``keys`` (all
    when None) at ``offset`` (any when None) until ``gate`` is set: a stalled store."""
    def hook(hs, offs):
        seen.extend((h.key, o) for h, o in zip(hs, offs))
        if (keys is None or any(h.key in keys for h in hs)) and offset in (None, offs[0]):
            gate.wait(30)
    return hook


class _StagingCopier(RecordingCopier):
    """No host views of the KV: each save copies its blocks into a staging buffer first."""

    def kv_views(self, layer, block_ids):
        return None


@pytest.mark.parametrize("staging", [False, True], ids=["kv-views", "staging"])
def test_blocks_taken_back_from_a_stalled_save_are_never_committed_with_their_next_owners_bytes(staging):
    """A preempted request's blocks go back to vLLM while its save is stuck in the store: layer 1
    of both objects is written, layer 0 of ``a`` is in the store's hands (with host KV views the
    write reads the KV cache itself) and that of ``b`` waits behind it. Once the store recovers,
    the write in flight may read the blocks' next owner's KV: ``a`` must be aborted, not
    committed, and ``b``'s layer 0 must not be copied out of the KV cache at all."""
    layout = make_layout(2, 64)
    backend = DictBackend()  # no views into the store: writes
    gate, seen = threading.Event(), []
    backend.write_hook = _writes_held_on(gate, seen, offset=layout.offsets[0])
    copier = random_kv(layout)
    if staging:
        copier = _StagingCopier(copier.kv, copier.log)
    # One object per batch, one worker per layer; the step's own deadline is far off and no
    # worker is replaced: only the cancel stops it.
    pipe = LayerPipeline(backend, copier, layout, save_timeout_s=5.0, max_stuck_threads=0,
                         max_transfer_blocks=1, save_threads=2)
    try:
        start(pipe, [ReqSave("p", ["a", "b"], [3, 4])], "p")
        assert wait_until(lambda: {("a", 0), ("b", 64)} <= set(seen))
        assert pipe.stop_background_reads(lambda tag: tag == "p", 0.2) == 1
        for layer in range(layout.num_layers):  # the next owner writes its KV into the blocks
            copier.kv[layer][[3, 4]] = 0xEE
        gate.set()
        assert pipe.wait_background_saves(5.0)
        [(res, tag)] = pipe.take_background_saves()
        assert tag == "p" and res.committed_keys == [] and sorted(res.failed_keys) == ["a", "b"]
        assert any("taken back" in e for e in res.errors), res.errors
        assert ("b", 0) not in seen  # no write started after the blocks were taken back
        assert ("from_kv", 0, (4,)) not in copier.log  # nor a copy out of them
        assert wait_until(lambda: not backend.reserved)
        assert not backend.objects
    finally:
        gate.set()
        pipe.close()


@pytest.mark.parametrize("views", [False, True], ids=["write", "zero-copy"])
def test_taking_back_waits_only_for_the_saves_holding_those_blocks(views):
    """Another step's save is stalled in the store; the preempted request's own save has copied
    its blocks out: nothing is cancelled and its objects commit with their bytes."""
    layout = make_layout(2, 64)
    backend = DictBackend(views=views)
    gate, seen = threading.Event(), []
    backend.write_hook = _writes_held_on(gate, seen, keys={"o"})
    stalled_view = backend.view

    def view(h, off, n):  # the zero-copy path: the store stalls handing out the window
        if h.key == "o":
            gate.wait(30)
        return stalled_view(h, off, n)

    backend.view = view
    copier = random_kv(layout)
    pipe = LayerPipeline(backend, copier, layout, save_threads=3)
    try:
        start(pipe, [ReqSave("other", ["o"], [1])], "other")
        start(pipe, [ReqSave("p", ["a", "b"], [3, 4])], "p")
        assert pipe.stop_background_reads(lambda tag: tag == "p", 10.0) == 0
        assert not gate.is_set() and pipe.pending_background_saves() == ["other", "p"]
        for layer in range(layout.num_layers):
            copier.kv[layer][[3, 4]] = 0xEE
        gate.set()
        assert pipe.wait_background_saves(5.0)
        done = dict((tag, res) for res, tag in pipe.take_background_saves())
        assert sorted(done["p"].committed_keys) == ["a", "b"] and done["p"].ok
    finally:
        gate.set()
        pipe.close()
    ref = random_kv(layout)  # the same seed: the KV before the next owner wrote into it
    for key, block in (("a", 3), ("b", 4), ("o", 1)):
        assert bytes(backend.objects[key]) == object_bytes(ref, layout, block)
