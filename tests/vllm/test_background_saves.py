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

from lw_core.config import parse_config  # noqa: E402
from lw_core.pipeline import SaveResult  # noqa: E402
from lw_vllm import pool, request_stats  # noqa: E402
from lw_vllm.meta import LayerwiseMeta, LayerwiseWorkerMeta  # noqa: E402
from lw_vllm.save_book import SaveBook  # noqa: E402
from lw_vllm.save_ledger import SaveLedger  # noqa: E402
from lw_vllm.scheduler_side import SchedulerSide  # noqa: E402
from lw_vllm.worker_side import WorkerSide  # noqa: E402

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
        assert side.request_finished(saving, [1, 2, 3, 4]) == ((True, None) if background else (False, None))
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
            side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None, finished_sending={"r-save"}))
        engine, *lines = map(json.loads, stats.read_text().splitlines())
        # The engine record comes first (lw_vllm.engine_facts), then one line per request.
        assert engine["engine"]["block_size"] == BLOCK and engine["engine"]["state_bytes"] is None, engine
        assert engine["engine"]["groups"] == [{"kind": "SimpleNamespace", "layers": 1, "block_size": BLOCK,
                                               "page_size_bytes": 4096}], engine
        recs = {r["req_id"]: r for r in lines}
        assert recs["r-save"]["saved_chunks"] == 3 and "r-none" in recs
        assert side.late.sending == {}
    finally:
        side.shutdown()


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

    def pending_background_saves(self) -> list[SaveBook]:
        return list(self.pending)

    def take_background_saves(self) -> list[tuple[SaveResult, SaveBook]]:
        out, self.done = self.done, []
        return out

    def finish(self, book: SaveBook, keys: list[str]) -> None:
        self.pending.remove(book)
        self.done.append((SaveResult(committed_keys=keys, saved_bytes=len(keys)), book))

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
    pipe.pending = [_book("a", "k1")]
    meta = LayerwiseMeta()
    meta.preempted = ["other"]
    w.handle_preemptions(meta)
    assert pipe.waits == [] and pipe.pending  # nothing of "other" runs: no wait
    meta.preempted = ["a"]
    w.handle_preemptions(meta)
    assert pipe.waits and not pipe.pending  # settled before the step may reuse a's blocks


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
