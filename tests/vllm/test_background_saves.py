"""kv_both saves finished in the background (``save_in_background``), driven as vLLM drives the
connector, without an engine: the scheduler part frees a request that had saves late and learns
through ``finished_sending`` when it may free it; the worker part reports a request only once no
save of it runs, waits for a preempted request's saves, and hands every save's result over."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_core.backends.memory import MemoryBackend  # noqa: E402
from lw_core.config import parse_config  # noqa: E402
from lw_core.pipeline import SaveResult  # noqa: E402
from lw_vllm import pool  # noqa: E402
from lw_vllm.meta import LayerwiseMeta, LayerwiseWorkerMeta  # noqa: E402
from lw_vllm.scheduler import request_stats  # noqa: E402
from lw_vllm.scheduler.scheduler_side import SchedulerSide  # noqa: E402
from lw_vllm.worker.save_book import SaveBook  # noqa: E402
from lw_vllm.worker.save_ledger import SaveLedger  # noqa: E402
from lw_vllm.worker.worker_side import WorkerSide  # noqa: E402

BLOCK = 16


def _configs(groups: int = 1):
    spec = SimpleNamespace(block_size=BLOCK, page_size_bytes=4096)
    kc = SimpleNamespace(num_blocks=8, kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}"])
                                          for i in range(groups)])
    vc = SimpleNamespace(
        model_config=SimpleNamespace(model="tiny-test", dtype="float32", use_mla=False, hf_config=SimpleNamespace(),
                                     get_total_num_kv_heads=lambda: 2),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout="LBHNC"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=False),
    )
    return vc, kc


def _req(rid: str, n_tokens: int) -> SimpleNamespace:
    toks = list(range(3, 3 + n_tokens))
    return SimpleNamespace(request_id=rid, all_token_ids=toks, prompt_token_ids=toks, kv_transfer_params=None,
                           lora_request=None, cache_salt=None, mm_features=None, skip_reading_prefix_cache=False)


def _step(new: list[tuple[str, list[int], int]], preempted: tuple[str, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=0) for r, b, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]),
        num_scheduled_tokens={r: n for r, _, n in new}, total_num_scheduled_tokens=sum(n for *_, n in new),
        preempted_req_ids=set(preempted))


@pytest.mark.parametrize("background", [True, False])
def test_scheduler_frees_a_saving_request_late_and_writes_its_stats_when_sending_ends(
        background, tmp_path, monkeypatch) -> None:
    stats = tmp_path / "stats.jsonl"
    monkeypatch.setenv(request_stats.STATS_ENV, str(stats))
    cfg = parse_config({"embedded_path": str(tmp_path / "pool"), "embedded_capacity_bytes": 4 << 20,
                        "save_in_background": background})
    vc, kc = _configs()
    side = SchedulerSide(vc, kc, cfg, "kv_both")
    try:
        saving, hit_only = _req("r-save", 3 * BLOCK + 1), _req("r-none", 5)
        for r in (saving, hit_only):
            assert side.get_num_new_matched_tokens(r, 0) == (0, False)
            side.update_state_after_alloc(r, None, 0)
        meta = side.build_connector_meta(_step([("r-save", [1, 2, 3, 4], 3 * BLOCK + 1), ("r-none", [5], 5)]))
        assert [x.req_id for x in meta.saves] == ["r-save"] and meta.free_late == []
        # r-none planned no save: freed at once either way; r-save waits for its saves when they run late.
        assert side.request_finished(hit_only, [5]) == (False, None)
        assert not side.has_pending_block_frees()
        assert side.request_finished(saving, [1, 2, 3, 4]) == ((True, None) if background else (False, None))
        # vLLM asks before preempting for lack of blocks: r-save's come back once its saves end.
        assert side.has_pending_block_frees() == background
        if not background:  # the step's saves ended in it: its report comes with its output
            side.update_connector_output(SimpleNamespace(
                kv_connector_worker_meta=LayerwiseWorkerMeta(saved={"r-save": 3}), finished_sending=None))
        meta = side.build_connector_meta(_step([], preempted=("r-x",)))
        assert meta.free_late == (["r-save"] if background else [])
        assert meta.preempted == (["r-x"] if background else [])
        assert side.build_connector_meta(_step([])).free_late == []  # told once
        if background:
            # The saves' report may come steps later; the stats line waits for the request's end.
            side.update_connector_output(SimpleNamespace(
                kv_connector_worker_meta=LayerwiseWorkerMeta(saved={"r-save": 3}), finished_sending=set()))
            assert "r-save" not in stats.read_text()
            assert side.has_pending_block_frees()
            side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None, finished_sending={"r-save"}))
            assert not side.has_pending_block_frees()
        engine, *lines = map(json.loads, stats.read_text().splitlines())
        # The engine record comes first (lw_vllm.scheduler.engine_facts), then one line per request.
        assert engine["engine"]["block_size"] == BLOCK and engine["engine"]["state_bytes"] is None, engine
        assert engine["engine"]["groups"] == [{"kind": "SimpleNamespace", "layers": 1, "block_size": BLOCK,
                                               "page_size_bytes": 4096}], engine
        recs = {r["req_id"]: r for r in lines}
        assert recs["r-save"]["saved_chunks"] == 3 and "r-none" in recs
        assert side.late.sending == {}
    finally:
        side.shutdown()


def test_the_connector_tells_vllm_of_blocks_held_for_saves() -> None:
    """vLLM 0.32's scheduler calls ``has_pending_block_frees`` before it preempts a request."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from lw_vllm.connector import LayerwiseStoreConnector

    assert LayerwiseStoreConnector.has_pending_block_frees is not KVConnectorBase_V1.has_pending_block_frees
    conn = LayerwiseStoreConnector.__new__(LayerwiseStoreConnector)  # only the parts the hook uses
    conn._sched, conn._worker = None, None
    assert conn.has_pending_block_frees() is False  # a worker never holds blocks
    conn._sched = SimpleNamespace(has_pending_block_frees=lambda: True)  # type: ignore[assignment]
    assert conn.has_pending_block_frees() is True


