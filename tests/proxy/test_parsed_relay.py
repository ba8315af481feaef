"""``--prefill-first`` for streamed chats a parser shapes (lw_proxy.parsed_relay): chats with tools,
and every chat once a prefiller answered as a server with a reasoning parser, take their first
events from a streamed two-token prefill, verbatim; the decoder continues from the token and its
event for it is cut. Mock engines: ``Knobs.tool_parser`` holds a tools chat's first token back and
opens a tool call with the second; ``Knobs.reasoning`` streams reasoning and stamps usage as vLLM
with a reasoning parser does."""

from __future__ import annotations

import json
import time

import pytest

from lw_dev.proxy_mocks import generate, harness, run
from lw_proxy import parsed_relay
from lw_proxy.relay import Mismatch

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT = {"messages": [{"role": "user", "content": "p"}], "max_tokens": 4, "stream": True, "temperature": 0}
TOOLS_CHAT = {**CHAT, "tools": [TOOL]}
USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def _events(h, body) -> tuple[float, list[dict]]:
    """(seconds to the first event, the stream's events but [DONE])."""
    t0 = time.monotonic()
    first, events = None, []
    async with h.session.post(h.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                first = first if first is not None else time.monotonic() - t0
                events.append(json.loads(line[6:]))
    assert not [ev for ev in events if "error" in ev], events
    return first or 0.0, events


def _shape(events):
    """As a client compares streams: without ids (the stream's and the tool calls'), ``created``
    and null fields."""
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if v is not None and k not in ("id", "created")}
        return [clean(v) for v in x] if isinstance(x, list) else x
    return [clean(ev) for ev in events]


def _relayed(h) -> float:
    return h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") or 0.0


async def _relayed_and_not(req, knobs):
    """Stream ``req`` without ``--prefill-first`` and with it (a slow decoder that continues from the
    prefill's token), every backend's ``knobs`` set; the events as a client compares them."""
    got = {}
    for prefill_first in (False, True):
        async with harness(prefill_first=prefill_first) as h:
            for b in (*h.prefillers, *h.decoders):
                for k, v in knobs.items():
                    setattr(b.knobs, k, v)
            h.decoders[0].knobs.forces_first = True
            h.decoders[0].knobs.answer_delay = 0.5
            h.prefillers[0].knobs.delay = 0.2  # the prefill computes; the decoder's POST comes meanwhile
            first, events = await _events(h, req)
            got[prefill_first] = _shape(events)
            assert _relayed(h) == (1 if prefill_first else 0)
            if prefill_first:
                assert first < 0.5, first  # the relayed events went out while the decoder waited
                body = h.prefillers[0].bodies[-1]
                assert (body["stream"], body["max_tokens"], body["max_completion_tokens"], body["return_token_ids"]) \
                    == (True, 2, 2, True)
                assert h.decoders[0].answered_first  # the decoder continued from the prefill's token
    return got


@pytest.mark.parametrize("extra", [{}, {"return_token_ids": True}, USAGE,
                                   {"logprobs": True, "top_logprobs": 1, "return_token_ids": True, **USAGE}],
                         ids=["plain", "ids", "usage", "all"])
def test_a_tools_chat_stream_is_relayed_event_for_event(extra):
    """A tool parser holds the first token back and opens the call with the second: the relayed
    stream is the one not relayed, event for event (the held-back token's event only where a single
    engine sends one: ids or log-probs asked), the tool call whole."""
    async def body():
        got = await _relayed_and_not({**TOOLS_CHAT, **extra}, {"tool_parser": True})
        assert got[True] == got[False]
        calls = [c for ev in got[True] for ch in ev["choices"] for c in ch.get("delta", {}).get("tool_calls", ())]
        assert "".join(c["function"]["arguments"] for c in calls) == "".join(generate("p", 4))
        assert calls[0]["function"]["name"] == "f"
        held = [ch for ev in got[True] for ch in ev["choices"] if ch.get("delta") == {}]
        assert len(held) == (1 if "return_token_ids" in extra else 0), got[True]

    run(body())


def test_a_tools_chat_of_two_choices_relays_each_choices_first_event():
    async def body():
        req = {**TOOLS_CHAT, "n": 2, "temperature": 0.8, "seed": 3, "return_token_ids": True}
        got = await _relayed_and_not(req, {"tool_parser": True, "distinct_choices": True})
        assert got[True] == got[False]
        assert {ch["index"] for ev in got[True] for ch in ev["choices"]} == {0, 1}

    run(body())


def test_a_reasoning_server_is_learned_from_its_first_answer_then_its_chats_are_relayed():
    """A server with a reasoning parser stamps chat usage with ``completion_tokens_details``; its
    one-token answer (parsed as the stream's last: content) is not the stream's first event. The
    first chat is not relayed; from then on streamed chats take the two-token streamed prefill, and
    their relayed events are the decoder's stream's: reasoning from the first token on."""
    async def body():
        async with harness() as h:
            for b in (*h.prefillers, *h.decoders):
                b.knobs.reasoning = True
            h.decoders[0].knobs.forces_first = True
            h.decoders[0].knobs.answer_delay = 0.5
            h.prefillers[0].knobs.delay = 0.2  # the prefill computes; the decoder's POST comes meanwhile
            _, plain = await _events(h, CHAT)
            assert _relayed(h) == 0 and h.prefillers[0].bodies[-1]["max_tokens"] == 1
            get = h.proxy.m.registry.get_sample_value
            assert get("lw_proxy_prefill_first_not_relayed_total", {"reason": "token"}) == 1
            first, relayed = await _events(h, CHAT)
            assert _relayed(h) == 1 and first < 0.5
            assert h.prefillers[0].bodies[-1]["max_tokens"] == 2 and h.prefillers[0].bodies[-1]["stream"] is True
            assert _shape(relayed) == _shape(plain)
            reasoning = [ch["delta"].get("reasoning_content") for ev in relayed for ch in ev["choices"]]
            assert "".join(r for r in reasoning if r) == "".join(generate("p", 4)) and reasoning[1]

    run(body())


