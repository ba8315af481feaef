"""Resuming recomputed choices (lw_proxy.recompute, lw_proxy.token_ids): by token ids, so the client's
answer is a single engine's, event for event; continuation streams keep every event that carries
something (reasoning, token ids, logprobs), and the ids the proxy asked for never reach a client that
did not."""

from __future__ import annotations

import msgspec
import pytest

from lw_dev.proxy_mocks import chat_context, generate, generate_ids, harness, run, tokenize
from lw_proxy import recompute as rc
from lw_proxy import token_ids


async def _events(session, url: str, body: dict) -> list[dict]:
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).decode()
    out = []
    for block in raw.split("\n\n"):
        block = block.strip()
        if block and block != "data: [DONE]":
            assert block.startswith("data: "), block
            out.append(msgspec.json.decode(block[len("data: "):]))
    assert raw.rstrip().endswith("data: [DONE]")
    return out


async def _single_engine(h, path: str, body: dict) -> list[dict]:
    """What the decoder answers on its own, as a plain vLLM server (no kv_transfer_params: no PD)."""
    return await _events(h.session, h.backend_urls[-1] + path, body)


def test_a_resumed_completion_stream_is_the_single_engines_event_for_event():
    async def body():
        async with harness(prefill_first=False) as h:
            req = {"prompt": "the prompt", "max_tokens": 6, "stream": True}
            want = await _single_engine(h, "/v1/completions", req)
            h.decoders[0].knobs.recompute_after = 2
            got = await _events(h.session, h.url + "/v1/completions", req)
            assert [e["choices"] for e in got] == [e["choices"] for e in want]
            assert all(c["token_ids"] is None and c["prompt_token_ids"] is None for e in got for c in e["choices"])
            cont = h.decoders[0].bodies[-1]
            prompt = tokenize("the prompt")
            assert cont["prompt"] == prompt + generate_ids(prompt, 2) and cont["max_tokens"] == 4
            assert cont["return_token_ids"] is True

    run(body())


def test_a_resumed_reasoning_chat_stream_keeps_its_events_and_resumes_by_token_ids():
    # A reasoning model's deltas carry reasoning_content and no content: a continuation stream used to
    # drop them all, and the chat continuation re-rendered the text (here: none) instead of the ids.
    async def body():
        async with harness() as h:
            h.decoders[0].knobs.reasoning = True
            msgs = [{"role": "user", "content": "think"}]
            req = {"messages": msgs, "max_tokens": 6, "stream": True}
            want = await _single_engine(h, "/v1/chat/completions", req)
            assert want[0]["choices"][0]["delta"]["role"] == "assistant"
            h.decoders[0].knobs.recompute_after = 2
            got = await _events(h.session, h.url + "/v1/chat/completions", req)
            assert [e["choices"] for e in got] == [e["choices"] for e in want]  # one role event, every delta
            assert [e.get("prompt_token_ids") for e in got] == [None] * len(got)
            prompt = tokenize(chat_context(msgs))
            cont = h.decoders[0].bodies[-1]
            assert cont["kv_transfer_params"]["prompt_token_ids"] == prompt + generate_ids(prompt, 2)
            assert cont["continue_final_message"] is True and cont["max_tokens"] == 4
            # the prefill of the resubmission computes the same prompt
            assert h.prefillers[0].bodies[-1]["kv_transfer_params"]["prompt_token_ids"] == prompt + generate_ids(prompt, 2)

    run(body())


def test_token_id_and_logprob_only_events_survive_a_continuation():
    # Every second token is sent with empty text (its text comes with the next one), with its token id
    # and logprob: the client that asked for them must get all of them, resumed or not.
    async def body():
        async with harness() as h:
            h.decoders[0].knobs.empty_every = 2
            h.decoders[0].knobs.recompute_after = 3
            req = {"prompt": "ids", "max_tokens": 7, "stream": True, "return_token_ids": True, "logprobs": 0}
            got = await _events(h.session, h.url + "/v1/completions", req)
            prompt = tokenize("ids")
            gen = generate_ids(prompt, 7)
            assert [t for e in got for t in e["choices"][0]["token_ids"]] == gen
            assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in got) == 7
            assert "".join(e["choices"][0]["text"] for e in got) == "".join(generate("ids", 7))
            assert any(e["choices"][0]["text"] == "" for e in got[3:])  # an id-only event of the continuation
            # the prompt's ids once, in the first event (not the continuation's longer prompt)
            assert [e["choices"][0]["prompt_token_ids"] for e in got] == [prompt] + [None] * (len(got) - 1)

    run(body())


@pytest.mark.parametrize("reasoning", [False, True])
def test_a_resumed_non_streaming_chat_is_the_single_engines(reasoning):
    async def body():
        async with harness(continue_after_prefill=False) as h:
            h.decoders[0].knobs.reasoning = reasoning  # the answer in reasoning_content, content null
            msgs = [{"role": "user", "content": "chat prompt"}]
            req = {"messages": msgs, "max_tokens": 6}
            async with h.session.post(h.backend_urls[-1] + "/v1/chat/completions", json=req) as r:
                want = await r.json()
            h.decoders[0].knobs.recompute_after = 2
            status, out = await h.post("/v1/chat/completions", req)
            assert status == 200
            assert out["choices"][0]["message"] == want["choices"][0]["message"]
            assert out["prompt_token_ids"] is None and out["choices"][0]["token_ids"] is None
            prompt = tokenize(chat_context(msgs))
            assert h.decoders[0].bodies[-1]["kv_transfer_params"]["prompt_token_ids"] == prompt + generate_ids(prompt, 2)

    run(body())


