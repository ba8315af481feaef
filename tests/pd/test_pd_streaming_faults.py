"""Streaming PD (``pd_streaming``) under faults, on real vLLM (CPU), tiny GQA model, embedded pool,
prefiller + decoder + lw-proxy, one stack for the module: the prefiller stalled (SIGSTOP) past the
receive's deadline, the pool directory wiped mid-stream, and (last: nothing restarts it) the
prefiller SIGKILLed mid-prefill. Each time the decoder's request completes with the single
engine's greedy output (what did not land is recomputed) within ``metaserver_timeout_s`` plus
slack, and the stack (after the kill: the decoder alone) goes on answering correctly.

"Mid-prefill" is observed, not guessed: the prefiller is frozen the moment the pool shows a
reservation of the prompt (pd_faults_flow.freeze_mid_prefill), before any fault is injected.
"""

from __future__ import annotations

import random
import shutil
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pd_faults_flow import Call, connector_extra, freeze_mid_prefill, kill, signal_group, watcher

from lw_bench.pd.stack import Stack, post_json
from lw_core.backends.embedded import EmbeddedBackend
from lw_core.backends.embedded.records import POOL_CHECK_S
from lw_dev.pd_flow import baseline, settle, through
from lw_dev.pd_oracle import SAMPLING, assert_same, completion_choice

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 8
TIMEOUT_S = 10.0  # metaserver_timeout_s: the streaming receive's deadline
SLACK_S = 20.0  # a loaded 2-core host: the recompute itself, the proxy, scheduling
PROMPT_TOKENS = 960  # the longest prompt the stack's max_model_len (1024) takes with MAX_TOKENS: 30 chunks
TRIES = 5  # prompts tried to catch the prefiller between reserving and committing


@pytest.fixture(scope="module")
def stack(gqa_stream_stack: Stack) -> Stack:
    """conftest's, the one test_pd_streaming used when both run (this module kills its prefiller)."""
    assert gqa_stream_stack.metaserver_timeout_s == TIMEOUT_S
    return gqa_stream_stack


@pytest.fixture
def pool(stack: Stack) -> Iterator[EmbeddedBackend]:
    w = watcher(stack.prefill)
    yield w
    w.close()


def _completion(seed: int) -> dict[str, Any]:
    r = random.Random(seed)
    prompt = [r.randrange(10, 500) for _ in range(PROMPT_TOKENS)]
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 2, **SAMPLING}


