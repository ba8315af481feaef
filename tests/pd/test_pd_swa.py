"""1P1D on real vLLM (CPU) with the tiny sliding-window hybrid (Gemma 3 style: layers 0 and 2 see a
48-token window, 1 and 3 are full attention; vLLM's hybrid KV cache manager on, block 32): through
lw-proxy the decoder loads the prefiller's prompt, computes its last token only and gives the single
engine's greedy output; its windowed layers read only the chunks inside the window. Its engines run
tool calling: a tool call that begins at the first token is the single engine's through PD, a
streamed one's first event the prefiller's (lw_proxy.parsed_relay)."""

from __future__ import annotations

import pytest
from pd_faults_flow import decoder_looks_first

from lw_bench.models import SWA_SPEC
from lw_bench.pd.stack import Stack, metric_sum, post_json, post_sse
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
    not, is the single engine's: the decoder continues from the prefill's token (forced where the
    grammar allows it), a streamed one after the prefiller's first event was relayed (below)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": text(600 + stream, 100)}], "max_tokens": 24,
            "temperature": 0, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}}
    ref = _tool_calls(baseline(swa_stack, "/v1/chat/completions", body), False)
    assert ref and ref[0][0] == "lookup" and ref[0][1].startswith("{"), ref
    ex = through(swa_stack, "/v1/chat/completions", {**body, "stream": stream})
    assert ex.status == 200, ex.out
    assert _tool_calls(ex.out, stream) == ref
    assert_remote_prefill_used(swa_stack, ex, 1)


RELAYED = "lw_proxy_prefill_first_relayed_total"


def _without_ids(x):
    """An event as clients compare them: no ids (the stream's, the tool calls'), ``created``, nulls."""
    if isinstance(x, dict):
        return {k: _without_ids(v) for k, v in x.items() if v is not None and k not in ("id", "created")}
    return [_without_ids(v) for v in x] if isinstance(x, list) else x


def _joined(events: list) -> tuple[str, list[tuple[str, str]], list[int]]:
    """A chat stream's content, tool calls and generated token ids, its events joined."""
    content = "".join((ch.get("delta") or {}).get("content") or "" for ev in events[:-1] for ch in ev["choices"])
    ids = [t for ev in events[:-1] for ch in ev["choices"] for t in ch.get("token_ids") or ()]
    return content, _tool_calls(events, True), ids


@pytest.mark.parametrize("choice", ["named", "auto"])
def test_a_streamed_tool_chat_gets_its_first_event_from_the_prefiller(swa_stack: Stack, choice: str) -> None:
    """Tools: the prefill is streamed and asks two tokens, and its first token's event, parsed by
    the prefiller's tool parser as one of many (lw_proxy.parsed_relay), goes to the client as the
    single engine's first token's event while the decoder continues from that token. Named tool
    choice (the arguments' JSON from the first token on: the call opens with it) and the pythonic
    parser on auto with the first token biased to ``[`` (a call may begin: the parser holds it back,
    an event with no delta but its id): the stream is the single engine's, the tool calls, content
    and token ids joined, and the first token's event delta for delta."""
    bracket = post_json(swa_stack.decode.url + "/tokenize", {"model": "tiny", "prompt": "[", "add_special_tokens": False})
    assert bracket[0] == 200 and len(bracket[1]["tokens"]) == 1, bracket
    body = {"model": "tiny", "messages": [{"role": "user", "content": text(630 + (choice == "auto"), 300)}],
            "max_tokens": 12, "temperature": 0, "tools": TOOLS, "stream": True, "return_token_ids": True}
    if choice == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": "lookup"}}
    else:
        body["logit_bias"] = {str(bracket[1]["tokens"][0]): 20}
    status, ref = post_sse(swa_stack.decode.url + "/v1/chat/completions", body)  # the single engine's stream
    assert status == 200 and ref[-1] == "[DONE]", ref
    before = metric_sum(swa_stack.proxy.url, RELAYED)
    # The prefiller is frozen until the decoder has posted (a parser's first event is relayed only to
    # a decoder that continues from its token, and one that found the prompt in the pool would not).
    ex = through(swa_stack, "/v1/chat/completions", body,
                 send=lambda url, b: decoder_looks_first(swa_stack.prefill, url, b))
    assert ex.status == 200 and ex.out[-1] == "[DONE]", ex.out
    assert metric_sum(swa_stack.proxy.url, RELAYED) - before == 1, "the prefiller's first event was not relayed"
    assert _joined(ex.out) == _joined(ref)
    first = _joined(ref)[2][0]
    if choice == "auto":
        assert first == bracket[1]["tokens"][0]
    # The relayed first token's event (the second: the role event opens the stream) is the single
    # engine's for that token, where its engine sent that token alone.
    assert ex.out[1]["choices"][0]["token_ids"] == [first], ex.out[:3]
    alone = [ev for ev in ref[:-1] if ev["choices"] and ev["choices"][0].get("token_ids") == [first]]
    if alone:
        assert _without_ids(ex.out[1]) == _without_ids(alone[0])
    assert_remote_prefill_used(swa_stack, ex, 1)
