"""1P1D on real vLLM (CPU) with the tiny GQA model (block 32): completions, chat, streaming and a
prompt list through lw-proxy give the single engine's greedy output while the decoder loads the
prefiller's chunks; and the failure paths (prefiller down, decoder down, metaserver silent)."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest
from pd_faults_flow import decoder_looks_first, freeze, signal_group

from lw_bench.pd.stack import Stack, free_port, http, metric_sum, post_json, post_sse
from lw_dev.fake_metaserver import FakeMetaserver
from lw_dev.pd_flow import (
    CONTINUED,
    assert_remote_prefill_used,
    baseline,
    continued_streams_proxy,
    decoder_path_proxy,
    settle,
    text,
    through,
)
from lw_dev.pd_oracle import SAMPLING, assert_same, by_index, chat_choice, completion_choice, completion_stream
from lw_proxy import prefill_continue, relay

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
RELAYED = "lw_proxy_prefill_first_relayed_total"


def _completion(prompt, **kw):
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 2, **SAMPLING, **kw}


def _chat(content: str, **kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "logprobs": True, "top_logprobs": 2, **SAMPLING, **kw}


@pytest.mark.parametrize("continued", [True, False], ids=["continued", "decoder-path"])
def test_completion_matches_single_engine_and_loads_the_prefill(gqa_stack: Stack, continued: bool) -> None:
    """Not streamed: continued after the prefill (the decoder given the prompt plus the prefill's
    first token: it loads the prefill's whole prompt and computes that token only), or on the
    decoder's path; the single engine's answer, log-probs included, either way."""
    body = _completion(text(1 + 60 * (not continued), 110))
    ref = completion_choice(baseline(gqa_stack, "/v1/completions", body)["choices"][0])
    url = None if continued else decoder_path_proxy(gqa_stack).url
    ex = through(gqa_stack, "/v1/completions", body, proxy_url=url)
    assert ex.status == 200, ex.out
    assert_same(ref, completion_choice(ex.out["choices"][0]), "completion")
    assert_remote_prefill_used(gqa_stack, ex, 1)
    (rec,) = ex.decode_stats
    assert rec["prompt_tokens"] > 3 * gqa_stack.block_size  # several chunks really moved
    assert (rec["remote_prefill"] == CONTINUED) == continued, rec
    if continued:
        (p,) = ex.prefill_stats
        assert rec["prompt_tokens"] == p["prompt_tokens"] + 1 and rec["metaserver_wait_s"] is None, rec


@pytest.mark.parametrize("continued", [True, False], ids=["continued", "decoder-path"])
def test_chat_matches_single_engine(gqa_stack: Stack, continued: bool) -> None:
    body = _chat(text(2 + 60 * (not continued), 100))
    ref = chat_choice(baseline(gqa_stack, "/v1/chat/completions", body)["choices"][0])
    url = None if continued else decoder_path_proxy(gqa_stack).url
    ex = through(gqa_stack, "/v1/chat/completions", body, proxy_url=url)
    assert ex.status == 200, ex.out
    assert_same(ref, chat_choice(ex.out["choices"][0]), "chat")
    assert_remote_prefill_used(gqa_stack, ex, 1)
    assert (ex.decode_stats[0]["remote_prefill"] == CONTINUED) == continued, ex.decode_stats


@pytest.mark.parametrize("ids", [False, True], ids=["text", "ids"])
def test_an_echo_completion_continued_after_its_prefill_is_the_single_engines(gqa_stack: Stack, ids: bool) -> None:
    """``echo``: the prefill and the continuation are asked without it, and the proxy puts the
    prompt's text in front, as vLLM echoes it (``RequestOutput.prompt``, the text as given; with
    ``return_token_ids`` vLLM echoes the ids only)."""
    body = {"model": "tiny", "prompt": text(401 + 2 * ids, 110), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "echo": True, **({"return_token_ids": True} if ids else {})}
    ref = baseline(gqa_stack, "/v1/completions", body)
    ex = through(gqa_stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    keys = ("text", "token_ids", "prompt_token_ids", "finish_reason")
    assert {k: ex.out["choices"][0][k] for k in keys} == {k: ref["choices"][0][k] for k in keys}
    assert ex.out["choices"][0]["text"].startswith("" if ids else body["prompt"]) and ex.out["usage"] == ref["usage"]
    assert ex.decode_stats[0]["remote_prefill"] == CONTINUED, ex.decode_stats


def test_min_tokens_keep_the_single_engines_first_token_from_the_prefill(gqa_stack: Stack) -> None:
    """``min_tokens``: the prompt's greedy first token made a stop token, so with ``min_tokens: 2``
    a single engine picks another first token (and may stop on it only from the third); the
    prefill, asked ``min_tokens: 1``, picks that one too, and the answer continued after it (the
    continuation asks 1) is the single engine's."""
    prompt = text(402, 110)
    probe = baseline(gqa_stack, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                   "temperature": 0, "return_token_ids": True})
    stop = probe["choices"][0]["token_ids"][0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "min_tokens": 2,
            "stop_token_ids": [stop], "return_token_ids": True}
    ref = baseline(gqa_stack, "/v1/completions", body)["choices"][0]
    assert ref["token_ids"][0] != stop, ref
    ex = through(gqa_stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    ch = ex.out["choices"][0]
    assert (ch["token_ids"], ch["text"], ch["finish_reason"]) == (ref["token_ids"], ref["text"], ref["finish_reason"])
    assert ex.decode_stats[0]["remote_prefill"] == CONTINUED, ex.decode_stats


@pytest.mark.parametrize(("chat", "n", "prompts"), [(False, 1, 1), (True, 1, 1), (False, 2, 1), (False, 2, 2)],
                         ids=["completion", "chat", "completion-n2", "prompt-list-n2"])
def test_a_seeded_sampled_answer_continued_after_its_prefill_is_the_single_engines(gqa_stack: Stack, chat: bool,
                                                                                     n: int, prompts: int) -> None:
    """Not streamed, temperature 1 with a seed: the prefiller draws each choice's first token with
    the seed (choice i: seed + i), its continuation's generator is set one draw ahead
    (lw_vllm.pd.seeded_continuation), so every token is the single engine's; a random-weight model's
    near-uniform tokens would differ almost always otherwise."""
    content = text(500 + 2 * chat + n, 100) if prompts == 1 else [text(510 + k, 100) for k in range(prompts)]
    kw = {"temperature": 1.0, "seed": 5, "n": n, "return_token_ids": True}
    body = _chat(content, **kw) if chat else _completion(content, **kw)
    ref = baseline(gqa_stack, _path(chat), body)
    ex = through(gqa_stack, _path(chat), body)
    assert ex.status == 200, ex.out
    tokens = {ch["index"]: ch["token_ids"] for ch in ex.out["choices"]}
    assert tokens == {ch["index"]: ch["token_ids"] for ch in ref["choices"]}
    assert len({tuple(t) for t in tokens.values()}) == n * prompts  # the choices differ: each had its own seed
    assert [r["remote_prefill"] for r in ex.decode_stats] == [CONTINUED] * n * prompts, ex.decode_stats


def _stop_body(stack: Stack, seed: int, across: bool) -> tuple[dict, str] | None:
    """A greedy completion with a stop string cut from the single engine's answer: one that begins
    in the first token's text and ends in the next (``across``), or one wholly after the first
    token's text that it does not begin; None when this prompt's answer offers none."""
    body = {"model": "tiny", "prompt": text(seed, 110), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    first = baseline(stack, "/v1/completions", {**body, "max_tokens": 1})["choices"][0]["text"]
    whole = baseline(stack, "/v1/completions", body)["choices"][0]["text"]
    n = len(first)
    if not whole.startswith(first) or not first.strip() or len(whole) < n + 4 or "\ufffd" in whole:
        return None
    stop = first[-1] + whole[n] if across else whole[n + 1 : n + 3]
    if stop in first or len(stop) < 2:
        return None
    if prefill_continue.could_cross(first, [stop]) != across:
        return None
    return {**body, "stop": [stop], "logprobs": 2, "return_tokens_as_token_ids": True}, stop


@pytest.mark.parametrize("across", [False, True], ids=["after-the-first-token", "across-the-first-token"])
def test_stop_strings_end_the_answer_where_a_single_engine_ends_it(gqa_stack: Stack, across: bool) -> None:
    """Not streamed, with a stop string: continued when no stop string can begin in the first token's
    text (the decoder finds it in its own output where a single engine finds it), the decoder's path
    when one could (its output holds the first token: it finds the stop across it)."""
    for seed in range(400 + 20 * across, 420 + 20 * across):
        got = _stop_body(gqa_stack, seed, across)
        if got is not None:
            break
    else:
        pytest.fail("no prompt's answer offers a stop string of this kind")
    body, stop = got
    ref = baseline(gqa_stack, "/v1/completions", body)["choices"][0]
    assert ref["finish_reason"] == "stop" and ref["stop_reason"] == stop, ref  # it does stop there
    ex = through(gqa_stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    (ch,) = ex.out["choices"]
    assert_same(completion_choice(ref), completion_choice(ch), "completion with a stop string")
    assert (ch["text"], ch["finish_reason"], ch["stop_reason"]) == (ref["text"], "stop", stop)
    assert (ex.decode_stats[0]["remote_prefill"] == CONTINUED) != across, ex.decode_stats


def test_streaming_matches_single_engine(gqa_stack: Stack) -> None:
    body = _completion(text(3, 120))
    base = baseline(gqa_stack, "/v1/completions", body)["choices"][0]
    ex = through(gqa_stack, "/v1/completions", {**body, "stream": True})
    assert ex.status == 200, ex.out
    got = completion_stream(ex.out)
    assert_same(completion_choice(base), got, "stream")
    if got["tokens"] == completion_choice(base)["tokens"]:
        assert got["text"] == base["text"]
    assert_remote_prefill_used(gqa_stack, ex, 1)


def _relayable_greedy_body(stack: Stack, chat: bool, logprobs: dict) -> dict:
    """A plain streamed greedy completion or chat (no logprobs, what a chat UI sends) whose first
    token the proxy may relay (lw_proxy.relay.first_event: whole text, not an empty or partial-UTF-8
    token, which a random-weight model does produce), judged on the single engine's one-token answer."""
    for seed in range(77, 87):
        body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **logprobs,
                **({"messages": [{"role": "user", "content": text(seed, 150)}]} if chat else {"prompt": text(seed, 150)})}
        first = baseline(stack, _path(chat), {**body, "max_tokens": 1, **({"min_tokens": 1} if "min_tokens" in body else {})})
        if relay.first_event(json.dumps(first).encode(), "probe", chat, "logprobs" in logprobs) is not None:
            return body
    pytest.fail("no prompt of seeds 77-86 starts with a token the proxy may relay")


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _stream_text(events: list, chat: bool) -> str:
    assert events and events[-1] == "[DONE]", events[-3:]
    assert not any("error" in ev for ev in events[:-1]), events
    return "".join((ch.get("delta") or {}).get("content") or "" if chat else ch.get("text") or ""
                   for ev in events[:-1] for ch in ev["choices"])


def _shape(ev: dict) -> tuple:
    """An event's keys, its choices' and their deltas' (what a client's parser sees)."""
    return (tuple(sorted(ev)), tuple((tuple(sorted(ch)), tuple(sorted(ch.get("delta") or {})))
                                     for ch in ev.get("choices") or ()))


def _stream_logprobs(events: list, chat: bool) -> dict:
    """The tokens and top-2 log-probs of a stream, as lw_dev.pd_oracle compares them."""
    if not chat:
        return completion_stream(events)
    content = [e for ev in events[:-1] for ch in ev["choices"] for e in (ch.get("logprobs") or {}).get("content") or ()]
    return chat_choice({"logprobs": {"content": content}})


@pytest.mark.parametrize(("chat", "logprobs"), [
    (False, {}), (True, {}), (False, {"logprobs": 2, "return_tokens_as_token_ids": True}),
    (True, {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}), (False, {"echo": True}),
    (True, {"min_tokens": 3}), (False, {"echo": True, "return_token_ids": True})],
                         ids=["completion", "chat", "completion-logprobs", "chat-logprobs", "completion-echo",
                              "chat-min-tokens", "completion-echo-ids"])
def test_streamed_greedy_text_takes_the_prefill_first_path_by_default(gqa_stack: Stack, chat: bool,
                                                                      logprobs: dict) -> None:
    """Through the proxy's default, a relayable streamed greedy completion's or chat's first token
    comes from the prefill's answer, and the whole text is the single engine's, in events shaped as
    the single engine's (chat: one role event, then the content), with the single engine's tokens
    and log-probs, each once, when asked; the decoder still loaded the prompt and computed the rest.

    Which comes first is a race on an idle stack: the decoder answers as soon as the prefiller has
    committed the prompt to the pool, which can be before the prefiller's own HTTP answer reaches
    the proxy (then there is nothing to gain by relaying). So the decoder is frozen (SIGSTOP) until
    the proxy has relayed the prefill's token, then resumed: the relay path runs for certain."""
    body = {**_relayable_greedy_body(gqa_stack, chat, logprobs), "stream": True}
    status, ref_events = post_sse(gqa_stack.decode.url + _path(chat), body)  # the single engine's stream
    assert status == 200, ref_events
    settle(gqa_stack)
    gqa_stack.decode.mark()
    before = metric_sum(gqa_stack.proxy.url, RELAYED)
    got: dict = {}
    call = threading.Thread(target=lambda: got.update(answer=post_sse(gqa_stack.proxy.url + _path(chat), body)),
                            daemon=True)
    freeze(gqa_stack.decode)
    try:
        call.start()
        deadline = time.monotonic() + 30
        while metric_sum(gqa_stack.proxy.url, RELAYED) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        relayed = metric_sum(gqa_stack.proxy.url, RELAYED) - before
    finally:
        signal_group(gqa_stack.decode, signal.SIGCONT)
    call.join(60)
    assert relayed == 1, "the proxy did not relay the prefill's first token while the decoder was stopped"
    status, events = got["answer"]
    assert status == 200, events
    assert _stream_text(events, chat) == _stream_text(ref_events, chat)
    # How tokens group into events depends on timing (an engine sends what it has: a fast one may
    # send the whole answer as its final event), so compare by kind of event: the role event (chat:
    # once, first), the content events before the finish (the relayed one and the decoder's alike,
    # and the single engine's when it sent any) and the final event.
    if chat:
        roles = [i for i, ev in enumerate(events[:-1]) for ch in ev["choices"] if "role" in (ch.get("delta") or {})]
        assert roles == [0] and _shape(events[0]) == _shape(ref_events[0]), (events, ref_events)
    middle, ref_middle = ({_shape(ev) for ev in evs[1 if chat else 0:-2]} for evs in (events, ref_events))
    assert len(middle) == 1 and ref_middle in (set(), middle), (events, ref_events)
    assert _shape(events[-2]) == _shape(ref_events[-2]), (events, ref_events)
    assert len({ev["id"] for ev in events[:-1]}) == 1  # the relayed events carry the decoder's id
    if "echo" in logprobs:  # the relayed event begins with the prompt (its ids only when ids are asked)
        assert _stream_text(events, chat).startswith("" if "return_token_ids" in logprobs else body["prompt"])
        assert events[0]["choices"][0]["prompt_token_ids"] == ref_events[0]["choices"][0]["prompt_token_ids"]
        assert events[0]["choices"][0]["prompt_token_ids"], events[0]  # vLLM's echoing event carries them
        assert [t for ev in events[:-1] for ch in ev["choices"] for t in ch.get("token_ids") or ()] == [
            t for ev in ref_events[:-1] for ch in ev["choices"] for t in ch.get("token_ids") or ()]
    if "logprobs" in logprobs:
        ref, got = _stream_logprobs(ref_events, chat), _stream_logprobs(events, chat)
        assert len(got["tokens"]) == MAX_TOKENS, got  # one entry per token: the relayed one's not twice
        assert_same(ref, got, "log-probs")
    (rec,) = gqa_stack.decode.new_stats()
    assert rec["loaded_tokens"] == rec["prompt_tokens"] - 1 and rec["failed_blocks"] == 0, rec


def _stream_tokens(events: list) -> list[int]:
    return [t for ev in events[:-1] for ch in ev["choices"] for t in ch.get("token_ids") or ()]


@pytest.mark.parametrize(("chat", "extra"), [(False, {}), (True, {"logprobs": True, "top_logprobs": 2,
                                                                   "return_tokens_as_token_ids": True}),
                                             (False, {"temperature": 1.0, "seed": 11})],
                         ids=["completion", "chat-logprobs", "completion-seeded"])
def test_a_stream_continued_after_its_prefill_is_the_single_engines(gqa_stack: Stack, chat: bool, extra: dict) -> None:
    """``--continue-streams``: the client gets the prefill's first token, then the stream of a
    decoder request of the prompt plus that token, which loads the prompt and computes from the
    token on; text, token ids and log-probs are the single engine's (a seeded draw's too: the
    decoder's generator is set one draw ahead), the usage summary counts the client's prompt."""
    url = continued_streams_proxy(gqa_stack).url
    body = {**_relayable_greedy_body(gqa_stack, chat, {k: v for k, v in extra.items() if "temperature" != k != "seed"}),
            **extra,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    probe = {k: v for k, v in body.items() if k != "stream_options"}
    first = baseline(gqa_stack, _path(chat), {**probe, "stream": False, "max_tokens": 1})
    assert relay.first_event(json.dumps(first).encode(), "probe", chat, "logprobs" in extra) is not None, first
    status, ref_events = post_sse(gqa_stack.decode.url + _path(chat), body)  # the single engine's stream
    assert status == 200, ref_events
    settle(gqa_stack, url)
    gqa_stack.decode.mark()
    before = metric_sum(url, RELAYED)
    status, events = post_sse(url + _path(chat), body)
    assert status == 200, events
    assert metric_sum(url, RELAYED) - before == 1
    assert _stream_text(events, chat) == _stream_text(ref_events, chat)
    assert _stream_tokens(events) == _stream_tokens(ref_events) and len(_stream_tokens(events)) == MAX_TOKENS
    assert events[-2]["usage"] == ref_events[-2]["usage"], (events[-2], ref_events[-2])
    assert len({ev["id"] for ev in events[:-1]}) == 1
    if chat:
        roles = [i for i, ev in enumerate(events[:-1]) for ch in ev["choices"] if "role" in (ch.get("delta") or {})]
        assert roles == [0], events
    if "logprobs" in extra:
        ref, got = _stream_logprobs(ref_events, chat), _stream_logprobs(events, chat)
        assert len(got["tokens"]) == MAX_TOKENS, got
        assert_same(ref, got, "log-probs")
    (rec,) = gqa_stack.decode.new_stats()  # one engine request: the prompt plus the relayed token
    assert rec["remote_prefill"] == CONTINUED and 0 < rec["loaded_tokens"] < rec["prompt_tokens"], rec
    assert rec["failed_blocks"] == 0, rec


@pytest.mark.parametrize("continued", [True, False], ids=["continued", "decoder-path"])
def test_prompt_list_fans_in_to_one_prefill(gqa_stack: Stack, continued: bool) -> None:
    """A completion of several prompts: one prefill of them all; then each prompt's choice is
    continued after its first token (the default) or, on the decoder's path, every prompt's engine
    request on the decoder is answered from that prefill. The single engine's answer either way."""
    prompts = [text(4 + 10 * continued, 90), text(5 + 10 * continued, 130), "ka lo" + " mi" * continued,
               text(6 + 10 * continued, 70)]  # the third is shorter than a chunk
    body = _completion(prompts)
    refs = [completion_choice(c) for c in by_index(baseline(gqa_stack, "/v1/completions", body)["choices"])]
    url = None if continued else decoder_path_proxy(gqa_stack).url
    ex = through(gqa_stack, "/v1/completions", body, proxy_url=url)
    assert ex.status == 200, ex.out
    assert [r["remote_prefill"] == CONTINUED for r in ex.decode_stats] == [continued] * len(prompts), ex.decode_stats
    got = [completion_choice(c) for c in by_index(ex.out["choices"])]
    assert len(got) == len(prompts)
    for i, (r, g) in enumerate(zip(refs, got)):
        assert_same(r, g, f"prompt {i}")
    assert_remote_prefill_used(gqa_stack, ex, len(prompts))


def _token_prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(10, 500) for _ in range(n)]


@pytest.mark.parametrize("n_tokens", [4 * 32, 4 * 32 + 1, 4 * 32 + 31], ids=["aligned", "plus1", "plus31"])
def test_decoder_computes_one_token_whatever_the_alignment(gqa_stack: Stack, n_tokens: int) -> None:
    assert gqa_stack.block_size == 32
    body = _completion(_token_prompt(n_tokens, n_tokens))
    ref = completion_choice(baseline(gqa_stack, "/v1/completions", body)["choices"][0])
    ex = through(gqa_stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    assert_same(ref, completion_choice(ex.out["choices"][0]), f"{n_tokens} tokens")
    assert_remote_prefill_used(gqa_stack, ex, 1)  # promised = loaded = prompt - 1


def test_second_turn_prefill_loads_the_first_turn(gqa_stack: Stack) -> None:
    """producer_is_to_load (default on): turn 2 extends turn 1; the prefiller loads turn 1's chunks
    from the pool and computes only the new tokens; the greedy output is unchanged."""
    bs = gqa_stack.block_size
    turn1 = [{"role": "user", "content": text(31, 120)}]
    ex1 = through(gqa_stack, "/v1/chat/completions", _chat(turn1[0]["content"]))
    assert ex1.status == 200, ex1.out
    (p1,) = ex1.prefill_stats
    n1 = p1["prompt_tokens"]
    messages = [*turn1, {"role": "assistant", "content": ex1.out["choices"][0]["message"]["content"]},
                {"role": "user", "content": text(32, 30)}]
    body = {**_chat(""), "messages": messages}
    ref = chat_choice(baseline(gqa_stack, "/v1/chat/completions", body)["choices"][0])
    ex2 = through(gqa_stack, "/v1/chat/completions", body)
    assert ex2.status == 200, ex2.out
    assert_same(ref, chat_choice(ex2.out["choices"][0]), "turn 2")
    assert_remote_prefill_used(gqa_stack, ex2, 1)
    (p2,) = ex2.prefill_stats
    n2 = p2["prompt_tokens"]
    assert n2 > n1 + bs, (n1, n2)
    # Turn 1's full chunks come from the pool (its last one may differ if the tokenizer merges
    # across the turn boundary); the prefill computes only what turn 2 added, plus at most a chunk.
    assert p2["loaded_tokens"] >= (n1 // bs - 1) * bs > 0, p2
    assert n2 - p2["loaded_tokens"] <= (n2 - n1) + bs, p2


def test_decoder_that_holds_the_prompt_does_not_wait(gqa_stack: Stack) -> None:
    """The same prompt again, on the decoder's path: every full chunk is in the pool, so the
    decoder's metaserver POST says needs_prefill=false and it decodes without waiting; output
    unchanged."""
    body = _completion(text(33, 110))
    ref = completion_choice(baseline(gqa_stack, "/v1/completions", body)["choices"][0])
    url = decoder_path_proxy(gqa_stack).url
    first = through(gqa_stack, "/v1/completions", body, proxy_url=url)
    # "pool holds the prompt" too when the early-dispatched prefill saved it before the decoder looked
    assert first.status == 200 and first.decode_stats[0]["remote_prefill"] in ("ok", "pool holds the prompt"), \
        first.decode_stats
    again = through(gqa_stack, "/v1/completions", body, proxy_url=url)
    assert again.status == 200, again.out
    assert_same(ref, completion_choice(again.out["choices"][0]), "held prompt")
    (rec,) = again.decode_stats
    n = rec["prompt_tokens"]
    assert rec["remote_prefill"] == "pool holds the prompt" and rec["metaserver_wait_s"] is None, rec
    # Every full chunk is loaded; the trailing partial one is keyed by this request's parent, so it is
    # there only when the early-dispatched prefill had saved it before the decoder looked.
    full = min(n // gqa_stack.block_size * gqa_stack.block_size, n - 1)
    assert rec["loaded_tokens"] in (full, n - 1) and rec["failed_blocks"] == 0, rec
    assert rec["promised_tokens"] == rec["loaded_tokens"], rec


def test_bench_pd_quick_reports_a_breakdown(gqa_stack: Stack) -> None:
    """``lw-bench pd --quick``'s measurement on this module's stack: well-formed, no timing claims."""
    import argparse

    from lw_bench.pd import mode as bench_pd

    p = argparse.ArgumentParser()
    bench_pd.add_arguments(p)
    cfg = {**bench_pd.config(p.parse_args(["--quick"])), "block_size": gqa_stack.block_size}
    r = bench_pd.summarize(cfg, bench_pd.measure(gqa_stack, cfg))
    (L,) = [str(x) for x in cfg["lengths"]]
    assert r["problems"] == [], r["problems"]
    assert sorted(rec["kind"] for rec in r["records"]) == ["alone", "pd", "turn2"]
    assert r["ttft_s"]["pd"][L] > 0 and r["ttft_s"]["alone"][L] > 0 and r["ratio_pd_vs_alone"][L] > 0
    assert r["ttft_s"]["turn2"][L] > 0 and r["ratio_turn2_vs_cold_pd"][L] > 0
    bs = gqa_stack.block_size
    assert r["turn2_prefiller_loaded_tokens"][L] == (int(L) // 2) // bs * bs  # turn 1's full chunks
    pd = next(rec for rec in r["records"] if rec["kind"] == "pd")
    assert set(pd["phases"]) == set(bench_pd.PHASES) and pd["phases"]["prefill"] > 0, pd
    assert pd["decoder"]["loaded_tokens"] == pd["decoder"]["prompt_tokens"] - 1, pd
    json.dumps(r)  # --save writes this


def test_prefiller_down_decoder_recomputes(gqa_stack: Stack) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxy = gqa_stack.add_proxy("proxy-no-prefiller", dead, gqa_stack.decode.url, "--max-retries", "1")
    body = _completion(text(7, 100))
    ref = completion_choice(baseline(gqa_stack, "/v1/completions", body)["choices"][0])
    ex = through(gqa_stack, "/v1/completions", body, proxy_url=proxy.url)
    assert ex.status == 200, ex.out
    assert_same(ref, completion_choice(ex.out["choices"][0]), "prefiller down")
    (rec,) = ex.decode_stats
    assert rec["remote_prefill"].startswith("metaserver answered 5"), rec  # the proxy's prefill error
    assert rec["loaded_tokens"] == 0, rec  # nothing was prefilled: the decoder computed it all
    assert ex.prefill_requests == 0 and ex.prefill_stats == []


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_decoder_down_is_a_clear_error(gqa_stack: Stack, stream: bool) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    name = f"proxy-no-decoder-{'s' if stream else 'p'}"
    # Streamed: the retry waits 2 s, so the prefill has answered by then, and whether its first
    # token is relayed depends on the token alone (a random-weight model's may be a partial UTF-8
    # sequence), not on which of the two was faster.
    proxy = gqa_stack.add_proxy(name, gqa_stack.prefill.url, dead, "--max-retries", "1",
                                *(("--retry-delay", "2") if stream else ()))
    t0 = time.monotonic()
    status, raw = http("POST", proxy.url + "/v1/completions", _completion(text(8, 40), stream=stream), timeout=60)
    assert time.monotonic() - t0 < 30, "the proxy took too long to give up on a dead decoder"
    if stream and status == 200:
        # The prefill's first token (greedy, with log-probs: relayable) went out before the
        # decoder attempts ran out: the stream then ends with the error, as any stream whose
        # decoder fails after its first event.
        events = [json.loads(b[len("data: "):]) for b in raw.decode().split("\n\n")
                  if b.startswith("data: ") and b != "data: [DONE]"]
        assert metric_sum(proxy.url, RELAYED) == 1 and "error" in events[-1], events
        out = events[-1]
    else:
        assert status == 502, (status, raw)
        out = json.loads(raw)
    assert "decoder" in out["error"]["message"].lower(), out
    assert out["error"]["code"] == 502


def test_metaserver_never_answers_decoder_recomputes_after_timeout(gqa_stack: Stack) -> None:
    fake = FakeMetaserver()
    fake.mode = "silent"
    try:
        body = _completion(text(9, 100))
        ref = completion_choice(baseline(gqa_stack, "/v1/completions", body)["choices"][0])
        params = {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": fake.url,
                  "lw_parent_id": "parent-silent", "lw_children": 1}
        gqa_stack.decode.mark()
        t0 = time.monotonic()
        status, out = post_json(gqa_stack.decode.url + "/v1/completions", {**body, "kv_transfer_params": params})
        took = time.monotonic() - t0
    finally:
        fake.close()
    assert status == 200, out
    assert_same(ref, completion_choice(out["choices"][0]), "metaserver silent")
    timeout_s = gqa_stack.metaserver_timeout_s
    assert timeout_s <= took < timeout_s + 30, f"answered after {took:.1f} s; decoder timeout {timeout_s} s"
    (rec,) = gqa_stack.decode.new_stats()
    assert rec["remote_prefill"] == f"no metaserver answer within {timeout_s:g} s", rec
    assert rec["loaded_tokens"] == 0 and rec["metaserver_wait_s"] >= timeout_s, rec
    assert fake.bodies == [{"lw_parent_id": "parent-silent", "request_id": rec["req_id"], "needs_prefill": True,
                           "forces_first": None}]


def test_a_metaserver_the_decoder_may_not_call_is_never_called(gqa_stack: Stack) -> None:
    """A client that reaches the decoder directly names the metaserver itself. With
    pd_allowed_metaservers unset only a proxy on loopback at /v1/metaserver is called: any other URL
    is refused before a connection is made, counted, and the request is computed here with the
    single engine's output. The stand-in on 127.0.0.1 counts every request it gets, on any path."""
    fake = FakeMetaserver()
    refused = "vllm:lw_pool_pd_metaserver_refused_total"
    try:
        body = _completion(text(31, 100))
        ref = completion_choice(baseline(gqa_stack, "/v1/completions", body)["choices"][0])
        before = metric_sum(gqa_stack.decode.url, refused)
        foreign = (f"http://127.0.0.1:{fake.port}/admin/reset",  # loopback, not the metaserver path
                   f"http://10.255.255.1:{fake.port}/v1/metaserver")  # another host
        for i, url in enumerate(foreign):
            params = {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": url,
                      "lw_parent_id": f"parent-foreign-{i}", "lw_children": 1, "lw_token": "t" * 32}
            gqa_stack.decode.mark()
            t0 = time.monotonic()
            status, out = post_json(gqa_stack.decode.url + "/v1/completions", {**body, "kv_transfer_params": params})
            assert status == 200, out
            assert_same(ref, completion_choice(out["choices"][0]), f"metaserver {url} refused")
            (rec,) = gqa_stack.decode.new_stats()
            assert "is not allowed" in rec["remote_prefill"] and rec["loaded_tokens"] == 0, rec
            assert rec.get("metaserver_wait_s") is None, rec  # no call, so no wait
            assert time.monotonic() - t0 < gqa_stack.metaserver_timeout_s  # never parked for an answer
        assert fake.stray == [] and fake.bodies == []
        # The control: the same server at the allowed path is called, and does count calls.
        params = {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": fake.url,
                  "lw_parent_id": "parent-allowed", "lw_children": 1}
        status, out = post_json(gqa_stack.decode.url + "/v1/completions", {**body, "kv_transfer_params": params})
        assert status == 200, out
        assert [b["lw_parent_id"] for b in fake.bodies] == ["parent-allowed"] and fake.stray == []
    finally:
        fake.close()
    deadline = time.monotonic() + 30
    while metric_sum(gqa_stack.decode.url, refused) - before < len(foreign):
        assert time.monotonic() < deadline, f"{refused} did not count the {len(foreign)} refusals"
        time.sleep(0.5)


def test_a_sampled_stream_is_relayed_and_its_decoder_continues_from_the_relayed_token(gqa_stack: Stack) -> None:
    """Unseeded sampled streams (temperature 1): the decoder's metaserver POST says it continues from
    the prefill's token, so the proxy relays that token and the decoder's answer goes on from it
    (lw_vllm.pd.first_token). Two independent draws of a random-weight model's near-uniform next
    token would differ almost always: the proxy would count a ``relay_mismatch`` and resume.

    The prefiller is frozen until the decoder has posted, so the POST is in before the prefill answers
    (the proxy relays a sampled token only then). A token that is empty or a partial UTF-8 character
    is not relayed at all; of several requests some are. Then a seeded request through the proxy
    draws the single engine's tokens: forcing the first token keeps the seed's draws in step."""
    mismatch = 'lw_proxy_errors_total{kind="relay_mismatch"}'
    before = metric_sum(gqa_stack.proxy.url, RELAYED), metric_sum(gqa_stack.proxy.url, mismatch)
    for seed in range(6):
        body = {"model": "tiny", "prompt": text(300 + seed, 150), "max_tokens": 8, "temperature": 1.0,
                "ignore_eos": True, "stream": True}
        settle(gqa_stack)
        status, events = decoder_looks_first(gqa_stack.prefill, gqa_stack.proxy.url + "/v1/completions", body)
        chunks = [ev for ev in events if isinstance(ev, dict)]
        assert status == 200 and events[-1] == "[DONE]" and not [ev for ev in chunks if "error" in ev], events
        assert [ev["choices"][0]["finish_reason"] for ev in chunks if ev["choices"]][-1] == "length", events
    relayed = metric_sum(gqa_stack.proxy.url, RELAYED) - before[0]
    assert relayed >= 1, "no sampled first token was relayed"
    assert metric_sum(gqa_stack.proxy.url, mismatch) == before[1], "a decoder did not continue from the relayed token"

    # A seeded request on the decoder's path: the decoder takes the prefill's token and still draws
    # once for it, so its later tokens are the ones a single engine draws with that seed.
    body = _completion(text(310, 150), temperature=1.0, seed=7)
    ref = completion_choice(baseline(gqa_stack, "/v1/completions", body)["choices"][0])
    url = decoder_path_proxy(gqa_stack).url
    settle(gqa_stack, url)
    gqa_stack.decode.mark()
    status, out = decoder_looks_first(gqa_stack.prefill, url + "/v1/completions", body)
    assert status == 200, out
    assert completion_choice(out["choices"][0])["tokens"] == ref["tokens"]
    (rec,) = gqa_stack.decode.new_stats()
    assert "first_from_prefill" in rec["t"] and rec["loaded_tokens"] > 0, rec


@pytest.mark.parametrize("n", [1, 2], ids=["greedy", "seeded-n2"])
def test_a_streamed_prompt_list_is_relayed_and_is_the_single_engines(gqa_stack: Stack, n: int) -> None:
    """A streamed completion of two prompts (greedy; seeded with two choices each): one streamed
    prefill of them all, each engine request on the decoder (named after the proxy's X-Request-Id
    and its prompt: lw_proxy.relay.choice_index) answered with its own choice's first token and its
    own prompt's digest, every first token relayed, and every choice the single engine's, token for
    token. The prefiller is frozen until the decoder has posted (a sampled token is relayed only to
    a decoder that said it continues from it)."""
    prompts = [text(540 + 2 * n, 90), text(541 + 2 * n, 130)]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 6, "stream": True, "return_token_ids": True,
            "ignore_eos": True, **({"temperature": 1.0, "seed": 9, "n": 2} if n > 1 else {"temperature": 0})}
    status, ref = post_sse(gqa_stack.decode.url + "/v1/completions", body)  # the single engine's stream
    assert status == 200 and ref[-1] == "[DONE]", ref

    def per_choice(events: list) -> dict[int, tuple[str, list[int]]]:
        out: dict[int, tuple[str, list[int]]] = {}
        for ev in events[:-1]:
            for ch in ev["choices"]:
                text_, ids = out.get(ch["index"], ("", []))
                out[ch["index"]] = (text_ + (ch.get("text") or ""), ids + (ch.get("token_ids") or []))
        return out

    settle(gqa_stack)
    gqa_stack.decode.mark()
    before = metric_sum(gqa_stack.proxy.url, RELAYED)
    status, events = decoder_looks_first(gqa_stack.prefill, gqa_stack.proxy.url + "/v1/completions", body)
    assert status == 200 and events[-1] == "[DONE]" and not [ev for ev in events[:-1] if "error" in ev], events
    assert metric_sum(gqa_stack.proxy.url, RELAYED) - before == 1, "the prompt list's first tokens were not relayed"
    got, want = per_choice(events), per_choice(ref)
    assert sorted(got) == list(range(2 * n)) and got == want
    assert len({tuple(ids) for _, ids in got.values()}) == 2 * n  # the choices differ: each is its own

    def prompt_ids(events: list) -> dict[int, list[int]]:  # each choice's first event carries its prompt's
        return {ch["index"]: ch["prompt_token_ids"] for ev in reversed(events[:-1]) for ch in ev["choices"]
                if ch.get("prompt_token_ids")}
    assert prompt_ids(events) == prompt_ids(ref) and len({tuple(p) for p in prompt_ids(ref).values()}) == 2
    settle(gqa_stack)
    recs = gqa_stack.decode.new_stats()
    assert len(recs) == 2 * n and all(r["loaded_tokens"] == r["prompt_tokens"] - 1 for r in recs), recs


def test_killed_decoder_behind_the_proxy_is_a_clear_error(gqa_stack: Stack) -> None:
    """A real vLLM decoder dies (SIGKILL of its whole process group): the proxy answers a clear 502
    naming the decoder -- never a 200 with an empty body -- and reports it out of rotation.
    Kept LAST in this module: it kills the module's decoder."""
    proc = gqa_stack.decode.proc
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(30)
    t0 = time.monotonic()
    status, out = post_json(gqa_stack.proxy.url + "/v1/completions", _completion(text(10, 40)), timeout=60)
    assert time.monotonic() - t0 < 30, "the proxy took too long to give up on a killed decoder"
    assert status == 502, (status, out)
    assert "decoder" in out["error"]["message"].lower(), out
    status, health = http("GET", gqa_stack.proxy.url + "/healthcheck", timeout=30)
    body = json.loads(health)
    assert status == 503 and body["healthy_decode_instances"] == 0, body
