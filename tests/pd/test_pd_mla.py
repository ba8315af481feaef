"""1P1D on real vLLM (CPU) with the tiny MLA model (DeepSeek-V2 style, CPU_MLA backend, block 16):
the decoder loads the prefiller's latent KV layer by layer and gives the single engine's greedy
output, for one prompt and for a prompt list fanned into one prefill."""

from __future__ import annotations

import pytest

from lw_bench.pd.stack import Stack
from lw_dev.pd_flow import assert_remote_prefill_used, baseline, text, through
from lw_dev.pd_oracle import SAMPLING, assert_same, by_index, chat_choice, completion_choice

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _completion(prompt, **kw):
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 2, **SAMPLING, **kw}


def test_mla_completion_matches_single_engine(mla_stack: Stack) -> None:
    body = _completion(text(21, 100))
    ref = completion_choice(baseline(mla_stack, "/v1/completions", body)["choices"][0])
    ex = through(mla_stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    assert_same(ref, completion_choice(ex.out["choices"][0]), "mla completion")
    assert_remote_prefill_used(mla_stack, ex, 1)
    assert ex.decode_stats[0]["loaded_tokens"] >= 6 * mla_stack.block_size


def test_mla_chat_matches_single_engine(mla_stack: Stack) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text(22, 80)}], "max_tokens": MAX_TOKENS,
            "logprobs": True, "top_logprobs": 2, **SAMPLING}
    ref = chat_choice(baseline(mla_stack, "/v1/chat/completions", body)["choices"][0])
    ex = through(mla_stack, "/v1/chat/completions", body)
    assert ex.status == 200, ex.out
    assert_same(ref, chat_choice(ex.out["choices"][0]), "mla chat")
    assert_remote_prefill_used(mla_stack, ex, 1)


def test_mla_prompt_list_matches_single_engine(mla_stack: Stack) -> None:
    prompts = [text(23, 60), text(24, 95), "lo ka mi"]
    body = _completion(prompts)
    refs = [completion_choice(c) for c in by_index(baseline(mla_stack, "/v1/completions", body)["choices"])]
    ex = through(mla_stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    got = [completion_choice(c) for c in by_index(ex.out["choices"])]
    assert len(got) == len(prompts)
    for i, (r, g) in enumerate(zip(refs, got)):
        assert_same(r, g, f"mla prompt {i}")
    assert_remote_prefill_used(mla_stack, ex, len(prompts))
