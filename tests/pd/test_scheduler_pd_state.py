"""A recurrent-state model's (gated delta-net) decoder scheduler part without an engine, over a real
embedded pool and the metaserver stand-in (``meta``, tests/pd/conftest.py), non-streaming PD:

* a hit ends at the last boundary before the prompt's last token, also for a prompt that ends on a
  block while the pool holds the state after its last token (saved for a longer prompt with the
  same prefix, or retained): loading that state would run the last token through the recurrent
  layers twice, since vLLM is told the prompt less one token is computed;
* the decoder says ``needs_prefill: false`` (and does not wait) only when the pool holds what its
  hit can load, that boundary's state included; chunks without the state are no hit, and a prefill
  that committed its chunks is not "seen in the pool" before its state is;
* a plain request on a kv_both engine hits up to the same boundary;
* boundary-state lookups go through the scheduler's deadlined lookup: a store that stalls on state
  keys costs ``lookup_timeout_s`` (a miss), then lookups pause.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from test_pd_streaming_state import BLOCK, _gdn_side  # noqa: E402
from test_scheduler_pd import _req  # noqa: E402

from lw_vllm.request.request_state import RemotePhase  # noqa: E402
from lw_vllm.scheduler import pool_lookup  # noqa: E402
from lw_vllm.scheduler.scheduler_side import SchedulerSide  # noqa: E402


def _commit(side: SchedulerSide, keys: list[str]) -> None:
    handles = side.backend.reserve(keys, 64)
    assert all(h is not None for h in handles)
    side.backend.commit(handles)


def _prompt_hashes(side: SchedulerSide, req: Any) -> list[bytes]:
    return side.pd.prompt_hashes(side._state(req))


def _publish(side: SchedulerSide, req: Any, chunks: int, states: tuple[int, ...]) -> list[bytes]:
    """A prefiller's objects of ``req``'s prompt: its first ``chunks`` chunks (the partial one
    counts) and the states at the boundaries ``states``."""
    assert side.states is not None
    hashes = _prompt_hashes(side, req)
    if chunks:
        _commit(side, side.keyspace.keys(side.tags[0], hashes[:chunks]))
    if states:
        _commit(side, [side.states.keyspace.key(side.tags[0], hashes[j - 1]) for j in states])
    return hashes


def _posted(meta: Any, rid: str) -> dict:
    deadline = time.monotonic() + 5
    while True:
        got = [b for b in meta.bodies if b["request_id"] == rid]
        if got:
            return got[0]
        assert time.monotonic() < deadline, f"{rid}: the POST never arrived"
        time.sleep(0.01)


def test_exact_block_prompt_never_loads_the_state_after_its_last_token(meta, pool_dir) -> None:
    side, _ = _gdn_side(pool_dir, 5.0, streaming=False)
    try:
        meta.mode = "silent"
        req = _req("d-exact", 3 * BLOCK, meta.url, "par-exact")
        _publish(side, req, 3, states=(2, 3))  # the state at 48 tokens too: a longer prompt's
        assert side.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, True)  # 32, not 47 from the state at 48
        assert side.reqs["d-exact"].remote.phase is RemotePhase.POOL_HOLDS_PROMPT
        assert _posted(meta, "d-exact")["needs_prefill"] is False
    finally:
        side.shutdown()


@pytest.mark.parametrize("states", [(), (3,)], ids=["no-state", "state-after-the-last-token"])
def test_chunks_without_the_state_the_hit_needs_are_not_held(meta, pool_dir, states) -> None:
    side, _ = _gdn_side(pool_dir, 5.0, streaming=False)
    rid = f"d-nostate-{len(states)}"
    try:
        meta.mode = "held"
        req = _req(rid, 3 * BLOCK, meta.url, f"par-{rid}")
        _publish(side, req, 3, states)  # every chunk, but no state at 32
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # it waits for the prefill
        assert _posted(meta, rid)["needs_prefill"] is True
        assert side.reqs[rid].remote.phase is RemotePhase.WAITING
        _publish(side, req, 0, states=(2,))  # the prefiller computes and saves the state at 32
        meta.release()
        deadline = time.monotonic() + 5
        while (got := side.get_num_new_matched_tokens(req, 0)) == (None, False):
            assert time.monotonic() < deadline, "still waiting"
            time.sleep(0.005)
        assert got == (2 * BLOCK, True)
    finally:
        side.shutdown()


def test_a_prefill_is_seen_in_the_pool_only_once_its_state_is(meta, pool_dir) -> None:
    side, _ = _gdn_side(pool_dir, 5.0, streaming=False)
    try:
        meta.mode = "silent"  # no answer: only the pool says the prefill is there
        req = _req("d-seen", 3 * BLOCK + 5, meta.url, "par-seen")
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        assert _posted(meta, "d-seen")["needs_prefill"] is True
        _publish(side, req, 4, states=())  # every chunk, the partial one too; the state not yet
        t_end = time.monotonic() + 0.2
        while time.monotonic() < t_end:
            assert side.get_num_new_matched_tokens(req, 0) == (None, False)
            time.sleep(0.005)
        _publish(side, req, 0, states=(3,))
        deadline = time.monotonic() + 5
        while (got := side.get_num_new_matched_tokens(req, 0)) == (None, False):
            assert time.monotonic() < deadline, "the state in the pool was not seen"
            time.sleep(0.005)
        assert got == (3 * BLOCK, True)
    finally:
        side.shutdown()


def test_a_one_block_prompt_has_nothing_to_wait_for(meta, pool_dir) -> None:
    """No boundary before its last token: no state to restore, so no prefill is needed."""
    side, _ = _gdn_side(pool_dir, 5.0, streaming=False)
    try:
        meta.mode = "silent"
        req = _req("d-one", BLOCK, meta.url, "par-one")
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        assert side.reqs["d-one"].remote.phase is RemotePhase.NOTHING_TO_LOAD
        assert _posted(meta, "d-one")["needs_prefill"] is False
    finally:
        side.shutdown()


def test_kv_both_plain_request_hits_up_to_the_boundary_before_its_last_token(pool_dir) -> None:
    side, _ = _gdn_side(pool_dir, 5.0, streaming=False, role="kv_both")
    try:
        req = _req("both", 3 * BLOCK, None)
        _publish(side, req, 3, states=(3,))
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # the state at 48 is past its last token
        req2 = _req("both2", 3 * BLOCK, None)
        _publish(side, req2, 0, states=(2,))
        assert side.get_num_new_matched_tokens(req2, 0) == (2 * BLOCK, True)
    finally:
        side.shutdown()


def test_a_store_stalling_on_state_keys_costs_the_lookup_deadline_then_lookups_pause(
        pool_dir, monkeypatch) -> None:
    backoff_s = 1.0
    monkeypatch.setattr(pool_lookup, "LOOKUP_BACKOFF_S", backoff_s)
    deadline_s = 0.3
    side, _ = _gdn_side(pool_dir, 5.0, streaming=False, role="kv_both", lookup_timeout_s=deadline_s)
    release = threading.Event()
    try:
        assert side.states is not None
        mark = f"/{side.states.keyspace.layout_fp}/"
        inner = side.backend.lookup

        def lookup(keys: list[str]) -> int:  # the attention chunks answer, the states stall
            if any(mark in k for k in keys):
                release.wait(5.0)
            return inner(keys)

        reqs = [_req(f"s{i}", 3 * BLOCK + 5, None) for i in range(3)]
        _publish(side, reqs[0], 3, states=(3,))
        monkeypatch.setattr(side.backend, "lookup", lookup)
        t = time.perf_counter()
        assert side.get_num_new_matched_tokens(reqs[1], 0) == (0, False)  # a miss, not a wait for the store
        assert time.perf_counter() - t < deadline_s + 2.0
        stats = side.metrics.take()
        assert stats is not None and stats.data["lookup_errors"] == 1
        t = time.perf_counter()
        assert side.get_num_new_matched_tokens(reqs[2], 0) == (0, False)  # paused: no second deadline
        assert time.perf_counter() - t < 0.2
        release.set()
        time.sleep(backoff_s)
        assert side.get_num_new_matched_tokens(_req("s3", 3 * BLOCK + 5, None), 0) == (3 * BLOCK, True)
    finally:
        release.set()
        side.shutdown()
