"""Streaming PD (``pd_streaming``) with the tiny gated delta-net hybrid (Qwen3-Next style: layers 0
and 2 linear attention, 1 and 3 full attention; bf16, prefix caching on so vLLM keeps block-aligned
states, block 256 asked for; block and state dtype as the engines report them) on real vLLM (CPU):
the decoder parks first and pulls the full-attention layers' chunks while the prefill runs, then
the recurrent state at the hand-off boundary, which the prefiller saves after its forward
(stream_recv's tail).

What the decoder loads is what non-streaming GDN PD loads (tests/pd/test_pd_gdn.py): vLLM hands the
prefiller a state only at the prompt's last full boundary before its last token
(``(n - 1) // block * block``), so the streamed hit ends there and the decoder computes the rest (less
than a block, or a block when the prompt ends on one). A prefill that never comes ends the receive
at its deadline and vLLM recomputes the request whole (a hybrid's failed receive)."""

from __future__ import annotations

import time

import pytest

from lw_bench.models import GDN_SPEC
from lw_bench.pd.stack import Stack, free_port, post_json
from lw_dev.fake_metaserver import FakeMetaserver
from lw_dev.harness import assert_same_greedy
from lw_dev.pd_flow import baseline, text, through
from lw_dev.pd_oracle import SAMPLING, by_index, completion_choice
from lw_dev.pd_streaming_flow import STREAM_TIMEOUT_S, decoder_first
from lw_dev.state_sizes import gdn_state_nbytes, ssm_dtype

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 8


def _body(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 2, **SAMPLING}


def _state_nbytes(stack: Stack) -> int:
    """One state object's bytes, in the dtype the decoder stores states in on this CPU."""
    engine = stack.decode.engine()
    state = gdn_state_nbytes(ssm_dtype=ssm_dtype(engine))
    assert engine["state_bytes"] == state, engine
    return state


def _ref(stack: Stack, body: dict) -> dict:
    # Under another cache_salt: the decoder's own prefix cache must not serve the PD run.
    return completion_choice(baseline(stack, "/v1/completions", {**body, "cache_salt": "single-engine"})["choices"][0])


