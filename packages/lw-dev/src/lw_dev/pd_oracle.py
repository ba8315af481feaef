"""Turn OpenAI responses into the greedy oracle's shape ({"tokens", "top2"}) and compare.

Requests ask ``return_tokens_as_token_ids`` so tokens come back as ``"token_id:<n>"``, and 2
top log-probs per position; the rule is lw_dev.harness.assert_same_greedy: equal tokens,
or a first divergence only at a near-tie, with log-probs agreeing before it.
"""

from __future__ import annotations

from typing import Any

from lw_dev.harness import assert_same_greedy

SAMPLING = {"temperature": 0.0, "ignore_eos": True, "return_tokens_as_token_ids": True}


def _tid(tok: str) -> int:
    assert tok.startswith("token_id:"), f"expected return_tokens_as_token_ids output, got {tok!r}"
    return int(tok.split(":", 1)[1])


def _top2(pairs: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(pairs.items(), key=lambda kv: -kv[1])[:2]


def completion_choice(choice: dict[str, Any]) -> dict[str, Any]:
    lp = choice["logprobs"]
    return {"tokens": [_tid(t) for t in lp["tokens"]],
            "top2": [_top2({_tid(t): v for t, v in d.items()}) for d in lp["top_logprobs"]]}


def chat_choice(choice: dict[str, Any]) -> dict[str, Any]:
    content = choice["logprobs"]["content"]
    return {"tokens": [_tid(c["token"]) for c in content],
            "top2": [_top2({_tid(t["token"]): t["logprob"] for t in c["top_logprobs"]}) for c in content]}


def completion_stream(events: list[Any]) -> dict[str, Any]:
    """Concatenate a streamed completion (one choice); the final event must be [DONE]."""
    assert events and events[-1] == "[DONE]", f"stream did not end with [DONE]: {events[-3:]}"
    out: dict[str, Any] = {"tokens": [], "top2": [], "text": ""}
    for ev in events[:-1]:
        assert "error" not in ev, f"error event in the stream: {ev}"
        for ch in ev["choices"]:
            out["text"] += ch.get("text") or ""
            lp = ch.get("logprobs")
            if lp:
                part = completion_choice(ch)
                out["tokens"] += part["tokens"]
                out["top2"] += part["top2"]
    return out


def by_index(choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(choices, key=lambda c: c["index"])


def assert_same(ref: dict[str, Any], got: dict[str, Any], what: str) -> None:
    try:
        assert_same_greedy(ref, got)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}\nref tokens {ref['tokens']}\ngot tokens {got['tokens']}") from None
