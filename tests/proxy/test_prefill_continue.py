"""``--prefill-first`` for answers that are not streamed (lw_proxy.prefill_continue): the prefill
goes out alone, and the decoder continues each choice from the prefill's first token, given as
token ids (``lw_prefilled``), without a metaserver call; the client gets a single engine's answer."""

from __future__ import annotations

import msgspec
import pytest

from lw_dev.proxy_mocks import chat_context, generate, generate_ids, harness, run, token_text, tokenize
from lw_proxy import prefill_continue
from lw_proxy.validate import parse_chat, parse_completion

GREEDY = {"prompt": "p", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "p"}], "max_tokens": 4, "temperature": 0}


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


async def _as_single_engine(h, req: dict) -> dict:
    """The proxy's answer to completion ``req``, checked equal to the decoder's as a plain vLLM
    server (no kv_transfer_params) but for what names the response (id, created)."""
    async with h.session.post(h.backend_urls[-1] + "/v1/completions", json=req) as r:
        assert r.status == 200
        want = await r.json()
    status, out = await h.post("/v1/completions", req)
    assert status == 200, out
    strip = ("id", "created", "kv_transfer_params")
    assert {k: v for k, v in out.items() if k not in strip} == {k: v for k, v in want.items() if k not in strip}, (out, want)
    return out


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_the_decoder_continues_from_the_prefills_token_without_a_metaserver_call(chat):
    async def body():
        async with harness() as h:
            pf, dec = h.prefillers[0], h.decoders[0]
            pf.knobs.logprob = -0.25  # tell the prefiller's entries from the decoder's
            req = {**(CHAT if chat else GREEDY), **({"logprobs": True} if chat else {"logprobs": 1})}
            status, out = await h.post(_path(chat), req)
            assert status == 200, out
            prompt = tokenize(chat_context(CHAT["messages"]) if chat else "p")
            want = generate(prompt, 4)
            (ch,) = out["choices"]
            if chat:
                assert ch["message"]["content"] == "".join(want)
                entries = [(e["token"], e["logprob"]) for e in ch["logprobs"]["content"]]
            else:
                assert ch["text"] == "".join(want)
                lp = ch["logprobs"]
                entries = list(zip(lp["tokens"], lp["token_logprobs"]))
                # offsets continue across the seam as vLLM counts them: each the last plus its token's length
                assert lp["text_offset"][:2] == [0, len(want[0])]
            assert entries == list(zip(want, [-0.25, -0.5, -0.5, -0.5]))
            assert ch["finish_reason"] == "length" and ch["token_ids"] is None  # ids the client did not ask for
            assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
            assert out["id"].startswith("chatcmpl-lw-" if chat else "cmpl-lw-") and out.get("kv_transfer_params") is None
            # The decoder got the prompt's ids plus the first token, one request, and called no metaserver.
            (sent,) = dec.bodies
            first = generate_ids(prompt, 1)
            kv = sent["kv_transfer_params"]
            assert kv["lw_prefilled"] == 1 and dec.metaserver_ids == []
            assert (kv["prompt_token_ids"] if chat else sent["prompt"]) == prompt + first
            assert sent["max_completion_tokens" if chat and "max_completion_tokens" in sent else "max_tokens"] == 3
            assert len(pf.bodies) == 1 and pf.bodies[0]["max_tokens"] == 1
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 1

    run(body())


@pytest.mark.parametrize("extra", [{}, {"return_token_ids": True}, {"n": 2, "temperature": 0.7}],
                         ids=["plain", "ids", "n2"])
