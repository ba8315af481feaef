"""Streaming PD (``pd_streaming``, docs/guide/streaming-pd.md) on real vLLM (CPU), tiny GQA model,
embedded pool, prefiller + decoder + lw-proxy: the decoder pulls the prompt's layers while the
prefiller publishes them (vLLM's async load), the greedy output equals the single engine's, and a
prefill that never comes turns into a recompute at the deadline."""

from __future__ import annotations

import random
import time

import pytest
from pd_faults_flow import decoder_looks_first

from lw_bench.pd.stack import Stack, free_port, metric_sum, metric_sums, post_json, post_sse
from lw_dev.fake_metaserver import FakeMetaserver
from lw_dev.pd_flow import baseline, settle, text, through
from lw_dev.pd_oracle import SAMPLING, assert_same, completion_choice
from lw_dev.pd_streaming_flow import streams_in_decoder_first

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 8
TIMEOUT_S = 10.0  # metaserver_timeout_s: the whole receive's deadline
RELAYED = "lw_proxy_prefill_first_relayed_total"


@pytest.fixture(scope="module")
def stream_stack(gqa_stream_stack: Stack) -> Stack:
    """conftest's, handed on to test_pd_streaming_faults once this module is done."""
    assert gqa_stream_stack.metaserver_timeout_s == TIMEOUT_S
    return gqa_stream_stack


def _completion(prompt, **kw):
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 2, **SAMPLING, **kw}


def _token_prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(10, 500) for _ in range(n)]


def _loaded_whole(rec: dict, *, streamed: bool = False) -> None:
    """The decoder loaded the whole prompt but its last token, every chunk landed. Through the
    proxy the prefill is dispatched with the decoder's request and may have committed the whole
    prompt before the decoder first looks ("pool holds the prompt": a plain load); ``streamed``
    requires the streaming receive."""
    n = rec["prompt_tokens"]
    assert rec["remote_prefill"] in (("streaming",) if streamed else ("streaming", "pool holds the prompt")), rec
    assert rec["promised_tokens"] == rec["loaded_tokens"] == n - 1 and rec["failed_blocks"] == 0, rec
    if rec["remote_prefill"] == "streaming":
        assert "stream_sent" in rec["t"] and "load_done" in rec["t"], rec


@pytest.mark.parametrize("prompt", [text(41, 110), _token_prompt(5, 4 * 32), _token_prompt(6, 4 * 32 + 1)],
                         ids=["text", "aligned", "plus1"])
