"""A load that copies from a zero-copy ``view()`` whose object is evicted and its space reused while
the copy runs (a reader stalled past its lease) must fail those blocks, so vLLM recomputes them:
the KV cache may hold another object's bytes (the view path of the pipeline)."""

from __future__ import annotations

import time

import numpy as np
from test_pipeline_support import fill_pool, make_layout, pattern

from lw_core.backends.embedded import EmbeddedBackend
from lw_core.pipeline import LayerPipeline
from lw_core.pipeline.host_copier import HostCopier
from lw_core.plan import ReqLoad

MiB = 1 << 20
LAYOUT = make_layout(4, 256 << 10)  # 1 MiB objects: two fill the 2 MiB arena


class StallingCopier(HostCopier):
    """Before its copy of the last layer into the KV (every view is taken by then), the reader
    "stalls": its lease expires and a writer evicts the object and reuses its space. The copy then
    reads whatever the view's window holds now."""

    stall = None

    def to_kv(self, layer, block_ids, srcs):
        if self.stall is not None and layer == LAYOUT.num_layers - 1:
            stall, self.stall = self.stall, None
            stall()
        return super().to_kv(layer, block_ids, srcs)


def test_view_copied_from_an_object_evicted_meanwhile_fails_its_block(tmp_path):
    path = str(tmp_path / "p")
    reader = EmbeddedBackend(path, capacity_bytes=2 * MiB, lease_ttl_s=0.2)
    writer = EmbeddedBackend(path, capacity_bytes=2 * MiB)
    try:
        fill_pool(writer, LAYOUT, ["a", "b"])

        def stall() -> None:
            time.sleep(0.3)  # past the reader's lease
            writer.release(writer.open(["b"]))  # b was read since: eviction takes a
            fill_pool(writer, LAYOUT, ["c"])
            assert writer.lookup(["a"]) == 0, "test premise: a was evicted for c"

        dst = StallingCopier.allocate(LAYOUT.num_layers, 4, list(LAYOUT.layer_nbytes), fill=None)
        dst.stall = stall
        with LayerPipeline(reader, dst, LAYOUT, layer_timeout_s=10.0) as pipe:
            pipe.start_load([ReqLoad("r", ["a"], [1])])
            for layer in range(LAYOUT.num_layers):
                pipe.wait_layer(layer)
            res = pipe.finish_load()
        last = LAYOUT.num_layers - 1
        c_last = pattern("c", LAYOUT.nbytes)[LAYOUT.offsets[last] : LAYOUT.offsets[last] + LAYOUT.layer_nbytes[last]]
        assert np.array_equal(dst.kv[last][1], np.frombuffer(c_last, np.uint8)), "test premise: c's bytes were copied"
        assert res.failed_block_ids == [1] and res.failed_req_ids == ["r"], res
        assert any("evicted or reused" in e for e in res.errors), res.errors
        assert reader.stats()["stale_views"] >= 1
    finally:
        reader.close()
        writer.close()


def test_intact_views_keep_their_blocks(tmp_path):
    b = EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=4 * MiB)
    try:
        fill_pool(b, LAYOUT, ["a"])
        dst = HostCopier.allocate(LAYOUT.num_layers, 4, list(LAYOUT.layer_nbytes), fill=None)
        with LayerPipeline(b, dst, LAYOUT) as pipe:
            pipe.start_load([ReqLoad("r", ["a"], [2])])
            for layer in range(LAYOUT.num_layers):
                pipe.wait_layer(layer)
            res = pipe.finish_load()
        assert res.ok and res.loaded_objects == 1, res
        a = np.frombuffer(pattern("a", LAYOUT.nbytes), np.uint8)
        assert np.array_equal(dst.kv[3][2], a[LAYOUT.offsets[3] : LAYOUT.offsets[3] + LAYOUT.layer_nbytes[3]])
    finally:
        b.close()
