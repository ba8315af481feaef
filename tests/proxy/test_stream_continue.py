"""``--continue-streams`` (lw_proxy.sse_relay, prefill_continue.applies_stream): a stream of one
choice gets the prefill's first token, then the stream of a decoder request of the prompt plus that
token (``lw_prefilled``: no metaserver call, no step on the prompt's last token); the client's
stream is a single engine's, event for event."""

from __future__ import annotations

import asyncio
import json

import pytest

from lw_dev.proxy_mocks import generate, generate_ids, harness, run, tokenize, wait_until

GREEDY = {"prompt": "p", "max_tokens": 4, "stream": True, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "p"}], "max_tokens": 4, "stream": True, "temperature": 0}
USAGE = {"stream_options": {"include_usage": True}}


def _path(req: dict) -> str:
    return "/v1/chat/completions" if "messages" in req else "/v1/completions"


async def _events(h, req: dict, url: str | None = None) -> list:
    async with h.session.post((url or h.url) + _path(req), json=req) as r:
        assert r.status == 200, await r.text()
        raw = await r.read()
    return [json.loads(b[6:]) for b in raw.split(b"\n\n") if b.startswith(b"data: {")]


def _shape(events: list) -> list:
    """As a client compares streams: without ids and ``created``, null fields left out, and the
    prompt's counts in usage (the mock vLLM counts every prompt as 5 tokens; the proxy counts the
    client's: ``test_the_usage_summary_counts_the_clients_prompt_and_every_token``)."""
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()
                    if v is not None and k not in ("id", "created", "prompt_tokens", "total_tokens")}
        return [clean(v) for v in x] if isinstance(x, list) else x
    return [clean(ev) for ev in events]


def _completion_text(events: list, index: int | None = None) -> str:
    """A completion stream's text (of choice ``index`` only, when given)."""
    return "".join(ch.get("text") or "" for ev in events for ch in ev.get("choices") or ()
                   if index is None or ch.get("index") == index)


def _counter(h, name: str, **labels: str) -> float:
    return h.proxy.m.registry.get_sample_value(name, labels or None) or 0.0


async def _continued_and_single(req: dict, **knobs) -> tuple[list, list, object]:
    """``req`` through a proxy with ``--continue-streams`` and straight to the decoder as a plain
    vLLM server would answer it; both streams' events, and the harness's decoder state."""
    async with harness(continue_streams=True) as h:
        for b in (*h.prefillers, *h.decoders):
            for k, v in knobs.items():
                setattr(b.knobs, k, v)
        got = await _events(h, req)
        single = await _events(h, req, h.backend_urls[-1])
        assert _counter(h, "lw_proxy_prefill_first_relayed_total") == 1
        return got, single, h.decoders[0]


@pytest.mark.parametrize("req", [GREEDY, CHAT, {**GREEDY, "return_token_ids": True}, {**CHAT, "return_token_ids": True},
                                 {**GREEDY, **USAGE}, {**CHAT, **USAGE, "logprobs": True, "top_logprobs": 1},
                                 {**GREEDY, "echo": True}, {**GREEDY, "min_tokens": 3},
                                 {**CHAT, "temperature": 0.8, "seed": 5}],
                         ids=["completion", "chat", "ids", "chat_ids", "usage", "chat_logprobs_usage", "echo",
                              "min_tokens", "seeded"])
def test_a_continued_stream_is_a_single_engines_event_for_event(req):
    async def body():
        got, single, dec = await _continued_and_single(req)
        assert _shape(got) == _shape(single)
        assert len({ev["id"] for ev in got}) == 1 and len({ev.get("created") for ev in got}) == 1
        cont = dec.bodies[0]  # the only decoder request: the prompt plus the prefill's token
        params = cont["kv_transfer_params"]
        prompt = tokenize("p")
        first = generate_ids(prompt, 1)
        if "messages" in req:
            assert params["prompt_token_ids"] == prompt + first
        else:
            assert cont["prompt"] == prompt + first and "echo" not in cont
        assert params["lw_prefilled"] == 1 and cont["max_tokens"] == 3 and dec.metaserver_results == []
        assert cont.get("min_tokens") == (2 if "min_tokens" in req else None)
        assert cont.get("seed") == req.get("seed")

    run(body())


