"""1P1D on real vLLM (CPU) with the tiny sliding-window hybrid (Gemma 3 style: layers 0 and 2 see a
48-token window, 1 and 3 are full attention; vLLM's hybrid KV cache manager on, block 32): through
lw-proxy the decoder loads the prefiller's prompt, computes its last token only and gives the single
engine's greedy output; its windowed layers read only the chunks inside the window."""

from __future__ import annotations

import pytest

from lw_bench.models import SWA_SPEC
from lw_bench.pd.stack import Stack
from lw_dev.pd_flow import assert_remote_prefill_used, baseline, text, through
from lw_dev.pd_oracle import SAMPLING, assert_same, by_index, completion_choice

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _window_blocks(hit_tokens: int, block: int) -> int:
    """Blocks a windowed layer reads for a hit of ``hit_tokens``: vLLM skips the blocks wholly
    before the window of the first token it computes (``max(0, hit - window + 1) // block``)."""
    return -(-hit_tokens // block) - max(0, hit_tokens - SWA_SPEC["sliding_window"] + 1) // block


def test_swa_prompts_match_single_engine_and_decoder_computes_one_token(swa_stack: Stack) -> None:
    bs = swa_stack.block_size
    assert bs == 32
    # Seven chunks and more (past the window: windowed layers skip chunks), and one chunk plus a
    # partial one (inside the window: every layer reads every chunk).
    prompts = [text(41, 160), text(42, 30)]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": MAX_TOKENS, "logprobs": 2, **SAMPLING}
    refs = [completion_choice(c) for c in by_index(baseline(swa_stack, "/v1/completions", body)["choices"])]
    ex = through(swa_stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    got = [completion_choice(c) for c in by_index(ex.out["choices"])]
    assert len(got) == len(prompts)
    for i, (r, g) in enumerate(zip(refs, got)):
        assert_same(r, g, f"swa prompt {i}")
    assert_remote_prefill_used(swa_stack, ex, len(prompts))  # promised = loaded = prompt - 1
    # A block of one layer: K and V, 2 kv heads of 32 in float32; two full and two windowed layers.
    page = 2 * SWA_SPEC["num_key_value_heads"] * SWA_SPEC["head_dim"] * 4 * bs
    recs = sorted(ex.decode_stats, key=lambda r: -r["prompt_tokens"])
    assert recs[0]["prompt_tokens"] > 6 * bs and recs[1]["prompt_tokens"] < SWA_SPEC["sliding_window"] + bs, recs
    for r in recs:
        hit = r["loaded_tokens"]
        assert r["loaded_bytes"] == (2 * -(-hit // bs) + 2 * _window_blocks(hit, bs)) * page, r
    assert _window_blocks(recs[0]["loaded_tokens"], bs) < -(-recs[0]["loaded_tokens"] // bs)
