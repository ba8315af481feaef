"""``--prefill-first`` (lw_proxy.relay): a streamed greedy completion's first token comes from the
prefill's answer while the decoder still works; the output stays the decoder's, token for token."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from lw_core.wire import prompt_digest
from lw_dev.proxy_mocks import chat_context, generate, generate_ids, harness, run, token_text, tokenize
from lw_proxy import parsed_relay, relay
from lw_proxy.validate import parse_completion

GREEDY = {"prompt": "p", "max_tokens": 4, "stream": True, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "p"}], "max_tokens": 4, "stream": True, "temperature": 0}


async def _sse(h, body):
    """(seconds to the first content event, texts of content events, error events, raw events);
    a body with ``messages`` is a chat (its content deltas are the texts)."""
    chat = "messages" in body
    t0 = time.monotonic()
    first, texts, errors, events = None, [], [], []
    async with h.session.post(h.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            events.append(ev)
            if "error" in ev:
                errors.append(ev)
            for ch in ev.get("choices") or ():
                text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                if text:
                    first = first if first is not None else time.monotonic() - t0
                    texts.append(text)
    return first, texts, errors, events


def test_first_token_comes_from_the_prefill_and_the_output_is_unchanged():
    async def body():
        async with harness() as h:  # the proxy's default
            h.decoders[0].knobs.delay = 1.0  # the decoder is slow to answer (scheduling, load)
            first, texts, errors, events = await _sse(h, GREEDY)
            assert errors == []
            assert "".join(texts) == "".join(generate("p", 4)) and len(texts) == 4  # no token twice
            assert first < 0.7, f"first token after {first:.2f} s: it waited for the decoder"
            assert len({ev["id"] for ev in events}) <= 2  # the relayed event's id, then the decoder's
            async with h.session.get(h.url + "/metrics") as r:
                assert "lw_proxy_prefill_first_relayed_total 1.0" in await r.text()

    run(body())


def test_with_no_prefill_first_the_first_token_waits_for_the_decoder():
    """And the stream's decoder is not offered the prefill's token (nothing is relayed, and a
    streaming decoder taking it would wait for the metaserver answer); a non-streamed request's is."""
    async def body():
        async with harness(prefill_first=False) as h:
            h.decoders[0].knobs.delay = 1.0
            first, texts, _, _ = await _sse(h, GREEDY)
            assert "".join(texts) == "".join(generate("p", 4))
            assert first >= 0.9
            async with h.session.post(h.url + "/v1/completions", json={**GREEDY, "stream": False}) as r:
                assert r.status == 200
            assert [b["kv_transfer_params"]["lw_first_token"] for b in h.decoders[0].bodies] == [False, True]

    run(body())


def test_sampled_requests_are_not_relayed():
    async def body():
        async with harness(prefill_first=True) as h:
            h.decoders[0].knobs.delay = 1.0
            first, texts, _, _ = await _sse(h, {**GREEDY, "temperature": 0.7})
            assert "".join(texts) == "".join(generate("p", 4))
            assert first >= 0.9  # the decoder's own first token

    run(body())


def test_a_stream_with_min_tokens_is_relayed_and_its_prefill_asks_one():
    """``min_tokens``: the prefill asks ``min_tokens: 1`` (its first token is never EOS or a stop
    token, as a single engine's first is not), the decoder the client's, and the stream is relayed."""
    async def body():
        async with harness(prefill_first=True) as h:
            h.decoders[0].knobs.delay = 0.5
            _, texts, errors, _ = await _sse(h, {**GREEDY, "min_tokens": 3})
            assert errors == [] and "".join(texts) == "".join(generate("p", 4)) and len(texts) == 4
            assert [b["min_tokens"] for b in h.prefillers[0].bodies] == [1]
            assert [b["min_tokens"] for b in h.decoders[0].bodies] == [3]
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 1

    run(body())


def test_a_sampled_stream_is_relayed_when_its_decoder_continues_from_the_prefills_token():
    """The decoder's metaserver POST says ``forces_first``; its answer carries the prefill's token
    and the prompt's digest, and the proxy relays the token of a sampled request."""
    async def body():
        async with harness(prefill_first=True) as h:
            h.prefillers[0].knobs.delay = 0.3  # the decoder's POST is in before the prefill answers
            h.decoders[0].knobs.forces_first = True
            _, texts, errors, _ = await _sse(h, {**GREEDY, "temperature": 0.7})
            assert errors == [] and "".join(texts) == "".join(generate("p", 4)) and len(texts) == 4
            ((status, answer),) = h.decoders[0].metaserver_results
            assert status == 200 and answer["first_token"] == generate_ids(tokenize("p"), 1)[0]
            assert answer["prompt_digest"] == prompt_digest(tokenize("p"))
            assert h.decoders[0].bodies[0]["kv_transfer_params"]["lw_first_token"] is True
            async with h.session.get(h.url + "/metrics") as r:
                assert "lw_proxy_prefill_first_relayed_total 1.0" in await r.text()

    run(body())


def test_a_sampled_stream_whose_decoder_posts_after_the_prefill_answered_is_relayed_once_it_did():
    """A short prefill can answer before the decoder's metaserver POST is in: the stream waits for
    the POST (not for the decoder's token) and relays the prefill's token once the decoder said it
    continues from it; a decoder that says it does not gets the decoder's path then."""
    async def body():
        async with harness(prefill_first=True) as h:
            dec = h.decoders[0]
            dec.knobs.delay = 0.3  # the POST comes 0.3 s after the prefill answered
            dec.knobs.answer_delay = 0.6  # and the decoder's own first token 0.6 s after that
            dec.knobs.forces_first = True
            first, texts, errors, _ = await _sse(h, {**GREEDY, "temperature": 0.7})
            assert errors == [] and "".join(texts) == "".join(generate("p", 4)) and len(texts) == 4
            assert 0.25 <= first < 0.8, first
            assert dec.answered_first == {0: generate_ids(tokenize("p"), 1)[0]}
            get = h.proxy.m.registry.get_sample_value
            assert get("lw_proxy_prefill_first_relayed_total") == 1
            dec.knobs.forces_first = None  # an older connector: it says nothing of the token
            first, texts, errors, _ = await _sse(h, {**GREEDY, "temperature": 0.7})
            assert errors == [] and "".join(texts) == "".join(generate("p", 4)) and first >= 0.85
            assert get("lw_proxy_prefill_first_relayed_total") == 1
            assert get("lw_proxy_prefill_first_not_relayed_total", {"reason": "not_forced"}) == 1

    run(body())


