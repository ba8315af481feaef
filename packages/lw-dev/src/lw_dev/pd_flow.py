"""One PD exchange as the tests see it: a single-engine baseline straight at the decoder, the same
request through lw-proxy, and the connectors' per-request records from both engines."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lw_bench.pd.stack import Proc, Stack, http, metric_sum, post_json, post_sse

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
    prefill_requests: float  # how far the prefiller's successful-request counter moved


def through(stack: Stack, path: str, body: dict[str, Any], *, proxy_url: str | None = None,
            send: Callable[[str, dict[str, Any]], tuple[int, Any]] | None = None) -> Exchange:
    """``body`` through the proxy (``send(url, body)``: how it goes out, e.g. with the prefiller
    frozen until the decoder has posted; else a plain POST), with what each engine recorded."""
    url = (proxy_url or stack.proxy.url) + path
    # Also before: the previous exchange (or the stack's warm-up) may have answered from the pool
    # while its prefill still ran; that prefill's record must not count as this exchange's.
    settle(stack, proxy_url)
    stack.decode.mark()
    stack.prefill.mark()
    before = metric_sum(stack.prefill.url, REQUESTS_DONE)
    if send is not None:
        status, out = send(url, body)
    else:
        status, out = post_sse(url, body) if body.get("stream") else post_json(url, body)
    settle(stack, proxy_url)
    prefill_stats = _stable(stack.prefill.new_stats)
    moved = metric_sum(stack.prefill.url, REQUESTS_DONE) - before
    return Exchange(status, out, stack.decode.new_stats(), prefill_stats, moved)


def _stable(read: Any, quiet_s: float = 0.3, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """Records once no new one has come for ``quiet_s``: a prefill the proxy cancelled (its decoder
    had answered already) is recorded when the prefiller notices the abort."""
    deadline = time.monotonic() + timeout_s
    recs, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.05)
        now = read()
        if len(now) != len(recs):
            recs, since = now, time.monotonic()
    return recs


def settle(stack: Stack, proxy_url: str | None = None, timeout_s: float = 15.0) -> None:
    """Wait until no prefill is in flight. A decoder answers as soon as the prompt is in the pool (or
    at once when it holds it), which can be before the prefiller's own answer: its stats record and
    its metrics (finished requests, saved bytes) then trail the client's response, and must not leak
    into the next test. Call it before taking a "before" sample of the prefiller's counters."""
    proxy_url = proxy_url or stack.proxy.url
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _, raw = http("GET", proxy_url + "/healthcheck", timeout=5)
            in_flight = sum(b["in_flight"] for b in json.loads(raw).get("backends", ()) if b["role"] == "prefiller")
        except (OSError, ValueError, KeyError, TypeError):
            in_flight = 0  # a proxy that cannot say: rely on the engine's own gauges
        busy = sum(metric_sum(stack.prefill.url, m) for m in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        if in_flight == 0 and busy == 0:
            return
        time.sleep(0.05)


def decoder_path_proxy(stack: Stack) -> Proc:
    """A proxy of ``stack`` with ``--no-continue-after-prefill``: a non-streamed answer takes the
    decoder's path (its metaserver call, the prefill's first token forced), started once per stack."""
    for p in stack.extra_procs:
        if p.name == "proxy-decoder-path":
            return p
    return stack.add_proxy("proxy-decoder-path", stack.prefill.url, stack.decode.url, "--metaserver-timeout",
                           str(stack.metaserver_timeout_s * 2), "--no-continue-after-prefill")


def continued_streams_proxy(stack: Stack) -> Proc:
    """A proxy of ``stack`` with ``--continue-streams``: a stream of one choice is continued after
    its prefill (the decoder gets the prompt plus the prefill's first token), started once per stack."""
    for p in stack.extra_procs:
        if p.name == "proxy-continue-streams":
            return p
    return stack.add_proxy("proxy-continue-streams", stack.prefill.url, stack.decode.url, "--metaserver-timeout",
                           str(stack.metaserver_timeout_s * 2), "--continue-streams")


CONTINUED = "continues an answered prefill"  # lw_vllm's RemotePhase.PREFILLED, as the stats record names it


def assert_remote_prefill_used(stack: Stack, ex: Exchange, n_prompts: int) -> None:
    """The decoder loaded the whole prompt the prefiller committed (its partial chunk too: the stacks
    run layerwise, where discard_partial_chunks defaults to false) and computed the last token only;
    the prefiller ran once per prompt and had committed its chunks when it answered."""
    bs = stack.block_size
    assert len(ex.decode_stats) == n_prompts, ex.decode_stats
    # One record per engine request the prefiller ran. Not its success counter: a prefill whose
    # decoder had answered is left to finish by the proxy, but one cancelled (e.g. a stalled prefill)
    # is counted as aborted by vLLM.
    assert len(ex.prefill_stats) == n_prompts, f"prefiller ran {ex.prefill_stats}, expected {n_prompts} requests"
    # A non-streamed answer continued after its prefill (lw_proxy.prefill_continue): the decoder's
    # prompt is the prefill's plus the prefill's first token.
    assert sorted(r["prompt_tokens"] for r in ex.prefill_stats) == sorted(
        r["prompt_tokens"] - (r["remote_prefill"] == CONTINUED) for r in ex.decode_stats)
    for r in ex.prefill_stats:
        # Counted from the worker reports that arrived with the max_tokens=1 step's output, i.e.
        # committed before vLLM produced the prefill's answer. Chunks it loaded need no saving.
        n = r["prompt_tokens"]
        assert r["saved_chunks"] + r["loaded_tokens"] // bs == -(-n // bs), f"prefiller saved {r}"
    for r in ex.decode_stats:
        n = r["prompt_tokens"]
        if n < bs:
            # Shorter than a block: the decoder does not wait for the prefill, but loads whatever
            # the pool holds; with early dispatch the prefiller may already have committed this
            # parent's partial chunk (the prompt less its last token), or not yet.
            assert r["remote_prefill"] in ("nothing to load", CONTINUED), r
            assert r["loaded_tokens"] in (0, n - 1) and r["failed_blocks"] == 0, r
            assert r["promised_tokens"] == r["loaded_tokens"], r
            continue
        # "pool holds the prompt": the prefill (dispatched with the client request, lw-proxy's
        # --prefill-dispatch early) had saved the whole prompt before the decoder looked it up; the
        # prompts are fresh, so what it loaded is this prefill's (checked above), with no wait.
        # "continues an answered prefill": the proxy sent it once the prefill had answered.
        assert r["remote_prefill"] in ("ok", "pool holds the prompt", CONTINUED), r
        assert r["promised_tokens"] == r["loaded_tokens"] == n - 1 and r["failed_blocks"] == 0, r
