"""1P1D on real vLLM (CPU) with the tiny gated delta-net hybrid (Qwen3-Next style: layers 0 and 2
linear attention, 1 and 3 full attention; bf16, prefix caching on so vLLM keeps block-aligned
states, block 256 asked for): through lw-proxy the decoder gives the single engine's greedy output.
The block and the state's dtype (float32 or bf16, by the CPU: lw_dev.state_sizes) are the engines'
own, from their connector's engine record.

What the decoder loads: the prefiller saves every chunk of the prompt, its partial one too, but
vLLM hands it a recurrent state only at the prompt's last full boundary before its last token
(``(n - 1) // block * block``, the default ``prefix_cache_retention_interval``). A hit must end where a
state is, so the decoder loads up to that boundary, state included, and computes the rest of the
prompt (less than a block beyond it, or a whole block when the prompt ends on one); a prompt
shorter than a block loads nothing. Loading "the prompt less its last token" would need a state at
that position, which is not block aligned: vLLM keeps no such state.
"""

from __future__ import annotations

import pytest
from pd_state_flow import check_prompt_ending_on_a_block

from lw_bench.models import GDN_SPEC
from lw_bench.pd.stack import Stack
from lw_dev.harness import assert_same_greedy
from lw_dev.pd_flow import baseline, decoder_path_proxy, text, through
from lw_dev.pd_oracle import SAMPLING, by_index, completion_choice
from lw_dev.state_sizes import gdn_state_nbytes, ssm_dtype

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def test_gdn_prompts_match_single_engine_and_decoder_loads_up_to_the_last_state(gdn_stack: Stack) -> None:
    bs = gdn_stack.block_size  # the engines' (their engine record)
    engine = gdn_stack.decode.engine()
    state = gdn_state_nbytes(ssm_dtype=ssm_dtype(engine))  # the state's dtype as this CPU runs it
    assert engine["state_bytes"] == state, engine
    # Two full chunks and a partial one (a hit of 512 tokens, state at 512), and a partial chunk only.
    prompts = [text(61, 420), text(62, 100)]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": MAX_TOKENS, "logprobs": 2, **SAMPLING}
    # The baseline under another cache_salt: the decoder's own prefix cache must not serve the PD run.
    base = baseline(gdn_stack, "/v1/completions", {**body, "cache_salt": "single-engine"})
    refs = [completion_choice(c) for c in by_index(base["choices"])]
    # The decoder's path (a non-streamed prompt list is continued after its prefill by default):
    # each prompt's decoder computes from its last state to the prompt's end, as the single engine
    # splits it, and decodes the first token; a continuation computes that token with the rest.
    ex = through(gdn_stack, "/v1/completions", body, proxy_url=decoder_path_proxy(gdn_stack).url)
    assert ex.status == 200, ex.out
    got = [completion_choice(c) for c in by_index(ex.out["choices"])]
    assert len(got) == len(prompts)
    # A lost state moves this tiny random model's log-probs by a few 1e-3 only (test_hybrid_state),
    # under the oracle's default tolerance; a restored one gives the single engine's log-probs to
    # 1e-4 (both engines split the prompt at the same block boundary).
    for r, g in zip(refs, got):
        assert_same_greedy(r, g, lp_tol=1e-4)

    assert len(ex.prefill_stats) == len(prompts), ex.prefill_stats
    for r in ex.prefill_stats:  # every chunk, the partial one too (layerwise keeps partial chunks)
        assert r["saved_chunks"] == -(-r["prompt_tokens"] // bs), r
    # One block of one full-attention layer: K and V, 2 kv heads of 64 in bf16.
    page = 2 * GDN_SPEC["num_key_value_heads"] * GDN_SPEC["head_dim"] * 2 * bs
    recs = sorted(ex.decode_stats, key=lambda r: -r["prompt_tokens"])
    assert len(recs) == 2 and recs[0]["prompt_tokens"] > 2 * bs and recs[1]["prompt_tokens"] < bs, recs
    for r in recs:
        n = r["prompt_tokens"]
        hit = (n - 1) // bs * bs  # the last state vLLM handed the prefiller
        assert r["remote_prefill"] in (("nothing to load",) if n < bs else ("ok", "pool holds the prompt")), r
        assert r["promised_tokens"] == r["loaded_tokens"] == hit and r["failed_blocks"] == 0, r
        # The two attention layers' chunks and, with a hit, the state object at its end.
        assert r["loaded_bytes"] == 2 * (hit // bs) * page + (state if hit else 0), r


def test_gdn_prompt_ending_on_a_block_waits_for_its_state_and_never_loads_the_one_after_its_last_token(
        gdn_stack: Stack) -> None:
    """The pool holds the prompt's chunks and the state after its last token (a longer prompt's):
    tests/pd/pd_state_flow.py."""
    check_prompt_ending_on_a_block(gdn_stack, seed=81)
    # Continued after its prefill: the decoder's prompt ends with the prefill's token, after the state.
    check_prompt_ending_on_a_block(gdn_stack, seed=181, continued=True)
