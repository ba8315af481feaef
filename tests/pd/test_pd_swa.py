"""1P1D on real vLLM (CPU) with the tiny sliding-window hybrid (Gemma 3 style: layers 0 and 2 see a
48-token window, 1 and 3 are full attention; vLLM's hybrid KV cache manager on, block 32): through
lw-proxy the decoder loads the prefiller's prompt, computes its last token only and gives the single
engine's greedy output; its windowed layers read only the chunks inside the window. Its engines run
tool calling: a tool call that begins at the first token is the single engine's through PD."""

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


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}, "count": {"type": "integer"}}, "required": ["word"]}}}]


def _tool_calls(answer: dict, stream: bool) -> list[tuple[str, str]]:
    """(name, arguments) of each tool call of a chat answer, a stream's deltas joined (ids are random)."""
    if not stream:
        return [(c["function"]["name"], c["function"]["arguments"]) for c in answer["choices"][0]["message"]["tool_calls"]]
    assert answer and answer[-1] == "[DONE]", answer[-3:]
    calls: dict[int, list[str]] = {}
    for ev in answer[:-1]:
        for ch in ev["choices"]:
            for c in (ch.get("delta") or {}).get("tool_calls") or ():
                got = calls.setdefault(c.get("index", 0), ["", ""])
                got[0] += (c.get("function") or {}).get("name") or ""
                got[1] += (c.get("function") or {}).get("arguments") or ""
    return [tuple(v) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_that_begins_at_the_first_token_is_the_single_engines(swa_stack: Stack, stream: bool) -> None:
    """A chat that names the tool to call (vLLM's named tool choice: its arguments' JSON is the
    whole output, from the first token on, under a grammar): the tool call through PD, streamed or
    not, is the single engine's. Requests with tools keep the decoder's path (the prefill's token is
    forced on the decoder where the grammar allows it), so nothing splits the call."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": text(600 + stream, 100)}], "max_tokens": 24,
            "temperature": 0, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}}
    ref = _tool_calls(baseline(swa_stack, "/v1/chat/completions", body), False)
    assert ref and ref[0][0] == "lookup" and ref[0][1].startswith("{"), ref
    ex = through(swa_stack, "/v1/chat/completions", {**body, "stream": stream})
    assert ex.status == 200, ex.out
    assert _tool_calls(ex.out, stream) == ref
    assert_remote_prefill_used(swa_stack, ex, 1)
