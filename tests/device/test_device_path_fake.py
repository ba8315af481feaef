"""The torch copier's device path on CPU tensors through recording fake ops: the same contract the
CUDA module runs, plus the ordering rules only a recorder can see (which stream waits on which
event, when staging is filled and reused)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from device_contract import (
    NB,
    NoViews,
    check_cross_tp,
    check_late_load_never_lands,
    check_pipeline_save_then_load,
    check_round_trip,
    layouts,
)
from fake_ops import FakeOps, entries, position

from lw_core.pipeline import LayerPipeline
from lw_core.plan import ObjectLayout, ReqLoad, ReqSave
from lw_vllm.device.copier import TorchCopier

CPU = torch.device("cpu")


def fake_make(log=None, **kw):
    def make(tensors, nb):
        return TorchCopier(tensors, nb, ops=FakeOps(log, layers=tensors, **kw))

    return make


@pytest.mark.parametrize("name", list(layouts()))
def test_round_trip_contract(name):
    check_round_trip(fake_make(), CPU, name)


@pytest.mark.parametrize("views", [True, False], ids=["views", "staged"])
def test_pipeline_contract(views):
    check_pipeline_save_then_load(fake_make(), CPU, views)


def test_late_load_contract():
    check_late_load_never_lands(fake_make(), CPU)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"], ids=["head-major", "token-major"])
def test_cross_tp_contract(layout):
    check_cross_tp(fake_make(), CPU, layout)


def _kv(layers=3, fill=0):
    return [torch.full((NB, 2, 64), fill, dtype=torch.uint8) for _ in range(layers)]


def _filled_backend(layout, keys, value_of):
    backend = NoViews(16 << 20)
    hs = backend.reserve(keys, layout.nbytes)
    for h, k in zip(hs, keys):
        backend.write([h], [0], [bytes([value_of(k)]) * layout.nbytes])
    backend.commit(hs)
    return backend


def test_loads_read_into_pinned_staging_and_are_ordered_around_compute():
    log: list = []
    kv = _kv()
    copier = TorchCopier(kv, NB, ops=FakeOps(log, layers=kv))
    ops = copier.dev.ops
    layout = ObjectLayout((128,) * 3)
    keys = ["a", "b", "c"]
    backend = _filled_backend(layout, keys, lambda k: ord(k))
    given: list[tuple[int, int]] = []  # (address, size) of every staging buffer the pipeline took
    host_buffer = copier.host_buffer

    def recording_host_buffer(nbytes):
        a = host_buffer(nbytes)
        given.append((a.ctypes.data, a.nbytes))
        return a

    copier.host_buffer = recording_host_buffer
    log.append(("forward starts",))
    with LayerPipeline(backend, copier, layout, prefetch_depth=2, max_transfer_blocks=2) as pipe:
        pipe.start_load([ReqLoad("r", keys, [4, 2, 6])])
        for layer in range(3):
            pipe.wait_layer(layer)
            log.append(("attention", layer))
        assert pipe.finish_load().ok
    h2d = entries(log, "h2d")
    assert len(h2d) == 6  # 3 layers x 2 batches
    # The H2D stream waits for the compute stream's work before the step, before its first copy.
    (i_fence, fence), = [(i, e) for i, e in entries(log, "record") if e[1] == "compute" and i < h2d[0][0]]
    assert position(log, ("wait", copier.dev.h2d_stream.name, fence[2])) < h2d[0][0]
    assert i_fence > position(log, ("forward starts",))
    for i, e in h2d:
        _, stream, layer, ids, ptr, data = e
        assert stream == copier.dev.h2d_stream.name  # never on the compute stream
        # the batch came straight from a pinned staging buffer the pool read into, already filled
        assert ptr in ops.pinned_ptrs and any(a <= ptr < a + n for a, n in given), given
        assert data == b"".join(bytes([ord(k)]) * 128 for k, b in zip(keys, [4, 2, 6]) if b in ids)
        ev = next(r[2] for j, r in entries(log, "record") if j > i and r[1] == stream)
        # compute waits for this copy before the layer's attention
        assert position(log, ("wait", "compute", ev)) < position(log, ("attention", layer))
    assert copier.dev.staging.allocated == len(given)  # no copier-owned extra buffers
    for layer in range(3):
        assert kv[layer][4].eq(ord("a")).all() and kv[layer][6].eq(ord("c")).all()


@pytest.mark.parametrize("views", [True, False], ids=["views", "staged"])
def test_saves_read_the_kv_only_after_the_layers_compute_event(views):
    log: list = []
    kv = _kv(fill=9)
    copier = TorchCopier(kv, NB, ops=FakeOps(log, layers=kv))
    layout = ObjectLayout((128,) * 3)
    from lw_core.backends.memory import MemoryBackend

    backend = MemoryBackend(16 << 20) if views else NoViews(16 << 20)
    with LayerPipeline(backend, copier, layout, max_transfer_blocks=1) as pipe:
        pipe.start_save([ReqSave("r", ["x", "y"], [1, 5])])
        for layer in range(3):
            log.append(("attention", layer))
            pipe.save_layer(layer)
        res = pipe.finish_save()
    assert res.ok and sorted(res.committed_keys) == ["x", "y"]
    d2h = entries(log, "d2h")
    assert len(d2h) == 6
    d2h_stream = copier.dev.d2h_stream.name
    for i, (_, stream, layer, _ids, _ptr) in d2h:
        assert stream == d2h_stream
        marks = [e[2] for j, e in entries(log, "record") if e[1] == "compute" and j > position(log, ("attention", layer))]
        mark = marks[0]  # the compute event save_layer took right after this layer's attention
        assert position(log, ("wait", d2h_stream, mark)) < i


def test_a_copier_staging_buffer_is_reused_only_after_its_copy_event_completed():
    log: list = []
    kv = _kv(1)
    copier = TorchCopier(kv, NB, ops=FakeOps(log, auto_complete=False, layers=kv))
    ops = copier.dev.ops
    src = [bytes([7]) * 128]  # pageable: goes through the copier's own pinned buffer
    copier.to_kv(0, [1], src)
    copier.to_kv(0, [2], src)
    first, second = (e[4] for _, e in entries(log, "h2d"))
    assert first != second  # the first buffer's copy has not completed: not handed out again
    ops.complete_all()
    copier.to_kv(0, [3], src)
    third = entries(log, "h2d")[-1][1][4]
    assert third in (first, second)
    assert copier.dev.staging.allocated == 2


def test_a_save_into_pageable_memory_that_never_completes_times_out_and_parks_its_buffer():
    kv = _kv(1, fill=3)
    copier = TorchCopier(kv, NB, ops=FakeOps(auto_complete=False, layers=kv), copy_timeout_s=0.05)
    with pytest.raises(TimeoutError, match="copy_timeout_s=0.05"):
        copier.from_kv(0, [1], [bytearray(128)])
    copier.dev.ops.auto_complete = True
    out = bytearray(128)
    assert copier.from_kv(0, [2], [out]) is None and out == bytes([3]) * 128
    assert copier.dev.staging.allocated == 2  # the timed-out buffer was not reused


def test_copies_of_a_layer_nobody_waited_for_are_fenced_when_the_step_finishes():
    log: list = []
    kv = _kv()
    copier = TorchCopier(kv, NB, ops=FakeOps(log, layers=kv))
    layout = ObjectLayout((128,) * 3)
    backend = _filled_backend(layout, ["a"], lambda k: 1)
    with LayerPipeline(backend, copier, layout, prefetch_depth=2) as pipe:
        pipe.start_load([ReqLoad("r", ["a"], [3])])
        pipe.wait_layer(0)  # submits layers 0 and 1; the forward stops here
        assert pipe._load.events[1].wait(5.0)
        res = pipe.finish_load()
    assert res.failed_block_ids == [3]
    (i1, _), = [(i, e) for i, e in entries(log, "h2d") if e[2] == 1]
    ev = next(r[2] for j, r in entries(log, "record") if j > i1 and r[1] == copier.dev.h2d_stream.name)
    assert ("wait", "compute", ev) in log  # later compute on block 3 runs after this copy


def test_bad_buffers_are_refused_on_the_device_path_too():
    copier = TorchCopier(_kv(1), NB, ops=FakeOps())
    with pytest.raises(ValueError, match="has 100 bytes, expected 128"):
        copier.to_kv(0, [1], [bytes(100)])
    with pytest.raises(IndexError, match="block id 8 out of range"):
        copier.from_kv(0, [8], [bytearray(128)])
    with pytest.raises(ValueError, match="copy_timeout_s=0 must be"):
        TorchCopier(_kv(1), NB, ops=FakeOps(), copy_timeout_s=0)


def test_cpu_copier_gives_page_aligned_staging_and_no_load_fence():
    c = TorchCopier(_kv(1), NB)
    assert c.dev is None and c.host_buffer(8192).ctypes.data % 4096 == 0
    c.begin_load()  # nothing to order on the CPU


def test_the_copier_imports_without_vllm():
    code = "import sys; sys.modules['vllm'] = None; import lw_vllm.device.copier, lw_vllm.device.device_path; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