def test_a_relayed_first_token_is_resumed_from_once():
    # --prefill-first: the first token's id comes from the prefill's answer and the decoder's copy of
    # it is cut, so a later resume does not count it twice.
    async def body():
        async with harness(prefill_first=True) as h:
            req = {"prompt": "p", "max_tokens": 6, "stream": True, "temperature": 0}
            want = await _single_engine(h, "/v1/completions", req)
            h.decoders[0].knobs.delay = 0.3  # the prefill answers first: its token is relayed
            h.decoders[0].knobs.recompute_after = 3
            got = await _events(h.session, h.url + "/v1/completions", req)
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 1
            assert "".join(c["text"] for e in got for c in e["choices"]) == "".join(c["text"] for e in want
                                                                                     for c in e["choices"])
            assert h.prefillers[0].bodies[0]["return_token_ids"] is True
            prompt = tokenize("p")
            assert h.decoders[0].bodies[-1]["prompt"] == prompt + generate_ids(prompt, 3)

    run(body())


def test_echo_requests_are_not_asked_for_token_ids():
    assert token_ids.asks({"prompt": "p"}) and not token_ids.asks({"prompt": "p", "echo": True})
    assert not token_ids.asks({"prompt": "p", "return_token_ids": True})  # the client's own: kept as sent
    assert token_ids.asks({"prompt": "p", "return_token_ids": False})


def test_strip_nulls_the_id_lists_and_nothing_else():
    ev = (b'data: {"choices":[{"index":0,"text":"a \\"token_ids\\":[1]","prompt_token_ids":[1, 2],'
          b'"token_ids":[3]}],"prompt_token_ids":[4]}\n\n')
    out = token_ids.strip(ev)
    obj = msgspec.json.decode(out[len(b"data: "):])
    assert obj == {"choices": [{"index": 0, "text": 'a "token_ids":[1]', "prompt_token_ids": None,
                                "token_ids": None}], "prompt_token_ids": None}
    assert token_ids.strip(b'data: {"choices":[]}\n\n') == b'data: {"choices":[]}\n\n'


def test_what_an_event_carries():
    assert not rc.carries({"index": 0, "text": "", "logprobs": None, "finish_reason": None, "token_ids": None})
    assert not rc.carries({"index": 0, "delta": {"content": ""}, "stop_reason": None})
    for ch in ({"index": 0, "text": "x"}, {"index": 0, "finish_reason": "length", "text": ""},
               {"index": 0, "text": "", "token_ids": [5]}, {"index": 0, "text": "", "logprobs": {"tokens": []}},
               {"index": 0, "delta": {"tool_calls": [{"index": 0}]}}, {"index": 0, "delta": {"reasoning_content": "r"}},
               {"index": 0, "delta": {"role": "assistant", "content": ""}}):
        assert rc.carries(ch), ch


def test_ledger_keeps_the_first_prompt_ids_and_knows_when_ids_are_incomplete():
    led = rc.StreamLedger(False, 1 << 20, n=2)
    led.feed(1, " a", [7], [1, 2])
    led.feed(1, " b", [8], [1, 2, 7, 8])  # a continuation's prompt: not the client's
    assert led.prompt_tokens(0) == led.prompt_tokens(1) == [1, 2] and led.tokens(1) == [7, 8]
    led.feed(2, " x", None, [3])
    assert led.tokens(2) is None and led.prompt_tokens(2) == [3]
    led.feed(3, " r", None, ids_follow=True)  # relayed text whose id the decoder's event brings
    led.feed(3, "", [9])
    assert led.tokens(3) == [9] and led.generated(3) == 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_a_resumed_echo_completion_echoes_the_prompt_once(stream):
    """With ``echo`` the decoder's text begins with the prompt (and it returns no token ids, which
    would drop the echoed text): a recomputed choice resumes by text, the generated text alone
    after the prompt, and its continuation is asked without ``echo``, so the client gets the prompt
    once, then the first two tokens and the continuation's."""
    async def body():
        async with harness(prefill_first=False) as h:
            req = {"prompt": "the prompt", "max_tokens": 6, "stream": stream, "echo": True}
            h.decoders[0].knobs.recompute_after = 2
            if stream:
                got = await _events(h.session, h.url + "/v1/completions", req)
                text = "".join(c.get("text") or "" for e in got for c in e["choices"])
            else:
                status, out = await h.post("/v1/completions", req)
                assert status == 200, out
                text = out["choices"][0]["text"]
            head = "".join(generate("the prompt", 2))
            cont = h.decoders[0].bodies[-1]
            assert "echo" not in cont and cont["prompt"] == "the prompt" + head and cont["max_tokens"] == 4
            assert text == "the prompt" + head + "".join(generate(tokenize("the prompt" + head), 4))

    run(body())


def test_a_resumed_choice_asks_what_is_left_of_min_tokens():
    """vLLM counts ``min_tokens`` in output tokens, which a continuation starts anew: after two
    tokens, a client's 5 is 3 (the continuation used to ask 5 again, with 4 tokens left)."""
    async def body():
        async with harness(prefill_first=False) as h:
            h.decoders[0].knobs.recompute_after = 2
            status, out = await h.post("/v1/completions", {"prompt": "the prompt", "max_tokens": 6, "min_tokens": 5})
            assert status == 200, out
            assert out["choices"][0]["text"] == "".join(generate("the prompt", 6))
            cont = h.decoders[0].bodies[-1]
            assert cont["max_tokens"] == 4 and cont["min_tokens"] == 3

    run(body())
