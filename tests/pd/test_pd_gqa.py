"""1P1D on real vLLM (CPU) with the tiny GQA model (block 32): completions, chat, streaming and a
prompt list through lw-proxy give the single engine's greedy output while the decoder loads the
prefiller's chunks; and the failure paths (prefiller down, decoder down, metaserver silent)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from pd_fakes import FakeMetaserver
from pd_flow import assert_remote_prefill_used, baseline, text, through
from pd_oracle import SAMPLING, assert_same, by_index, chat_choice, completion_choice, completion_stream
from pd_servers import Stack, free_port, http, post_json

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _completion(prompt, **kw):
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 2, **SAMPLING, **kw}


def _chat(content: str, **kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "logprobs": True, "top_logprobs": 2, **SAMPLING, **kw}


def test_completion_matches_single_engine_and_loads_the_prefill(gqa_stack: Stack) -> None:
    body = _completion(text(1, 110))
    ref = completion_choice(baseline(gqa_stack, "/v1/completions", body)["choices"][0])
    ex = through(gqa_stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    assert_same(ref, completion_choice(ex.out["choices"][0]), "completion")
    assert_remote_prefill_used(gqa_stack, ex, 1)
    assert ex.decode_stats[0]["prompt_tokens"] > 3 * gqa_stack.block_size  # several chunks really moved


def test_chat_matches_single_engine(gqa_stack: Stack) -> None:
    body = _chat(text(2, 100))
    ref = chat_choice(baseline(gqa_stack, "/v1/chat/completions", body)["choices"][0])
    ex = through(gqa_stack, "/v1/chat/completions", body)
    assert ex.status == 200, ex.out
    assert_same(ref, chat_choice(ex.out["choices"][0]), "chat")
    assert_remote_prefill_used(gqa_stack, ex, 1)


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


def test_prompt_list_fans_in_to_one_prefill(gqa_stack: Stack) -> None:
    prompts = [text(4, 90), text(5, 130), "ka lo", text(6, 70)]  # the third is shorter than a chunk
    body = _completion(prompts)
    refs = [completion_choice(c) for c in by_index(baseline(gqa_stack, "/v1/completions", body)["choices"])]
    ex = through(gqa_stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    got = [completion_choice(c) for c in by_index(ex.out["choices"])]
    assert len(got) == len(prompts)
    for i, (r, g) in enumerate(zip(refs, got)):
        assert_same(r, g, f"prompt {i}")
    assert_remote_prefill_used(gqa_stack, ex, len(prompts))


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
    proxy = gqa_stack.add_proxy(name, gqa_stack.prefill.url, dead, "--max-retries", "1")
    t0 = time.monotonic()
    status, out = post_json(proxy.url + "/v1/completions", _completion(text(8, 40), stream=stream), timeout=60)
    assert time.monotonic() - t0 < 30, "the proxy took too long to give up on a dead decoder"
    assert status == 502, (status, out)
    assert isinstance(out, dict) and "decoder" in out["error"]["message"].lower(), out
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
    assert fake.bodies == [{"lw_parent_id": "parent-silent", "request_id": rec["req_id"]}]


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