def test_an_echo_completion_continued_after_its_prefill_is_the_single_engines(extra):
    """``echo``: the prefill is asked without it (its first token is read from the generated text),
    the continuation too, and the answer begins with the prompt once, as a single engine's (not
    when the client asked for token ids: vLLM then echoes the prompt's ids only)."""
    async def body():
        async with harness() as h:
            req = {**GREEDY, "prompt": "the prompt", "echo": True, **extra}
            out = await _as_single_engine(h, req)
            assert out["choices"][0]["text"].startswith("" if extra.get("return_token_ids") else "the prompt")
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_relayed_total") == 1
            assert all("echo" not in b for b in (*h.prefillers[0].bodies, *h.decoders[0].bodies[1:]))

    run(body())


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize(("min_tokens", "prefill", "rest"), [(1, 1, None), (3, 1, 2)], ids=["one", "three"])
def test_min_tokens_the_prefill_asks_one_and_the_continuation_what_is_left(chat, min_tokens, prefill, rest):
    """vLLM counts ``min_tokens`` in output tokens: the prefill (one token) asks 1, so its first
    token is drawn as a single engine's; the continuation, whose output starts after that token,
    asks one fewer than the client (none left: 0)."""
    async def body():
        async with harness() as h:
            status, out = await h.post(_path(chat), {**(CHAT if chat else GREEDY), "min_tokens": min_tokens})
            assert status == 200, out
            prompt = tokenize(chat_context(CHAT["messages"]) if chat else "p")
            ch = out["choices"][0]
            assert (ch["message"]["content"] if chat else ch["text"]) == "".join(generate(prompt, 4))
            assert [b["min_tokens"] for b in h.prefillers[0].bodies] == [prefill]
            (sent,) = h.decoders[0].bodies
            assert sent["kv_transfer_params"]["lw_prefilled"] == 1 and sent["min_tokens"] == (rest or 0)

    run(body())


def test_a_prompt_list_of_several_choices_continues_each_choice_with_its_seed():
    """``n`` 2 over three prompts: the prefill draws every choice of every prompt (its ``n`` kept),
    and choice ``j`` of each prompt is continued from its own first token with ``seed + j``."""
    async def body():
        async with harness() as h:
            pf, dec = h.prefillers[0], h.decoders[0]
            pf.knobs.distinct_choices = True  # the prefiller's choices draw different first tokens
            prompts = ["p", "q r", "s t u"]
            status, out = await h.post("/v1/completions", {**GREEDY, "prompt": prompts, "n": 2, "temperature": 0.7,
                                                           "seed": 3})
            assert status == 200, out
            (pre,) = pf.bodies
            assert pre["n"] == 2 and pre["prompt"] == prompts and pre["seed"] == 3
            sent = {tuple(b["prompt"]): b["seed"] for b in dec.bodies}
            assert len(sent) == 6 and dec.metaserver_ids == []
            for ch in out["choices"]:
                i, j = divmod(ch["index"], 2)
                ids = tokenize(prompts[i])
                first = generate_ids(ids + [j] if j else ids, 1)[0]
                assert sent[tuple(ids + [first])] == 3 + j, ch
                assert ch["text"] == token_text(first) + "".join(generate(ids + [first], 3)), ch

    run(body())


@pytest.mark.parametrize("extra", [{}, {"return_token_ids": True, "temperature": 0.7, "seed": 3}],
                         ids=["greedy", "seeded-ids"])
def test_a_prompt_list_continues_each_prompt_from_its_own_first_token(extra):
    """A completion of several prompts: one prefill of them all, then each prompt's choice goes to
    a decoder as that prompt's ids plus its first token (the request's seed: vLLM seeds every
    prompt of a request alike); the answer is the single engine's."""
    async def body():
        async with harness() as h:
            prompts = ["p", "q r", "s t u"]
            req = {**GREEDY, "prompt": prompts, **extra}
            await _as_single_engine(h, req)
            (pre,) = h.prefillers[0].bodies
            assert pre["prompt"] == prompts and pre["max_tokens"] == 1 and pre["n"] == 1
            conts = h.decoders[0].bodies[1:]
            assert sorted(b["prompt"] for b in conts) == sorted(
                tokenize(p) + generate_ids(tokenize(p), 1) for p in prompts)
            assert all(b["kv_transfer_params"]["lw_prefilled"] == 1 and b["max_tokens"] == 3
                       and b.get("seed") == extra.get("seed") for b in conts)
            assert h.decoders[0].metaserver_ids == []

    run(body())


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_sampled_answer_of_several_choices_continues_each_choice_from_its_own_token(chat):
    async def body():
        async with harness() as h:
            pf, dec = h.prefillers[0], h.decoders[0]
            pf.knobs.distinct_choices = True
            req = {**(CHAT if chat else GREEDY), "temperature": 0.7, "n": 3}
            status, out = await h.post(_path(chat), req)
            assert status == 200, out
            prompt = tokenize(chat_context(CHAT["messages"]) if chat else "p")
            for ch in out["choices"]:
                j = ch["index"]
                first = generate_ids(prompt + [j] if j else prompt, 1)[0]
                text = ch["message"]["content"] if chat else ch["text"]
                assert text == token_text(first) + "".join(generate(prompt + [first], 3)), j
            assert sorted(ch["index"] for ch in out["choices"]) == [0, 1, 2]
            assert len(dec.bodies) == 3 and all(b["n"] == 1 for b in dec.bodies) and dec.metaserver_ids == []
            assert out["usage"]["completion_tokens"] == 12

    run(body())


