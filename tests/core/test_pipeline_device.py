"""The pipeline against a device-like copier: asynchronous tokens, no host views of the KV."""

from __future__ import annotations

import itertools
import threading

import numpy as np
from test_pipeline_support import DictBackend, RecordingCopier, expected_block, fill_pool, make_layout

from lw_core.pipeline import LayerPipeline
from lw_core.pipeline.host_copier import HostCopier
from lw_core.pipeline.pool import StagingPool
from lw_core.plan import ReqLoad, ReqSave


class DeviceLikeCopier(RecordingCopier):
    """Copies happen at once but report a token per call, like stream events; KV is not host-visible."""

    def __init__(self, kv, log):
        super().__init__(kv, log)
        self._ids = itertools.count(1)
        self.waited: list = []

    def kv_views(self, layer, block_ids):
        return None

    def to_kv(self, layer, block_ids, srcs):
        super().to_kv(layer, block_ids, srcs)
        tok = ("h2d", next(self._ids), layer)
        self.log.append(("token", tok))
        return tok

    def from_kv(self, layer, block_ids, dsts, after=None):
        assert after is not None and after[0] == "compute"  # the save copy is ordered after compute
        super().from_kv(layer, block_ids, dsts)
        return ("d2h", next(self._ids), layer)

    def compute_event(self):
        return ("compute", next(self._ids))

    def wait(self, token, timeout_s):
        self.waited.append(token)
        return True

    def make_visible(self, token):
        self.log.append(("visible", token))


def test_every_layer_token_is_made_visible_before_wait_layer_returns():
    layout = make_layout(3, 32)
    backend = DictBackend(views=True)
    fill_pool(backend, layout, ["a", "b", "c"])
    log: list = []
    kv = HostCopier.allocate(3, 8, 32).kv
    copier = DeviceLikeCopier(kv, log)
    with LayerPipeline(backend, copier, layout, prefetch_depth=2, max_transfer_blocks=2) as pipe:
        pipe.start_load([ReqLoad("r", ["a", "b", "c"], [4, 2, 6])])
        for layer in range(3):
            pipe.wait_layer(layer)
            log.append(("returned", layer))
        assert pipe.finish_load().ok
    for layer in range(3):
        toks = [e[1] for e in log if e[0] == "token" and e[1][2] == layer]
        assert len(toks) == 2  # two batches
        returned = log.index(("returned", layer))
        for t in toks:
            assert log.index(("visible", t)) < returned
    for key, b in (("a", 4), ("b", 2), ("c", 6)):
        for layer in range(3):
            assert np.array_equal(copier.kv[layer][b], expected_block(layout, key, layer))


def test_saves_stage_through_host_buffers_when_kv_is_not_host_visible():
    layout = make_layout(2, 48)
    backend = DictBackend(views=False)
    kv = HostCopier.allocate(2, 8, 48, fill=None).kv
    for a in kv:
        a[:] = np.random.default_rng(3).integers(0, 256, a.shape, dtype=np.uint8)
    copier = DeviceLikeCopier(kv, [])
    with LayerPipeline(backend, copier, layout) as pipe:
        pipe.start_save([ReqSave("r", ["x", "y"], [1, 7])])
        for layer in range(2):
            pipe.save_layer(layer)
        res = pipe.finish_save()
    assert res.ok and sorted(res.committed_keys) == ["x", "y"]
    assert bytes(backend.objects["y"]) == kv[0][7].tobytes() + kv[1][7].tobytes()
    assert [t[0] for t in copier.waited].count("d2h") == 2  # each copy-out finished before the write


def test_staging_buffers_are_reused_only_after_their_copy_finished():
    done = threading.Event()
    pool = StagingPool(lambda tok, timeout: done.is_set())
    a = pool.get(4096)
    assert a.ctypes.data % 4096 == 0
    pool.put(a, token="in flight")
    b = pool.get(4096)
    assert b.ctypes.data != a.ctypes.data  # still owned by the device copy
    done.set()
    c = pool.get(4096)
    assert c.ctypes.data == a.ctypes.data
