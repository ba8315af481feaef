"""``lw-bench pd --request-kinds``: PD's time to first token per kind of client request, against the
same kind of request sent to the prefiller alone, and the share whose first token lw-proxy relayed
from the prefill (``--prefill-first``).

A kind is an endpoint (``/v1/completions`` or ``/v1/chat/completions``), streamed or not, and the
sampling fields that change how the proxy may treat it (``REQUEST_KINDS``). Per store, length, rep and
kind two requests go out, each on a prompt of its own (a prompt seen once is in the pool, and the
second request would measure a pool hit): ``alone`` straight to the prefiller and ``pd`` through the
proxy a deployment runs by default (streaming decoder, ``--prefill-first``; the streaming decoder
without it under ``--no-relay``).

* streamed kinds: time to the first event that carries a generated token (completion ``text``,
  chat ``delta.content`` outside the role event; empty text counts: a token whose text the
  detokenizer holds back is streamed so); ``alone`` asks for one token, as a prefill does;
* non-streamed kinds: time to the whole answer, ``alone`` and ``pd`` both asking for the same number
  of tokens (a non-streamed client sees nothing before the end);
* streamed kinds through the proxy also ask ``GAP_TOKENS`` tokens, for the gaps between the first
  three token events of the first token's choice: ``first_gap_s`` (first → second: what the decoder
  takes to send the token after a relayed one, where a single engine takes one decode step) and
  ``next_gap_s`` (second → third: the decoder's own step and relay).

Chat prompts are the tiny tokenizer's decoding of random token ids, so their length in tokens is the
asked one give or take a few, plus the chat template's own.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import msgspec

from lw_bench.pd.compare import RELAYED
from lw_bench.pd.compare import prompt as random_prompt
from lw_bench.pd.request import token_times
from lw_bench.pd.stack import metric_sums

SAMPLING = {"temperature": 0.8, "top_p": 0.95}
STOP = ["\n\n\n", "###"]  # stop strings the random prompts' answers hardly ever reach: the path, not a stop
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]
# Why lw-proxy did not relay a stream's first token (``lw_proxy_prefill_first_not_relayed_total``).
NOT_RELAYED = ("request", "decoder_first", "token", "not_forced")
GAP_TOKENS = 3  # a PD stream's tokens: the first, and the two gaps after it
_NOT_RELAYED = {f'lw_proxy_prefill_first_not_relayed_total{{reason="{r}"}}': r for r in NOT_RELAYED}


class RequestKind(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    chat: bool
    stream: bool
    fields: dict[str, Any] = {}  # what the kind adds to a greedy request (temperature 0)
    text_prompt: bool = False  # a completion's prompt as text (the ids decoded), not as token ids
    prompts: int = 1  # a completion's list of this many prompts (each of the asked length)


REQUEST_KINDS: dict[str, RequestKind] = {k.name: k for k in (
    RequestKind(name="completion", chat=False, stream=True),
    RequestKind(name="completion_full", chat=False, stream=False),
    RequestKind(name="completion_sampled", chat=False, stream=True, fields=SAMPLING),
    RequestKind(name="completion_logprobs", chat=False, stream=True, fields={"logprobs": 2}),
    RequestKind(name="chat", chat=True, stream=True),
    RequestKind(name="chat_full", chat=True, stream=False),
    RequestKind(name="chat_sampled", chat=True, stream=True, fields=SAMPLING),
    RequestKind(name="chat_logprobs", chat=True, stream=True, fields={"logprobs": True, "top_logprobs": 2}),
    RequestKind(name="completion_n", chat=False, stream=True, fields={**SAMPLING, "n": 2}),
    RequestKind(name="chat_n", chat=True, stream=True, fields={**SAMPLING, "n": 2}),
    RequestKind(name="completion_full_sampled", chat=False, stream=False, fields=SAMPLING),
    RequestKind(name="chat_full_sampled", chat=True, stream=False, fields=SAMPLING),
    RequestKind(name="completion_full_stop", chat=False, stream=False, fields={"stop": STOP}),
    RequestKind(name="completion_echo", chat=False, stream=True, fields={"echo": True}, text_prompt=True),
    RequestKind(name="completion_min_tokens", chat=False, stream=True, fields={"min_tokens": 2}),
    # A named tool choice: the tool call opens with the first token (the engines run a tool parser).
    RequestKind(name="completion_list", chat=False, stream=True, prompts=2),
    RequestKind(name="chat_tools", chat=True, stream=True, fields={"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "lookup"}}}),
)}


def parse(text: str) -> list[str]:
    """``--request-kinds``: comma-separated names, ``all``, or ``none`` (empty list)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["all"]:
        return list(REQUEST_KINDS)
    if names == ["none"]:
        return []
    bad = [x for x in names if x not in REQUEST_KINDS]
    if not names or bad:
        raise SystemExit(f"lw-bench pd: --request-kinds={text!r}: expected all, none or a comma-separated list of "
                         f"{', '.join(REQUEST_KINDS)}")
    return list(dict.fromkeys(names))


def body(kind: RequestKind, ids: list[int], decode: Any, *, max_tokens: int, seed: int,
         more: Sequence[list[int]] = ()) -> dict[str, Any]:
    """The request of ``kind`` on the prompt ``ids`` (chat and ``text_prompt``: their text,
    ``decode(ids)``; ``more``: a prompt list's further prompts); ``min_tokens`` at most
    ``max_tokens`` (a prefiller alone asked one token)."""
    b: dict[str, Any] = {"model": "tiny", "temperature": 0.0, "ignore_eos": True, "max_tokens": max_tokens,
                         "stream": kind.stream, **kind.fields}
    if "temperature" in kind.fields:
        b["seed"] = seed  # sampled, reproducibly
    if "min_tokens" in b:
        b["min_tokens"] = min(b["min_tokens"], max_tokens)
    if kind.chat:
        b["messages"] = [{"role": "user", "content": decode(ids)}]
    else:
        b["prompt"] = decode(ids) if kind.text_prompt else ids
        if more:
            b["prompt"] = [b["prompt"], *(decode(m) if kind.text_prompt else m for m in more)]
    return b