@pytest.mark.parametrize("seed, words", [(71, 420), (72, 300)])
def test_streamed_prompt_matches_single_engine_and_loads_up_to_the_last_state(
        gdn_stream_stack: Stack, seed: int, words: int) -> None:
    stack = gdn_stream_stack
    bs = stack.block_size  # the engines' (their engine record)
    body = _body(text(seed, words))
    ref = _ref(stack, body)
    status, out, took = decoder_first(stack, body, f"parent-gdn-stream-{seed}")
    assert status == 200, out
    # A restored state gives the single engine's log-probs to 1e-4 (a lost one moves them by a few
    # 1e-3: test_pd_gdn); both engines split the prompt at the same block boundary.
    assert_same_greedy(ref, completion_choice(out["choices"][0]), lp_tol=1e-4)
    assert took < STREAM_TIMEOUT_S, f"{took:.1f} s: the decoder waited for its deadline instead of streaming"
    (rec,) = stack.decode.new_stats()
    n = rec["prompt_tokens"]
    hit = (n - 1) // bs * bs  # the last state vLLM handed the prefiller, as non-streaming PD loads
    assert n > bs and hit > 0, rec
    assert rec["remote_prefill"] == "streaming", rec
    assert rec["promised_tokens"] == rec["loaded_tokens"] == hit and rec["failed_blocks"] == 0, rec
    # The two full-attention layers' chunks (K and V, 2 kv heads of 64, bf16), then the state object.
    page = 2 * GDN_SPEC["num_key_value_heads"] * GDN_SPEC["head_dim"] * 2 * bs
    assert rec["loaded_bytes"] == 2 * (hit // bs) * page + _state_nbytes(stack), rec
    t = rec["t"]  # the receive ended with the prefill, not at its deadline
    assert t["load_done"] - t["stream_sent"] < STREAM_TIMEOUT_S / 2, t


def test_a_prefill_that_never_comes_is_recomputed_whole(gdn_stream_stack: Stack) -> None:
    stack = gdn_stream_stack
    fake = FakeMetaserver()
    fake.mode = "silent"
    try:
        body = _body(text(73, 420))
        ref = _ref(stack, body)
        params = {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": fake.url,
                  "lw_parent_id": "parent-gdn-stalled", "lw_children": 1}
        stack.decode.mark()
        t0 = time.monotonic()
        status, out = post_json(stack.decode.url + "/v1/completions", {**body, "kv_transfer_params": params})
        took = time.monotonic() - t0
    finally:
        fake.close()
    assert status == 200, out
    # Recomputed from scratch: the single engine's tokens (log-probs to the oracle's tolerance).
    assert_same_greedy(ref, completion_choice(out["choices"][0]))
    assert STREAM_TIMEOUT_S <= took < STREAM_TIMEOUT_S + 30, f"answered after {took:.1f} s; receive deadline {STREAM_TIMEOUT_S} s"
    (rec,) = stack.decode.new_stats()
    assert rec["remote_prefill"] == "streaming" and rec["loaded_tokens"] == 0 and rec["failed_blocks"] > 0, rec


def test_through_the_proxy_prompts_match_single_engine_and_a_short_one_loads_nothing(gdn_stream_stack: Stack) -> None:
    """The production flow: the proxy dispatches the prefill once the decoder called, the decoder
    streams (or, should the prefill have committed first, loads from the pool), and a prompt
    shorter than a block has no boundary state to restore and computes itself."""
    stack = gdn_stream_stack
    bs = stack.block_size
    prompts = [text(74, 420), text(75, 100)]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": MAX_TOKENS, "logprobs": 2, **SAMPLING}
    base = baseline(stack, "/v1/completions", {**body, "cache_salt": "single-engine"})
    refs = [completion_choice(c) for c in by_index(base["choices"])]
    ex = through(stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    got = [completion_choice(c) for c in by_index(ex.out["choices"])]
    assert len(got) == len(prompts)
    for r, g in zip(refs, got):
        assert_same_greedy(r, g, lp_tol=1e-4)
    page = 2 * GDN_SPEC["num_key_value_heads"] * GDN_SPEC["head_dim"] * 2 * bs
    recs = sorted(ex.decode_stats, key=lambda r: -r["prompt_tokens"])
    assert len(recs) == 2 and recs[0]["prompt_tokens"] > 2 * bs and recs[1]["prompt_tokens"] < bs, recs
    long, short = recs
    hit = (long["prompt_tokens"] - 1) // bs * bs
    assert long["remote_prefill"] in ("streaming", "pool holds the prompt"), long
    assert long["promised_tokens"] == long["loaded_tokens"] == hit and long["failed_blocks"] == 0, long
    assert long["loaded_bytes"] == 2 * (hit // bs) * page + _state_nbytes(stack), long  # streamed or loaded
    assert short["remote_prefill"] == "nothing to load" and short["loaded_tokens"] == 0, short


def test_prefiller_down_ends_the_receive_at_the_metaserver_error(gdn_stream_stack: Stack) -> None:
    """The proxy's prefill fails at once (nothing listens): its metaserver error answer cancels the
    decoder's receive, chunks and state wait alike, long before the deadline; the decoder computes
    the prompt and gives the single engine's output."""
    stack = gdn_stream_stack
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = stack.add_proxy("proxy-no-prefiller-gdn", dead, stack.decode.url, "--max-retries", "1")
    body = _body(text(76, 420))
    ref = _ref(stack, body)
    t0 = time.monotonic()
    ex = through(stack, "/v1/completions", body, proxy_url=proxy.url)
    took = time.monotonic() - t0
    assert ex.status == 200, ex.out
    assert_same_greedy(ref, completion_choice(ex.out["choices"][0]))
    assert took < STREAM_TIMEOUT_S / 2, f"{took:.1f} s: the receive waited for its deadline"
    (rec,) = ex.decode_stats
    assert rec["remote_prefill"] == "streaming" and rec["loaded_tokens"] == 0 and rec["failed_blocks"] > 0, rec
    assert "prefill_failed" in rec["t"], rec
