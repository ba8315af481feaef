"""Decoder-first PD flow end to end against mock vLLM servers on 127.0.0.1 (docs/design/architecture.md §6)."""

from __future__ import annotations

import msgspec

from lw_dev.proxy_mocks import METASERVER_OK, chat_context, generate, generate_ids, harness, run, tokenize


def _text(words):
    return "".join(words)


async def _sse(h, path, body):
    """POST a streaming request; return (status, list of decoded data payloads, raw text)."""
    async with h.session.post(h.url + path, json=body) as r:
        raw = (await r.read()).decode()
        status = r.status
    events = []
    for block in raw.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else msgspec.json.decode(payload))
    return status, events, raw


def test_completion_goes_decoder_first_then_one_prefill():
    async def body():
        async with harness(continue_after_prefill=False) as h:
            status, out = await h.post("/v1/completions", {"model": "m", "prompt": "hello world", "max_tokens": 4})
            assert status == 200, out
            assert out["choices"][0]["text"] == _text(generate("hello world", 4))
            dec, pf = h.decoders[0], h.prefillers[0]
            (dbody,) = dec.bodies
            params = dbody["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
            assert params["metaserver"] == h.url + "/v1/metaserver"
            assert params["lw_children"] == 1
            # the client's own fields reach the decoder untouched
            assert dbody["prompt"] == "hello world" and dbody["max_tokens"] == 4
            (pbody,) = pf.bodies
            assert pbody["prompt"] == "hello world"
            assert pbody["max_tokens"] == 1 and pbody["stream"] is False
            assert pbody["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                                   "lw_parent_id": params["lw_parent_id"]}
            assert dec.metaserver_results == [METASERVER_OK]
            assert len(h.proxy.registry) == 0  # bookkeeping freed once the decoder answered

    run(body())


def test_prompt_list_fans_in_to_one_prefill():
    async def body():
        async with harness(continue_after_prefill=False) as h:  # the decoder's path (a list is continued by default)
            prompts = ["alpha", "beta gamma", "delta"]
            status, out = await h.post("/v1/completions", {"prompt": prompts, "max_tokens": 3, "n": 2})
            assert status == 200, out
            dec, pf = h.decoders[0], h.prefillers[0]
            assert dec.bodies[0]["kv_transfer_params"]["lw_children"] == 6
            assert len(pf.bodies) == 1, "one prefill dispatch must carry every child"
            assert pf.bodies[0]["prompt"] == prompts and pf.bodies[0]["n"] == 1
            assert [s for s, _ in dec.metaserver_results] == [200] * 6
            texts = sorted((c["index"], c["text"]) for c in out["choices"])
            assert texts == [(i, _text(generate(prompts[i // 2], 3))) for i in range(6)]
        async with harness(prefill_first=False) as h:  # a streamed list not relayed: no choice's token is used
            async with h.session.post(h.url + "/v1/completions",
                                      json={"prompt": prompts, "max_tokens": 3, "n": 2, "stream": True}) as r:
                assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
            assert [(b["n"], b["stream"]) for b in h.prefillers[0].bodies] == [(1, False)]

    run(body())


def test_token_prompt_lists_count_children():
    async def body():
        async with harness(continue_after_prefill=False) as h:  # the decoder's path (a list is continued by default)
            status, _ = await h.post("/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2})
            assert status == 200
            assert h.decoders[0].bodies[0]["kv_transfer_params"]["lw_children"] == 2
            status, _ = await h.post("/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 2})
            assert status == 200
            assert h.decoders[0].bodies[1]["kv_transfer_params"]["lw_children"] == 1
            assert len(h.prefillers[0].bodies) == 2

    run(body())


def test_chat_prefill_caps_both_token_fields():
    async def body():
        async with harness() as h:
            msgs = [{"role": "user", "content": "hi there"}]
            status, out = await h.post("/v1/chat/completions", {"messages": msgs, "max_completion_tokens": 5})
            assert status == 200, out
            assert out["choices"][0]["message"]["content"] == _text(generate(chat_context(msgs), 5))
            (pbody,) = h.prefillers[0].bodies
            assert pbody["max_tokens"] == 1 and pbody["max_completion_tokens"] == 1 and pbody["stream"] is False
            assert pbody["messages"] == msgs

    run(body())


def test_streaming_completion_and_chat():
    async def body():
        async with harness() as h:
            status, events, _ = await _sse(h, "/v1/completions", {"prompt": "abc", "max_tokens": 6, "stream": True})
            assert status == 200 and events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == _text(generate("abc", 6))
            msgs = [{"role": "user", "content": "q"}]
            status, events, _ = await _sse(h, "/v1/chat/completions",
                                           {"messages": msgs, "max_tokens": 4, "stream": True,
                                            "stream_options": {"include_usage": True}})
            assert status == 200 and events[-1] == "[DONE]"
            assert events[-2]["usage"]["completion_tokens"] == 4
            text = "".join(e["choices"][0]["delta"]["content"] for e in events[:-2])
            assert text == _text(generate(chat_context(msgs), 4))
            # the prefill never streams
            assert all(b["stream"] is False for b in h.prefillers[0].bodies)
            assert "stream_options" not in h.prefillers[0].bodies[1]

    run(body())


def test_recomputed_choice_is_resumed_non_streaming():
    async def body():
        async with harness(continue_after_prefill=False) as h:
            h.decoders[0].knobs.recompute_after = 3
            status, out = await h.post("/v1/completions", {"prompt": "the prompt", "max_tokens": 8})
            assert status == 200, out
            ch = out["choices"][0]
            assert ch["text"] == _text(generate("the prompt", 8))
            assert ch["stop_reason"] != "recomputed" and ch["finish_reason"] == "length"
            assert ch["token_ids"] is None and ch["prompt_token_ids"] is None  # the client did not ask for them
            first, second = h.decoders[0].bodies
            assert first["return_token_ids"] is True  # the proxy asked, to resume by token ids
            # the prompt's token ids + the generated ones, not the text re-tokenized
            prompt = tokenize("the prompt")
            assert second["prompt"] == prompt + generate_ids(prompt, 3)
            assert second["max_tokens"] == 5
            assert out["usage"]["completion_tokens"] == 8
            assert "lw_proxy_recompute_resubmissions_total 1.0" in await h.metrics()

    run(body())


def test_recomputed_choice_is_resumed_streaming_and_chat():
    async def body():
        async with harness(continue_after_prefill=False) as h:
            h.decoders[0].knobs.recompute_after = 2
            status, events, _ = await _sse(h, "/v1/completions", {"prompt": "xy", "max_tokens": 5, "stream": True})
            assert status == 200 and events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == _text(generate("xy", 5))
            assert all(c.get("stop_reason") != "recomputed" for e in events[:-1] for c in e["choices"])
            assert len({e["id"] for e in events[:-1]}) == 1, "the resumed part keeps the stream's id"

            h.decoders[0].recomputed = 0
            msgs = [{"role": "user", "content": "chat prompt"}]
            status, out = await h.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 6})
            assert status == 200
            assert out["choices"][0]["message"]["content"] == _text(generate(chat_context(msgs), 6))
            last = h.decoders[0].bodies[-1]
            assert last["continue_final_message"] is True and last["add_generation_prompt"] is False
            assert last["messages"][-1]["role"] == "assistant" and last["max_tokens"] == 4

    run(body())


def test_recompute_is_bounded():
    async def body():
        async with harness(max_retries=1) as h:
            h.decoders[0].knobs.recompute_after = 1
            h.decoders[0].knobs.recompute_times = 100
            status, out = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 10})
            assert status == 502 and "recomputed" in out["error"]["message"]
            assert len(h.decoders[0].bodies) == 3  # the first answer + max_retries + 1 resubmissions

    run(body())


def test_least_loaded_decoder_spreads_concurrent_requests():
    async def body():
        import asyncio

        async with harness(n_prefill=2, n_decode=2) as h:
            for d in h.decoders:
                d.knobs.delay = 0.2
            rs = await asyncio.gather(*(h.post("/v1/completions", {"prompt": "p" * 40, "max_tokens": 2})
                                        for _ in range(4)))
            assert all(s == 200 for s, _ in rs)
            assert [len(d.bodies) for d in h.decoders] == [2, 2]

    run(body())
