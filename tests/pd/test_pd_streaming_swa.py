"""Streaming PD (``pd_streaming``) with the sliding-window hybrid (Gemma 3 style, vLLM's hybrid KV
cache manager on, block 32) on real vLLM (CPU): the decoder parks first and pulls each layer while
the prefill runs; its output is the single engine's, it loads the whole prompt but the last token,
and its windowed layers read only the chunks inside the window. A prefill that never comes ends
the receive at its deadline and vLLM recomputes the request whole (a hybrid's failed receive)."""

from __future__ import annotations

import time

import pytest

from lw_bench.models import SWA_SPEC
from lw_bench.pd.stack import Stack, post_json
from lw_dev.fake_metaserver import FakeMetaserver
from lw_dev.pd_flow import baseline, text
from lw_dev.pd_oracle import SAMPLING, assert_same, completion_choice
from lw_dev.pd_streaming_flow import STREAM_TIMEOUT_S, streams_in_decoder_first

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 8


def _body(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 2, **SAMPLING}


def test_streamed_hybrid_prompt_reads_only_the_window(swa_stream_stack: Stack) -> None:
    bs = swa_stream_stack.block_size
    rec = streams_in_decoder_first(swa_stream_stack, _body(text(51, 160)), "parent-swa-stream", "swa streaming",
                                   STREAM_TIMEOUT_S)
    hit = rec["loaded_tokens"]
    assert hit > 6 * bs, rec
    # Two full-attention layers read every chunk; the two windowed ones only those vLLM keeps: a
    # block wholly before the window of the first token computed is a null block, never read.
    chunks = -(-hit // bs)
    window = chunks - max(0, hit - SWA_SPEC["sliding_window"] + 1) // bs
    page = 2 * SWA_SPEC["num_key_value_heads"] * SWA_SPEC["head_dim"] * 4 * bs
    assert window < chunks and rec["loaded_bytes"] == (2 * chunks + 2 * window) * page, rec


def test_a_prefill_that_never_comes_is_recomputed_whole(swa_stream_stack: Stack) -> None:
    fake = FakeMetaserver()
    fake.mode = "silent"
    try:
        body = _body(text(52, 100))
        ref = completion_choice(baseline(swa_stream_stack, "/v1/completions", body)["choices"][0])
        params = {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": fake.url,
                  "lw_parent_id": "parent-swa-stalled", "lw_children": 1}
        swa_stream_stack.decode.mark()
        t0 = time.monotonic()
        status, out = post_json(swa_stream_stack.decode.url + "/v1/completions",
                                {**body, "kv_transfer_params": params})
        took = time.monotonic() - t0
    finally:
        fake.close()
    assert status == 200, out
    assert_same(ref, completion_choice(out["choices"][0]), "stalled hybrid prefill")
    assert STREAM_TIMEOUT_S <= took < STREAM_TIMEOUT_S + 30, f"answered after {took:.1f} s; receive deadline {STREAM_TIMEOUT_S} s"
    (rec,) = swa_stream_stack.decode.new_stats()
    assert rec["remote_prefill"] == "streaming" and rec["loaded_tokens"] == 0 and rec["failed_blocks"] > 0, rec
