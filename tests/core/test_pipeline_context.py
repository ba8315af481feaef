"""The steps work with one immutable ``StepContext`` (never the pipeline itself), the flags they
flip have one owner, and the buffer helpers no longer tie the pipeline to the host copier."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from test_pipeline_support import DictBackend, fill_pool, make_layout

from lw_core.pipeline import LayerPipeline
from lw_core.pipeline.host_copier import HostCopier
from lw_core.plan import ReqLoad, ReqSave


def kv_for(layout):
    return HostCopier.allocate(layout.num_layers, 4, list(layout.layer_nbytes))


def test_importing_the_pipeline_does_not_import_the_host_copier():
    code = "import sys, lw_core.pipeline; print('lw_core.pipeline.host_copier' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_steps_get_the_frozen_context_not_the_pipeline():
    layout = make_layout(2, 16)
    backend = DictBackend()
    fill_pool(backend, layout, ["a"])
    with LayerPipeline(backend, kv_for(layout), layout, prefetch_depth=2) as pipe:
        with pytest.raises(dataclasses.FrozenInstanceError):
            pipe.ctx.backend = DictBackend()  # type: ignore[misc]
        pipe.start_load([ReqLoad("r", ["a"], [1])])
        pipe.start_save([ReqSave("r", ["b"], [0])])
        for step in (pipe._load, pipe._save):
            assert step.ctx is pipe.ctx and not hasattr(step, "pipe")
        for layer in range(2):
            pipe.wait_layer(layer)
            pipe.save_layer(layer)
        assert pipe.finish_load().ok and pipe.finish_save().ok
    assert pipe.limits.prefetch_depth == 2 and pipe.backend is backend and pipe.layout is layout


class NoViews(DictBackend):
    def __init__(self) -> None:
        super().__init__()
        self.view_calls = 0

    def view(self, handle, offset, nbytes):
        self.view_calls += 1
        return None


def test_a_backend_without_views_is_asked_once_per_direction():
    layout = make_layout(2, 16)
    backend = NoViews()
    fill_pool(backend, layout, ["a", "b"])
    with LayerPipeline(backend, kv_for(layout), layout) as pipe:
        for keys in (["a"], ["b"]):
            pipe.start_load([ReqLoad("r", keys, [0])])
            for layer in range(2):
                pipe.wait_layer(layer)
            assert pipe.finish_load().ok
        assert pipe.ctx.views.load is False and pipe.ctx.views.save is True
        assert backend.view_calls == 1  # the first layer's batch; never again
