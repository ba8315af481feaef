"""The decoder's scheduler part in PD mode, driven the way vLLM's scheduler drives it, without an
engine: a kv_consumer SchedulerSide over a real embedded pool and a metaserver stand-in.

Shows: "not ready yet" (None) while the metaserver holds the call, never blocking; one POST per
request however often vLLM asks; a load once the answer is 200 even with consumer_is_to_load
false; recompute (pool lookup only) on error; short prompts post without waiting and their call
survives the request; an aborted waiting request cancels its call; the idle wait is bounded and
wakes on the answer."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_core.config import parse_config  # noqa: E402
from lw_vllm import scheduler_side  # noqa: E402
from lw_vllm.scheduler_side import SchedulerSide  # noqa: E402

from pd_fakes import FakeMetaserver  # noqa: E402

BLOCK = 16
LAYERS = 2
PAGE = 4096


def _configs():
    spec = SimpleNamespace(block_size=BLOCK, page_size_bytes=PAGE)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec,
                                                                       layer_names=[f"l{i}" for i in range(LAYERS)])])
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="tiny-test", dtype="float32", use_mla=False),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=False),
    )
    return vllm_config, kv_cache_config


@pytest.fixture(scope="module")
def meta() -> Iterator[FakeMetaserver]:
    s = FakeMetaserver()
    yield s
    s.close()


@pytest.fixture
def pool_dir() -> Iterator[str]:
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path("/tmp")
    p = base / f"lw-pd-sched-{uuid.uuid4().hex[:8]}"
    yield str(p)
    shutil.rmtree(p, ignore_errors=True)


def _side(pool_dir: str, **extra) -> SchedulerSide:
    cfg = parse_config({"embedded_path": pool_dir, "embedded_capacity_bytes": 4 << 20, "metaserver_timeout_s": 2.0,
                        **extra})
    vc, kc = _configs()
    return SchedulerSide(vc, kc, cfg, "kv_consumer")


def _req(rid: str, n_tokens: int, url: str | None, parent: str = "par") -> SimpleNamespace:
    toks = list(range(3, 3 + n_tokens))
    params = None if url is None else {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": url,
                                       "lw_parent_id": parent, "lw_children": 1}
    return SimpleNamespace(request_id=rid, all_token_ids=toks, prompt_token_ids=toks, kv_transfer_params=params,
                           lora_request=None, cache_salt=None, mm_features=None, skip_reading_prefix_cache=False)


def _publish(side: SchedulerSide, req: SimpleNamespace, n_chunks: int) -> None:
    """What a prefiller does: commit the first ``n_chunks`` chunk objects of ``req``'s prompt."""
    keys = side.keyspace.keys(side.tags[0], side._hashes(side._state(req))[:n_chunks])
    handles = side.backend.reserve(keys, LAYERS * PAGE)
    assert all(h is not None for h in handles)
    side.backend.commit(handles)


def _ask(side: SchedulerSide, req, limit_s: float = 10.0):
    """Ask like vLLM's scheduler does, once per pass, until an answer; return it and the slowest call."""
    deadline, slowest = time.monotonic() + limit_s, 0.0
    while True:
        t = time.perf_counter()
        n, is_async = side.get_num_new_matched_tokens(req, 0)
        slowest = max(slowest, time.perf_counter() - t)
        assert is_async is False
        if n is not None:
            return n, slowest
        assert time.monotonic() < deadline, "still not ready"
        time.sleep(0.002)


def test_not_ready_while_the_metaserver_holds_then_timeout_and_lookup(meta, pool_dir) -> None:
    side = _side(pool_dir)
    try:
        meta.mode, meta.bodies = "silent", []
        req = _req("r-hold", 5 * BLOCK + 3, meta.url, "par-hold")
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        _publish(side, req, 5)  # the prefiller commits while the decoder waits
        for _ in range(20):
            assert side.get_num_new_matched_tokens(req, 0) == (None, False)
            assert side.last_call_looked_up is False  # "not ready" is no lookup (metrics)
        n, slowest = _ask(side, req)  # the 2 s deadline passes
        assert side.last_call_looked_up is True
        assert side.reqs["r-hold"].remote.detail == "no metaserver answer within 2 s"
        # Recompute path, yet committed objects are valid KV: the lookup still uses them.
        assert n == 5 * BLOCK and slowest < 0.1
        assert meta.bodies == [{"lw_parent_id": "par-hold", "request_id": "r-hold"}]  # once, however often asked
    finally:
        side.shutdown()


def test_ok_answer_loads_every_full_chunk(meta, pool_dir) -> None:
    side = _side(pool_dir)
    try:
        assert side.can_load is False  # a plain request sent to this decoder would not load
        meta.mode, meta.bodies = "ok", []
        req = _req("r-a", 4 * BLOCK, meta.url)
        _publish(side, req, 4)
        n, _ = _ask(side, req)
        assert n == 3 * BLOCK  # 4 full chunks, but one token must be left to compute
        assert side.reqs["r-a"].remote.ok
    finally:
        side.shutdown()


def test_error_answer_computes_what_the_pool_lacks(meta, pool_dir) -> None:
    side = _side(pool_dir)
    try:
        meta.mode = "error"
        req = _req("r-e", 3 * BLOCK + 1, meta.url)
        n, _ = _ask(side, req)
        assert n == 0
        st = side.reqs["r-e"]
        assert not st.remote.ok and "502" in st.remote.detail
    finally:
        side.shutdown()