def test_streamed_prompt_gives_the_single_engine_output(stream_stack: Stack, prompt) -> None:
    body = _completion(prompt)
    ref = completion_choice(baseline(stream_stack, "/v1/completions", body)["choices"][0])
    ex = through(stream_stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    assert_same(ref, completion_choice(ex.out["choices"][0]), "streaming PD")
    (rec,) = ex.decode_stats
    assert rec["prompt_tokens"] > 3 * stream_stack.block_size
    _loaded_whole(rec)
    (p,) = ex.prefill_stats  # the prefiller saved (and so published) every chunk of the prompt
    assert p["saved_chunks"] == -(-rec["prompt_tokens"] // stream_stack.block_size), p


def test_sampled_streams_are_relayed_and_the_streaming_decoder_continues_from_the_relayed_token(
        stream_stack: Stack) -> None:
    """A streaming decoder continues from the prefill's first token too: its receive is reported
    only once the metaserver answer carrying the token reached it, so vLLM schedules the request
    with the token. Unseeded temperature-1 streams are relayed with no ``relay_mismatch`` (two
    independent draws of a random-weight model's near-uniform next token would differ almost
    always); a seeded request through the proxy draws the single engine's tokens."""
    mismatch = 'lw_proxy_errors_total{kind="relay_mismatch"}'
    url = stream_stack.proxy.url
    before = metric_sum(url, RELAYED), metric_sum(url, mismatch)
    for seed in range(6):
        body = {"model": "tiny", "prompt": text(320 + seed, 150), "max_tokens": 8, "temperature": 1.0,
                "ignore_eos": True, "stream": True}
        settle(stream_stack)
        status, events = post_sse(url + "/v1/completions", body)
        chunks = [ev for ev in events if isinstance(ev, dict)]
        assert status == 200 and events[-1] == "[DONE]" and not [ev for ev in chunks if "error" in ev], events
        assert [ev["choices"][0]["finish_reason"] for ev in chunks if ev["choices"]][-1] == "length", events
    relayed = metric_sum(url, RELAYED) - before[0]
    assert relayed >= 1, "no sampled first token was relayed"
    assert metric_sum(url, mismatch) == before[1], "a decoder did not continue from the relayed token"

    # Not streamed, with log-probs: the answer is the decoder's, the first token's entry the
    # prefiller's, computed over the whole prompt as the single engine does: equal to its bits.
    # The decoder looks at the pool before the prefill exists (else it may hold the prompt already,
    # and then neither streams nor waits for the token).
    body = _completion(text(330, 150), temperature=1.0, seed=7)
    single = baseline(stream_stack, "/v1/completions", body)["choices"][0]
    ref = completion_choice(single)
    settle(stream_stack)
    stream_stack.decode.mark()
    status, out = decoder_looks_first(stream_stack.prefill, url + "/v1/completions", body)
    assert status == 200, out
    assert completion_choice(out["choices"][0])["tokens"] == ref["tokens"]
    lp = out["choices"][0]["logprobs"]
    assert (lp["token_logprobs"][0], lp["top_logprobs"][0]) == (single["logprobs"]["token_logprobs"][0],
                                                                single["logprobs"]["top_logprobs"][0])
    settle(stream_stack)
    (rec,) = stream_stack.decode.new_stats()
    assert rec["remote_prefill"] == "streaming" and "first_from_prefill" in rec["t"], rec
    assert rec["loaded_tokens"] == rec["prompt_tokens"] - 1 and rec["failed_blocks"] == 0, rec


def _choice_tokens(choices: list[dict]) -> dict[int, list[str]]:
    """Each choice's tokens (``return_tokens_as_token_ids``) by index, across a non-streamed answer's
    choices or a stream's events' choices."""
    out: dict[int, list[str]] = {}
    for ch in choices:
        out.setdefault(ch["index"], []).extend((ch.get("logprobs") or {}).get("tokens") or ())
    return out


def test_each_choice_of_a_seeded_request_continues_from_its_own_prefill_token(stream_stack: Stack) -> None:
    """``n`` 3, seeded, temperature 1: the prefill keeps ``n`` and the seed (vLLM seeds choice ``i``
    with ``seed + i`` on every engine), each choice's request on the decoder is answered with its
    own choice's first token and continues from it, so every choice draws the single engine's
    tokens, streamed and not. Choice ``i`` given another choice's token would draw other tokens."""
    url = stream_stack.proxy.url
    counters = (RELAYED, 'lw_proxy_prefill_first_not_relayed_total{reason="token"}',
                'lw_proxy_errors_total{kind="relay_mismatch"}')
    before = metric_sums(url, list(counters))
    for stream in (False, True):  # each on a prompt of its own: the pool must not hold it already
        body = {"model": "tiny", "prompt": text(340 + stream, 150), "max_tokens": 6, "temperature": 1.0, "seed": 11,
                "n": 3, "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
        ref = _choice_tokens(baseline(stream_stack, "/v1/completions", body)["choices"])
        assert sorted(ref) == [0, 1, 2] and len({tuple(v[:1]) for v in ref.values()}) > 1, ref  # the choices differ
        settle(stream_stack)
        stream_stack.decode.mark()
        status, out = decoder_looks_first(stream_stack.prefill, url + "/v1/completions", {**body, "stream": stream})
        assert status == 200, out
        chunks = [ev for ev in out if isinstance(ev, dict)] if stream else [out]
        assert not [ev for ev in chunks if "error" in ev], chunks
        assert _choice_tokens([ch for ev in chunks for ch in ev["choices"]]) == ref, (stream, chunks)
        settle(stream_stack)
        recs = stream_stack.decode.new_stats()
        assert len(recs) == 3 and all("first_from_prefill" in r["t"] for r in recs), recs
    after = metric_sums(url, list(counters))
    relayed, unrelayable, mismatch = (after[k] - before[k] for k in counters)
    # The stream relayed its three first tokens, unless one is a token the relay refuses.
    assert (relayed, mismatch) == (1, 0) or (unrelayable, mismatch) == (1, 0), (relayed, unrelayable, mismatch)


def _tokens_view(events: list) -> dict:
    """A stream as a client sees it whatever events vLLM merged (a lagging API server sends a
    request's waiting outputs as one event): the first events (chat: role, first content), the
    text, the token ids and log-prob entries token by token, the prompt's ids, and per event the
    usage against the tokens sent so far."""
    chunks = _client_view([ev for ev in events if isinstance(ev, dict)])
    assert events[-1] == "[DONE]", events[-3:]
    text, ids, lps, prompt, usage_ok = "", [], [], [], True
    for ev in chunks:
        prompt += ev.get("prompt_token_ids") or []
        for ch in ev["choices"]:
            text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            ids += ch.get("token_ids") or []
            lp = ch.get("logprobs") or {}
            lps += lp.get("content") or lp.get("tokens") or []
            prompt += ch.get("prompt_token_ids") or []
        if ev.get("choices"):
            usage_ok &= ev["usage"]["completion_tokens"] == len(ids)
    n_first = 2 if "delta" in chunks[0]["choices"][0] else 1
    return {"first": chunks[:n_first], "text": text, "ids": ids, "logprobs": lps, "prompt": prompt,
            "usage": chunks[-1]["usage"], "usage_per_event": usage_ok}


def _client_view(events: list) -> list:
    """SSE payloads as a client compares two streams: no id or ``created`` (per request), no null
    fields, floats (log-probs computed over loaded KV differ in the last bits) as their type."""
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if v is not None and k not in ("id", "created")}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return "float" if isinstance(x, float) else x
    return [clean(ev) for ev in events]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stop", [None, ["@@@@@@@@", "@@@"]], ids=["no_stop", "stop"])
def test_a_relayed_stream_with_ids_and_usage_is_the_single_engines(stream_stack: Stack, path: str, stop) -> None:
    """Token ids, continuous usage and log-probs asked, with and without stop strings (vLLM holds
    back the longest one's length less one of the streamed text): the relayed stream (its first
    events built from the prefill's answer) is the same request streamed by one engine: its first
    events, and token by token its text, ids, log-probs and usage."""
    url = stream_stack.proxy.url
    body: dict = {"model": "tiny", "max_tokens": 5, "temperature": 0.0, "ignore_eos": True, "stream": True,
                  "return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                  "stop": stop}
    if path.endswith("chat/completions"):
        body.update(messages=[{"role": "user", "content": text(350 + 2 * bool(stop), 120)}], logprobs=True,
                    top_logprobs=1)
    else:
        body.update(prompt=text(351 + 2 * bool(stop), 120), logprobs=1)
    settle(stream_stack)
    status, single = post_sse(stream_stack.decode.url + path, body)
    assert status == 200 and single[-1] == "[DONE]", single
    before = metric_sum(url, RELAYED)
    settle(stream_stack)
    status, events = decoder_looks_first(stream_stack.prefill, url + path, body)
    assert status == 200, events
    assert metric_sum(url, RELAYED) == before + 1, "the first token was not relayed"
    pd, one = _tokens_view(events), _tokens_view(single)
    first, one_first = pd.pop("first"), one.pop("first")
    assert pd == one
    # The relayed events are the single engine's first ones (unless its API server, lagging, sent
    # the first tokens in one event: vLLM merges a request's outputs that wait).
    if len(one_first[-1]["choices"][0]["token_ids"]) == 1:
        assert first == one_first


def test_stalled_prefill_is_recomputed_at_the_deadline(stream_stack: Stack) -> None:
    """No prefiller ever reserves the prompt (the metaserver is silent, nothing prefills): the
    receive gives up at metaserver_timeout_s, every block is reported failed, vLLM recomputes the
    prompt and the output is the single engine's -- no hang, no wrong output."""
    fake = FakeMetaserver()
    fake.mode = "silent"
    try:
        body = _completion(text(43, 100))
        ref = completion_choice(baseline(stream_stack, "/v1/completions", body)["choices"][0])
        params = {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": fake.url,
                  "lw_parent_id": "parent-stalled", "lw_children": 1}
        stream_stack.decode.mark()
        t0 = time.monotonic()
        status, out = post_json(stream_stack.decode.url + "/v1/completions", {**body, "kv_transfer_params": params})
        took = time.monotonic() - t0
    finally:
        fake.close()
    assert status == 200, out
    assert_same(ref, completion_choice(out["choices"][0]), "stalled prefill")
    assert TIMEOUT_S <= took < TIMEOUT_S + 30, f"answered after {took:.1f} s; receive deadline {TIMEOUT_S} s"
    (rec,) = stream_stack.decode.new_stats()
    n = rec["prompt_tokens"]
    assert rec["remote_prefill"] == "streaming" and rec["loaded_tokens"] == 0, rec
    assert rec["failed_blocks"] == -(-(n - 1) // stream_stack.block_size), rec


def test_prefiller_down_ends_the_receive_at_the_metaserver_error(stream_stack: Stack) -> None:
    """The proxy's prefill fails at once (nothing listens): its metaserver error answer ends the
    decoder's streaming receive long before the deadline; the decoder computes the prompt."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = stream_stack.add_proxy("proxy-no-prefiller", dead, stream_stack.decode.url, "--max-retries", "1")
    body = _completion(text(46, 100))
    ref = completion_choice(baseline(stream_stack, "/v1/completions", body)["choices"][0])
    t0 = time.monotonic()
    ex = through(stream_stack, "/v1/completions", body, proxy_url=proxy.url)
    took = time.monotonic() - t0
    assert ex.status == 200, ex.out
    assert_same(ref, completion_choice(ex.out["choices"][0]), "prefiller down")
    assert took < TIMEOUT_S / 2, f"{took:.1f} s: the receive waited for its deadline"
    (rec,) = ex.decode_stats
    n = rec["prompt_tokens"]
    assert rec["remote_prefill"] == "streaming" and rec["loaded_tokens"] == 0, rec
    assert rec["failed_blocks"] == -(-(n - 1) // stream_stack.block_size) and "prefill_failed" in rec["t"], rec


def test_second_request_after_the_stall_streams_again(stream_stack: Stack) -> None:
    """The engine is not left in a bad state by the failed receive."""
    body = _completion(text(44, 90))
    ref = completion_choice(baseline(stream_stack, "/v1/completions", body)["choices"][0])
    ex = through(stream_stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    assert_same(ref, completion_choice(ex.out["choices"][0]), "after the stall")
    (rec,) = ex.decode_stats
    _loaded_whole(rec)


def test_decoder_first_then_the_prefill_streams_in(stream_stack: Stack) -> None:
    """The decoder parks and opens its chunks before the prefill exists (no reservation yet: it
    retries); the prefill then runs and the decoder pulls what it publishes: the output is the
    single engine's, every chunk arrived, long before the deadline."""
    body = _completion(text(45, 110))
    rec = streams_in_decoder_first(stream_stack, body, "parent-late-prefill", "decoder first", TIMEOUT_S)
    _loaded_whole(rec, streamed=True)


def test_bench_pd_streaming_rows_on_this_stack(stream_stack: Stack) -> None:
    """``lw-bench pd --streaming``'s measurement of the streaming stack (rows pd_stream and
    alone_stream, same prompts as the non-streaming rows): well-formed, every chunk streamed."""
    import argparse

    from lw_bench.pd import mode as bench_pd

    p = argparse.ArgumentParser()
    bench_pd.add_arguments(p)
    cfg = {**bench_pd.config(p.parse_args(["--quick", "--streaming"])), "block_size": stream_stack.block_size}
    assert cfg["streaming"] is True
    recs = bench_pd.measure(stream_stack, cfg, suffix="_stream")
    assert sorted(r["kind"] for r in recs) == ["alone_stream", "pd_stream"]
    r = bench_pd.summarize(cfg, recs)
    (L,) = [str(x) for x in cfg["lengths"]]
    assert r["problems"] == [], r["problems"]
    assert r["ttft_s"]["pd_stream"][L] > 0 and r["ttft_s"]["alone_stream"][L] > 0
    assert r["streaming_ratios"]["pd_stream_vs_alone_stream"][L] > 0
    assert r["streaming_ratios"]["pd_stream_vs_pd"][L] is None  # no non-streaming rows in this run
    (pd,) = [x for x in recs if x["kind"] == "pd_stream"]
    assert pd["decoder"]["remote_prefill"] in ("streaming", "pool holds the prompt"), pd
    assert pd["decoder"]["loaded_tokens"] == pd["decoder"]["prompt_tokens"] - 1, pd
    bench_pd.print_table(r)