def _choices(events, chat):
    """Each choice's streamed texts, by index, and the indices' order of their first events."""
    texts: dict[int, list[str]] = {}
    for ev in events:
        for ch in ev.get("choices") or ():
            text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            texts.setdefault(ch["index"], [])
            if text:
                texts[ch["index"]].append(text)
    return texts


def _sampled_choices(h):
    """The harness's prefiller and decoder set for relayed sampled choices: the prefiller's choices
    draw different tokens and it answers after the decoder's POSTs are in; the decoder continues
    from each choice's token and sends its own tokens late."""
    pf, dec = h.prefillers[0], h.decoders[0]
    pf.knobs.distinct_choices = True
    pf.knobs.delay = 0.3
    dec.knobs.forces_first = True
    dec.knobs.token_delay = 0.3
    return pf, dec


def test_each_choice_of_an_echo_stream_begins_with_the_prompt_once():
    """``echo`` with ``n`` 2, sampled: the streamed prefill (without ``echo``) relays each choice's
    first token as it comes, each choice's first event beginning with the prompt's text (vLLM
    echoes per choice) and carrying its ids, and the decoder's echoing events are cut."""
    async def body():
        async with harness(prefill_first=True) as h:
            pf, dec = _sampled_choices(h)
            req = {**GREEDY, "prompt": "the prompt", "echo": True, "temperature": 0.7, "seed": 5, "n": 2}
            _, _, errors, events = await _sse(h, req)
            assert errors == [], errors
            assert "echo" not in pf.bodies[0] and pf.bodies[0]["stream"] is True
            prompt = tokenize("the prompt")
            texts = _choices(events, False)
            for j in range(2):
                first = generate_ids(prompt + [j] if j else prompt, 1)[0]
                want = ["the prompt" + token_text(first)] + generate(prompt + [first], 3)
                assert texts[j] == want, (j, texts[j], want)
                opening = next(ch for ev in events for ch in ev["choices"] if ch["index"] == j)
                assert opening["prompt_token_ids"] == prompt
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 1

    run(body())


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_each_choice_of_a_sampled_stream_gets_its_own_prefill_token(chat):
    """``n`` 3, sampled: the prefill keeps ``n`` (and the seed) and is streamed, each choice's
    engine request on the decoder is answered with its own choice's first token (vLLM names choice
    ``j``'s request ``j_<id>``), the three first tokens are relayed as they come, and every choice
    continues from its own: the client gets the prefiller's draws, each token once."""
    async def body():
        async with harness(prefill_first=True) as h:
            pf, dec = _sampled_choices(h)
            req = {**(CHAT if chat else GREEDY), "temperature": 0.7, "seed": 5, "n": 3}
            first, _, errors, events = await _sse(h, req)
            assert errors == [] and first < 0.55, (first, errors)
            prompt = tokenize(chat_context(CHAT["messages"]) if chat else "p")
            firsts = [generate_ids(prompt + [j] if j else prompt, 1)[0] for j in range(3)]
            assert len(set(firsts)) == 3  # the test tells the choices apart
            assert pf.bodies[0]["n"] == 3 and pf.bodies[0]["seed"] == 5 and pf.bodies[0]["max_tokens"] == 1
            assert pf.bodies[0]["stream"] is True
            got = sorted((dec.metaserver_ids[k].split("_")[0], a["first_token"])
                         for k, (_, a) in enumerate(dec.metaserver_results))
            assert sorted(got) == sorted((str(j), firsts[j]) for j in range(3)), got
            texts = _choices(events, chat)
            for j in range(3):
                want = [token_text(firsts[j])] + generate(prompt + [firsts[j]], 3)
                assert texts[j] == want, (j, texts[j], want)
            # the three relayed tokens opened the stream, before any of the decoder's
            head = [ch["index"] for ev in events[:6 if chat else 3] for ch in ev["choices"]]
            assert sorted(head) == [0, 0, 1, 1, 2, 2] if chat else [0, 1, 2], head
            if chat:
                roles = [ch["index"] for ev in events for ch in ev["choices"] if "role" in ch["delta"]]
                assert sorted(roles) == [0, 1, 2]
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 1

    run(body())