def test_plain_request_to_a_consumer_neither_posts_nor_loads(meta, pool_dir) -> None:
    side = _side(pool_dir)
    try:
        meta.bodies = []
        req = _req("r-plain", 4 * BLOCK, None)
        _publish(side, req, 3)
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        assert side.last_call_looked_up is False
        assert side.metaserver is not None and meta.bodies == []
        # consumer_is_to_load=true: plain requests load too.
        side2 = _side(pool_dir, consumer_is_to_load=True)
        try:
            assert side2.get_num_new_matched_tokens(_req("r-plain2", 4 * BLOCK, None), 0) == (3 * BLOCK, False)
        finally:
            side2.shutdown()
    finally:
        side.shutdown()


def test_short_prompt_posts_without_waiting_and_its_call_outlives_the_request(meta, pool_dir) -> None:
    side = _side(pool_dir)
    try:
        meta.mode, meta.bodies, meta.cancelled = "silent", [], 0
        req = _req("r-short", BLOCK - 2, meta.url, "par-short")
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        side.request_finished(req, [])
        deadline = time.monotonic() + 5
        while not meta.bodies:
            assert time.monotonic() < deadline, "the short request's POST never arrived"
            time.sleep(0.01)
        assert meta.bodies == [{"lw_parent_id": "par-short", "request_id": "r-short"}]
        time.sleep(0.2)
        assert "r-short" not in meta.cancelled_ids  # siblings of this parent still need the prefill dispatched
    finally:
        side.shutdown()


def test_aborted_waiting_request_cancels_its_call(meta, pool_dir) -> None:
    side = _side(pool_dir, metaserver_timeout_s=30.0)
    try:
        meta.mode, meta.bodies, meta.cancelled = "silent", [], 0
        req = _req("r-abort", 3 * BLOCK, meta.url)
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        deadline = time.monotonic() + 5
        while not meta.bodies:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        side.request_finished(req, [])
        while "r-abort" not in meta.cancelled_ids:
            assert time.monotonic() < deadline, "the aborted request's POST was not cancelled"
            time.sleep(0.01)
    finally:
        side.shutdown()


def test_idle_wait_is_bounded_and_only_after_an_empty_step(meta, pool_dir) -> None:
    side = _side(pool_dir, metaserver_timeout_s=30.0)
    try:
        meta.mode = "silent"
        req = _req("r-idle", 3 * BLOCK, meta.url)
        busy = SimpleNamespace(scheduled_new_reqs=[], total_num_scheduled_tokens=5,
                               scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                                     num_computed_tokens=[]),
                               num_scheduled_tokens={})
        empty = SimpleNamespace(**{**vars(busy), "total_num_scheduled_tokens": 0})
        side.build_connector_meta(busy)
        # the first call also starts the client's loop thread and the POST: not what is timed here
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        t = time.perf_counter()
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        assert time.perf_counter() - t < 0.01  # another request ran last step: no wait at all
        side.build_connector_meta(empty)
        t = time.perf_counter()
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        waited = time.perf_counter() - t
        assert scheduler_side.IDLE_WAIT_S * 0.5 <= waited < scheduler_side.IDLE_WAIT_S + 0.05, waited
        t = time.perf_counter()
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # same pass: no second wait
        assert time.perf_counter() - t < 0.01
    finally:
        side.shutdown()


def _step(req_id: str, block_ids: list[int], n_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(block_ids,), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]),
        num_scheduled_tokens={req_id: n_tokens}, total_num_scheduled_tokens=n_tokens)


def test_prefiller_saves_what_the_pool_lacks_and_reports_it_with_the_answer(pool_dir, tmp_path, monkeypatch) -> None:
    from lw_vllm.meta import LayerwiseWorkerMeta

    stats = tmp_path / "stats.jsonl"
    monkeypatch.setenv(scheduler_side.STATS_ENV, str(stats))
    cfg = parse_config({"embedded_path": pool_dir, "embedded_capacity_bytes": 4 << 20})
    vc, kc = _configs()
    side = SchedulerSide(vc, kc, cfg, "kv_producer")
    try:
        assert side.metaserver is None  # a prefiller never calls the metaserver
        req = _req("p-1", 3 * BLOCK + 5, None)
        _publish(side, req, 2)  # an earlier prefill of the same prefix
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # a producer never loads
        meta = side.build_connector_meta(_step("p-1", [10, 11, 12, 13], 3 * BLOCK + 5))
        assert meta.loads == [] and len(meta.saves) == 1
        (x,) = meta.saves
        assert x.block_ids == [12] and x.hashes == side._hashes(side._state(req))[2:3]  # only chunk 2
        # max_tokens=1: vLLM finishes the request before handing over that step's worker report.
        side.request_finished(req, [10, 11, 12, 13])
        assert not stats.exists() or stats.read_text() == ""
        side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=LayerwiseWorkerMeta(saved={"p-1": 1})))
        import json

        (rec,) = [json.loads(line) for line in stats.read_text().splitlines()]
        assert rec["req_id"] == "p-1" and rec["saved_chunks"] == 1 and "remote_prefill" not in rec
    finally:
        side.shutdown()
