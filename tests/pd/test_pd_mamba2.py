"""1P1D on real vLLM (CPU) with the tiny Mamba2 hybrid (Granite 4 style: layers 0 and 2 Mamba2,
1 and 3 full attention; float32, prefix caching on, block 128 asked for; lw_vllm.cpu_fixes.mamba2_fix makes
its prefills run on the CPU build): through lw-proxy the decoder gives the single engine's greedy
output, loading up to the last block boundary before the prompt's last token, the conv and SSM
states at that boundary included (block and state dtype as the engines report them) (as for gated delta-net: tests/pd/test_pd_gdn.py); with
``pd_streaming`` the state lands after the streamed chunks (tests/pd/test_pd_streaming_gdn.py).
"""

from __future__ import annotations

import pytest
from pd_state_flow import check_prompt_ending_on_a_block

from lw_bench.models import MAMBA2_SPEC
from lw_bench.pd.stack import Stack
from lw_dev.harness import assert_same_greedy
from lw_dev.pd_flow import baseline, text, through
from lw_dev.pd_oracle import SAMPLING, by_index, completion_choice
from lw_dev.state_sizes import mamba2_state_nbytes, ssm_dtype

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def test_mamba2_prompts_match_single_engine_and_decoder_loads_up_to_the_last_state(mamba2_stack: Stack) -> None:
    _check(mamba2_stack, streaming=False)


def test_mamba2_streaming_pd_matches_single_engine_and_loads_up_to_the_last_state(mamba2_stream_stack: Stack) -> None:
    _check(mamba2_stream_stack, streaming=True)


def _check(stack: Stack, *, streaming: bool) -> None:
    bs = stack.block_size  # the engines' (their engine record)
    engine = stack.decode.engine()
    state = mamba2_state_nbytes(ssm_dtype=ssm_dtype(engine))
    assert engine["state_bytes"] == state, engine
    # One block of one attention layer: K and V, 2 kv heads of 32 (hidden 128 / 4 heads), float32.
    page = 2 * MAMBA2_SPEC["num_key_value_heads"] * (MAMBA2_SPEC["hidden_size"] // MAMBA2_SPEC["num_attention_heads"]) \
        * 4 * bs
    prompts = [text(71, 420), text(72, 60)]  # several chunks and a partial one; a partial chunk only
    body = {"model": "tiny", "prompt": prompts, "max_tokens": MAX_TOKENS, "logprobs": 2, **SAMPLING}
    base = baseline(stack, "/v1/completions", {**body, "cache_salt": "single-engine"})
    refs = [completion_choice(c) for c in by_index(base["choices"])]
    ex = through(stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    got = [completion_choice(c) for c in by_index(ex.out["choices"])]
    assert len(got) == len(prompts)
    for r, g in zip(refs, got):
        assert_same_greedy(r, g, lp_tol=1e-4)

    for r in ex.prefill_stats:
        assert r["saved_chunks"] == -(-r["prompt_tokens"] // bs), r
    recs = sorted(ex.decode_stats, key=lambda r: -r["prompt_tokens"])
    assert len(recs) == 2 and recs[0]["prompt_tokens"] > 2 * bs and recs[1]["prompt_tokens"] < bs, recs
    for r in recs:
        hit = (r["prompt_tokens"] - 1) // bs * bs  # the last state vLLM handed the prefiller
        if streaming and hit:  # streamed, or loaded should the prefill have committed first
            assert r["remote_prefill"] in ("streaming", "pool holds the prompt"), r
        assert r["promised_tokens"] == r["loaded_tokens"] == hit and r["failed_blocks"] == 0, r
        # The two attention layers' chunks and, with a hit, the state object at its end.
        assert r["loaded_bytes"] == 2 * (hit // bs) * page + (state if hit else 0), r


def test_mamba2_prompt_ending_on_a_block_waits_for_its_state_and_never_loads_the_one_after_its_last_token(
        mamba2_stack: Stack) -> None:
    """The pool holds the prompt's chunks and the state after its last token (a longer prompt's):
    tests/pd/pd_state_flow.py."""
    check_prompt_ending_on_a_block(mamba2_stack, seed=91)
    # Continued after its prefill: the decoder's prompt ends with the prefill's token, after the state.
    check_prompt_ending_on_a_block(mamba2_stack, seed=191, continued=True)
