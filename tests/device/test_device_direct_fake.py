"""Direct copies between registered pool memory and the KV blocks, on CPU tensors through the
recording fake ops: registration (and its failure), both mechanisms' address arithmetic on the real
bytes of an embedded pool, and the rules that make asynchronous copies safe: leases are released,
views checked and objects committed or aborted only once the copies that use them completed."""

from __future__ import annotations

import logging
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from fake_ops import FakeOps, entries, position
from recording_backend import Recording, ViewsOnly

from lw_core.backends.embedded import EmbeddedBackend
from lw_core.backends.embedded import backend as embedded_backend
from lw_core.pipeline import LayerPipeline
from lw_core.plan import ObjectLayout, ReqLoad, ReqSave
from lw_vllm.device import host_register
from lw_vllm.device.copier import TorchCopier
from lw_vllm.device.direct_path import BATCH_DMA_MIN_SEGMENT, DirectPath

NB, LAYERS, MiB = 8, 3, 1 << 20


def _kv(fill: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    if fill:
        return [torch.randint(0, 256, (NB, 2, 256), generator=g, dtype=torch.uint8) for _ in range(LAYERS)]
    return [torch.zeros(NB, 2, 256, dtype=torch.uint8) for _ in range(LAYERS)]


def _copier(kv, log=None, mechanism="auto", **kw) -> TorchCopier:
    return TorchCopier(kv, NB, ops=FakeOps(log, layers=kv, **kw), mechanism=mechanism)


def _layout(c: TorchCopier) -> ObjectLayout:
    return ObjectLayout(tuple(c.block_nbytes(i) for i in range(LAYERS)))


KEYS, SRC_BLOCKS, DST_BLOCKS = ["k0", "k1", "k2", "k3"], [6, 0, 3, 5], [2, 7, 4, 1]


def _save(backend, c, **kw):
    with LayerPipeline(backend, c, _layout(c), max_transfer_blocks=3, **kw) as pipe:
        pipe.start_save([ReqSave("r", KEYS, SRC_BLOCKS)])
        for layer in range(LAYERS):
            pipe.save_layer(layer)
        return pipe.finish_save()


def _load(backend, c, **kw):
    with LayerPipeline(backend, c, _layout(c), prefetch_depth=2, max_transfer_blocks=3, **kw) as pipe:
        pipe.start_load([ReqLoad("r", KEYS, DST_BLOCKS)])
        for layer in range(LAYERS):
            pipe.wait_layer(layer)
        return pipe.finish_load()


def _same(src, dst) -> None:
    for layer in range(LAYERS):
        for b_src, b_dst in zip(SRC_BLOCKS, DST_BLOCKS):
            assert torch.equal(dst[layer][b_dst], src[layer][b_src]), (layer, b_src, b_dst)
        assert not dst[layer][[0, 3, 5, 6]].any()  # never loaded


@pytest.fixture
def pool(pool_path):
    b = EmbeddedBackend(pool_path, capacity_bytes=4 * MiB)
    yield b
    b.close()


def test_the_arena_is_registered_once_in_page_aligned_pieces_and_unregistered_on_close(pool, monkeypatch):
    monkeypatch.setattr(host_register, "PIECE_MAX", MiB)
    log: list = []
    c = _copier(_kv(False), log)
    LayerPipeline(pool, c, _layout(c)).close()
    LayerPipeline(pool, c, _layout(c)).close()  # a second pipeline over the same pool: nothing new
    (arena,) = pool.host_regions()
    base = np.frombuffer(arena, dtype=np.uint8).ctypes.data
    regs = [e[1:] for _, e in entries(log, "register")]
    assert regs == [(base + i * MiB, MiB) for i in range(4)]
    assert all(a % host_register.PAGE == 0 for a, _ in regs)
    c.close()
    assert sorted(e[1] for _, e in entries(log, "unregister")) == [a for a, _ in regs]


def test_a_failed_registration_is_logged_once_counted_and_copies_are_staged(pool, caplog):
    src, dst = _kv(True), _kv(False)
    cs, cd = _copier(src, fail_register=True), _copier(dst, fail_register=True)
    with caplog.at_level(logging.WARNING, logger="lw_vllm.device"):
        assert _save(pool, cs).ok
        assert _load(pool, cd).ok
        LayerPipeline(pool, cd, _layout(cd)).close()  # a refused range is not tried again
    _same(src, dst)
    assert cs.register_failures == 1 and cd.register_failures == 1
    assert cd.mechanism_counts["staged"] > 0 and cd.mechanism_counts["kernel"] == cd.mechanism_counts["batch_dma"] == 0
    assert len(caplog.records) == 2  # one line per copier
    assert "could not register" in caplog.records[0].message and "pinned staging" in caplog.records[0].message


@pytest.mark.parametrize("by", ["address", "views"])
@pytest.mark.parametrize("mechanism, kind", [("kernel", "kernel"), ("batch_dma", "batch_copy"), ("auto", "kernel")])
def test_batches_in_the_registered_pool_move_directly_by_the_chosen_mechanism(pool, mechanism, kind, by):
    pool = pool if by == "address" else ViewsOnly(pool)
    log: list = []
    src, dst = _kv(True), _kv(False)
    cs, cd = _copier(src, log, mechanism), _copier(dst, log, mechanism)
    log.append(("saves start",))
    assert _save(pool, cs).ok
    log.append(("loads start",))
    assert _load(pool, cd).ok
    _same(src, dst)
    assert not entries(log, "pinned") and not entries(log, "h2d") and not entries(log, "d2h")  # no staging
    how = "kernel" if kind == "kernel" else "batch_dma"
    assert cs.mechanism_counts[how] == cd.mechanism_counts[how] == LAYERS * 2  # 4 blocks in batches of 3
    saves = [(i, e) for i, e in enumerate(log) if e[0] in ("kernel_d2h", "batch_copy") and i < position(log, ("loads start",))]
    loads = [(i, e) for i, e in enumerate(log) if e[0] in ("kernel_h2d", "batch_copy") and i > position(log, ("loads start",))]
    assert len(saves) == len(loads) == LAYERS * 2
    for i, e in saves:  # on the save stream, after it waited for a compute mark
        assert e[1] == cs.dev.d2h_stream.name
        assert any(w[1] == e[1] and w[2].stream == "compute" for j, w in entries(log, "wait") if j < i)
    for i, e in loads:  # on the load stream, and compute waits for the event after it
        assert e[1] == cd.dev.h2d_stream.name
        ev = next(r[2] for j, r in entries(log, "record") if j > i and r[1] == e[1])
        assert ("wait", "compute", ev) in log


def test_a_pool_made_anew_at_its_path_is_registered_again_and_the_old_arena_let_go(pool_path, monkeypatch):
    """The embedded pool re-attaches when its directory is replaced: the next step registers the new
    arena (on a thread of its own), copies move directly from it again, and the old arena is
    unregistered once no copy uses it."""
    monkeypatch.setattr(embedded_backend, "POOL_CHECK_S", 0.0)
    b = EmbeddedBackend(pool_path, capacity_bytes=4 * MiB)
    log: list = []
    src, dst = _kv(True), _kv(False)
    cs, cd = _copier(src, log), _copier(dst, log)
    ps = LayerPipeline(b, cs, _layout(cs), max_transfer_blocks=3)
    pd = LayerPipeline(b, cd, _layout(cd), prefetch_depth=2, max_transfer_blocks=3)
    other = None
    try:
        old = _base(b)
        assert _step(ps, pd) and cd.mechanism_counts["kernel"] == LAYERS * 2
        shutil.rmtree(pool_path)
        other = EmbeddedBackend(pool_path, capacity_bytes=4 * MiB)  # another process makes a new pool there
        b.lookup(["k0"])
        assert b.stats()["reattached"] == 1
        new = _base(b)
        assert new != old
        _step(ps, pd)  # the step that notices: it registers the new arena on a thread; its copies may be staged
        for p in (ps, pd):
            assert p._registering is not None
            p._registering.join(10)
        for c in (cs, cd):
            assert [r.addr for r in c.dev.direct.registry.regions(id(c.dev.direct))] == [new]
        assert len([e for _, e in entries(log, "register") if e[1] == new]) == 2  # one per copier's registry
        assert len([e for _, e in entries(log, "unregister") if e[1] == old]) == 2  # the old arena let go
        dst[0].zero_(), dst[1].zero_(), dst[2].zero_()
        kernel, staged = cd.mechanism_counts["kernel"], cd.mechanism_counts["staged"]
        assert _step(ps, pd)
        _same(src, dst)
        assert cd.mechanism_counts["kernel"] == kernel + LAYERS * 2 and cd.mechanism_counts["staged"] == staged
    finally:
        ps.close(), pd.close(), cs.close(), cd.close(), b.close()
        if other is not None:
            other.close()


def test_a_batch_planned_in_memory_that_was_let_go_is_never_enqueued():
    old, new = np.zeros(2 * MiB, dtype=np.uint8), np.zeros(2 * MiB, dtype=np.uint8)
    ops = FakeOps()
    d = DirectPath(ops, "kernel")
    d.register([old])
    layer = torch.zeros(1, 2, 4096, dtype=torch.uint8)
    plan = d.plan(layer, [old[8192 : 8192 + 4096]], 4096)
    assert plan is not None
    gone = d.register([new])  # the pool moved: the old range is let go (still registered)
    assert [r.addr for r in gone] == [plan.region.addr]
    with pytest.raises(RuntimeError, match="registered anew"):
        d.h2d(plan, layer, [1])
    assert d.plan(layer, [old[8192 : 8192 + 4096]], 4096) is None  # nor planned again
    assert d.plan(layer, [new[8192 : 8192 + 4096]], 4096) is not None


def _base(b: EmbeddedBackend) -> int:
    (arena,) = b.host_regions()
    addr = int(np.frombuffer(arena, dtype=np.uint8).ctypes.data)
    return -(-addr // host_register.PAGE) * host_register.PAGE


def _step(ps: LayerPipeline, pd: LayerPipeline) -> bool:
    """A save of KEYS under fresh keys' names, then a load of them: True when both went through."""
    ps.start_save([ReqSave("r", KEYS, SRC_BLOCKS)])
    for layer in range(LAYERS):
        ps.save_layer(layer)
    saved = ps.finish_save()
    pd.start_load([ReqLoad("r", KEYS, DST_BLOCKS)])
    for layer in range(LAYERS):
        pd.wait_layer(layer)
    return bool(pd.finish_load().ok and (saved.ok or not saved.committed_keys))


def test_auto_takes_batched_dma_for_large_segments_and_the_gather_below():
    arena = np.zeros(4 * MiB, dtype=np.uint8)

    def plan(inner: int, **kw) -> str | None:
        d = DirectPath(FakeOps(**kw), "auto")
        d.register([arena])
        layer = torch.zeros(1, 2, inner, dtype=torch.uint8)
        p = d.plan(layer, [arena[8192 : 8192 + inner]], inner)
        return None if p is None else p.how

    assert plan(BATCH_DMA_MIN_SEGMENT) == "batch_dma"
    assert plan(BATCH_DMA_MIN_SEGMENT // 2) == "kernel"
    assert plan(BATCH_DMA_MIN_SEGMENT, batch=False) == "kernel"  # no batched DMA offered: the gather
    assert plan(4096, views=False) == "batch_dma"  # no device view: the DMA at any size
    assert plan(4096, views=False, batch=False) is None  # neither: staged


def test_staged_registers_nothing(pool):
    log: list = []
    src, dst = _kv(True), _kv(False)
    assert _save(pool, _copier(src, log, "staged")).ok
    assert _load(pool, _copier(dst, log, "staged")).ok
    _same(src, dst)
    assert not entries(log, "register") and entries(log, "h2d") and entries(log, "d2h")


def test_a_bad_mechanism_is_named():
    with pytest.raises(ValueError, match="mechanism='dma' is not accepted; accepted: auto, kernel, batch_dma, staged"):
        _copier(_kv(False), mechanism="dma")


def _complete_later(ops: FakeOps, after_s: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(after_s), ops.complete_all()), daemon=True)
    t.start()
    return t


def _events_done(*copiers: TorchCopier):
    return lambda: all(ev.done for c in copiers for ev in c.dev.ops.events)


def test_a_loads_views_are_checked_and_its_leases_released_only_after_its_copies_completed(pool):
    src, dst = _kv(True), _kv(False)
    assert _save(pool, _copier(src)).ok
    cd = _copier(dst, auto_complete=False)
    rec = Recording(pool, _events_done(cd))
    t = _complete_later(cd.dev.ops, 0.2)
    res = _load(rec, cd, layer_timeout_s=10.0)
    t.join()
    assert res.ok, res.errors
    _same(src, dst)
    assert [c[2] for c in rec.calls if c[0] == "intact"] == [True]  # checked after the copies ended
    assert rec.wait_for("release") == [("release", 4, True)]


def test_a_copy_still_running_after_the_step_fails_its_blocks_and_keeps_the_leases_until_it_ends(pool):
    src, dst = _kv(True), _kv(False)
    assert _save(pool, _copier(src)).ok
    cd = _copier(dst, auto_complete=False)
    rec = Recording(pool, _events_done(cd))
    res = _load(rec, cd, layer_timeout_s=1.0)
    assert sorted(res.failed_block_ids) == sorted(DST_BLOCKS)
    assert any("still running" in e for e in res.errors), res.errors
    assert not [c for c in rec.calls if c[0] in ("intact", "release")]
    cd.dev.ops.complete_all()
    assert rec.wait_for("release") == [("release", 4, True)]


def test_a_copy_that_never_ends_keeps_the_leases_and_says_so(pool):
    src, dst = _kv(True), _kv(False)
    assert _save(pool, _copier(src)).ok
    cd = _copier(dst, auto_complete=False)
    rec = Recording(pool, _events_done(cd))
    layout = _layout(cd)
    with LayerPipeline(rec, cd, layout, layer_timeout_s=0.3) as pipe:
        pipe.start_load([ReqLoad("r", KEYS[:1], [2])])
        for layer in range(LAYERS):
            pipe.wait_layer(layer)
        assert pipe.finish_load().failed_block_ids == [2]
        deadline = time.monotonic() + 10.0
        errors: list[str] = []
        while not errors and time.monotonic() < deadline:
            time.sleep(0.05)
            errors = pipe.ctx.background.take()
    assert any("leases are kept until they expire" in e for e in errors), errors
    assert not [c for c in rec.calls if c[0] == "release"]


def test_a_save_commits_only_after_its_copies_into_the_pool_completed(pool):
    src = _kv(True)
    cs = _copier(src, auto_complete=False)
    rec = Recording(pool, _events_done(cs))
    t = _complete_later(cs.dev.ops, 0.2)
    res = _save(rec, cs, save_timeout_s=10.0)
    t.join()
    assert res.ok and sorted(res.committed_keys) == sorted(KEYS), res.errors
    assert rec.calls == [("commit", 4, True)]
    dst = _kv(False)
    assert _load(pool, _copier(dst)).ok
    _same(src, dst)


def test_a_save_whose_copy_runs_past_the_deadline_is_aborted_only_once_the_copy_ended(pool):
    cs = _copier(_kv(True), auto_complete=False)
    rec = Recording(pool, _events_done(cs))
    res = _save(rec, cs, save_timeout_s=1.0)
    assert not res.committed_keys and sorted(res.failed_keys) == sorted(KEYS)
    assert not rec.calls  # neither committed nor aborted while the copies may still write
    cs.dev.ops.complete_all()
    assert rec.wait_for("abort") == [("abort", 4, True)]


class GatedViews(Recording):
    """``view`` of the layer at ``offset`` waits for ``gate``; ``returned`` is set once it is over."""

    def __init__(self, inner, offset: int):
        super().__init__(inner, lambda: True)
        self.offset, self.gate, self.returned = offset, threading.Event(), threading.Event()

    def view_addresses(self, handles, offset, nbytes):
        return self._gated(offset, lambda: self.inner.view_addresses(handles, offset, nbytes))

    def table_addresses(self, table, rows, offset, nbytes):
        return self._gated(offset, lambda: self.inner.table_addresses(table, rows, offset, nbytes))

    def view(self, handle, offset, nbytes):
        return self._gated(offset, lambda: self.inner.view(handle, offset, nbytes))

    def _gated(self, offset, fn):
        if offset == self.offset:
            self.gate.wait(10.0)
            try:  # the step released its leases meanwhile: the view is refused, or not
                return fn()
            finally:
                self.returned.set()
        return fn()


def test_a_direct_load_that_comes_after_the_step_was_cancelled_never_lands(pool):
    src, dst = _kv(True), _kv(False)
    assert _save(pool, _copier(src)).ok
    cd = _copier(dst)
    layout = _layout(cd)
    gated = GatedViews(pool, layout.offsets[1])
    try:
        with LayerPipeline(gated, cd, layout, layer_timeout_s=0.3) as pipe:
            pipe.start_load([ReqLoad("r", KEYS, DST_BLOCKS)])
            pipe.wait_layer(0)
            pipe.wait_layer(1)  # misses: its views are held at the gate
            res = pipe.finish_load()
            assert sorted(res.failed_block_ids) == sorted(DST_BLOCKS) and 1 in res.deadline_misses
            gated.gate.set()
            assert gated.returned.wait(10.0)
            time.sleep(0.2)  # the worker now finds the step cancelled and drops the batch
        assert not dst[1].any(), "a late direct load wrote into the KV cache"
        assert cd.mechanism_counts["kernel"] >= 1  # layer 0 did move directly
    finally:
        gated.gate.set()


def test_a_direct_enqueue_that_raises_is_fenced_before_later_compute(pool):
    log: list = []
    dst = _kv(False)
    cd = _copier(dst, log)
    cd.register_host(pool.host_regions())
    (arena,) = pool.host_regions()
    src = np.frombuffer(arena, dtype=np.uint8)[: cd.block_nbytes(0)]

    def broken(*a):
        raise RuntimeError("simulated launch failure")

    cd.dev.ops.kernel_h2d = broken
    with pytest.raises(RuntimeError, match="simulated launch failure"):
        cd.to_kv(0, [1], [src])
    (i, rec), = [(i, e) for i, e in entries(log, "record") if e[1] == cd.dev.h2d_stream.name][:1]
    cd.begin_load()
    assert position(log, ("wait", "compute", rec[2])) > i  # the compute stream waits for it


def test_taking_back_a_background_saves_blocks_fences_its_device_copies_before_the_compute_stream_reuses_them(pool):
    # A preempted request's blocks: the save's workers are done once its copies are enqueued, but
    # the copies may still read the blocks on the device; the compute stream (the caller's, on the
    # forward thread) must wait for them before vLLM's next forward overwrites those blocks.
    log: list = []
    src = _kv(True)
    cs = _copier(src, log, auto_complete=False)
    with LayerPipeline(pool, cs, _layout(cs), max_transfer_blocks=3, save_timeout_s=10.0) as pipe:
        pipe.start_save([ReqSave("r", KEYS, SRC_BLOCKS)])
        for layer in range(LAYERS):
            pipe.save_layer(layer)
        pipe.finish_save_in_background("r")
        deadline = time.monotonic() + 10.0
        while len(entries(log, "kernel_d2h")) + len(entries(log, "batch_copy")) < LAYERS * 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        copies = [e for _, e in entries(log, "record") if e[1] != "compute"]
        assert copies, log
        pipe.stop_background_reads(lambda tag: tag == "r", 0.5)
        fenced = {e[2] for _, e in entries(log, "wait") if e[1] == "compute"}
        copy_events = {e[2] for e in copies if not e[2].done}
        assert copy_events and copy_events <= fenced, (copy_events, fenced)
        cs.dev.ops.complete_all()
        assert pipe.wait_background_saves(10.0)
        (res, tag), = pipe.take_background_saves()
    assert tag == "r" and res.ok and sorted(res.committed_keys) == sorted(KEYS), res.errors
    dst = _kv(False)
    assert _load(pool, _copier(dst)).ok
    _same(src, dst)


class CountingAddresses:
    """The pool, counting its address calls."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.counts = {"address_table": 0, "table_addresses": 0, "view_addresses": 0}

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.counts:
            return attr

        def counted(*a):
            self.counts[name] += 1
            return attr(*a)

        return counted


def test_a_step_builds_its_address_table_once_and_a_cpu_copier_asks_for_no_addresses(pool):
    counting = CountingAddresses(pool)
    src, dst = _kv(True), _kv(False)
    cs, cd = _copier(src), _copier(dst)
    assert _save(counting, cs).ok and _load(counting, cd).ok
    _same(src, dst)
    # one table per step (the save, the load), one lookup per batch of every layer, no per-batch rebuild
    assert counting.counts == {"address_table": 2, "table_addresses": 2 * LAYERS * 2, "view_addresses": 0}

    counting.counts = dict.fromkeys(counting.counts, 0)
    host_src, host_dst = _kv(True), _kv(False)
    on_cpu = [TorchCopier(host_src, NB), TorchCopier(host_dst, NB)]  # the CPU copier: views, never addresses
    assert _save(counting, on_cpu[0]).ok and _load(counting, on_cpu[1]).ok
    _same(host_src, host_dst)
    assert counting.counts == dict.fromkeys(counting.counts, 0)


@pytest.mark.parametrize("mechanism", ["kernel", "batch_dma"])
def test_no_copy_ops_run_every_host_step_of_a_mechanism_and_move_no_byte(pool, mechanism):
    """``lw-bench pipeline --host-work`` times the device path with these ops: saves commit and
    loads complete through the asked mechanism, while neither the pool nor the KV changes."""
    from lw_vllm.device.device_streams import InlineOps, NoCopyOps

    src, dst = _kv(True), _kv(False)
    cs = TorchCopier(src, NB, ops=NoCopyOps(), mechanism=mechanism)
    saved = _save(pool, cs)
    assert sorted(saved.committed_keys) == sorted(KEYS), saved.errors
    cd = TorchCopier(dst, NB, ops=NoCopyOps(), mechanism=mechanism)
    res = _load(pool, cd)
    assert not res.failed_block_ids, res.errors
    assert all(not t.any() for t in dst)  # the load moved nothing into the KV
    assert cs.mechanism_counts[mechanism] > 0 and cd.mechanism_counts[mechanism] > 0
    assert sum(cd.mechanism_counts.values()) == cd.mechanism_counts[mechanism]
    real = TorchCopier(dst, NB, ops=InlineOps(), mechanism=mechanism)
    assert not _load(pool, real).failed_block_ids
    assert all(not t.any() for t in dst)  # the save moved nothing into the pool: its objects hold zeros
    for c in (cs, cd, real):
        c.close()