def test_the_usage_summary_counts_the_clients_prompt_and_every_token():
    async def body():
        got, single, _ = await _continued_and_single({**CHAT, **USAGE})
        assert got[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}  # "p": one token
        assert single[-1]["usage"]["completion_tokens"] == 4

    run(body())


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_first_token_held_back_as_part_of_a_character_comes_whole_with_the_next(chat):
    """A partial UTF-8 character: the relayed event has empty text, and the continuation (whose
    detokenizer is primed with the prompt plus that token) sends it with its first token."""
    async def body():
        got, single, _ = await _continued_and_single(CHAT if chat else GREEDY, hold_first=True)
        assert _shape(got) == _shape(single)

    run(body())


@pytest.mark.parametrize("extra", [{"n": 2}, {"stop": "zz"}, {"logprobs": 1},
                                   {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}],
                         ids=["n2", "stop", "logprobs", "continuous_usage"])
def test_streams_a_continuation_would_show_differently_keep_the_early_dispatch(extra):
    async def body():
        async with harness(continue_streams=True) as h:
            got = await _events(h, {**GREEDY, **extra})
            assert not h.decoders[0].bodies[0]["kv_transfer_params"].get("lw_prefilled")
            assert h.decoders[0].metaserver_results  # the decoder's path, the prefill dispatched early
            assert _completion_text(got, 0) == "".join(generate("p", 4))

    run(body())


def test_a_prefill_that_cannot_be_continued_or_failed_leaves_the_stream_to_the_decoder():
    """A first token a stop string could begin in (the continuation, which looks for stops in its
    own text, would miss it), and a prefiller that fails: the decoder gets the client's request
    with the parent whose prefill already ran, and the stream is its own."""
    async def body():
        async with harness(continue_streams=True) as h:
            pf, dec = h.prefillers[0], h.decoders[0]
            first = generate("p", 1)[0]
            got = await _events(h, {**GREEDY, "stop": first[-1] + "x", "include_stop_str_in_output": True})
            assert not dec.bodies[0]["kv_transfer_params"].get("lw_prefilled") and len(pf.bodies) == 1
            assert dec.metaserver_results  # answered from the prefill that ran
            assert _counter(h, "lw_proxy_prefill_first_not_relayed_total", reason="token") == 1
            assert _completion_text(got) == "".join(generate("p", 4))
            pf.knobs.status = 500  # a prefill that fails: the decoder computes
            got = await _events(h, GREEDY)
            assert _completion_text(got) == "".join(generate("p", 4))
            assert not dec.bodies[1]["kv_transfer_params"].get("lw_prefilled")
            assert _counter(h, "lw_proxy_prefill_first_relayed_total") == 0
            assert len(h.proxy.registry) == 0

    run(body())


def test_a_recomputed_continuation_is_resumed_and_a_failing_one_ends_with_an_error_event():
    async def body():
        async with harness(continue_streams=True) as h:
            dec = h.decoders[0]
            dec.knobs.recompute_after = 1  # the continuation ends after one token with "recomputed"
            got = await _events(h, {**GREEDY, **USAGE})
            assert _completion_text(got) == "".join(generate("p", 4))
            assert got[-1]["usage"]["completion_tokens"] == 4 and got[-1]["usage"]["prompt_tokens"] == 1
            prompt = tokenize("p")
            assert [b["prompt"] for b in dec.bodies] == [prompt + generate_ids(prompt, 1), prompt + generate_ids(prompt, 2)]
            dec.knobs.status = 400  # the decoder refuses the continuation after the token went out
            got = await _events(h, GREEDY)
            assert got[0]["choices"][0]["text"] == generate("p", 1)[0] and "error" in got[-1]
            assert len(h.proxy.registry) == 0

    run(body())


def test_a_client_gone_during_the_prefill_cancels_it_and_sends_the_decoder_nothing():
    async def body():
        async with harness(continue_streams=True) as h:
            pf = h.prefillers[0]
            pf.knobs.delay = 2.0
            task = asyncio.ensure_future(_events(h, GREEDY))
            await wait_until(lambda: pf.bodies, what="the prefill sent")
            task.cancel()
            await wait_until(lambda: pf.aborted == 1, what="the prefill aborted")
            await wait_until(lambda: len(h.proxy.registry) == 0, what="the parent closed")
            assert h.decoders[0].bodies == []

    run(body())