def test_a_parsed_chat_is_not_relayed_to_a_decoder_that_does_not_continue_from_its_token():
    async def body():
        async with harness() as h:
            for b in (*h.prefillers, *h.decoders):
                b.knobs.tool_parser = True
            h.decoders[0].knobs.answer_delay = 0.5  # forces_first unsaid: an older connector
            h.prefillers[0].knobs.delay = 0.2
            first, events = await _events(h, TOOLS_CHAT)
            assert first >= 0.65 and _relayed(h) == 0
            get = h.proxy.m.registry.get_sample_value
            assert get("lw_proxy_prefill_first_not_relayed_total", {"reason": "not_forced"}) == 1
            args = [c["function"]["arguments"] for ev in events for ch in ev["choices"]
                    for c in ch["delta"].get("tool_calls", ())]
            assert "".join(args) == "".join(generate("p", 4))

    run(body())


def test_a_parsed_chat_waits_for_a_decoder_post_that_comes_after_the_prefill():
    async def body():
        async with harness() as h:
            for b in (*h.prefillers, *h.decoders):
                b.knobs.tool_parser = True
            dec = h.decoders[0]
            dec.knobs.forces_first = True
            dec.knobs.delay = 0.3  # the POST comes after the two-token prefill answered
            dec.knobs.answer_delay = 0.6
            first, events = await _events(h, TOOLS_CHAT)
            assert 0.25 <= first < 0.8 and _relayed(h) == 1 and dec.answered_first
            args = [c["function"]["arguments"] for ev in events for ch in ev["choices"]
                    for c in ch["delta"].get("tool_calls", ())]
            assert "".join(args) == "".join(generate("p", 4))

    run(body())


def test_a_chat_ending_at_its_first_token_or_without_roles_is_not_relayed():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": [1]}
    tok = {"created": 5, "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [7], "finish_reason": None}]}
    from lw_proxy.validate import parse_chat
    req = parse_chat(json.dumps(CHAT).encode())
    first = parsed_relay.first_event(parsed_relay.ParsedFirst((role,), tok), "abc", req, roles=True)
    assert first is not None and first.choices[0].delta == {"content": "a"} and first.prompt_ids == [1]
    evs = [json.loads(x[6:]) for x in first.block.split(b"\n\n") if x]
    assert [ev["id"] for ev in evs] == ["chatcmpl-lw-abc"] * 2 and evs[0]["prompt_token_ids"] is None  # not asked
    assert evs[1]["choices"][0]["token_ids"] is None and first.created == 5
    ended = {**tok, "choices": [{**tok["choices"][0], "finish_reason": "stop"}]}
    two = {**tok, "choices": [{**tok["choices"][0], "token_ids": [7, 8]}]}  # the prefiller merged two tokens
    for ev, roles in ((ended, (role,)), (two, (role,)), (tok, ())):
        assert parsed_relay.first_event(parsed_relay.ParsedFirst(roles, ev), "abc", req, roles=True) is None


def test_the_decoders_first_token_event_is_cut_whole_or_from_a_merged_event():
    opened = {"tool_calls": [{"index": 0, "id": "call-a", "type": "function", "function": {"name": "f", "arguments": "{"}}]}
    ch = {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call-b", "type": "function",
                                                "function": {"name": "f", "arguments": "{"}}]}, "token_ids": [7]}
    assert parsed_relay.cut(ch, opened, 7) and ch["delta"] == {} and ch["token_ids"] == []
    merged = {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call-b", "type": "function",
                                                    "function": {"name": "f", "arguments": "{\"a"}}]}, "token_ids": [7, 8]}
    assert parsed_relay.cut(merged, opened, 7)
    assert merged["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": "\"a"}}]} and merged["token_ids"] == [8]
    text = {"index": 0, "delta": {"reasoning_content": "ab"}, "token_ids": [7, 8]}
    assert parsed_relay.cut(text, {"reasoning_content": "a"}, 7) and text["delta"] == {"reasoning_content": "b"}
    held = {"index": 0, "delta": {"content": "ab"}, "token_ids": [7, 8]}
    assert parsed_relay.cut(held, {}, 7) and held["delta"] == {"content": "ab"}
    assert not parsed_relay.cut({"index": 0, "delta": {"role": "assistant"}}, opened, 7)  # the role event
    for ch, delta in (({"delta": {}, "token_ids": [6]}, {}),  # another token
                      ({"delta": {"content": "b"}, "token_ids": [7]}, {"content": "a"}),
                      ({"delta": {"content": "ba"}, "token_ids": [7, 8]}, {"content": "a"}),
                      ({"delta": {"tool_calls": [{"index": 0, "function": {"name": "g", "arguments": "{"}}]},
                        "token_ids": [7, 8]}, opened)):
        with pytest.raises(Mismatch):
            parsed_relay.cut(ch, delta, 7)
