"""1P1D on real vLLM (CPU), the tiny GQA model on engines that run a reasoning parser (vLLM's
``granite``, which reads text, not think tokens the tiny tokenizer lacks): lw-proxy learns it from
the first chat answer (vLLM sets ``usage.completion_tokens_details`` only on such a server), does
not relay or continue that answer (a one-token answer is parsed as its stream's last, where a
single engine's first event parses it as one of many), and relays later streamed chats from a
streamed two-token prefill (lw_proxy.parsed_relay); every answer is the single engine's."""

from __future__ import annotations

import pytest
from pd_faults_flow import decoder_looks_first

from lw_bench.pd.stack import Stack, metric_sum, post_sse
from lw_dev.pd_flow import CONTINUED, assert_remote_prefill_used, baseline, text, through

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
RELAYED = "lw_proxy_prefill_first_relayed_total"
NOT_RELAYED_TOKEN = 'lw_proxy_prefill_first_not_relayed_total{reason="token"}'


def _body(seed: int, stream: bool) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text(seed, 120)}], "max_tokens": 8,
            "temperature": 0, "return_token_ids": True, "stream": stream}


def _joined(events: list) -> tuple[str, str, list[int]]:
    """A chat stream's content, reasoning and generated token ids, its events joined."""
    assert events and events[-1] == "[DONE]", events[-3:]
    deltas = [(ch.get("delta") or {}, ch.get("token_ids") or []) for ev in events[:-1] for ch in ev["choices"]]
    return ("".join(d.get("content") or "" for d, _ in deltas), "".join(d.get("reasoning") or "" for d, _ in deltas),
            [t for _, ids in deltas for t in ids])


def _streamed(s: Stack, seed: int, relayed: bool) -> None:
    """A streamed chat through PD is the single engine's stream; its first event was the prefiller's
    (``relayed``: from a streamed two-token prefill), or not, because the prefill's one-token answer
    showed a reasoning parser (``token``)."""
    body = _body(seed, True)
    status, ref = post_sse(s.decode.url + CHAT, body)  # the single engine's stream
    assert status == 200, ref
    before = metric_sum(s.proxy.url, RELAYED), metric_sum(s.proxy.url, NOT_RELAYED_TOKEN)
    # The prefiller is frozen until the decoder has posted: its POST is in (and it found no prompt in
    # the pool) before the prefill answers, so the decoder waits for the token and the relay runs.
    ex = through(s, CHAT, body, send=lambda url, b: decoder_looks_first(s.prefill, url, b))
    assert ex.status == 200, ex.out
    moved = metric_sum(s.proxy.url, RELAYED) - before[0], metric_sum(s.proxy.url, NOT_RELAYED_TOKEN) - before[1]
    assert moved == ((1, 0) if relayed else (0, 1)), moved
    assert _joined(ex.out) == _joined(ref)
    if relayed:
        assert ex.out[1]["choices"][0]["token_ids"] == [_joined(ref)[2][0]], ex.out[:3]
    assert_remote_prefill_used(s, ex, 1)


def test_a_reasoning_parsers_server_is_learned_and_its_chats_relayed_from_a_streamed_prefill(
        reasoning_stack: Stack) -> None:
    s = reasoning_stack
    _streamed(s, 701, relayed=False)  # the first chat's prefill shows the parser: not relayed
    whole = baseline(s, CHAT, _body(700, False))
    assert isinstance(whole["usage"]["completion_tokens_details"], dict), whole["usage"]  # what the proxy reads
    # Not streamed: the prefill's answer shows the parser, so it is not continued (the decoder's path).
    ex = through(s, CHAT, _body(700, False))
    assert ex.status == 200, ex.out
    assert ex.out["choices"][0]["message"] == whole["choices"][0]["message"]
    assert ex.out["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
    assert [r["remote_prefill"] for r in ex.decode_stats] != [CONTINUED], ex.decode_stats
    for seed in (702, 703):  # the proxy learned it: relayed from a streamed prefill of two tokens
        _streamed(s, seed, relayed=True)
