"""A decoder whose pool cannot see what the prefiller saved (each host on its own embedded pool, or
another model identity): the metaserver's "committed" then finds nothing. Not a silent miss: it is
counted in ``pd_prefill_not_in_pool`` (vllm:lw_pool_pd_prefill_not_in_pool_total) and logged,
at most once a minute, with the likely causes. Scheduler side only, no engine."""

from __future__ import annotations

import logging
import shutil

import pytest
from test_scheduler_pd import BLOCK, _ask, _publish, _req, _side

from lw_vllm.metrics import COUNTERS
from lw_vllm.pd import pd_coordinator

WARN = "holds none of"


def _decoder(path: str, **extra):
    return _side(path, **extra)  # its own Collector: SchedulerSide's metrics


def _count(side) -> int:
    st = side.metrics.take()
    return 0 if st is None else st.data["pd_prefill_not_in_pool"]


def test_committed_but_in_another_pool_is_counted_and_logged_once(meta, pool_dir, caplog,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    prefiller = _side(pool_dir)  # host A's pool
    decoder = _decoder(pool_dir + "-host-b")  # host B's own embedded pool
    clock = [1000.0]
    monkeypatch.setattr(pd_coordinator.time, "monotonic", lambda: clock[0])
    try:
        meta.mode = "ok"
        caplog.set_level(logging.WARNING, logger="lw_vllm.pd.pd_coordinator")
        for i in range(3):  # the same prompt each time (its chunks are committed once)
            req = _req(f"r-far-{i}", 3 * BLOCK + 4, meta.url, f"par-far-{i}")
            if i == 0:
                _publish(prefiller, req, 3)  # committed on host A before the metaserver's 200
            n, _ = _ask(decoder, req)
            assert n == 0 and decoder.reqs[req.request_id].remote.answered_ok
        assert _count(decoder) == 3
        warned = [r.getMessage() for r in caplog.records if WARN in r.getMessage()]
        assert len(warned) == 1, warned
        for cause in ("another pool", "model identity", "block size", "lw_pool_pd_prefill_not_in_pool_total"):
            assert cause in warned[0]
        assert "r-far-0" in warned[0] and decoder.keyspace.model_fp in warned[0]

        clock[0] += pd_coordinator.NOT_IN_POOL_LOG_S + 1  # a minute later: logged again, with the count
        req = _req("r-far-late", 2 * BLOCK, meta.url, "par-far-late")  # its chunks are on host A already
        assert _ask(decoder, req)[0] == 0
        warned = [r.getMessage() for r in caplog.records if WARN in r.getMessage()]
        assert len(warned) == 2 and "(2 more since the last message)" in warned[1]
        assert _count(decoder) == 1
    finally:
        decoder.shutdown()
        prefiller.shutdown()
        shutil.rmtree(pool_dir + "-host-b", ignore_errors=True)


def test_another_model_identity_on_the_same_pool_is_counted(meta, pool_dir) -> None:
    prefiller = _side(pool_dir, model_id="model-a")
    decoder = _decoder(pool_dir, model_id="model-b")
    try:
        meta.mode = "ok"
        req = _req("r-id", 2 * BLOCK + 1, meta.url, "par-id")
        _publish(prefiller, req, 2)
        assert _ask(decoder, req)[0] == 0
        assert _count(decoder) == 1
    finally:
        decoder.shutdown()
        prefiller.shutdown()


def test_visible_prefill_or_a_failed_one_is_not_counted(meta, pool_dir, caplog) -> None:
    decoder = _decoder(pool_dir)
    try:
        meta.mode = "ok"
        req = _req("r-near", 3 * BLOCK + 2, meta.url, "par-near")
        _publish(decoder, req, 3)  # same pool, same keys: some of it is there
        assert _ask(decoder, req)[0] == 3 * BLOCK
        meta.mode = "error"  # the prefill failed: nothing was promised, nothing to count
        err = _req("r-err", 3 * BLOCK, meta.url, "par-err")
        err.all_token_ids = err.prompt_token_ids = list(range(1000, 1000 + 3 * BLOCK))  # not in the pool
        assert _ask(decoder, err)[0] == 0 and not decoder.reqs["r-err"].remote.answered_ok
        assert _count(decoder) == 0
        assert not [r for r in caplog.records if WARN in r.getMessage()]
    finally:
        decoder.shutdown()


def test_the_counter_reaches_vllm_metrics() -> None:
    assert COUNTERS["pd_prefill_not_in_pool"][0] == "vllm:lw_pool_pd_prefill_not_in_pool_total"


def test_a_continued_prefill_not_in_this_pool_is_counted(meta, pool_dir) -> None:
    """``lw_prefilled``: the proxy continues a prefill that answered, so its chunks were committed;
    a decoder whose pool holds none of them says so, as for a metaserver's "committed"."""
    prefiller = _side(pool_dir)
    decoder = _decoder(pool_dir + "-host-b")
    try:
        req = _req("r-cont", 3 * BLOCK + 4, meta.url, "par-cont")
        _publish(prefiller, req, 3)  # committed on host A
        req.all_token_ids = req.prompt_token_ids = [*req.prompt_token_ids, 7]  # plus the prefill's first token
        req.kv_transfer_params["lw_prefilled"] = 1
        assert decoder.get_num_new_matched_tokens(req, 0) == (0, False)
        assert _count(decoder) == 1
    finally:
        decoder.shutdown()
        prefiller.shutdown()
        shutil.rmtree(pool_dir + "-host-b", ignore_errors=True)
