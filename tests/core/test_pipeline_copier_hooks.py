"""The optional Copier hooks the pipeline calls for a device copier: ``begin_load`` (order a step's
loads after compute so far), ``host_buffer`` (staging memory, pinned on a device), and the fence
``finish_load`` puts behind copies of layers nobody waited for."""

from __future__ import annotations

import itertools

from test_pipeline_support import DictBackend, RecordingCopier, expected_block, fill_pool, make_layout

from lw_core.pipeline import LayerPipeline
from lw_core.pipeline.host_copier import HostCopier, aligned_empty
from lw_core.plan import ReqLoad


class HookedCopier(RecordingCopier):
    """Reports a token per host->KV copy and logs the optional hooks."""

    def __init__(self, kv, log, fail_begin=False):
        super().__init__(kv, log)
        self.fail_begin = fail_begin
        self._ids = itertools.count(1)
        self.buffers: list[int] = []

    def begin_load(self):
        self.log.append(("begin_load",))
        if self.fail_begin:
            raise RuntimeError("device lost")

    def host_buffer(self, nbytes):
        a = aligned_empty(nbytes)
        self.buffers.append(a.ctypes.data)
        return a

    def kv_views(self, layer, block_ids):
        return None

    def to_kv(self, layer, block_ids, srcs):
        super().to_kv(layer, block_ids, srcs)
        tok = ("h2d", next(self._ids), layer)
        self.log.append(("token", tok))
        return tok

    def make_visible(self, token):
        self.log.append(("visible", token))


def _setup(keys, fail_begin=False, views=False):
    layout = make_layout(3, 64)
    backend = DictBackend(views=views)
    fill_pool(backend, layout, keys)
    log: list = []
    copier = HookedCopier(HostCopier.allocate(3, 8, 64).kv, log, fail_begin)
    return layout, backend, log, copier


def test_begin_load_comes_before_any_load_and_staging_comes_from_host_buffer():
    layout, backend, log, copier = _setup(["a", "b"])
    with LayerPipeline(backend, copier, layout, prefetch_depth=2) as pipe:
        pipe.start_load([])  # nothing to load: no fence
        assert pipe.finish_load().ok and log == []
        pipe.start_load([ReqLoad("r", ["a", "b"], [5, 1])])
        for layer in range(3):
            pipe.wait_layer(layer)
        assert pipe.finish_load().ok
    assert log[0] == ("begin_load",) and log.count(("begin_load",)) == 1
    assert copier.buffers  # the pool read into the copier's memory
    for layer in range(3):
        assert (copier.kv[layer][5] == expected_block(layout, "a", layer)).all()


def test_a_failing_begin_load_fails_the_steps_loads_and_copies_nothing():
    layout, backend, log, copier = _setup(["a"], fail_begin=True)
    with LayerPipeline(backend, copier, layout) as pipe:
        pipe.start_load([ReqLoad("r", ["a"], [2])])
        for layer in range(3):
            pipe.wait_layer(layer)
        res = pipe.finish_load()
    assert res.failed_block_ids == [2] and res.failed_req_ids == ["r"]
    assert any("copier.begin_load: unexpected RuntimeError: device lost" in e for e in res.errors)
    assert not [e for e in log if e[0] == "to_kv"]


def test_finish_fences_copies_of_layers_that_were_never_waited_for():
    layout, backend, log, copier = _setup(["a"], views=True)
    with LayerPipeline(backend, copier, layout, prefetch_depth=3) as pipe:
        pipe.start_load([ReqLoad("r", ["a"], [3])])
        pipe.wait_layer(0)  # submits all three layers
        step = pipe._load
        assert all(step.events[layer].wait(5.0) for layer in range(3))
        res = pipe.finish_load()
    assert res.failed_block_ids == [3]
    tokens = [e[1] for e in log if e[0] == "token"]
    assert {t[2] for t in tokens} == {0, 1, 2}
    for t in tokens:  # layer 0 by wait_layer, layers 1 and 2 by finish_load
        assert ("visible", t) in log