def test_a_pd_prefill_on_a_kv_both_engine_saves_in_its_step(tmp_path) -> None:
    """A kv_both engine behind the proxy may prefill for a decoder: that step's saves end in the
    step, so its answer still comes after the commit."""
    cfg = parse_config({"embedded_path": str(tmp_path / "pool"), "embedded_capacity_bytes": 4 << 20})
    vc, kc = _configs()
    side = SchedulerSide(vc, kc, cfg, "kv_both")
    try:
        plain, prefill = _req("r-plain", 2 * BLOCK + 1), _req("r-pd", 2 * BLOCK + 1)
        prefill.kv_transfer_params = {"do_remote_decode": True, "do_remote_prefill": False}
        for r in (plain, prefill):
            assert side.get_num_new_matched_tokens(r, 0)[0] == 0
            side.update_state_after_alloc(r, None, 0)
        assert not side.build_connector_meta(_step([("r-plain", [1, 2, 3], 2 * BLOCK + 1)])).saves_in_step
        assert side.build_connector_meta(_step([("r-pd", [4, 5, 6], 2 * BLOCK + 1)])).saves_in_step
    finally:
        side.shutdown()


def test_hybrid_models_and_prefillers_wait_for_their_saves(tmp_path) -> None:
    cfg = parse_config({"embedded_path": str(tmp_path / "pool"), "embedded_capacity_bytes": 4 << 20})
    vc, kc = _configs()
    assert not WorkerSide(vc, kc, cfg, "kv_producer").background
    assert WorkerSide(vc, kc, cfg, "kv_both").background
    # vLLM frees a sliding window's blocks while its request runs: a hybrid's saves end in their step.
    assert not pool.saves_in_background(cfg, "kv_both", _configs(groups=2)[1])
    assert not pool.saves_in_background(parse_config({"pd_streaming": True}), "kv_both", kc)