@pytest.mark.parametrize("n", [1, 3])
def test_a_seeded_answer_continues_each_choice_with_its_own_seed(n):
    """vLLM seeds choice i of n with seed + i on every engine: the prefill keeps n and the seed, and
    choice i's continuation (one choice) is sent with seed + i (lw-vllm sets its generator one draw
    ahead, lw_vllm.pd.seeded_continuation)."""
    async def body():
        async with harness() as h:
            h.prefillers[0].knobs.distinct_choices = True
            status, out = await h.post("/v1/completions", {**GREEDY, "temperature": 0.7, "seed": 11, "n": n})
            assert status == 200, out
            (pre,) = h.prefillers[0].bodies
            assert (pre["seed"], pre["n"]) == (11, n)
            prompt = tokenize("p")
            firsts = {generate_ids(prompt + [j] if j else prompt, 1)[0]: j for j in range(n)}
            # each choice's continuation (its prompt ends with that choice's first token) has its seed
            sent = {firsts[b["prompt"][-1]]: b["seed"] for b in h.decoders[0].bodies}
            assert sent == {j: 11 + j for j in range(n)} and all(b["n"] == 1 for b in h.decoders[0].bodies)
            assert all(b["kv_transfer_params"]["lw_prefilled"] == 1 for b in h.decoders[0].bodies)

    run(body())


def test_an_answer_the_prefill_completes_needs_no_decoder():
    async def body():
        async with harness() as h:
            status, out = await h.post("/v1/completions", {**GREEDY, "max_tokens": 1})
            assert status == 200 and out["choices"][0]["text"] == generate("p", 1)[0]
            assert h.decoders[0].bodies == [] and len(h.prefillers[0].bodies) == 1

    run(body())


@pytest.mark.parametrize("extra", [{"presence_penalty": 0.5},
                                   {"response_format": {"type": "json_object"}}, {"bad_words": ["x"]},
                                   {"stop": "x", "include_stop_str_in_output": "yes"}],
                         ids=["penalty", "json", "bad_words", "stop-unread"])
def test_requests_a_continuation_would_change_keep_the_decoders_path(extra):
    async def body():
        async with harness() as h:
            h.decoders[0].knobs.forces_first = True
            status, out = await h.post("/v1/completions", {**GREEDY, **extra})
            assert status == 200, out
            (sent,) = h.decoders[0].bodies
            kv = sent["kv_transfer_params"]
            assert kv["lw_prefilled"] == 0 and kv["lw_first_token"] is True and sent["prompt"] == "p"
            assert len(h.decoders[0].metaserver_ids) == 1 and len(h.prefillers[0].bodies) == 1

    run(body())