@pytest.mark.parametrize("n", [1, 2])
def test_each_prompt_of_a_streamed_prompt_list_gets_its_own_prefill_tokens(n):
    """A streamed completion of several prompts (``n`` each, sampled): one streamed prefill of them
    all; the decoder's engine request of prompt ``i``'s choice ``j`` (vLLM names it after the
    proxy's ``X-Request-Id``, ``[j_]cmpl-lw-<parent>-<i>-<8 random>``) is answered with that
    choice's first token and that prompt's digest, every first token is relayed, and each choice
    continues from its own: the client gets the prefiller's draws, each token once."""
    prompts = ["p", "q r", "s t u"]

    async def body():
        async with harness(prefill_first=True) as h:
            pf, dec = _sampled_choices(h)
            req = {**GREEDY, "prompt": prompts, "temperature": 0.7, "seed": 5, "n": n}
            first, _, errors, events = await _sse(h, req)
            assert errors == [] and first < 0.55, (first, errors)
            assert pf.bodies[0]["n"] == n and pf.bodies[0]["stream"] is True and pf.bodies[0]["prompt"] == prompts
            firsts = {}
            for pi, p in enumerate(prompts):
                for j in range(n):
                    ids = tokenize(p)
                    firsts[pi * n + j] = (generate_ids(ids + [j] if j else ids, 1)[0], prompt_digest(ids))
            assert len({t for t, _ in firsts.values()}) == len(firsts)  # the test tells the choices apart
            got = {}
            for eid, (_, a) in zip(dec.metaserver_ids, dec.metaserver_results):
                j = int(eid.split("_")[0]) if n > 1 else 0
                pi = int(eid.split("_")[-1].split("-")[-2])
                got[pi * n + j] = (a["first_token"], a["prompt_digest"])
            assert got == firsts
            texts = _choices(events, False)
            for i, (t, _) in firsts.items():
                want = [token_text(t)] + generate(tokenize(prompts[i // n]) + [t], 3)
                assert texts[i] == want, (i, texts[i], want)
            head = sorted(ch["index"] for ev in events[:len(firsts)] for ch in ev["choices"])
            assert head == sorted(firsts), head  # every relayed token before any of the decoder's
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 1

    run(body())


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_choice_the_prefiller_finishes_first_is_relayed_without_waiting_for_the_others(chat):
    """The prefiller streams the prefill of ``n`` 2 and finishes choice 1 a second after choice 0
    (vLLM runs choices as engine requests of their own): choice 0's first token reaches the client
    and its decoder request at once, choice 1's when it comes; each choice continues from its own."""
    async def body():
        async with harness(prefill_first=True) as h:
            pf, dec = h.prefillers[0], h.decoders[0]
            pf.knobs.distinct_choices, pf.knobs.delay, pf.knobs.choice_delay = True, 0.2, 1.0
            dec.knobs.forces_first = True
            req = {**(CHAT if chat else GREEDY), "temperature": 0.7, "seed": 5, "n": 2}
            first, _, errors, events = await _sse(h, req)
            assert errors == [] and first < 0.8, (first, errors)
            prompt = tokenize(chat_context(CHAT["messages"]) if chat else "p")
            firsts = [generate_ids(prompt + [j] if j else prompt, 1)[0] for j in range(2)]
            texts = _choices(events, chat)
            for j in range(2):
                assert texts[j] == [token_text(firsts[j])] + generate(prompt + [firsts[j]], 3), j
            if chat:  # both choices' role events open the stream, as a single engine's
                assert [list(ev["choices"][0]["delta"]) for ev in events[:2]] == [["role", "content"]] * 2
                assert [ch["index"] for ev in events for ch in ev["choices"] if "role" in ch["delta"]] == [0, 1]
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 1
            assert h.proxy.m.registry.get_sample_value("lw_proxy_errors_total", {"kind": "relay_mismatch"}) is None

    run(body())


def test_a_prefill_stream_that_breaks_after_one_choice_leaves_the_others_to_their_decoder():
    """The prefiller dies after choice 0's event: choice 0 was relayed and continues from its token;
    choice 1's decoder request gets the prefill's failure and computes its own first token, which
    the client then gets from the decoder. No other prefiller is asked (a sampled choice drawn
    again could differ from one already out)."""
    async def body():
        async with harness(n_prefill=2, prefill_first=True) as h:
            dec = h.decoders[0]
            for p in h.prefillers:
                p.knobs.distinct_choices, p.knobs.delay, p.knobs.die_after = True, 0.2, 1
            dec.knobs.forces_first = True
            _, _, errors, events = await _sse(h, {**GREEDY, "temperature": 0.7, "n": 2})
            assert errors == []
            prompt = tokenize("p")
            first0 = generate_ids(prompt, 1)[0]
            texts = _choices(events, False)
            assert texts[0] == [token_text(first0)] + generate(prompt + [first0], 3)
            assert texts[1] == generate(prompt, 4)  # the decoder's own (it is not told choice 1 is distinct)
            assert len(h.prefillers[0].bodies) + len(h.prefillers[1].bodies) == 1
            assert h.proxy.m.registry.get_sample_value("lw_proxy_errors_total", {"kind": "prefill_failed"}) == 1

    run(body())


def test_choices_whose_decoder_contradicts_their_relayed_tokens_are_resumed_after_them():
    """Should the decoder's choices not start with their relayed tokens, none of their text reaches
    the client and each choice is resumed after its own relayed token."""
    async def body():
        async with harness(prefill_first=True) as h:
            pf, dec = h.prefillers[0], h.decoders[0]
            pf.knobs.distinct_choices, pf.knobs.delay = True, 0.3
            dec.knobs.forces_first, dec.knobs.first_word = True, " w999"
            _, texts, errors, events = await _sse(h, {**GREEDY, "temperature": 0.7, "n": 2, "max_tokens": 4})
            assert errors == [] and " w999" not in "".join(texts)
            prompt = tokenize("p")
            firsts = [generate_ids(prompt + [j] if j else prompt, 1)[0] for j in range(2)]
            want = {j: [token_text(firsts[j])] + generate(prompt + [firsts[j]], 3) for j in range(2)}
            assert _choices(events, False) == want
            resumed = sorted(b["prompt"] for b in dec.bodies if b.get("prompt") != "p")
            assert resumed == sorted(prompt + [t] for t in firsts)
            assert 'lw_proxy_errors_total{kind="relay_mismatch"} 2.0' in await h.metrics()

    run(body())


def _usage(events):
    (u,) = [ev["usage"] for ev in events if ev.get("usage") and not ev.get("choices")]
    return u


@pytest.mark.parametrize("which", [frozenset({1}), None], ids=["one choice", "every choice"])
def test_the_usage_summary_counts_what_the_client_got_when_choices_are_resumed_after_their_relayed_tokens(which):
    """Usage asked (``include_usage``): a choice dropped for contradicting its relayed token counts
    its relayed token and its continuation's, never the decoder's own; with every choice dropped
    before the decoder's summary came, the prompt is still the client's, not a continuation's."""
    async def body():
        async with harness(prefill_first=True) as h:
            pf, dec = h.prefillers[0], h.decoders[0]
            pf.knobs.distinct_choices, pf.knobs.delay = True, 0.3
            dec.knobs.forces_first, dec.knobs.first_word, dec.knobs.first_word_choices = True, " w999", which
            dec.knobs.token_delay = 0.05  # the decoder's summary comes well after the mismatches
            _, texts, errors, events = await _sse(h, {**GREEDY, "temperature": 0.7, "n": 2, "max_tokens": 4,
                                                      "stream_options": {"include_usage": True}})
            assert errors == [] and " w999" not in "".join(texts)
            u = _usage(events)
            assert u["completion_tokens"] == 8 and u["total_tokens"] == u["prompt_tokens"] + 8, u
            if which is None:  # the decoder's summary never came: the prompt is the client's
                assert u["prompt_tokens"] == len(tokenize("p")), u

    run(body())


def test_a_resumed_choice_counts_its_continuations_tokens_in_the_usage_summary():
    """A choice the decoder ended "recomputed" after 2 of 6 tokens: the summary counts all 6."""
    async def body():
        async with harness() as h:
            h.decoders[0].knobs.recompute_after = 2
            _, texts, errors, events = await _sse(h, {**GREEDY, "max_tokens": 6,
                                                      "stream_options": {"include_usage": True}})
            assert errors == [] and "".join(texts) == "".join(generate("p", 6))
            assert _usage(events)["completion_tokens"] == 6
            cont = [b for b in h.decoders[0].bodies if b.get("prompt") != "p"]
            assert len(cont) == 1 and cont[0]["stream_options"] == {"include_usage": True}

    run(body())


@pytest.mark.parametrize("seed", [None, 5], ids=["continued", "decoder-path"])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_non_streamed_answer_of_several_choices_continues_each_from_its_prefill_token(chat, seed):
    """Not streamed, ``n`` 2, log-probs asked: each choice continues from its own prefill token and
    its first log-prob entry is the prefiller's, whether the proxy continues the prefill
    (lw_proxy.prefill_continue) or, seeded, the decoder takes the token with its metaserver answer."""
    async def body():
        async with harness() as h:
            pf, dec = h.prefillers[0], h.decoders[0]
            pf.knobs.distinct_choices, pf.knobs.delay, pf.knobs.logprob = True, 0.3, -0.25
            dec.knobs.forces_first = True
            path = "/v1/chat/completions" if chat else "/v1/completions"
            req = {**(CHAT if chat else GREEDY), "stream": False, "temperature": 0.7, "n": 2, "seed": seed,
                   **({"logprobs": True} if chat else {"logprobs": 0})}
            async with h.session.post(h.url + path, json=req) as r:
                assert r.status == 200, await r.text()
                choices = (await r.json())["choices"]
            prompt = tokenize(chat_context(CHAT["messages"]) if chat else "p")
            for ch in choices:
                j = ch["index"]
                first = generate_ids(prompt + [j] if j else prompt, 1)[0]
                want = [token_text(first)] + generate(prompt + [first], 3)
                if chat:
                    assert ch["message"]["content"] == "".join(want)
                    entries = [(e["token"], e["logprob"]) for e in ch["logprobs"]["content"]]
                else:
                    assert ch["text"] == "".join(want)
                    entries = list(zip(ch["logprobs"]["tokens"], ch["logprobs"]["token_logprobs"]))
                assert entries == list(zip(want, [-0.25, -0.5, -0.5, -0.5])), (j, entries)
            assert sorted(ch["index"] for ch in choices) == [0, 1]

    run(body())


def test_several_choices_are_relayed_only_when_every_choice_continues_from_its_token():
    """A greedy request of several choices whose decoder does not continue from the tokens keeps
    the decoder's path (``not_forced``); an answer that lacks one choice's token relays none."""
    async def body():
        async with harness(prefill_first=True) as h:
            h.decoders[0].knobs.delay = 0.5
            first, _, errors, events = await _sse(h, {**GREEDY, "n": 2})
            assert errors == [] and first >= 0.45
            assert _choices(events, False) == {0: generate("p", 4), 1: generate("p", 4)}
            get = h.proxy.m.registry.get_sample_value
            assert get("lw_proxy_prefill_first_not_relayed_total", {"reason": "not_forced"}) == 1

    run(body())
    ans = {"id": "x", "created": 1, "model": "m", "choices": [
        {"index": 1, "text": " w6", "finish_reason": "length", "token_ids": [8]},
        {"index": 0, "text": " w5", "finish_reason": "length", "token_ids": [7], "prompt_token_ids": [1]}]}
    first = relay.first_event(msgspec.json.encode(ans), "abc", n=2)
    assert first.choices == {0: relay.Relayed(" w5", [7]), 1: relay.Relayed(" w6", [8])} and first.prompt_ids == [1]
    assert [json.loads(b[6:])["choices"][0]["index"] for b in first.block.split(b"\n\n") if b] == [0, 1]
    assert relay.first_tokens_of(ans, False) == ({0: 7, 1: 8}, [1])
    ans["choices"][1]["finish_reason"] = "stop"  # choice 0 ended at its first token
    assert relay.first_event(msgspec.json.encode(ans), "abc", n=2) is None
    assert relay.first_tokens_of(ans, False) == ({1: 8}, [1])
    assert relay.first_event(msgspec.json.encode(ans), "abc", n=3) is None
    assert [relay.choice_index(r, 3) for r in ("0_cmpl-a-0", "2_cmpl-b", "3_x", "cmpl-1_x", "x")] == [0, 2, None, None, None]
    assert relay.choice_index("cmpl-1_x", 1) == 0
    # Prompt i of a completion's list: named after the proxy's X-Request-Id, then 8 random characters.
    ids = ("cmpl-lw-p-1-0a1b2c3d", "1_cmpl-lw-p-2-0a1b2c3d", "0_cmpl-lw-p-0-x", "cmpl-lw-q-1-x", "cmpl-lw-p-3-x",
           "2_cmpl-lw-p-0-x", "cmpl-lw-p-x")
    assert [relay.choice_index(r, 1, 3, "p") for r in ids[:1]] == [1]
    assert [relay.choice_index(r, 2, 3, "p") for r in ids] == [None, 5, 0, None, None, None, None]
    assert relay.choice_index("cmpl-lw-p-1-x", 1, 3, None) is None  # a name this proxy did not give


def test_decoder_failing_after_the_relay_ends_the_stream_with_an_error():
    async def body():
        async with harness(prefill_first=True, max_retries=0) as h:
            h.decoders[0].knobs.delay = 0.5
            h.decoders[0].knobs.status = 503
            first, texts, errors, _ = await _sse(h, GREEDY)
            assert texts == [generate("p", 1)[0]] and first < 0.45  # the relayed token went out
            assert len(errors) == 1 and errors[0]["error"]["code"] in (502, 503), errors

    run(body(), timeout=20)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("stop", [None, ["zzz"]], ids=["", "stop"])
def test_a_decoder_that_picks_another_first_token_is_resumed_after_the_relayed_one(chat, stop):
    """A near-tie decided the other way by the decoder: none of its answer reaches the client, the
    choice continues from the prefiller's token (a single engine's), and the output is whole. With
    stop strings the relayed event held back the token's last characters (as vLLM does); the
    contradicting decoder never sends them, so the resumed choice's text begins with them."""
    async def body():
        async with harness(prefill_first=True) as h:
            dec = h.decoders[0]
            dec.knobs.delay = 1.0
            dec.knobs.first_word = " w999"
            extra = {"stop": stop} if stop else {}
            first, texts, errors, events = await _sse(h, {**(CHAT if chat else GREEDY), "max_tokens": 5, **extra})
            assert errors == [] and first < 0.7
            assert "".join(texts) == "".join(generate("p", 5)) and " w999" not in "".join(texts)
            if stop:
                assert texts[0] == generate("p", 1)[0][:-2]  # the relayed event held two characters back
            assert dec.knobs.first_word is None  # the decoder did pick the other token
            # by token ids: the prompt's and the relayed token's, both from the prefill's answer
            prompt = tokenize("p")
            if chat:
                roles = [ch["delta"]["role"] for ev in events for ch in ev["choices"] if "role" in ch["delta"]]
                assert roles == ["assistant"]
                resumed = [b for b in dec.bodies if b.get("continue_final_message")]
                assert len(resumed) == 1 and resumed[0]["messages"][-1] == {"role": "assistant",
                                                                             "content": generate("p", 1)[0]}
                assert resumed[0]["kv_transfer_params"]["prompt_token_ids"] == prompt + generate_ids(prompt, 1)
            else:
                resumed = [b for b in dec.bodies if b.get("prompt") != "p"]
                assert [(b["prompt"], b["max_tokens"]) for b in resumed] == [(prompt + generate_ids(prompt, 1), 4)]
            assert 'lw_proxy_errors_total{kind="relay_mismatch"} 1.0' in await h.metrics()

    run(body())


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_first_token_whose_text_is_held_back_is_relayed_as_a_single_engine_streams_it(chat):
    """A first token that is part of a UTF-8 character has empty text until the next token
    completes it: a single engine streams an event with empty text, then the next token's carries
    both. The relay sends that empty event and the decoder's stream goes on from its second token:
    each token once, the text whole."""
    async def body():
        async with harness(prefill_first=True) as h:
            for b in (*h.prefillers, *h.decoders):
                b.knobs.hold_first = True
            h.decoders[0].knobs.delay = 0.5
            _, texts, errors, events = await _sse(h, CHAT if chat else GREEDY)
            assert errors == [] and "".join(texts) == "".join(generate("p", 4)) and len(texts) == 3
            contents = [(ch.get("delta") or {}).get("content") if chat else ch.get("text")
                        for ev in events for ch in ev["choices"]]
            assert contents == ["", "", *texts] if chat else ["", *texts], contents  # chat: the role event first
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 1

    run(body())


def _shape(events):
    """Events as a client compares them: without the id and ``created`` (per request) and the
    fields whose value is null."""
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if v is not None and k not in ("id", "created")}
        return [clean(v) for v in x] if isinstance(x, list) else x
    return [clean(ev) for ev in events]


async def _relayed_and_not(req, check) -> dict[bool, list]:
    """Stream ``req`` through a proxy without ``--prefill-first`` and one with it (a slow decoder,
    so the relay path runs), ``check(h, texts, errors, events)`` on each; the events as a client
    compares them (``_shape``), by whether the first token was relayed, which is checked."""
    got = {}
    for prefill_first in (False, True):
        async with harness(prefill_first=prefill_first) as h:
            h.decoders[0].knobs.delay = 0.5
            _, texts, errors, events = await _sse(h, req)
            check(h, texts, errors, events)
            got[prefill_first] = _shape(events)
            relayed = h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total")
            assert relayed == (1 if prefill_first else 0)
    return got


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("extra", [{}, {"return_token_ids": True},
                                   {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                                   {"return_token_ids": True, "logprobs": "lp",
                                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                                   {"stop": "zz"}, {"stop": ["zzzzzz", "y"], "logprobs": "lp"}],
                         ids=["plain", "ids", "usage", "all", "stop", "stop_long"])
def test_a_relayed_stream_is_the_decoders_stream_event_for_event(chat, extra):
    """Clients cannot tell: a relayed stream (the first events built from the prefill's answer)
    has the events of the same stream not relayed, with token ids and continuous usage when asked,
    and with stop strings the first token's text held back as vLLM holds it (all of it when the
    longest stop string is longer than the token)."""
    extra = dict(extra)
    if extra.pop("logprobs", None):
        extra.update({"logprobs": True, "top_logprobs": 1} if chat else {"logprobs": 1})
    req = {**(CHAT if chat else GREEDY), **extra}

    def check(h, texts, errors, events):
        assert errors == [] and "".join(texts) == "".join(generate("p", 4))

    async def body():
        got = await _relayed_and_not(req, check)
        assert got[True] == got[False]
        if "stream_options" in extra:
            assert all("usage" in ev for ev in got[True])
        if "return_token_ids" in extra:
            assert any("token_ids" in ch for ev in got[True] for ch in ev["choices"])

    run(body())


@pytest.mark.parametrize("extra", [{}, {"return_token_ids": True, "logprobs": 1},
                                   {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}],
                         ids=["plain", "ids", "usage"])
def test_a_streamed_prompt_list_is_relayed_as_the_decoders_stream_event_for_event(extra):
    """Each prompt's first event carries that prompt's ids (asked) and count (continuous usage)."""
    req = {**GREEDY, "prompt": ["p", "q r"], **extra}

    def check(h, texts, errors, events):
        assert errors == [] and "".join(texts) == "".join(a + b for a, b in zip(generate("p", 4), generate("q r", 4)))

    async def body():
        got = await _relayed_and_not(req, check)
        assert got[True] == got[False]
        if "return_token_ids" in extra:
            assert [ev["choices"][0]["prompt_token_ids"] for ev in got[True][:2]] == [tokenize("p"), tokenize("q r")]

    run(body())


@pytest.mark.parametrize("extra", [{}, {"return_token_ids": True}, {"stop": "zz"},
                                   {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}],
                         ids=["plain", "ids", "stop", "usage"])
def test_an_echo_stream_is_relayed_as_the_decoders_stream_event_for_event(extra):
    """``echo``: the prefill is asked without it, and the relayed event begins with the prompt's
    text (none when the client asked for ids: vLLM then echoes the ids only) and carries the
    prompt's ids, as the decoder's own echoing event; the decoder's is cut."""
    req = {**GREEDY, "prompt": "the prompt", "echo": True, **extra}

    def check(h, texts, errors, events):
        assert errors == [], errors
        echo = "" if "return_token_ids" in extra else "the prompt"
        assert "".join(texts) == echo + "".join(generate("the prompt", 4))
        assert events[0]["choices"][0]["prompt_token_ids"] == tokenize("the prompt")
        assert all("echo" not in b for b in h.prefillers[0].bodies)

    async def body():
        got = await _relayed_and_not(req, check)
        assert got[True] == got[False]

    run(body())


def test_eligible_only_for_plain_greedy_single_prompt_streams():
    def req(**kw):
        return parse_completion(msgspec.json.encode({**GREEDY, **kw}))

    assert relay.eligible(req())
    assert relay.eligible(req(temperature=0.0))
    # Sampled streams are eligible, but relayed only when the decoder continues from the token.
    for kw in ({"temperature": 0.5}, {"temperature": None}):
        r = req(**kw)
        assert relay.eligible(r) and not relay.relayable(r, forced=False) and relay.relayable(r, forced=True), kw
    assert relay.relayable(req(), forced=False)
    # min_tokens: the prefill asks at most one (its first token is then drawn as a single engine's)
    assert relay.eligible(req(temperature=0.5, min_tokens=2)) and relay.eligible(req(min_tokens=0))
    assert [relay.prefill_min_tokens(req(**kw)) for kw in ({}, {"min_tokens": None}, {"min_tokens": 0},
                                                           {"min_tokens": 1}, {"min_tokens": 7})] == [0, 0, 0, 1, 1]
    for mt in ("2", 2.0, True, -1):
        assert not relay.eligible(req(min_tokens=mt)) and relay.prefill_min_tokens(req(min_tokens=mt)) is None, mt
    for kw in ({"stream": False}, {"echo": True, "prompt": ["a", "b"]}, {"stream": False, "prompt": ["a", "b"]},
               {"stop": [""]}, {"stop": [1]}, {"stop": "x", "include_stop_str_in_output": 1}, {"echo": 1},
               {"echo": True, "prompt": [1, 2]}, {"echo": True, "logprobs": 0}, {"echo": True, "truncate_prompt_tokens": 3},
               {"best_of": 2},
               {"stream_options": {"include_usage": True, "continuous_usage_stats": 1}},
               {"stream_options": {"include_usage": "yes", "continuous_usage_stats": True}}):
        assert not relay.eligible(req(**kw)), kw
    # Token ids and continuous usage go out with the relayed token as a single engine sends them.
    for kw in ({"return_token_ids": True}, {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
               {"stream_options": {"continuous_usage_stats": False}}, {"stop": ["x"]}, {"stop": []}, {"echo": True},
               {"echo": False}, {"echo": True, "return_token_ids": True},
               {"prompt": ["a", "b"]}, {"n": 2, "prompt": ["a", "b"], "temperature": 0.5}):  # streamed lists too
        assert relay.eligible(req(**kw)), kw
    assert [relay.held_back(req(**kw)) for kw in ({}, {"stop": "ab"}, {"stop": ["a", "abcd"]}, {"stop": []},
                                                  {"stop": "abc", "include_stop_str_in_output": True})] == [0, 1, 3, 0, 0]
    assert relay.continuous_usage(req(stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert relay.continuous_usage(req(stream_options={"continuous_usage_stats": True})) is False  # vLLM: both
    # Several choices of one prompt: relayed only when the decoder continues from each one's token.
    assert relay.eligible(req(n=2)) and not relay.relayable(req(n=2), forced=False)
    assert relay.relayable(req(n=2), forced=True)
    assert relay.eligible(req(stream_options={"include_usage": True}))


@pytest.mark.parametrize("key", relay.EXCLUDED)
def test_an_excluded_key_with_any_value_but_null_or_false_makes_a_request_ineligible(key):
    def req(value):
        kw = {"stream_options": {key: value}} if key == "continuous_usage_stats" else {key: value}
        return parse_completion(msgspec.json.encode({**GREEDY, **kw}))

    for absent in (None, False):
        assert relay.eligible(req(absent)), absent
    # logprobs: 0 and prompt_logprobs: 0 ask for the sampled token's logprob; "" and [] are values too
    for value in (0, 0.0, "", [], {}, 1, True, "x", ["x"]):
        assert not relay.eligible(req(value)), value


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("logprobs", [0, 2])
def test_log_probs_of_the_relayed_token_are_the_prefillers_and_come_once(chat, logprobs):
    """Each token's entry once, in order: the first (the relayed token's) the prefiller's, the rest
    the decoder's (the mocks tell them apart by value)."""
    async def body():
        async with harness() as h:
            h.prefillers[0].knobs.logprob = -0.25
            h.decoders[0].knobs.delay = 1.0
            if chat:
                req = {**CHAT, "logprobs": True, "top_logprobs": logprobs}
                first, texts, errors, events = await _sse(h, req)
                entries = [(e["token"], e["logprob"]) for ev in events for ch in ev["choices"]
                           for e in (ch.get("logprobs") or {}).get("content") or ()]
            else:
                first, texts, errors, events = await _sse(h, {**GREEDY, "logprobs": logprobs})
                entries = [x for ev in events for ch in ev["choices"] if ch.get("logprobs")
                           for x in zip(ch["logprobs"]["tokens"], ch["logprobs"]["token_logprobs"])]
            assert errors == [] and first < 0.7 and "".join(texts) == "".join(generate("p", 4))
            assert entries == list(zip(generate("p", 4), [-0.25, -0.5, -0.5, -0.5])), entries
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 1

    run(body())


def test_an_answer_without_the_asked_log_probs_is_not_relayed():
    def answer(lp):
        return msgspec.json.encode({"id": "x", "created": 1, "model": "m", "choices": [
            {"index": 0, "text": " w5", "finish_reason": "length", "logprobs": lp, "token_ids": [7]}]})

    good = {"tokens": [" w5"], "token_logprobs": [-1.0], "top_logprobs": [{" w5": -1.0}], "text_offset": [0]}
    first = relay.first_event(answer(good), "abc", logprobs=True)
    assert first.choices[0].logprobs == 1 and json.loads(first.block[6:])["choices"][0]["logprobs"] == good
    assert relay.first_event(answer(good), "abc").choices[0].logprobs == 0  # not asked: not sent
    for bad in (None, {}, {**good, "tokens": []}, {**good, "token_logprobs": [-1.0, -2.0]},
                {**good, "tokens": [" w5", " w6"], "token_logprobs": [-1.0, -2.0], "top_logprobs": None,
                 "text_offset": [0, 3]}):  # two entries for one relayed token
        assert relay.first_event(answer(bad), "abc", logprobs=True) is None, bad
    ch = {"index": 0, "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "top_logprobs": None,
                                   "text_offset": [0, 1]}}
    assert relay.cut_logprobs(ch, 1, False) == 0
    assert ch["logprobs"] == {"tokens": ["b"], "token_logprobs": [-2.0], "top_logprobs": None, "text_offset": [1]}
    ch = {"index": 0, "logprobs": {"content": [{"token": "a"}]}}
    assert relay.cut_logprobs(ch, 2, True) == 1 and ch["logprobs"] is None


def test_first_event_only_for_a_whole_token_that_hit_the_length():
    def answer(text, finish="length", **ids):
        return msgspec.json.encode({"id": "x", "created": 1, "model": "m",
                                    "choices": [{"index": 0, "text": text, "finish_reason": finish, **ids}]})

    block, choices, pids, created = relay.first_event(answer(" w5"), "abc")
    ((text, toks, n_logprobs, held, _),) = choices.values()
    ev = json.loads(block[len(b"data: "):])
    assert text == " w5" and held == "" and ev["id"] == "cmpl-lw-abc" and ev["choices"][0]["text"] == " w5"
    assert ev["choices"][0]["finish_reason"] is None and toks is None and pids is None and n_logprobs == 0
    assert created == ev["created"] == 1
    first = relay.first_event(answer(" w5", token_ids=[7], prompt_token_ids=[1, 2]), "abc")
    assert (first.choices[0].token_ids, first.prompt_ids) == ([7], [1, 2])  # kept for the ledger, never sent
    assert json.loads(first.block[len(b"data: "):])["choices"][0]["token_ids"] is None
    for bad in (answer(""), answer(" w5", "stop"), b"not json", None):
        assert relay.first_event(bad, "abc") is None
    # U+FFFD (bytes a prompt left open that the token cannot complete) is the single engine's text too.
    assert relay.first_event(answer("\ufffda", token_ids=[7]), "abc").choices == {0: relay.Relayed("\ufffda", [7])}
    # A token whose text the detokenizer holds back (a partial UTF-8 character): a single engine
    # streams it as an event with empty text, which is relayed; the decoder's is cut by its id.
    first = relay.first_event(answer("", token_ids=[7], prompt_token_ids=[1, 2]), "abc")
    assert first.choices == {0: relay.Relayed("", [7])}
    assert json.loads(first.block[len(b"data: "):])["choices"][0]["text"] == ""
    assert relay.first_event(answer("", token_ids=[7, 8]), "abc") is None


def test_cut_drops_the_relayed_text_across_events_and_refuses_a_different_one():
    a = {"index": 0, "text": " he"}
    skip, skip_ids = relay.cut(a, " hello", None)
    assert (skip, skip_ids) == ("llo", None)
    b = {"index": 0, "text": "llo world"}
    assert relay.cut(b, skip, skip_ids) == ("", None)
    assert a["text"] == "" and b["text"] == " world"
    try:
        relay.cut({"index": 0, "text": " w6"}, " w5", None)
    except relay.Mismatch:
        pass
    else:
        raise AssertionError("a different first token must not pass")


def test_a_streamed_greedy_chat_gets_its_first_token_from_the_prefill():
    """As a single engine streams it: one role event, then the content token by token, each token
    once; the ids the relayed events named are the decoder's."""
    async def body():
        async with harness() as h:
            h.decoders[0].knobs.delay = 1.0
            first, texts, errors, events = await _sse(h, {**CHAT, "stream_options": {"include_usage": True}})
            assert errors == [] and first < 0.7, (first, errors)
            assert "".join(texts) == "".join(generate("p", 4)) and len(texts) == 4
            roles = [ch["delta"]["role"] for ev in events for ch in ev.get("choices") or () if "role" in ch["delta"]]
            assert roles == ["assistant"] and "role" in events[0]["choices"][0]["delta"]
            assert all(ev["object"] == "chat.completion.chunk" for ev in events)
            assert len({ev["id"] for ev in events}) <= 2 and events[-1]["usage"]["completion_tokens"] == 4
            assert all(ev.get("prompt_token_ids") is None for ev in events)  # asked by the proxy, not the client
            assert all(ch.get("token_ids") is None for ev in events for ch in ev.get("choices") or ())
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 1

    run(body())


def test_a_reasoning_chat_keeps_the_decoders_first_token_when_its_answer_shows_no_content():
    async def body():
        async with harness() as h:
            h.decoders[0].knobs.delay = 1.0
            for b in (*h.prefillers, *h.decoders):
                b.knobs.reasoning = True  # the answer is reasoning, no content: nothing to relay
            _, _, errors, events = await _sse(h, CHAT)
            reasoning = [ch["delta"].get("reasoning_content") for ev in events for ch in ev["choices"]]
            assert errors == [] and "".join(x for x in reasoning if x) == "".join(generate("p", 4))
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 0

    run(body())


def test_chat_eligibility_and_first_events():
    from lw_proxy.validate import parse_chat

    def req(**kw):
        return parse_chat(msgspec.json.encode({**CHAT, **kw}))

    assert relay.eligible(req()) and relay.eligible(req(stream_options={"include_usage": True}))
    assert relay.eligible(req(logprobs=True, top_logprobs=2)) and relay.asks_logprobs(req(logprobs=True))
    assert not relay.asks_logprobs(req(logprobs=False)) and not relay.asks_logprobs(req(top_logprobs=2))
    assert relay.eligible(req(temperature=0.5)) and not relay.relayable(req(temperature=0.5), forced=False)
    for kw in ({"stream": False}, {"stop": [""]}, {"echo": True}, {"include_reasoning": False},
               {"return_prompt_text": True}, {"stream_options": {"include_usage": True, "continuous_usage_stats": 1}}):
        assert not relay.eligible(req(**kw)), kw
    for kw in ({"tools": []}, {"functions": [{"name": "f"}]}):  # relayed from a streamed prefill (parsed_relay)
        assert relay.eligible(req(**kw)) and parsed_relay.parsed(req(**kw), reasoning=False), kw
    assert not parsed_relay.parsed(req(), reasoning=False) and parsed_relay.parsed(req(), reasoning=True)

    def answer(msg, finish="length", **top):
        return msgspec.json.encode({"id": "x", "created": 7, "model": "m", **top,
                                    "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                                                 "token_ids": [9]}]})

    first = relay.first_event(answer({"role": "assistant", "content": " w5"}, prompt_token_ids=[1, 2]), "abc", True)
    role_ev, content_ev = (json.loads(x[len(b"data: "):]) for x in first.block.split(b"\n\n") if x)
    assert role_ev["id"] == content_ev["id"] == "chatcmpl-lw-abc" and role_ev["created"] == 7
    assert role_ev["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert content_ev["choices"][0]["delta"] == {"content": " w5"} and content_ev["object"] == "chat.completion.chunk"
    assert (first.choices, first.prompt_ids) == ({0: relay.Relayed(" w5", [9])}, [1, 2])
    for msg in ({"role": "assistant", "content": None, "reasoning_content": " w5"},
                {"role": "assistant", "content": " w5", "reasoning": "r"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "t"}]},
                {"role": "assistant", "content": " w5", "tool_calls": [{"id": "t"}]}, {"role": "assistant"},
                {"role": "assistant", "content": "", "reasoning": ""}):  # a reasoning block opened
        assert relay.first_event(answer(msg), "abc", True) is None, msg
    assert relay.first_event(answer({"content": " w5"}, "stop"), "abc", True) is None
    reasoning_usage = {"usage": {"prompt_tokens": 2, "completion_tokens_details": {"reasoning_tokens": 0}}}
    assert relay.first_event(answer({"role": "assistant", "content": " w5"}, **reasoning_usage), "abc", True) is None
    ch = {"index": 0, "delta": {"content": " w5 w6"}}
    assert relay.cut(ch, " w5", None, True) == ("", None) and ch["delta"] == {"content": " w6"}


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_relayed_stream_has_one_created_the_prefills(chat):
    """The prefiller and the decoder stamp ``created`` each with the second their request started;
    a single engine's stream has one. Every event of a relayed stream, the usage summary included,
    carries the relayed event's; a stream not relayed is the decoder's as it came."""
    async def body():
        for prefill_first, want in ((True, 111), (False, 222)):
            async with harness(prefill_first=prefill_first) as h:
                h.prefillers[0].knobs.created, h.decoders[0].knobs.created = 111, 222
                h.decoders[0].knobs.delay = 0.5
                req = {**(CHAT if chat else GREEDY), "stream_options": {"include_usage": True}}
                _, texts, errors, events = await _sse(h, req)
                assert errors == [] and "".join(texts) == "".join(generate("p", 4))
                assert events[-1]["usage"] is not None
                assert {ev["created"] for ev in events} == {want}, events

    run(body())


def test_every_stream_not_relayed_is_counted_with_its_reason():
    """``lw_proxy_prefill_first_not_relayed_total{reason}``: a kind the relay does not apply to, a
    decoder that answered first, a token that cannot be relayed, a sampled request whose decoder
    does not continue from the token; a relayed stream counts in none of them."""
    def not_relayed(h) -> dict[str, float]:
        get = h.proxy.m.registry.get_sample_value
        return {k: v for k in ("request", "decoder_first", "token", "not_forced")
                if (v := get("lw_proxy_prefill_first_not_relayed_total", {"reason": k}) or 0.0)}

    async def body():
        async with harness() as h:
            h.decoders[0].knobs.delay = 0.5
            await _sse(h, GREEDY)  # relayed
            assert not_relayed(h) == {}
            await _sse(h, {**GREEDY, "prompt_logprobs": 1})
            await _sse(h, {**GREEDY, "suffix": "s"})
            assert not_relayed(h) == {"request": 2}
            await _sse(h, {**GREEDY, "temperature": 0.7})  # this decoder does not say forces_first
            assert not_relayed(h) == {"request": 2, "not_forced": 1}
            h.prefillers[0].knobs.reasoning = True  # the prefill's answer holds no content
            await _sse(h, CHAT)
            assert not_relayed(h) == {"request": 2, "not_forced": 1, "token": 1}
            h.prefillers[0].knobs.reasoning = False
            h.decoders[0].knobs.delay, h.prefillers[0].knobs.delay = 0.0, 1.0
            h.decoders[0].knobs.skip_metaserver = True  # it answers without waiting for the prefill
            _, texts, errors, _ = await _sse(h, GREEDY)
            assert errors == [] and "".join(texts) == "".join(generate("p", 4))
            assert not_relayed(h) == {"request": 2, "not_forced": 1, "token": 1, "decoder_first": 1}
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 1

    run(body())


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_non_streamed_answer_takes_the_first_log_prob_entry_from_the_prefill(chat):
    """Not streamed, log-probs asked, the decoder continues from the prefill's token: the answer is
    the decoder's with the first token's entry the prefiller's (computed over the whole prompt, as
    a single engine does); a decoder that does not continue from it keeps its own entries."""
    async def body():
        async with harness(continue_after_prefill=False) as h:  # the decoder's path
            h.prefillers[0].knobs.logprob = -0.25
            h.prefillers[0].knobs.delay = 0.3  # the decoder's POST is in before the prefill answers
            path = "/v1/chat/completions" if chat else "/v1/completions"
            req = {**(CHAT if chat else GREEDY), "stream": False, "temperature": 0.7, "seed": 5,
                   **({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})}
            for forces, want in ((True, [-0.25, -0.5, -0.5, -0.5]), (None, [-0.5] * 4)):
                h.decoders[0].knobs.forces_first = forces
                async with h.session.post(h.url + path, json=req) as r:
                    assert r.status == 200, await r.text()
                    (ch,) = (await r.json())["choices"]
                if chat:
                    assert ch["message"]["content"] == "".join(generate("p", 4))
                    entries = [(e["token"], e["logprob"]) for e in ch["logprobs"]["content"]]
                else:
                    assert ch["text"] == "".join(generate("p", 4))
                    entries = list(zip(ch["logprobs"]["tokens"], ch["logprobs"]["token_logprobs"]))
                assert entries == list(zip(generate("p", 4), want)), (forces, entries)

    run(body())


def test_a_streamed_prefills_choice_answers_with_its_own_prompts_count_and_ids():
    """A prompt list's streamed prefill: each choice's answer (what its relayed event and its
    metaserver answer are built from) carries its own prompt's ids and count, as vLLM's events do."""
    from lw_proxy.prefill_dispatch import metaserver_answers
    from lw_proxy.prefill_stream import PrefillStream

    def ev(i, pids, prompt):
        return b"data: " + msgspec.json.encode({"id": "x", "created": 1, "model": "m", "choices": [
            {"index": i, "text": " w", "finish_reason": "length", "token_ids": [40 + i], "prompt_token_ids": pids}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}}) + b"\n\n"

    ps = PrefillStream(chat=False)
    assert ps.feed(ev(1, [7, 8, 9], 3) + ev(0, [5], 1)) == [1, 0]
    one = json.loads(ps.answer([1]))
    assert one["usage"]["prompt_tokens"] == 3 and one["choices"][0]["prompt_token_ids"] == [7, 8, 9]
    req = parse_completion(msgspec.json.encode({"prompt": ["a", "b c d"], "stream": True, "max_tokens": 4}))
    both = metaserver_answers(ps.answer([0, 1]), req)
    assert {i: msgspec.json.decode(a)["prompt_digest"] for i, a in both.items()} == {
        0: prompt_digest([5]), 1: prompt_digest([7, 8, 9])}