class _Pipe:
    """The pipeline's background-save surface, with saves the test finishes by hand."""

    def __init__(self) -> None:
        self.pending: list[SaveBook] = []
        self.done: list[tuple[SaveResult, SaveBook]] = []
        self.waits: list[float] = []
        self.stopped: list[SaveBook] = []  # saves told to stop reading their blocks

    def pending_background_saves(self) -> list[SaveBook]:
        return list(self.pending)

    def take_background_saves(self) -> list[tuple[SaveResult, SaveBook]]:
        out, self.done = self.done, []
        return out

    def finish(self, book: SaveBook, keys: list[str]) -> None:
        self.pending.remove(book)
        self.done.append((SaveResult(committed_keys=keys, saved_bytes=len(keys)), book))

    def stop_background_reads(self, holds, timeout_s: float) -> int:
        self.stopped += [b for b in self.pending if holds(b)]
        return 0

    def wait_background_saves(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        for book in list(self.pending):
            self.finish(book, list(book.owner))
        return True


def _worker(tmp_path) -> tuple[WorkerSide, _Pipe]:
    vc, kc = _configs()
    cfg = parse_config({"embedded_path": str(tmp_path / "pool"), "embedded_capacity_bytes": 4 << 20})
    w = WorkerSide(vc, kc, cfg, "kv_both")
    pipe = _Pipe()
    w.pipe = pipe  # type: ignore[assignment]
    w.ledger = SaveLedger(pipe, w.background, w.report, w.stats, cfg.save_timeout_s)  # type: ignore[arg-type]
    return w, pipe


def _book(rid: str, *keys: str) -> SaveBook:
    b = SaveBook()
    for k in keys:
        b.add(k, rid, None)
    return b


def test_worker_reports_a_late_freed_request_only_when_none_of_its_saves_runs(tmp_path) -> None:
    w, pipe = _worker(tmp_path)
    a1, a2, b = _book("a", "k1"), _book("a", "k2"), _book("b", "k3")
    pipe.pending = [a1, a2, b]
    meta = LayerwiseMeta()
    meta.free_late = ["a", "b"]
    w.bind(meta)
    assert w.take_finished_sending() is None  # both still saving
    pipe.finish(a1, ["k1"])
    pipe.finish(b, ["k3"])
    w.bind(LayerwiseMeta())
    assert w.take_finished_sending() == {"b"}  # a's second step still runs
    rep = w.take_report()
    assert rep is not None and rep.saved == {"a": 1, "b": 1}  # results arrive with the same pass
    pipe.finish(a2, ["k2"])
    w.bind(LayerwiseMeta())
    assert w.take_finished_sending() == {"a"}
    assert w.take_finished_sending() is None  # reported once
    rep = w.take_report()
    assert rep is not None and rep.saved == {"a": 2}  # a running total: TP ranks report in different steps


def test_an_idle_step_waits_a_little_for_the_saves_it_must_report(tmp_path) -> None:
    w, pipe = _worker(tmp_path)
    pipe.pending = [_book("a", "k1")]
    meta = LayerwiseMeta()
    meta.free_late, meta.idle = ["a"], True
    w.bind(meta)
    assert w.take_finished_sending() == {"a"} and len(pipe.waits) == 1


def test_preemption_waits_for_the_preempted_requests_saves_only(tmp_path) -> None:
    w, pipe = _worker(tmp_path)
    a, b = _book("a", "k1"), _book("b", "k2")
    pipe.pending = [a, b]
    meta = LayerwiseMeta()
    meta.preempted = ["other"]
    w.handle_preemptions(meta)
    assert pipe.stopped == []  # nothing of "other" runs: no wait
    meta.preempted = ["a"]
    w.handle_preemptions(meta)
    assert pipe.stopped == [a]  # a's saves stop reading its blocks before the step reuses them; b's go on
    assert pipe.waits == []  # and no wait for every save


class _StalledStore(MemoryBackend):
    """A memory pool whose writes (and the windows they go through) wait while ``stalled``."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled = threading.Event()
        self.recovered = threading.Event()

    def _wait(self) -> None:
        if self.stalled.is_set():
            self.recovered.wait(30)

    def view(self, handle, offset, nbytes):
        self._wait()
        return super().view(handle, offset, nbytes)

    def write(self, handles, offsets, srcs) -> None:
        self._wait()
        super().write(handles, offsets, srcs)


def test_a_preempted_requests_save_stalled_in_the_store_never_commits_the_next_owners_kv() -> None:
    """The store stalls longer than the save deadline with steps of saves queued; a request whose
    save waits behind them is preempted, vLLM hands its blocks to another request, then the store
    recovers: every object in the pool holds its own key's bytes (the preempted request's save
    must not copy the next owner's KV and commit it under its keys)."""
    import numpy as np

    from lw_core.pipeline import LayerPipeline
    from lw_core.pipeline.host_copier import HostCopier
    from lw_core.plan import ObjectLayout, ReqSave
    from lw_vllm.metrics import Collector
    from lw_vllm.worker.worker_report import WorkerReport

    timeout_s, queued = 0.2, 15  # the queue takes far longer than a wait for the preempted saves
    layout = ObjectLayout(layer_nbytes=(64, 64))
    kv = HostCopier.allocate(2, queued + 4, 64)
    for a in kv.kv:
        a[:] = np.random.default_rng(1).integers(0, 256, a.shape, dtype=np.uint8)
    ref = [a.copy() for a in kv.kv]
    store = _StalledStore()
    pipe = LayerPipeline(store, kv, layout, save_timeout_s=timeout_s, max_stuck_threads=0)
    ledger = SaveLedger(pipe, True, WorkerReport(), Collector(), timeout_s)

    def step(rid: str, keys: list[str], blocks: list[int]) -> None:
        pipe.start_save([ReqSave(rid, keys, blocks)])
        for layer in range(2):
            pipe.save_layer(layer)
        ledger.finish(_book(rid, *keys), in_step=False)

    blocks = {f"q{i}": i for i in range(queued)} | {"p0": queued, "p1": queued + 1}
    try:
        store.stalled.set()
        for i in range(queued):
            step(f"r{i}", [f"q{i}"], [i])
        step("p", ["p0", "p1"], [queued, queued + 1])
        ledger.wait_preempted({"p"})
        for a in kv.kv:  # vLLM gave p's blocks to another request, which wrote its KV there
            a[[queued, queued + 1]] = 0xEE
        store.recovered.set()
        assert pipe.wait_background_saves(10.0)
        ledger.collect()
        handles = store.open(list(blocks))
        stored = {k: h for k, h in zip(blocks, handles) if h is not None}
        for key, h in stored.items():
            got = bytearray(layout.nbytes)
            store.read([h], [0], [got])
            want = b"".join(ref[layer][blocks[key]].tobytes() for layer in range(2))
            assert bytes(got) == want, f"{key} holds bytes other than its own"
        store.release(list(stored.values()))
        assert "p0" not in stored and "p1" not in stored  # cancelled before they were copied
    finally:
        store.recovered.set()
        pipe.close()


def test_real_pipeline_commits_after_the_step_returns(tmp_path) -> None:
    """The hooks over a real pipeline and embedded pool: wait_for_save returns while the store
    write is held; the objects commit later and the late-freed request is then reported."""
    import torch

    vc, kc = _configs()
    cfg = parse_config({"embedded_path": str(tmp_path / "pool"), "embedded_capacity_bytes": 4 << 20,
                        "use_layerwise": True})
    w = WorkerSide(vc, kc, cfg, "kv_both")
    kv = torch.randn(8, 2, BLOCK, 32)  # vLLM CPU: [blocks, heads, tokens, k+v content], 4096 B per block
    w.register_kv_caches({"l0": kv})
    try:
        assert w.pipe is not None
        gate = threading.Event()
        real_write = w.backend.write
        w.backend.write = lambda *a, **k: (gate.wait(10), real_write(*a, **k))[1]
        from lw_vllm.meta import Xfer

        meta = LayerwiseMeta(saves=[Xfer("r", [b"\x01" * 16, b"\x02" * 16], [1, 2])])
        w.bind(meta)
        w.save_kv_layer("l0")
        w.wait_for_save()  # returns with the write still held
        keys = w.keyspace.keys(w.tag, [b"\x01" * 16, b"\x02" * 16])
        assert w.backend.lookup(keys) == 0
        nxt = LayerwiseMeta()
        nxt.free_late = ["r"]
        w.bind(nxt)
        assert w.take_finished_sending() is None
        gate.set()
        assert w.pipe.wait_background_saves(5.0)
        assert w.take_finished_sending() == {"r"}
        assert w.backend.lookup(keys) == 2
        rep = w.take_report()
        assert rep is not None and rep.saved == {"r": 2}
    finally:
        w.shutdown()


def test_a_step_with_a_pd_prefill_commits_before_wait_for_save_returns(tmp_path) -> None:
    import torch

    from lw_vllm.meta import Xfer

    vc, kc = _configs()
    cfg = parse_config({"embedded_path": str(tmp_path / "pool"), "embedded_capacity_bytes": 4 << 20,
                        "use_layerwise": True})
    w = WorkerSide(vc, kc, cfg, "kv_both")
    w.register_kv_caches({"l0": torch.randn(8, 2, BLOCK, 32)})
    try:
        meta = LayerwiseMeta(saves=[Xfer("r", [b"\x03" * 16], [1])])
        meta.saves_in_step = True
        w.bind(meta)
        w.save_kv_layer("l0")
        w.wait_for_save()
        assert w.backend.lookup(w.keyspace.keys(w.tag, [b"\x03" * 16])) == 1  # committed in the step
        assert w.pipe is not None and w.pipe.pending_background_saves() == []
    finally:
        w.shutdown()
