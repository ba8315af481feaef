"""The pipeline over the real backends: in-process MemoryBackend and the multi-process embedded pool.
The contract is lw_dev.backend_contract's, run on both here (tests/mooncake runs it on Mooncake)."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest
from test_pipeline_support import make_layout

from lw_core.backends import embedded, memory
from lw_core.pipeline import LayerPipeline
from lw_core.plan import ReqLoad, ReqSave
from lw_dev.backend_contract import LAYOUT, SAVES, BackendContract, ViewsContract, load_all, save_all, seeded_kv


@pytest.fixture(params=["memory", "embedded"])
def backend(request, tmp_path):
    if request.param == "memory":
        b = memory.MemoryBackend(capacity_bytes=64 << 20)
    else:
        b = embedded.EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=16 << 20)
    yield b
    b.close()


class TestBackendContract(BackendContract, ViewsContract):
    """The whole contract over ``backend``: memory and embedded (both serve loads from views)."""


def _save_in_child(path: str, ready) -> None:
    from lw_core.backends.embedded import EmbeddedBackend

    with EmbeddedBackend(path, capacity_bytes=16 << 20) as b:
        res = save_all(b, seeded_kv(LAYOUT, 7), LAYOUT, SAVES)
        ready.put(res.committed_keys)


def test_objects_saved_by_another_process_load_exactly(tmp_path):
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