def _decoder_record(stack: Stack, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not (recs := stack.decode.new_stats()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(recs) == 1, recs
    return recs[0]


def _mid_prefill(stack: Stack, pool: EmbeddedBackend, seed: int) -> tuple[dict[str, Any], Any, Call]:
    """Send a long prompt through the proxy and freeze the prefiller while its chunks are reserved,
    not committed. Returns the body, the single engine's answer and the call (still running)."""
    for i in range(TRIES):
        body = _completion(seed + i)
        ref = completion_choice(baseline(stack, "/v1/completions", body)["choices"][0])
        settle(stack)
        stack.decode.mark()
        call = Call(stack.proxy.url + "/v1/completions", body, timeout_s=TIMEOUT_S + 2 * SLACK_S)
        if freeze_mid_prefill(stack.prefill, pool, call.done, timeout_s=30):
            return body, ref, call
        call.join(TIMEOUT_S + 2 * SLACK_S)  # the prefill ended first: try a new prompt
    pytest.fail(f"the prefiller was never caught between reserving and committing a prompt in {TRIES} tries")


def _recomputed(stack: Stack, ref: Any, call: Call, what: str) -> dict[str, Any]:
    """The call answered the single engine's output within the deadline plus slack, and the
    decoder took the streaming receive; its record."""
    status, out = call.join(TIMEOUT_S + 2 * SLACK_S)
    assert status == 200, out
    assert_same(ref, completion_choice(out["choices"][0]), what)
    assert call.took < TIMEOUT_S + SLACK_S, f"{what}: answered after {call.took:.1f} s"
    rec = _decoder_record(stack)
    assert rec["remote_prefill"] == "streaming", rec
    return rec


def _still_streams(stack: Stack, seed: int, what: str) -> dict[str, Any]:
    """A new prompt through the proxy: the single engine's output, every chunk loaded."""
    body = _completion(seed)
    ref = completion_choice(baseline(stack, "/v1/completions", body)["choices"][0])
    ex = through(stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    assert_same(ref, completion_choice(ex.out["choices"][0]), what)
    (rec,) = ex.decode_stats
    n = rec["prompt_tokens"]
    assert rec["remote_prefill"] in ("streaming", "pool holds the prompt"), rec
    assert rec["loaded_tokens"] == n - 1 and rec["failed_blocks"] == 0, rec
    return rec


def test_prefiller_stalled_past_the_deadline_is_recomputed_then_resumes(stack: Stack, pool: EmbeddedBackend) -> None:
    """SIGSTOP of the prefiller mid-prefill, held past the receive's deadline: its reservations
    stay open (the writer is alive), the decoder gives up at ``metaserver_timeout_s`` and
    recomputes. After SIGCONT the prefiller finishes and the stack streams a new prompt."""
    _, ref, call = _mid_prefill(stack, pool, 200)
    try:
        status, out = call.join(TIMEOUT_S + 2 * SLACK_S)  # while the prefiller stays stopped
    finally:
        signal_group(stack.prefill, signal.SIGCONT)
    assert status == 200, out
    rec = _recomputed(stack, ref, call, "prefiller stalled")
    assert call.took >= TIMEOUT_S * 0.9, f"answered after {call.took:.1f} s, before the {TIMEOUT_S} s deadline"
    assert rec["failed_blocks"] > 0 and rec["loaded_tokens"] < rec["prompt_tokens"] - 1, rec
    assert stack.prefill.proc.alive()
    _still_streams(stack, 250, "after the stall")


def test_pool_wiped_mid_stream_is_recomputed_or_loaded_and_the_stack_goes_on(stack: Stack,
                                                                           pool: EmbeddedBackend) -> None:
    """The pool directory is deleted (and a new empty pool made at its path) while the prefiller
    holds the prompt's reservations and the decoder waits on them. Whichever way the engines notice
    (a re-attach fails the old handles; a stream on the still-mapped old files ends normally), the
    answer is the single engine's, in time; afterwards both engines use the new pool."""
    path = connector_extra(stack.prefill)["embedded_path"]
    cap = connector_extra(stack.prefill)["embedded_capacity_bytes"]
    _, ref, call = _mid_prefill(stack, pool, 300)
    fresh = None
    try:
        pool.close()
        shutil.rmtree(path)
        fresh = EmbeddedBackend(path, capacity_bytes=cap)  # a new, empty pool at the same path
        time.sleep(POOL_CHECK_S + 0.2)  # the engines' next pool check is due
    finally:
        signal_group(stack.prefill, signal.SIGCONT)
    try:
        rec = _recomputed(stack, ref, call, "pool wiped")
        assert rec["loaded_tokens"] + rec["failed_blocks"] * stack.block_size >= rec["prompt_tokens"] - 1, rec
        _still_streams(stack, 350, "after the wipe")
        assert fresh.stats()["objects"] > 0, "the engines did not move to the new pool"
    finally:
        if fresh is not None:
            fresh.close()


def test_prefiller_killed_mid_prefill_is_recomputed(stack: Stack, pool: EmbeddedBackend) -> None:
    """SIGKILL of the prefiller's process group while it holds the prompt's reservations: its
    reservations are abandoned (dead writer) and the proxy's prefill fails; the decoder recomputes
    what did not land and answers the single engine's output within the deadline plus slack, and
    goes on answering with no prefiller at all. Kept LAST in this module: it kills the prefiller
    (starting it again costs another engine start-up, 60-170 s here)."""
    _, ref, call = _mid_prefill(stack, pool, 100)
    t_kill = time.monotonic()
    try:
        kill(stack.prefill)
    finally:
        signal_group(stack.prefill, signal.SIGCONT)  # no-op once dead; never leave it stopped
    rec = _recomputed(stack, ref, call, "prefiller killed")
    n = rec["prompt_tokens"]
    assert rec["failed_blocks"] > 0 and rec["loaded_tokens"] < n - 1, rec  # not loaded whole: recomputed
    assert time.monotonic() - t_kill < TIMEOUT_S + SLACK_S
    body = _completion(150)
    ref = completion_choice(baseline(stack, "/v1/completions", body)["choices"][0])
    stack.decode.mark()
    t0 = time.monotonic()
    status, out = post_json(stack.proxy.url + "/v1/completions", body, timeout=TIMEOUT_S + 2 * SLACK_S)
    assert status == 200, out
    assert_same(ref, completion_choice(out["choices"][0]), "no prefiller after the kill")
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
    rec = _decoder_record(stack)
    assert rec["loaded_tokens"] == 0, rec