# The mock's answer to "p": " w80", " w96", " w22", " w36", ... (one token each).
@pytest.mark.parametrize(("stop", "include", "want", "tokens", "path"), [
    (["w22"], False, " w80 w96 ", 3, "continued"),  # the stop lies after the first token: the decoder finds it
    (["zz", "w22"], True, " w80 w96 w22", 3, "continued"),
    (["w9"], False, " w80 ", 2, "continued"),  # its prefix "w" does not end " w80"
    ("0 w9", False, " w8", 2, "decoder"),  # it would begin in the first token (" w80") and end in the next
    ([" w80 w"], False, "", 2, "decoder"),  # the whole first token begins it
    (["80"], False, " w", 1, "prefill"),  # wholly in the first token: the prefill ended the answer
], ids=["after", "after-included", "after-prefix-elsewhere", "across", "across-whole-first", "in-first"])
def test_stop_strings_are_found_where_a_single_engine_finds_them(stop, include, want, tokens, path):
    async def body():
        async with harness() as h:
            pf, dec = h.prefillers[0], h.decoders[0]
            dec.knobs.forces_first = True
            status, out = await h.post("/v1/completions", {**GREEDY, "max_tokens": 6, "stop": stop,
                                                           "include_stop_str_in_output": include})
            assert status == 200, out
            (ch,) = out["choices"]
            assert ch["text"] == want and ch["finish_reason"] == "stop", ch
            assert ch["stop_reason"] in ([stop] if isinstance(stop, str) else stop), ch
            assert len(pf.bodies) == 1 and pf.bodies[0]["stop"] == stop
            kinds = [b["kv_transfer_params"]["lw_prefilled"] for b in dec.bodies]
            assert kinds == {"continued": [1], "decoder": [0], "prefill": []}[path], dec.bodies
            assert out["usage"]["completion_tokens"] == tokens

    run(body())


def test_with_on_metaserver_dispatch_the_decoders_decide_whether_to_prefill():
    async def body():
        async with harness(prefill_dispatch="on-metaserver") as h:
            h.decoders[0].knobs.needs_prefill = False  # it holds the prompt: no prefill at all
            status, out = await h.post("/v1/completions", GREEDY)
            assert status == 200 and out["choices"][0]["text"] == "".join(generate("p", 4))
            assert h.prefillers[0].bodies == [] and h.decoders[0].bodies[0]["prompt"] == "p"

    run(body())


def test_a_chat_whose_first_token_is_reasoning_goes_to_the_decoder_with_the_answered_prefill():
    async def body():
        async with harness() as h:
            pf, dec = h.prefillers[0], h.decoders[0]
            pf.knobs.reasoning = dec.knobs.reasoning = True
            dec.knobs.forces_first = True
            status, out = await h.post("/v1/chat/completions", CHAT)
            assert status == 200, out
            prompt = tokenize(chat_context(CHAT["messages"]))
            assert out["choices"][0]["message"]["reasoning_content"] == "".join(generate(prompt, 4))
            (sent,) = dec.bodies
            assert sent["kv_transfer_params"]["lw_prefilled"] == 0
            assert len(pf.bodies) == 1  # one prefill: the decoder's metaserver call was answered from it
            assert dec.answered_first == {0: generate_ids(prompt, 1)[0]}
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_not_relayed_total",
                                                       {"reason": "token"}) == 1

    run(body())


def test_a_failed_prefill_leaves_the_request_to_the_decoder():
    async def body():
        async with harness() as h:
            h.prefillers[0].knobs.status = 500
            status, out = await h.post("/v1/completions", GREEDY)
            assert status == 200 and out["choices"][0]["text"] == "".join(generate("p", 4))
            (sent,) = h.decoders[0].bodies
            assert sent["prompt"] == "p" and sent["kv_transfer_params"]["lw_prefilled"] == 0
            assert [s for s, _ in h.decoders[0].metaserver_results] == [502]  # told to compute it all
            assert h.proxy.m.registry.get_sample_value("lw_proxy_prefill_first_not_relayed_total",
                                                       {"reason": "decoder_first"}) == 1

    run(body())


def test_a_decoder_refusing_the_continuation_is_answered_as_it_said():
    async def body():
        async with harness() as h:
            h.decoders[0].knobs.status = 400
            status, out = await h.post("/v1/completions", GREEDY)
            assert status == 400 and out["error"]["message"] == "mock failure"

    run(body())


def test_a_continuation_the_decoder_recomputes_is_resumed_after_what_it_generated():
    async def body():
        async with harness() as h:
            h.decoders[0].knobs.recompute_after = 1  # the continuation loses its KV after one token
            status, out = await h.post("/v1/completions", {**GREEDY, "max_tokens": 5})
            assert status == 200 and out["choices"][0]["text"] == "".join(generate("p", 5))
            assert out["usage"]["completion_tokens"] == 5
            first = generate_ids(tokenize("p"), 2)
            assert h.decoders[0].bodies[-1]["prompt"] == tokenize("p") + first  # resumed by ids after both

    run(body())


