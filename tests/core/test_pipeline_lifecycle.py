"""Pipeline construction, threads and shutdown."""

from __future__ import annotations

import threading

import pytest
from test_pipeline_support import DictBackend, make_layout, wait_until

from lw_core.pipeline import LayerPipeline
from lw_core.pipeline.host_copier import HostCopier
from lw_core.plan import ReqLoad, ReqSave


def make(layout, **kw):
    return LayerPipeline(DictBackend(), HostCopier.allocate(layout.num_layers, 4, list(layout.layer_nbytes)), layout, **kw)


def test_close_is_idempotent_and_leaves_no_threads():
    before = set(threading.enumerate())
    layout = make_layout(2, 16)
    pipe = make(layout, load_threads=2, save_threads=2)
    assert len(pipe.threads()) == 5 and all(t.daemon for t in pipe.threads())  # + the reserve thread
    pipe.start_save([ReqSave("r", ["a"], [0])])
    for layer in range(2):
        pipe.save_layer(layer)
    assert pipe.finish_save().ok
    pipe.start_save([ReqSave("r", ["b"], [1])])
    for layer in range(2):
        pipe.save_layer(layer)
    pipe.finish_save_in_background(None)  # its finisher thread ends with the pipeline too
    pipe.close()
    pipe.close()
    assert pipe.threads() == []
    assert wait_until(lambda: set(threading.enumerate()) <= before)
    with pytest.raises(RuntimeError, match="closed"):
        pipe.start_load([ReqLoad("r", ["a"], [0])])


def test_steps_reuse_the_same_threads():
    layout = make_layout(4, 16)
    with make(layout, prefetch_depth=2) as pipe:
        threads = set(pipe.threads())
        for _ in range(20):
            pipe.start_save([ReqSave("r", ["k"], [1])])
            pipe.start_load([ReqLoad("r", ["k"], [0])])
            for layer in range(4):
                pipe.wait_layer(layer)
                pipe.save_layer(layer)
            pipe.finish_load()
            pipe.finish_save()
        assert set(pipe.threads()) == threads  # no thread per layer or per step


def test_close_with_open_steps_releases_and_aborts():
    layout = make_layout(2, 16)
    backend = DictBackend()
    hs = backend.reserve(["x"], layout.nbytes)
    backend.write(hs, [0], [bytes(layout.nbytes)])
    backend.commit(hs)
    pipe = LayerPipeline(backend, HostCopier.allocate(2, 4, 16), layout)
    pipe.start_load([ReqLoad("r", ["x"], [0])])
    pipe.start_save([ReqSave("r", ["y"], [1])])
    pipe.save_layer(0)
    pipe.close()
    assert backend.leases == 0 and not backend.reserved and backend.lookup(["y"]) == 0


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"prefetch_depth": 0}, r"prefetch_depth=0 is not accepted; accepted: an integer >= 1 and <= 1024 \(typical: 1-4\)"),
        ({"prefetch_depth": 1025}, r"prefetch_depth=1025 .*<= 1024"),  # the config key's bound, written once
        ({"max_transfer_blocks": -1}, "max_transfer_blocks=-1"),
        ({"max_transfer_bytes": 1.5}, "max_transfer_bytes=1.5 .* an integer"),
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank=2 must be < tp_size=2"),
        ({"tp_size": True}, "tp_size=True"),
        ({"layer_timeout_s": 0}, "layer_timeout_s=0 is not accepted; accepted: a finite number > 0"),
        ({"save_timeout_s": float("inf")}, "save_timeout_s=inf"),
        ({"load_threds": 2}, "load_threds"),
    ],
)
def test_bad_arguments_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        make(make_layout(2, 16), **kw)


def test_layout_must_match_the_kv_cache():
    with pytest.raises(ValueError, match=r"layout.layer_nbytes\[1\]=32 but the KV cache's block of layer 1 has 16 bytes"):
        LayerPipeline(DictBackend(), HostCopier.allocate(2, 4, 16), make_layout(2, [16, 32]))
