"""One PD exchange as the tests see it: a single-engine baseline straight at the decoder, the same
request through lw-proxy, and the connectors' per-request records from both engines."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pd_servers import Stack, metric_sum, post_json, post_sse

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "dr", "st", "en", "or"]
REQUESTS_DONE = "vllm:request_success_total"


def text(seed: int, words: int) -> str:
    """Deterministic pseudo-text in the tiny tokenizer's alphabet (about 1.5 tokens a word)."""
    r = random.Random(seed)
    return " ".join("".join(r.choice(_SYLLABLES) for _ in range(r.randint(1, 3))) for _ in range(words))


def baseline(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The single-engine answer: the decoder without kv_transfer_params computes every token
    itself (a kv_consumer with consumer_is_to_load=false neither loads nor saves; checked)."""
    stack.decode.mark()
    status, out = post_json(stack.decode.url + path, {**body, "stream": False})
    assert status == 200, f"baseline {path}: {status} {out}"
    for rec in stack.decode.new_stats():
        assert rec["loaded_tokens"] == 0 and rec["saved_chunks"] == 0 and "remote_prefill" not in rec, rec
    return out


@dataclass
class Exchange:
    status: int
    out: Any  # JSON body, or the SSE payloads when streamed
    decode_stats: list[dict[str, Any]]
    prefill_stats: list[dict[str, Any]]
    prefill_requests: float  # how far the prefiller's finished-request counter moved


def through(stack: Stack, path: str, body: dict[str, Any], *, proxy_url: str | None = None) -> Exchange:
    url = (proxy_url or stack.proxy.url) + path
    stack.decode.mark()
    stack.prefill.mark()
    before = metric_sum(stack.prefill.url, REQUESTS_DONE)
    status, out = post_sse(url, body) if body.get("stream") else post_json(url, body)
    moved = metric_sum(stack.prefill.url, REQUESTS_DONE) - before
    return Exchange(status, out, stack.decode.new_stats(), stack.prefill.new_stats(), moved)


def assert_remote_prefill_used(stack: Stack, ex: Exchange, n_prompts: int) -> None:
    """The decoder loaded every full chunk the prefiller committed and computed at most one chunk;
    the prefiller ran once per prompt and had committed its chunks when it answered."""
    bs = stack.block_size
    assert len(ex.decode_stats) == n_prompts, ex.decode_stats
    assert ex.prefill_requests == n_prompts, f"prefiller finished {ex.prefill_requests} requests, expected {n_prompts}"
    assert sorted(r["prompt_tokens"] for r in ex.prefill_stats) == sorted(r["prompt_tokens"] for r in ex.decode_stats)
    for r in ex.prefill_stats:
        # Counted from the worker reports that arrived with the max_tokens=1 step's output, i.e.
        # committed before vLLM produced the prefill's answer.
        assert r["saved_chunks"] == r["prompt_tokens"] // bs, f"prefiller saved {r}"
    for r in ex.decode_stats:
        n = r["prompt_tokens"]
        expected = (n - 1) // bs * bs  # full chunks, leaving one token to compute
        if expected == 0:
            assert r["remote_prefill"] == "nothing to load" and r["loaded_tokens"] == 0, r
            continue
        assert r["remote_prefill"] == "ok", r
        assert r["promised_tokens"] == r["loaded_tokens"] == expected and r["failed_blocks"] == 0, r
        assert n - r["loaded_tokens"] <= bs, f"decoder computed {n - r['loaded_tokens']} tokens > one chunk"