PATH = {False: "/v1/completions", True: "/v1/chat/completions"}


def prompt(seed: int, rep: int, length: int, kind: str, target: str) -> list[int]:
    """Random plain token ids, one prompt per (seed, rep, length, kind, target)."""
    return random_prompt(seed, rep, length, f"{kind}/{target}")


def pd_proxy(stack: Any) -> str:
    """The proxy a deployment runs by default: streaming decoder, prefill-first when measured."""
    return "pd_stream_relay" if "pd_stream_relay" in stack.proxies else "pd_stream"


def measure(stack: Any, cfg: dict[str, Any], decode: Any, *, seed: int = 0, progress: Any = None) -> list[dict[str, Any]]:
    """One record per request: store, request_kind, target (alone or pd), length, rep, status,
    ttft_s and, through a prefill-first proxy, whether its first token was relayed and, for a
    stream that was not, why (``not_relayed``: one of ``NOT_RELAYED``)."""
    proxy = pd_proxy(stack)
    relay = proxy.endswith("_relay")
    out: list[dict[str, Any]] = []
    for rep in range(cfg["reps"]):
        for length in cfg["lengths"]:
            for name in cfg["request_kinds"]:
                kind = REQUEST_KINDS[name]
                order = ("alone", "pd") if (rep + length // 16 + len(name)) % 2 else ("pd", "alone")
                for target in order:
                    one = kind.stream and target == "alone"  # the prefill's own answer: its first token
                    more = [prompt(seed, rep, length, f"{name}#{k}", target) for k in range(1, kind.prompts)]
                    n_tokens = 1 if one else max(cfg["pd_max_tokens"], GAP_TOKENS) if kind.stream else cfg["pd_max_tokens"]
                    b = body(kind, prompt(seed, rep, length, name, target), decode,
                             max_tokens=n_tokens, seed=seed + rep, more=more)
                    url = stack.servers["prefill"].url if target == "alone" else stack.proxies[proxy].url
                    names = [RELAYED, *_NOT_RELAYED]
                    before = metric_sums(url, names) if target == "pd" and relay else {}
                    t_send, times, status = token_times(url, PATH[kind.chat], b)
                    rec: dict[str, Any] = {"store": stack.store, "request_kind": name, "target": target,
                                           "length": length, "rep": rep, "status": status,
                                           "ttft_s": round(times[0] - t_send, 4)}
                    if kind.stream and target == "pd" and len(times) >= GAP_TOKENS:
                        rec["first_gap_s"] = round(times[1] - times[0], 4)
                        rec["next_gap_s"] = round(times[2] - times[1], 4)
                    if target == "pd" and relay:
                        after = metric_sums(url, names)
                        rec["relayed"] = after[RELAYED] > before[RELAYED]
                        if kind.stream and not rec["relayed"]:
                            rec["not_relayed"] = next((r for n, r in _NOT_RELAYED.items() if after[n] > before[n]), None)
                    out.append(rec)
                    if progress is not None:
                        progress(rec)
    return out


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def summarize(records: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """store -> length -> kind -> {alone_s, pd_s, pd_vs_alone (median of per-rep pairs),
    relayed_share (None without a prefill-first proxy), not_relayed (streams not relayed per
    reason)}; and the failed requests."""
    out: dict[str, Any] = {}
    problems = [f"{r['store']} {r['request_kind']} {r['target']} {r['length']}: HTTP {r['status']}"
                for r in records if r["status"] != 200]
    ok = [r for r in records if r["status"] == 200]
    for r in ok:
        out.setdefault(r["store"], {}).setdefault(str(r["length"]), {}).setdefault(r["request_kind"], None)
    for store, by_len in out.items():
        for L, by_kind in by_len.items():
            for name in by_kind:
                rs = [r for r in ok if r["store"] == store and str(r["length"]) == L and r["request_kind"] == name]
                pairs: dict[int, dict[str, float]] = {}
                for r in rs:
                    pairs.setdefault(r["rep"], {})[r["target"]] = r["ttft_s"]
                pd = [r for r in rs if r["target"] == "pd"]
                rel = [r["relayed"] for r in pd if "relayed" in r]
                by_kind[name] = {
                    "alone_s": _median([r["ttft_s"] for r in rs if r["target"] == "alone"]),
                    "pd_s": _median([r["ttft_s"] for r in pd]),
                    "pd_vs_alone": _median([v["pd"] / v["alone"] for v in pairs.values() if v.get("pd") and v.get("alone")]),
                    "relayed_share": round(sum(rel) / len(rel), 2) if rel else None,
                    "first_gap_s": _median([r["first_gap_s"] for r in pd if "first_gap_s" in r]),
                    "next_gap_s": _median([r["next_gap_s"] for r in pd if "next_gap_s" in r]),
                    "not_relayed": {why: n for why in NOT_RELAYED
                                    if (n := sum(r.get("not_relayed") == why for r in pd))},
                }
    return out, problems


__all__ = ["REQUEST_KINDS", "RequestKind", "measure", "parse", "summarize"]
