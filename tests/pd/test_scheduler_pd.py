"""The decoder's scheduler part in PD mode, driven the way vLLM's scheduler drives it, without an
engine: a kv_consumer SchedulerSide over a real embedded pool and a metaserver stand-in.

Shows: "not ready yet" (None) while the metaserver holds the call, never blocking; one POST per
request however often vLLM asks; a load once the answer is 200 even with consumer_is_to_load
false; recompute (pool lookup only) on error; short prompts post without waiting and their call
survives the request; an aborted waiting request cancels its call; the idle wait is bounded and
wakes on the answer; a streaming receive ends at the metaserver's answer (ok: at a chunk never
saved; error: cancelled), relayed through the step plan to the worker's receiver. The fixtures
``meta`` (the metaserver stand-in) and ``pool_dir`` are tests/pd/conftest.py's."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_core.config import parse_config  # noqa: E402
from lw_core.keys import chunk_hashes  # noqa: E402
from lw_vllm.pd import pd_coordinator  # noqa: E402
from lw_vllm.request.request_state import RemotePhase, ReqState  # noqa: E402
from lw_vllm.scheduler import request_stats  # noqa: E402
from lw_vllm.scheduler.scheduler_side import SchedulerSide  # noqa: E402

BLOCK = 16
LAYERS = 2
PAGE = 4096


def _configs():
    spec = SimpleNamespace(block_size=BLOCK, page_size_bytes=PAGE)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec,
                                                                       layer_names=[f"l{i}" for i in range(LAYERS)])])
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="tiny-test", dtype="float32", use_mla=False, hf_config=SimpleNamespace()),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=False),
    )
    return vllm_config, kv_cache_config


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
    keys = side.keyspace.keys(side.tags[0], chunk_hashes(req.all_token_ids, BLOCK)[:n_chunks])
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
        _publish(side, req, 4)  # the prefiller commits part of the prompt while the decoder waits
        for _ in range(20):
            assert side.get_num_new_matched_tokens(req, 0) == (None, False)
            assert side.last_call_looked_up is False  # "not ready" is no lookup (metrics)
        n, slowest = _ask(side, req)  # the 2 s deadline passes
        assert side.last_call_looked_up is True
        assert side.reqs["r-hold"].remote.outcome.detail == "no metaserver answer within 2 s"
        # Recompute path, yet committed objects are valid KV: the lookup still uses them.
        assert n == 4 * BLOCK and slowest < 0.1
        # once, however often asked
        assert meta.bodies == [{"lw_parent_id": "par-hold", "request_id": "r-hold", "needs_prefill": True, "forces_first": None}]
    finally:
        side.shutdown()


def test_ok_answer_loads_what_the_pool_holds(meta, pool_dir) -> None:
    side = _side(pool_dir)
    try:
        assert side.can_load is False  # a plain request sent to this decoder would not load
        meta.mode, meta.bodies = "ok", []
        req = _req("r-a", 4 * BLOCK + 5, meta.url)
        _publish(side, req, 3)
        n, _ = _ask(side, req)
        assert n == 3 * BLOCK  # what the pool holds after the answer; vLLM computes the rest
        assert side.reqs["r-a"].remote.answered_ok
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
        assert not st.remote.answered_ok and "502" in st.remote.outcome.detail
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
        assert side.pd.metaserver is not None and meta.bodies == []
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
        assert meta.bodies == [{"lw_parent_id": "par-short", "request_id": "r-short", "needs_prefill": False, "forces_first": None}]
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
        assert pd_coordinator.IDLE_WAIT_S * 0.5 <= waited < pd_coordinator.IDLE_WAIT_S + 0.05, waited
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
    monkeypatch.setenv(request_stats.STATS_ENV, str(stats))
    cfg = parse_config({"embedded_path": pool_dir, "embedded_capacity_bytes": 4 << 20})
    vc, kc = _configs()
    side = SchedulerSide(vc, kc, cfg, "kv_producer")
    try:
        assert side.pd.metaserver is None  # a prefiller never calls the metaserver
        req = _req("p-1", 3 * BLOCK + 5, None)
        _publish(side, req, 2)  # an earlier prefill of the same prefix
        assert side.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, False)  # producer_is_to_load
        side.update_state_after_alloc(req, None, 2 * BLOCK)
        step = _step("p-1", [10, 11, 12, 13], BLOCK + 5)
        step.scheduled_new_reqs[0].num_computed_tokens = 2 * BLOCK  # what vLLM sets after the alloc
        meta = side.build_connector_meta(step)
        (ld,) = meta.loads
        assert ld.block_ids == [10, 11] and len(meta.saves) == 1
        assert not meta.bulk_load  # a real tail to compute: the load stays layerwise
        (x,) = meta.saves
        assert x.block_ids == [12] and x.hashes == chunk_hashes(req.all_token_ids, BLOCK)[2:3]  # only chunk 2
        # max_tokens=1: vLLM finishes the request before handing over that step's worker report.
        side.request_finished(req, [10, 11, 12, 13])
        import json

        def requests() -> list[dict]:  # the request records (the file starts with the engine's)
            return [r for r in map(json.loads, stats.read_text().splitlines()) if "engine" not in r]

        assert requests() == []
        side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=LayerwiseWorkerMeta(saved={"p-1": 1})))
        (rec,) = requests()
        assert rec["req_id"] == "p-1" and rec["saved_chunks"] == 1 and "remote_prefill" not in rec
    finally:
        side.shutdown()
    # producer_is_to_load=false: the producer never loads, and still skips what the pool holds.
    cfg = parse_config({"embedded_path": pool_dir, "embedded_capacity_bytes": 4 << 20, "producer_is_to_load": False})
    side = SchedulerSide(vc, kc, cfg, "kv_producer")
    try:
        req = _req("p-2", 3 * BLOCK + 5, None)
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        meta = side.build_connector_meta(_step("p-2", [10, 11, 12, 13], 3 * BLOCK + 5))
        (x,) = meta.saves
        assert meta.loads == [] and x.block_ids == [12]
    finally:
        side.shutdown()


def _publish_keys(side: SchedulerSide, hashes: list[bytes]) -> None:
    handles = side.backend.reserve(side.keyspace.keys(side.tags[0], hashes), LAYERS * PAGE)
    assert all(h is not None for h in handles)
    side.backend.commit(handles)


def _prefill_req(rid: str, toks: list[int], parent: str) -> SimpleNamespace:
    params = {"do_remote_decode": True, "do_remote_prefill": False, "lw_parent_id": parent}
    return SimpleNamespace(request_id=rid, all_token_ids=toks, prompt_token_ids=toks, kv_transfer_params=params,
                           lora_request=None, cache_salt=None, mm_features=None, skip_reading_prefix_cache=False)


def _pd_sides(pool_dir: str) -> tuple[SchedulerSide, SchedulerSide]:
    """A layerwise prefiller's and decoder's scheduler sides over one pool."""
    cfg = parse_config({"embedded_path": pool_dir, "embedded_capacity_bytes": 4 << 20, "use_layerwise": True})
    vc, kc = _configs()
    return SchedulerSide(vc, kc, cfg, "kv_producer"), _side(pool_dir, use_layerwise=True, metaserver_timeout_s=30.0)


@pytest.mark.parametrize("tail", [0, 5], ids=["aligned", "partial"])
def test_whole_prompt_travels_and_the_decoder_computes_one_token(meta, pool_dir, tail: int) -> None:
    """The prefiller saves the partial chunk under a parent-scoped key; the decoder, seeing the whole
    prompt in the pool, proceeds without the metaserver's answer and loads all of it but the last token."""
    prod, side = _pd_sides(pool_dir)
    try:
        n_tok = 3 * BLOCK + tail
        meta.mode, meta.bodies = "silent", []
        dreq = _req("d-w", n_tok, meta.url, "par-w")
        assert side.get_num_new_matched_tokens(dreq, 0) == (None, False)  # nothing committed yet
        preq = _prefill_req("p-w", list(dreq.prompt_token_ids), "par-w")
        assert prod.get_num_new_matched_tokens(preq, 0) == (0, False)
        blocks = [20, 21, 22, 23][: -(-n_tok // BLOCK)]
        plan = prod.build_connector_meta(_step("p-w", blocks, n_tok))
        saved = [h for x in plan.saves for h in x.hashes]
        assert [b for x in plan.saves for b in x.block_ids] == blocks  # every block, the partial one too
        want = side.pd.prompt_hashes(ReqState.of(dreq, "par-w"))  # the decoder's view of the prompt
        assert saved == want and len(want) == len(blocks)
        _publish_keys(prod, saved)  # what the prefiller's worker commits
        n, _ = _ask(side, dreq)
        assert n == n_tok - 1
        assert side.reqs["d-w"].remote.answered_ok and "in_pool" in side.reqs["d-w"].t
        side.update_state_after_alloc(dreq, None, n)
        plan = side.build_connector_meta(_step("d-w", [5, 6, 7, 8][: len(blocks)], 1))
        (x,) = plan.loads
        assert x.hashes == want and x.block_ids == [5, 6, 7, 8][: len(blocks)]
        assert plan.bulk_load  # one token to compute: nothing for layer pipelining to hide
        # Another parent's decoder never matches this prompt's partial chunk.
        other = _req("d-o", n_tok, None)
        other.kv_transfer_params = {**dreq.kv_transfer_params, "lw_parent_id": "par-other"}
        if tail:
            assert side.pd.prompt_hashes(ReqState.of(other, "par-other"))[-1] != want[-1]
    finally:
        side.shutdown()
        prod.shutdown()


@pytest.mark.parametrize("tail", [0, 5, BLOCK - 1], ids=["aligned", "partial", "block-less-one"])
def test_a_continued_prefill_loads_the_prefills_prompt_and_calls_no_metaserver(meta, pool_dir, tail: int) -> None:
    """``lw_prefilled``: the decoder is given the prefill's prompt plus its first token; it loads
    the prefill's prompt, partial chunk included, at once and without a metaserver call, so only
    the token is computed; it never counts the prefill's partial chunk as a full chunk of its own."""
    prod, side = _pd_sides(pool_dir)
    try:
        n_tok = 3 * BLOCK + tail
        meta.mode, meta.bodies = "silent", []
        prod.get_num_new_matched_tokens(_prefill_req("p-c", list(range(3, 3 + n_tok)), "par-c"), 0)
        blocks = [20, 21, 22, 23][: -(-n_tok // BLOCK)]
        saved = [h for x in prod.build_connector_meta(_step("p-c", blocks, n_tok)).saves for h in x.hashes]
        _publish_keys(prod, saved)
        dreq = _req("d-c", n_tok + 1, meta.url, "par-c")  # the prompt and the prefill's first token
        dreq.all_token_ids[-1] = dreq.prompt_token_ids[-1] = 99_999
        dreq.kv_transfer_params["lw_prefilled"] = 1
        t = time.perf_counter()
        assert side.get_num_new_matched_tokens(dreq, 0) == (n_tok, False)  # no "not ready yet"
        assert time.perf_counter() - t < 1.0
        st = side.reqs["d-c"]
        assert st.remote.phase is RemotePhase.PREFILLED and st.load_hashes == saved
        assert st.pool_chunks == n_tok // BLOCK  # the partial chunk is the prefill's, not a chunk of its own
        side.update_state_after_alloc(dreq, None, n_tok)
        plan = side.build_connector_meta(_step("d-c", [5, 6, 7, 8][: -(-(n_tok + 1) // BLOCK)], 1))
        (x,) = plan.loads
        assert x.hashes == saved and x.block_ids == [5, 6, 7, 8][: len(blocks)]
        time.sleep(0.2)
        assert meta.bodies == []  # nothing asked of the metaserver
        # Without the prefill in the pool (another parent: its partial chunk's key differs) the
        # lookup finds the full chunks only, and the rest is computed.
        other = _req("d-o", n_tok + 1, meta.url, "par-none")
        other.all_token_ids[-1] = other.prompt_token_ids[-1] = 99_999
        other.kv_transfer_params["lw_prefilled"] = 1
        assert side.get_num_new_matched_tokens(other, 0) == (n_tok - tail if tail else n_tok, False)
    finally:
        side.shutdown()
        prod.shutdown()


def test_discard_partial_chunks_keeps_the_partial_chunk_home(meta, pool_dir) -> None:
    cfg = parse_config({"embedded_path": pool_dir, "embedded_capacity_bytes": 4 << 20, "use_layerwise": True,
                        "discard_partial_chunks": True})
    vc, kc = _configs()
    prod = SchedulerSide(vc, kc, cfg, "kv_producer")
    try:
        toks = list(range(3, 3 + 2 * BLOCK + 7))
        prod.get_num_new_matched_tokens(_prefill_req("p-d", toks, "par-d"), 0)
        plan = prod.build_connector_meta(_step("p-d", [1, 2, 3], len(toks)))
        assert [b for x in plan.saves for b in x.block_ids] == [1, 2]
    finally:
        prod.shutdown()


def test_decoder_that_holds_the_prompt_says_so_and_does_not_wait(meta, pool_dir) -> None:
    side = _side(pool_dir, metaserver_timeout_s=30.0)
    try:
        meta.mode, meta.bodies = "silent", []
        req = _req("r-held", 3 * BLOCK + 4, meta.url, "par-held")
        _publish(side, req, 3)  # the pool holds every full chunk already
        t = time.perf_counter()
        assert side.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, False)  # no "not ready yet"
        assert time.perf_counter() - t < 1.0
        assert side.reqs["r-held"].remote.phase is RemotePhase.POOL_HOLDS_PROMPT
        deadline = time.monotonic() + 5
        while not meta.bodies:
            assert time.monotonic() < deadline, "the POST never arrived"
            time.sleep(0.01)
        assert meta.bodies == [{"lw_parent_id": "par-held", "request_id": "r-held", "needs_prefill": False, "forces_first": None}]
        # Local prefix cache (2 chunks) plus the pool (the 3rd) count together.
        side2 = _side(pool_dir, metaserver_timeout_s=30.0)
        try:
            req2 = _req("r-held2", 3 * BLOCK + 4, meta.url, "par-held2")
            assert side2.get_num_new_matched_tokens(req2, 2 * BLOCK) == (BLOCK, False)
            assert side2.reqs["r-held2"].remote.phase is RemotePhase.POOL_HOLDS_PROMPT
        finally:
            side2.shutdown()
    finally:
        side.shutdown()


class _Rows:
    """KV blocks as numpy rows, read into directly (the worker's copier, for the receiver)."""

    def __init__(self) -> None:
        import numpy as np

        self.kv = [np.zeros((16, PAGE), np.uint8) for _ in range(LAYERS)]

    def kv_views(self, layer, blocks):
        return [memoryview(self.kv[layer][b]) for b in blocks]

    def wait(self, token, timeout_s):
        return True


@pytest.mark.parametrize("answer", ["ok", "error"])
def test_streaming_receive_ends_at_the_answer_when_a_chunk_never_comes(meta, pool_dir, answer) -> None:
    """Streaming PD decoder, its prompt's partial chunk never saved (a prefiller with
    discard_partial_chunks, a refused reservation): the metaserver's answer, relayed by the
    scheduler's step plan to the worker's receiver, ends the receive long before its deadline.
    ok: the full chunks the prefiller committed land and only the partial chunk is recomputed;
    error: the receive is cancelled, everything is recomputed."""
    import numpy as np

    from lw_core.plan import ObjectLayout
    from lw_vllm.metrics import Collector
    from lw_vllm.pd.stream_recv import StreamReceiver
    from lw_vllm.worker.stream_loads import StreamLoads
    from lw_vllm.worker.worker_report import WorkerReport

    timeout_s = 5.0
    side = _side(pool_dir, use_layerwise=True, pd_streaming=True, metaserver_timeout_s=timeout_s)
    rx = StreamReceiver(side.backend, _Rows(), ObjectLayout((PAGE,) * LAYERS), timeout_s)
    try:
        meta.mode, meta.bodies = "held", []
        dreq = _req(f"d-s-{answer}", 3 * BLOCK + 5, meta.url, f"par-s-{answer}")
        n, is_async = side.get_num_new_matched_tokens(dreq, 0)
        assert (n, is_async) == (3 * BLOCK + 4, True)  # the whole prompt but its last token, streamed
        blocks = [5, 6, 7, 8]
        side.update_state_after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: (blocks,)), n)
        loads = StreamLoads(rx, side.keyspace, side.tags[0], None, None, WorkerReport(), Collector())
        empty = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                                scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                      resumed_req_ids=set(), num_computed_tokens=[]))

        def step() -> list:
            loads.start(side.build_connector_meta(empty))
            return rx.take_done(idle_wait_s=0.01)

        assert step() == [] and rx.busy  # the receive started; nothing is in the pool yet
        # The prefiller commits the three full chunks, not the partial one, then answers.
        keys = side.keyspace.keys(side.tags[0], chunk_hashes(dreq.all_token_ids, BLOCK)[:3])
        hs = side.backend.reserve(keys, LAYERS * PAGE)
        for layer in range(LAYERS):
            side.backend.write(hs, [layer * PAGE] * 3, [np.full(PAGE, 10 * i + layer, np.uint8) for i in range(3)])
        side.backend.commit(hs)
        time.sleep(0.2)
        assert step() == []
        meta.mode = answer
        meta.release()
        t0 = time.monotonic()
        done: list = []
        while not done and time.monotonic() - t0 < 2 * timeout_s:
            done = step()
        took = time.monotonic() - t0
        assert took < timeout_s / 5, f"{took:.1f} s after the answer: the receive waited for its deadline"
        (d,) = done
        if answer == "ok":
            assert (d.good, d.failed_blocks) == (3, [8]), d
            assert "neither reserved nor committed" in (d.error or ""), d
            assert all((rx.copier.kv[layer][blocks[i]] == 10 * i + layer).all() for i in range(3) for layer in range(LAYERS))
        else:
            assert (d.good, d.failed_blocks) == (0, blocks), d
    finally:
        rx.close()
        side.shutdown()


def _asks_first(req: SimpleNamespace) -> SimpleNamespace:
    """``req`` as lw-proxy sends it when the decoder may continue from the prefill's token."""
    req.kv_transfer_params["lw_first_token"] = True
    req.sampling_params = SimpleNamespace(extra_args=None)
    req.num_output_tokens = 0
    return req


def test_a_request_asking_for_the_first_token_waits_for_the_answer_and_takes_it(meta, pool_dir) -> None:
    """It says ``forces_first``, is not started by the pool holding its prompt (the answer carries the
    token), and takes the answer's token when the digest names its prompt; never another prompt's."""
    from lw_core.wire import prompt_digest
    from lw_vllm.pd.first_token import FIRST_TOKEN_ARG

    side = _side(pool_dir)
    try:
        meta.mode, meta.bodies = "held", []
        req = _asks_first(_req("r-first", 3 * BLOCK, meta.url, "par-first"))
        other = _asks_first(_req("r-other", 3 * BLOCK, meta.url, "par-other"))
        other.prompt_token_ids = other.all_token_ids = [t + 1 for t in other.all_token_ids]
        for r in (req, other):
            assert side.get_num_new_matched_tokens(r, 0) == (None, False)
        _publish(side, req, 3)
        _publish(side, other, 3)
        for _ in range(5):  # the whole prompt is in the pool, yet it waits for the answer
            assert side.get_num_new_matched_tokens(req, 0) == (None, False)
            time.sleep(0.002)
        assert {b["request_id"]: b["forces_first"] for b in meta.bodies} == {"r-first": True, "r-other": True}
        meta.answer = {"status": "ok", "first_token": 77, "prompt_digest": prompt_digest(req.prompt_token_ids)}
        meta.release()
        assert _ask(side, req)[0] == 3 * BLOCK - 1
        assert req.sampling_params.extra_args == {FIRST_TOKEN_ARG: 77}
        assert _ask(side, other)[0] == 3 * BLOCK - 1  # loads, but the token followed another prompt
        assert other.sampling_params.extra_args is None
    finally:
        meta.answer = {"status": "ok"}
        side.shutdown()


def test_a_streaming_request_asking_for_the_first_token_is_reported_only_with_it(meta, pool_dir) -> None:
    """Streaming PD: the prompt lands before the metaserver's answer, yet the receive is not
    reported (vLLM would schedule the request without the token) until the answer carrying the
    token was passed on; by then the request carries it. A streaming request that does not ask
    for the token is reported as soon as its prompt landed."""
    import numpy as np

    from lw_core.plan import ObjectLayout
    from lw_core.wire import prompt_digest
    from lw_vllm.metrics import Collector
    from lw_vllm.pd.first_token import FIRST_TOKEN_ARG
    from lw_vllm.pd.stream_recv import StreamReceiver
    from lw_vllm.worker.stream_loads import StreamLoads
    from lw_vllm.worker.worker_report import WorkerReport

    side = _side(pool_dir, use_layerwise=True, pd_streaming=True, metaserver_timeout_s=5.0)
    rx = StreamReceiver(side.backend, _Rows(), ObjectLayout((PAGE,) * LAYERS), 5.0)
    try:
        meta.mode, meta.bodies = "held", []
        first = _asks_first(_req("d-first", 3 * BLOCK, meta.url, "par-sf"))
        plain = _req("d-plain", 3 * BLOCK, meta.url, "par-sp")
        plain.prompt_token_ids = plain.all_token_ids = [t + 1 for t in plain.all_token_ids]
        loads = StreamLoads(rx, side.keyspace, side.tags[0], None, None, WorkerReport(), Collector())
        empty = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                                scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                      resumed_req_ids=set(), num_computed_tokens=[]))
        for req, blocks in ((first, [5, 6, 7]), (plain, [9, 10, 11])):
            assert side.get_num_new_matched_tokens(req, 0) == (3 * BLOCK - 1, True)
            side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda b=blocks: (b,)), 3 * BLOCK - 1)
        plan = side.build_connector_meta(empty)
        assert sorted((x.req_id, x.holds) for x in plan.stream_loads) == [("d-first", True), ("d-plain", False)]
        loads.start(plan)
        for req in (first, plain):  # the prefiller commits every chunk, then is slow to answer
            keys = side.keyspace.keys(side.tags[0], chunk_hashes(req.all_token_ids, BLOCK))
            hs = side.backend.reserve(keys, LAYERS * PAGE)
            for layer in range(LAYERS):
                side.backend.write(hs, [layer * PAGE] * 3, [np.full(PAGE, layer + 1, np.uint8)] * 3)
            side.backend.commit(hs)

        def step() -> list:
            loads.start(side.build_connector_meta(empty))
            return [d.req_id for d in rx.take_done(idle_wait_s=0.01)]

        done: list = []
        t0 = time.monotonic()
        while not done and time.monotonic() - t0 < 5:
            done = step()
        assert done == ["d-plain"]
        for _ in range(20):  # landed, held for the answer
            assert step() == []
        assert {b["request_id"]: b.get("forces_first") for b in meta.bodies} == {"d-first": True, "d-plain": None}
        assert first.sampling_params.extra_args is None
        meta.mode, meta.answer = "ok", {"status": "ok", "first_token": 77,
                                         "prompt_digest": prompt_digest(first.prompt_token_ids)}
        meta.release()
        t0, done = time.monotonic(), []
        while not done and time.monotonic() - t0 < 5:
            done = step()
        assert done == ["d-first"] and time.monotonic() - t0 < 2.0
        assert first.sampling_params.extra_args == {FIRST_TOKEN_ARG: 77}
        assert all((rx.copier.kv[layer][b] == layer + 1).all() for b in (5, 6, 7) for layer in range(LAYERS))
    finally:
        meta.answer = {"status": "ok"}
        rx.close()
        side.shutdown()
