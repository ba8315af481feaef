"""Prefill and decode at different tensor-parallel sizes, scheduler side, no engine.

* GQA sizes that both divide the kv heads (P2 -> D1, P1 -> D2): the decoder finds the prefill
  under the prefiller's key space (every saver rank's object), promises it, and its load plan
  names the saver's TP size (``Xfer.src_tp``) so each worker reads its heads by ranges.
* MLA: keys carry no TP size, so a decoder at another size hits the same objects as its own.
* Sizes that cannot be matched (2 kv heads at TP 4, replicated, against TP 1), or a saver rank's
  object missing: the prompt is computed here, and an error naming both sizes is logged for every
  such request and counted; never a silent miss.

The engine runs (greedy output equal to a single engine) are ``tests/tp/test_tp_cross.py``."""

from __future__ import annotations

import logging
import shutil
from types import SimpleNamespace

import pytest
from test_scheduler_pd import BLOCK, LAYERS, PAGE, _ask, _req, _step

from lw_core.config import parse_config
from lw_core.keys import chunk_hashes
from lw_vllm import pool
from lw_vllm.metrics import Collector
from lw_vllm.scheduler.scheduler_side import SchedulerSide

KV_HEADS = 2


def _side(path: str, tp: int, mla: bool = False, role: str = "kv_consumer", kv_heads: int = KV_HEADS) -> SchedulerSide:
    # A GQA rank holds kv_heads / tp heads (one, replicated, when tp exceeds them): its pages scale
    # with that. MLA's do not.
    page = PAGE if mla else PAGE // kv_heads * max(1, kv_heads // tp)
    spec = SimpleNamespace(block_size=BLOCK, page_size_bytes=page)
    kc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(LAYERS)])])
    vc = SimpleNamespace(
        model_config=SimpleNamespace(model="tiny-test", dtype="float32", use_mla=mla, hf_config=SimpleNamespace(),
                                     get_total_num_kv_heads=lambda: 1 if mla else kv_heads),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        scheduler_config=SimpleNamespace(async_scheduling=False),
    )
    cfg = parse_config({"embedded_path": path, "embedded_capacity_bytes": 4 << 20, "metaserver_timeout_s": 2.0})
    return SchedulerSide(vc, kc, cfg, role, Collector())


def _publish_all_ranks(side: SchedulerSide, req, n_chunks: int, skip_tags: tuple[str, ...] = ()) -> None:
    hashes = chunk_hashes(req.all_token_ids, BLOCK)[:n_chunks]
    for tag in side.tags:
        if tag in skip_tags:
            continue
        handles = side.backend.reserve(side.keyspace.keys(tag, hashes), LAYERS * PAGE)
        assert all(h is not None for h in handles)
        side.backend.commit(handles)


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and r.name.startswith("lw_vllm")]


@pytest.mark.parametrize("p_tp,d_tp,mla", [(2, 1, False), (1, 2, False), (2, 1, True), (1, 2, True)],
                         ids=["gqa-P2-D1", "gqa-P1-D2", "mla-P2-D1", "mla-P1-D2"])
def test_decoder_loads_a_prefill_saved_at_another_tp(meta, pool_dir, caplog, p_tp, d_tp, mla) -> None:
    prefiller = _side(pool_dir, p_tp, mla, role="kv_producer")
    decoder = _side(pool_dir, d_tp, mla)
    try:
        meta.mode = "ok"
        caplog.set_level(logging.WARNING)
        req = _req("r-tp", 3 * BLOCK + 2, meta.url, "par-tp")
        _publish_all_ranks(prefiller, req, 3)
        assert _ask(decoder, req)[0] == 3 * BLOCK  # every full chunk (no partial one was saved here)
        decoder.update_state_after_alloc(req, None, 3 * BLOCK)
        plan = decoder.build_connector_meta(_step("r-tp", [4, 5, 6, 7], 2))
        (ld,) = plan.loads
        assert ld.block_ids == [4, 5, 6] and ld.hashes == chunk_hashes(req.all_token_ids, BLOCK)[:3]
        # GQA: the workers read the saver's objects by head ranges; MLA: the same keys at every size.
        assert ld.src_tp == (0 if mla else p_tp)
        assert _errors(caplog) == []
        st = decoder.metrics.take()
        assert st is None or st.data["pd_prefill_not_in_pool"] == 0
    finally:
        decoder.shutdown()
        prefiller.shutdown()