def test_which_requests_are_continued():
    def parse(body):
        return (parse_chat if "messages" in body else parse_completion)(msgspec.json.encode(body))

    def applies(body):
        return prefill_continue.applies(parse(body), True)

    assert applies(GREEDY) and applies(CHAT) and applies({**GREEDY, "temperature": 0.7, "n": 2})
    assert applies({**GREEDY, "seed": 3}) and applies({**GREEDY, "temperature": 0.7, "seed": 3})
    assert applies({**GREEDY, "stop": []}) and applies({**GREEDY, "response_format": {"type": "text"}})
    assert applies({**GREEDY, "stop": "x"}) and applies({**CHAT, "stop": ["x", "yz"], "include_stop_str_in_output": True})
    assert applies({**GREEDY, "presence_penalty": 0, "frequency_penalty": 0.0})
    assert applies({**GREEDY, "echo": True}) and applies({**GREEDY, "echo": True, "return_token_ids": True})
    assert applies({**GREEDY, "min_tokens": 2}) and applies({**CHAT, "min_tokens": 0})
    assert applies({**GREEDY, "prompt": ["a", "b"]}) and applies({**GREEDY, "prompt": [[1, 2], [3]]})
    assert applies({**GREEDY, "prompt": ["a", "b"], "n": 2})
    for kw in ({"stream": True}, {"prompt": ["a", "b"], "best_of": 2}, {"prompt": ["a", "b"], "echo": True},
               {"prompt": ["a", "b"], "min_tokens": "1"}, {"echo": True, "logprobs": 1}, {"echo": True, "prompt": [5, 6]},
               {"echo": 1}, {"suffix": "s"}, {"min_tokens": "2"},
               {"stop": 3}, {"frequency_penalty": 0.1}, {"best_of": 2, "n": 1},
               {"structured_outputs": {"regex": "a"}}, {"logits_processors": ["m.P"]}, {"vllm_xargs": {"a": 1}}):
        assert not applies({**GREEDY, **kw}), kw
    for kw in ({"tools": [{"type": "function", "function": {"name": "f"}}]}, {"continue_final_message": True},
               {"messages": [{"role": "user", "content": [{"type": "text", "text": "p"}]}]}):
        assert not applies({**CHAT, **kw}), kw
    assert not prefill_continue.applies(parse(GREEDY), False)  # --no-prefill-first


@pytest.mark.parametrize(("message", "continued"), [
    ({"content": "a", "reasoning": None}, True),
    ({"content": "", "reasoning": None}, True),  # a first token whose text vLLM holds back
    ({"content": None, "reasoning": ""}, False),  # a reasoning parser saw a block open ("<think>")
    ({"content": None, "reasoning_content": "a"}, False),
    ({"content": None}, False),
    ({"content": "a", "tool_calls": [{"id": "t"}]}, False),
], ids=["content", "held-back", "block-opened", "reasoning", "no-content", "tool-call"])
def test_a_chat_continues_only_from_a_first_token_in_plain_content(message, continued):
    req = parse_chat(msgspec.json.encode(CHAT))
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": "length",
                           "token_ids": [7]}], "prompt_token_ids": [1, 2]}
    got = prefill_continue.plan(req, msgspec.json.encode(answer))
    assert (got is not None) == continued
    if continued:
        assert got.continuations[0].prompt_ids == [1, 2, 7] and got.continuations[0].prefilled == 1


def test_could_cross():
    cross = prefill_continue.could_cross
    assert cross(" ab", ["bc"]) and cross(" ab", ["abc"]) and cross("ab", ["abcd"]) and cross("x\n", ["\n\n"])
    assert not cross(" ab", ["b"])  # a one-character stop lies wholly in one token's text
    assert not cross(" ab", ["ab"])  # wholly in the first token: the prefill would have stopped
    assert not cross("", ["ab"]) and not cross(" ab", []) and not cross(" ab", ["ca", "xa"]) and cross(" ab", ["ca", "ba"])
