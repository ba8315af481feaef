"""PD on a recurrent-state hybrid's stack (gated delta-net, Mamba2) for a prompt that ends on a block
while the pool already holds the state after its last token.

The prefiller first computes, as a plain request, a longer prompt with the same first ``k`` blocks:
it saves their chunks and the state vLLM hands it at that prompt's last boundary before its last
token, ``k`` blocks, i.e. the state after the short prompt's last token. Then the short prompt goes
through the proxy:

* the pool holds every chunk of it, but not the state its hit can use (``k - 1`` blocks: vLLM
  computes at least the last token, so a hit ends before it), so the decoder asks for the prefill
  (``needs_prefill`` true) and waits for it instead of recomputing nearly the whole prompt;
* it loads ``k - 1`` blocks and the state there, never the state at ``k`` blocks, which would run
  the last token through the recurrent layers twice;
* its greedy output and log-probs equal the decoder's alone (to 1e-4).

That is the decoder's path (``decoder_path_proxy``). Continued after its prefill (lw-proxy's
default for a non-streamed answer) the decoder's prompt is the short prompt plus the prefill's first
token, so the state after the short prompt's last token is exactly the one its hit needs: it loads
``k`` blocks and that state and computes the one token, with the same output.
"""

from __future__ import annotations

import time

from lw_bench.pd.stack import Stack, post_json
from lw_dev.harness import assert_same_greedy, random_tokens
from lw_dev.pd_flow import CONTINUED, baseline, decoder_path_proxy, settle, through
from lw_dev.pd_oracle import SAMPLING, completion_choice

BLOCKS = 2


def check_prompt_ending_on_a_block(stack: Stack, seed: int, max_tokens: int = 8, continued: bool = False) -> None:
    bs = stack.block_size
    prompt = random_tokens(seed, BLOCKS * bs)
    longer = prompt + random_tokens(seed + 1, bs // 2)
    settle(stack)
    stack.prefill.mark()
    status, out = post_json(stack.prefill.url + "/v1/completions", {"model": "tiny", "prompt": longer, "max_tokens": 1})
    assert status == 200, out
    deadline = time.monotonic() + 30
    while not (recs := stack.prefill.new_stats()):
        assert time.monotonic() < deadline, "the prefiller wrote no record for the longer prompt"
        time.sleep(0.05)
    assert [r["saved_chunks"] for r in recs] == [BLOCKS], recs

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "logprobs": 2, **SAMPLING}
    ref = completion_choice(baseline(stack, "/v1/completions", {**body, "cache_salt": "single-engine"})["choices"][0])
    ex = through(stack, "/v1/completions", body, proxy_url=None if continued else decoder_path_proxy(stack).url)
    assert ex.status == 200, ex.out
    assert_same_greedy(ref, completion_choice(ex.out["choices"][0]), lp_tol=1e-4)
    (r,) = ex.decode_stats
    if continued:
        assert r["prompt_tokens"] == BLOCKS * bs + 1 and r["remote_prefill"] == CONTINUED, r
        assert r["promised_tokens"] == r["loaded_tokens"] == BLOCKS * bs and r["failed_blocks"] == 0, r
        return
    assert r["prompt_tokens"] == BLOCKS * bs, r
    # Waited for the prefill (answered, or its objects seen in the pool), then loaded up to its state;
    # or, lw-proxy dispatching the prefill with the client request (``--prefill-dispatch early``), the
    # prefill had already saved the state at ``k - 1`` blocks when the decoder looked: only this prefill
    # saves that state (the longer prompt's is at ``k``), so the pool holding the prompt proves it ran.
    assert r["remote_prefill"] in ("ok", "pool holds the prompt"), r
    assert len(ex.prefill_stats) == 1, ex.prefill_stats
    hit = (BLOCKS - 1) * bs
    assert r["promised_tokens"] == r["loaded_tokens"] == hit and r["failed_blocks"] == 0, r