def test_a_saver_rank_object_missing_is_computed_and_named(meta, pool_dir, caplog) -> None:
    prefiller = _side(pool_dir, 2, role="kv_producer")
    decoder = _side(pool_dir, 1)
    try:
        meta.mode = "ok"
        caplog.set_level(logging.WARNING)
        req = _req("r-half", 3 * BLOCK + 2, meta.url, "par-half")
        _publish_all_ranks(prefiller, req, 3, skip_tags=(prefiller.tags[1],))  # rank 1's saves failed
        assert _ask(decoder, req)[0] == 0
        (err,) = _errors(caplog)
        assert "tensor_parallel_size=2" in err and "tensor_parallel_size=1" in err and "r-half" in err
        assert "not every saver rank's object" in err
        assert decoder.metrics.take().data["pd_prefill_not_in_pool"] == 1
    finally:
        decoder.shutdown()
        prefiller.shutdown()


def test_sizes_that_cannot_share_are_named_for_every_request(meta, pool_dir, caplog) -> None:
    # 2 kv heads at TP 4: vLLM replicates them (one per rank), so no byte range maps them to TP 1.
    prefiller = _side(pool_dir, 4, role="kv_producer")
    decoder = _side(pool_dir, 1)
    try:
        assert 4 not in decoder.readable_tp and 2 in decoder.readable_tp
        meta.mode = "ok"
        caplog.set_level(logging.WARNING)
        for i in range(2):
            req = _req(f"r-tp-{i}", 3 * BLOCK + 2, meta.url, f"par-tp-{i}")
            if i == 0:
                _publish_all_ranks(prefiller, req, 3)
            assert _ask(decoder, req)[0] == 0  # computed here
        errors = _errors(caplog)
        assert len(errors) == 2, errors  # every such request, not once a minute
        assert "tensor_parallel_size=4" in errors[0] and "tensor_parallel_size=1" in errors[0]
        assert "r-tp-0" in errors[0] and "cannot share KV" in errors[0]
        assert decoder.metrics.take().data["pd_prefill_not_in_pool"] == 2
    finally:
        decoder.shutdown()
        prefiller.shutdown()


def test_key_space_at_another_tp_is_that_engines_key_space(pool_dir) -> None:
    d1, d2 = _side(pool_dir, 1), _side(pool_dir + "x", 2)
    m1, m2 = _side(pool_dir + "m1", 1, mla=True), _side(pool_dir + "m2", 2, mla=True)
    try:
        assert d1.other_tp[2][0] == d2.keyspace and d1.other_tp[2][1] == d2.tags
        assert d2.other_tp[1][0] == d1.keyspace and d1.keyspace != d2.keyspace
        assert m1.keyspace == m2.keyspace and m1.tags == m2.tags and m1.other_tp == {} and m1.readable_tp == []
    finally:
        for s in (d1, d2, m1, m2):
            s.shutdown()
        for suffix in ("x", "m1", "m2"):  # the fixture removes pool_dir only
            shutil.rmtree(pool_dir + suffix, ignore_errors=True)


def test_indivisible_heads_say_they_cannot_work() -> None:
    vc = SimpleNamespace(model_config=SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 6),
                         parallel_config=SimpleNamespace(tensor_parallel_size=4))
    msg = pool.tp_mismatch(vc, 1)
    assert "tensor_parallel_size=1" in msg and "tensor_parallel_size=4" in msg and "cannot share" in msg
    assert pool.readable_tp_sizes(vc, (1, 2, 3, 6)) == []  # 4 does not divide 6: nothing is readable
    vc.parallel_config.tensor_parallel_size = 2
    assert pool.readable_tp_sizes(vc, (1, 2, 3, 4, 6)) == [1, 3, 6]  # 6 heads: 3 per rank at 2, 2 at 3
