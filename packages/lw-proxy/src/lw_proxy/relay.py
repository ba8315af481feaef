"""``--prefill-first``: a streamed completion's or chat completion's first token comes from the
prefiller.

The prefill is a ``max_tokens: 1`` completion of the client's request, so its answer already holds
the first token. With ``--prefill-first`` the proxy writes that token to the client as the stream's
first event as soon as the prefill answers, while the decoder still waits for the pool, loads and
computes; the decoder's own first token (the same one) is then cut from its stream, and the rest is
forwarded as usual. The client's TTFT becomes the prefill's, plus one hop.

Token-identical only where the prefiller's first token is the decoder's, so only for requests where
both pick it the same way and where the first token's text cannot be changed by what follows. The
decoder is handed the prefill's token with its metaserver answer (``continues``: one prompt, or
a streamed completion's several, each engine request told apart by its name, ``choice_index``;
``MetaserverResponse.first_token``) and, when its POST said ``forces_first``,
continues from it (lw_vllm.pd.first_token), sampled or greedy. A greedy request is relayed either
way; a sampled one only when its decoder's POST, in before the prefill answered, said so
(``relayable``). A request qualifies (``eligible``) when it is a streamed ``/v1/completions`` with
one prompt or several (``best_of`` at most 1), and none of ``suffix`` or ``prompt_logprobs``
(those change the first event) with a value other than null or false; ``echo: true`` only on a
text prompt without log-probs (``echo_ok``): its prefill is asked without it, and the relayed
event begins with the prompt's text and carries the prompt's ids, as vLLM's echoing event does
(``echo_text``), so the decoder's, which echoes, is cut like any other. A streamed
``/v1/chat/completions`` qualifies on the same terms (none of ``echo``, ``prompt_logprobs``,
``return_prompt_text``; ``include_reasoning`` not false); one with ``tools`` or ``functions``
(and every chat once a prefiller showed it runs a reasoning parser) is relayed from a streamed
two-token prefill (``parsed_relay``): a parser may hold back or reroute the first token of a
stream, which a one-token answer cannot show: vLLM parses its token as the stream's last
(``finished``: unstreamed tool arguments appended, a reasoning parser's fallback to content,
engine-based parsers flushed), where a single engine's first event parses it as one of many; the
rest of this docstring is about the one-token prefill. Every other request takes the normal path. The prefill's token is relayed only
when its choice ended with ``finish_reason: "length"`` (not an EOS or stop token). Its text is the
single engine's first streamed text whatever it holds: vLLM's detokenizer (``vllm.v1.engine.
detokenizer``) primes a decode stream with the prompt and only ever appends to a request's text, so
a one-token answer's text is the first delta of a stream of the same request (no stop strings here
hold text back), U+FFFD included (bytes a prompt left open that the token cannot complete). A
token whose text the detokenizer holds back (part of a UTF-8 character: its text is empty until a
later token completes it) is relayed as a single engine streams it, an event with empty text (chat:
empty content), when the prefill returned its id: the decoder's event for it is cut by that id, and
the decoder, which generated it, sends the character with a later token. For chat, only as the
message's ``content`` with no ``tool_calls`` and no reasoning (a reasoning parser routes text the
stream may send otherwise). A chat relay sends the two events a single engine opens with: the role
(``{"role": "assistant", "content": ""}``, the prefill's role) and the first content; the decoder's
own role event is then dropped. With stop strings (``stop``: a non-empty string or a list of them)
vLLM holds back the longest one's length less one of the streamed text until it knows no stop
string begins there (``held_back``): the relayed text is the first token's but for that many last
characters, as a single engine's first event, and the decoder, holding back the same, sends them
later (a first token that completes a stop string ends the prefill with ``stop``: not relayed).
Token ids (``return_token_ids``: the prompt's, completions in the
choice, chat at the top of the role event, and the token's) and continuous usage
(``stream_options``: ``include_usage`` and ``continuous_usage_stats``, JSON ``true``; the prompt's
count from the prefill's answer, one generated token, chat with the answer's
``completion_tokens_details``) go out with the relayed events as a single engine's first events
carry them; the decoder's first event of each relayed choice then gives up its prompt ids.

A request of ``n`` choices keeps ``n`` and its seed in the prefill (vLLM seeds choice ``i`` with
``seed + i`` on the prefiller, the decoder and a single engine alike), and each choice's engine
request on the decoder (vLLM names it ``f"{i}_{id}"``: ``choice_index``) is answered with its own
choice's first token (``fanin.Parent.answers``). Its prefill is streamed (``prefill_stream``):
each choice's token is handed to its engine request (``Parent.answer_choice``) and to the stream as
the prefiller streams it. The stream is relayed when the first choice's request continues from its
token (``forced``; greedy choices are not relayed on their own), opening as a single engine's does
(chat: every choice's role event, then the first choice's content); each later choice's first
event goes out when it comes (``Prefilled.more``), if that choice's request continues from it. Log-probs (``logprobs``, 0 included, ``top_logprobs``, and
``return_tokens_as_token_ids``, which only changes how they name tokens) go out with the relayed
token: the prefill's request is the client's, so its answer holds the first token's
entry, as a single engine computes it over the whole prompt; an answer without one entry per
relayed token is not relayed, and the decoder's entries for the relayed token are cut with its text
(``cut_logprobs``). The decoder request carries ``X-Request-Id: lw-<parent>`` so its events' ``id``
is the one the relayed event used, and its events' ``created`` is rewritten to the relayed event's
(``same_created``; the prefiller and the decoder each stamp the second their request started). Should the decoder's text not start with the relayed text (a near-tie the decoder, which
recomputes the last prompt token over loaded KV, decides the other way; it never happened in the
tests), the proxy drops the decoder's answer before any of it reaches the client and resumes the
choice after the relayed token, as it resumes a recomputed choice (``lw_proxy.recompute``): the
prefiller computed the whole prompt, as a single engine does, so its token is the single engine's
and the rest follows from it (``lw_proxy_errors_total{kind="relay_mismatch"}`` counts these, and
``lw_proxy_recompute_resubmissions_total`` the resubmissions).

A non-streamed answer is, with ``--prefill-first`` and early dispatch, continued after its prefill
(``lw_proxy.prefill_continue``: the decoder is given the prompt plus the prefill's token). The others
(that module says which) are the decoder's, assembled with the prefill's part where the two differ:
when the client asked for log-probs and the decoder continued from the prefill's token, the first
token's entry is the prefiller's (``with_prefill_logprobs``), as in a relayed stream: the prefiller
computed it over the whole prompt as a single engine does, the decoder over loaded KV.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, TypeGuard

import msgspec

from . import recompute as rc
from .validate import ClientRequest

# Keys that change a stream's first events: given (``given``), a request is not relayed, nor continued
# after its prefill (lw_proxy.prefill_continue). Completions (``echo``: see ``echo_ok``), then chat.
EXCLUDED = ("suffix", "prompt_logprobs")
# A streamed chat with ``tools`` or ``functions`` is relayed from a streamed prefill (``parsed_relay``);
# a non-streamed one is not continued.
# A chat's ``echo`` asks the prompt's log-probs (vLLM: ``prompt_logprobs = top_logprobs``, 0 by
# default), which sets ``skip_reading_prefix_cache``: its decoder computes the whole prompt and its own
# first token (lw_vllm's decoder does not wait for the prefill then), so nothing can be relayed.
EXCLUDED_CHAT_STREAM = ("echo", "prompt_logprobs", "return_prompt_text")
EXCLUDED_CHAT = (*EXCLUDED_CHAT_STREAM, "tools", "functions")


def echo_ok(req: ClientRequest) -> bool:
    """The request's ``echo`` allows a relay or a continuation (whose prefill echoes nothing: the
    proxy puts the echo in, ``echo_text``): none (null or false), or ``echo: true`` on a completion
    of one text prompt. Not a chat's; not a value other than a JSON boolean or null; not with a
    prompt of token ids (vLLM decodes the echoed text from them), ``truncate_prompt_tokens``, or
    log-probs asked: vLLM then asks the prompt's log-probs too, which only a run over the whole
    prompt gives, so its engines read no prefix from any cache or pool
    (``SamplingParams.skip_reading_prefix_cache``) and the decoder computes the prompt and its
    first token itself."""
    echo = req.body.get("echo")
    if echo is None or echo is False:
        return True
    return not (req.chat or echo is not True or len(req.prompts) != 1 or not isinstance(req.prompts[0], str)
                or asks_logprobs(req) or given(req.body.get("truncate_prompt_tokens")))


def echo_text(req: ClientRequest) -> str | None:
    """None without ``echo``; with it (``echo_ok``), the text a single engine's answer begins with
    before the generated text (``recompute.echo_prefix``: the prompt, or nothing when the client
    asked for token ids)."""
    return rc.echo_prefix(req) if req.body.get("echo") is True else None


def reasoning_usage(obj: Any) -> bool:
    """A decoded chat answer from a server that runs a reasoning parser: vLLM sets its usage's
    ``completion_tokens_details`` (the reasoning tokens' count) only then."""
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return isinstance(usage, dict) and isinstance(usage.get("completion_tokens_details"), dict)


def asks_usage(req: ClientRequest) -> bool:
    """The client asked for the stream's usage summary (``stream_options.include_usage``: JSON
    ``true``)."""
    so = req.body.get("stream_options")
    return isinstance(so, dict) and so.get("include_usage") is True


def asks_logprobs(req: ClientRequest) -> bool:
    """The client asked for the sampled tokens' log-probs (completions: ``logprobs`` given, 0
    included; chat: ``logprobs: true``)."""
    lp = req.body.get("logprobs")
    return lp is True if req.chat else given(lp)


def continues(req: ClientRequest) -> bool:
    """The decoder may continue from the prefill's first token (``lw_first_token``): one prompt
    (``n`` engine requests, one per choice; ``best_of`` at most 1), or a streamed completion of
    several prompts (``n`` per prompt: ``choice_index``), whose prefill draws each choice's
    first token as the decoder would (the prefill keeps ``n`` and the seed, and vLLM seeds choice
    ``i`` with ``seed + i`` on both). ``min_tokens``, when given, an integer (``prefill_min_tokens``:
    the prefill asks at most 1, so its first token, like a single engine's, is never EOS or a stop
    token when the client asked at least one)."""
    b = req.body
    listed = req.stream and not req.chat and len(req.prompts) > 1 and req.children == len(req.prompts) * req.n
    if (req.children != req.n and not listed) or (b.get("best_of") or 1) != 1:
        return False
    return prefill_min_tokens(req) is not None


def prefill_min_tokens(req: ClientRequest) -> int | None:
    """The prefill's ``min_tokens`` (it asks one token): 1 when the client asked for at least one,
    else 0 (vLLM's ``MinTokensLogitsProcessor`` masks EOS and the stop tokens while fewer than that
    many were generated, and stop strings are looked for only after them, so the first token is
    drawn as a single engine draws it either way); None for a value this proxy does not read (not a
    JSON integer ≥ 0 or null), which takes the decoder's path."""
    mt = req.body.get("min_tokens")
    if mt is None:
        return 0
    if type(mt) is not int or mt < 0:
        return None
    return min(mt, 1)


def offers_first(req: ClientRequest, prefill_first: bool) -> bool:
    """The decoder is offered the prefill's first token (``lw_first_token``): a request it may
    continue (``continues``) that is not streamed (its answer then starts with the single engine's
    first token, and ``with_prefill_logprobs`` applies), or a stream this proxy may relay
    (``prefill_first`` and ``eligible``). A stream the proxy does not relay is not offered it: a
    streaming-PD decoder taking the token reports its receive only once the metaserver answer came,
    which costs its first token the answer's hops and gains the client nothing."""
    return continues(req) and (not req.stream or (prefill_first and eligible(req)))


def assembles(req: ClientRequest) -> bool:
    """A non-streamed answer whose first log-prob entry comes from the prefill's answer
    (``with_prefill_logprobs``): one choice the decoder may continue, log-probs asked."""
    return not req.stream and continues(req) and asks_logprobs(req)


def with_prefill_logprobs(data: bytes, pre: Prefilled, chat: bool) -> bytes:
    """The decoder's non-streamed answer ``data`` with each choice's first token's log-prob entry
    taken from the prefill's answer's choice of the same index, when the decoder continued from the
    prefill's tokens (``pre.forced``) and both name the same token; else ``data`` as it is."""
    if not pre.forced:
        return data
    try:
        obj, pobj = msgspec.json.decode(data), msgspec.json.decode(pre.data)
        chs, pchs = obj["choices"], pobj["choices"]
    except (msgspec.DecodeError, KeyError, TypeError, ValueError):
        return data
    if not isinstance(chs, list) or not isinstance(pchs, list):
        return data
    by_index = {pch.get("index", 0): pch for pch in pchs if isinstance(pch, dict)}
    changed = False
    for ch in chs:
        pch = by_index.get(ch.get("index", 0)) if isinstance(ch, dict) else None
        if pch is not None and _first_entry_from(ch, pch, chat):
            changed = True
    return msgspec.json.encode(obj) if changed else data


def _first_entry_from(ch: dict[str, Any], pch: dict[str, Any], chat: bool) -> bool:
    """Put the prefill choice ``pch``'s log-prob entry in place of ``ch``'s first, when both name
    the same token; whether it did."""
    lp, plp = ch.get("logprobs"), pch.get("logprobs")
    toks, ptoks = ch.get("token_ids"), pch.get("token_ids")
    if _ids(toks) and _ids(ptoks) and toks[0] != ptoks[0]:
        return False
    if logprob_entries(plp, chat) != 1 or logprob_entries(lp, chat) < 1:
        return False
    assert isinstance(lp, dict) and isinstance(plp, dict)
    if chat:
        if lp["content"][0].get("token") != plp["content"][0].get("token"):
            return False
        lp["content"][0] = plp["content"][0]
    else:
        if lp["tokens"][0] != plp["tokens"][0]:
            return False
        for key in ("token_logprobs", "top_logprobs"):
            if isinstance(lp.get(key), list) and isinstance(plp.get(key), list):
                lp[key][0] = plp[key][0]
    return True


def greedy(req: ClientRequest) -> bool:
    """``temperature`` 0, given explicitly."""
    t = req.body.get("temperature")
    return not isinstance(t, bool) and isinstance(t, (int, float)) and t == 0


def eligible(req: ClientRequest) -> bool:
    """A streamed request whose first token may be relayed (see the module docstring): greedy ones
    always, sampled ones once their decoder continues from the relayed token (``relayable``)."""
    b = req.body
    if not req.stream or not continues(req):
        return False
    if any(given(b.get(k)) for k in (EXCLUDED_CHAT_STREAM if req.chat else EXCLUDED)) or not echo_ok(req):
        return False
    if req.chat and b.get("include_reasoning") not in (None, True):
        return False  # vLLM then sends no token ids with a parser's events: the relayed token cannot be cut
    return continuous_usage(req) is not None and held_back(req) is not None


def stop_strings(req: ClientRequest) -> list[str] | None:
    """The request's stop strings (``stop``: none, a non-empty string or a list of them; with
    ``include_stop_str_in_output`` absent or a JSON boolean where stop strings are given), or None
    for a ``stop`` this proxy does not read (such a request is neither relayed nor continued)."""
    stop, incl = req.body.get("stop"), req.body.get("include_stop_str_in_output")
    if stop is None or stop is False:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        return None
    return stops if incl is None or incl is False or incl is True else None


def held_back(req: ClientRequest) -> int | None:
    """How many characters of a stream's text vLLM holds back while it looks for the request's
    stop strings (``stop_strings``; none with ``include_stop_str_in_output``): the longest one's
    length less one (``vllm.v1.engine.detokenizer``), so a single engine's first event shows the
    first token's text but for its last that many characters. None for a ``stop`` this proxy does
    not read, which is not relayed."""
    stops = stop_strings(req)
    if stops is None:
        return None
    return 0 if req.body.get("include_stop_str_in_output") is True or not stops else max(map(len, stops)) - 1


def continuous_usage(req: ClientRequest) -> bool | None:
    """Whether every event of the stream carries usage (vLLM: ``stream_options.include_usage`` and
    ``continuous_usage_stats``); None when the request says so in a way this proxy does not read
    (a value other than a JSON boolean or null), which is not relayed."""
    so = req.body.get("stream_options")
    if not isinstance(so, dict):
        return False
    inc, cont = so.get("include_usage"), so.get("continuous_usage_stats")
    if not given(cont):
        return False
    if cont is not True or not (inc is None or inc is False or inc is True):
        return None
    return inc is True


def relayable(req: ClientRequest, forced: bool) -> bool:
    """An eligible request's prefill tokens go out: ``forced``: the decoder was handed each
    choice's token with its metaserver answer and continues from it; or greedy with one choice (the
    decoder picks the same token, or the proxy resumes after it)."""
    return forced or (greedy(req) and req.n == 1)


def first_tokens_of(obj: Any, chat: bool) -> tuple[dict[int, int], list[int]] | None:
    """The prefill answer's (decoded) generated token id per choice index, for each choice that
    ended on one plain token (``finish_reason: "length"``, not an EOS or stop) and returned it, and
    the prompt's ids (a completion's: its first choice's); None when no choice did or the prompt's
    ids are missing."""
    chs = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(chs, list):
        return None
    firsts: dict[int, int] = {}
    pids: Any = obj.get("prompt_token_ids") if chat else None
    for ch in chs:
        if not isinstance(ch, dict):
            continue
        if not chat and pids is None:
            pids = ch.get("prompt_token_ids")
        if ch.get("finish_reason") != "length":
            continue
        toks, idx = ch.get("token_ids"), ch.get("index", 0)
        if type(idx) is int and _ids(toks) and len(toks) == 1 and 0 <= toks[0] < 1 << 31:  # lw_core.wire.TokenId
            firsts[idx] = toks[0]
    if not firsts or not _ids(pids):
        return None
    return firsts, pids


def choice_index(engine_id: str, n: int, prompts: int = 1, parent_id: str | None = None) -> int | None:
    """Which choice of a request of ``prompts`` prompts and ``n`` choices each the decoder's engine
    request ``engine_id`` is (prompt ``i``'s choice ``j``: ``i * n + j``, as vLLM indexes a
    completion's choices): vLLM names the children of a request of several choices
    ``f"{j}_{request id}"`` (``vllm.v1.engine.parallel_sampling.ParentRequest.get_child_info``), and
    prompt ``i`` of a completion ``f"cmpl-{X-Request-Id}-{i}"`` plus ``-`` and 8 random characters
    (``vllm.v1.engine.input_processor.InputProcessor.assign_request_id``); this proxy names the
    decoder's request of parent ``parent_id`` (``request_id``), so the prompt is read after that
    name. A request of one choice is choice 0. None when the id does not say."""
    if n == 1 and prompts == 1:
        return 0
    j, rest = 0, engine_id
    if n > 1:
        head, sep, rest = engine_id.partition("_")
        if not sep or not head.isdigit() or len(head) > 6 or int(head) >= n:
            return None
        j = int(head)
    if prompts == 1:
        return j
    prefix = f"cmpl-{request_id(parent_id)}-" if parent_id is not None else None
    if prefix is None or not rest.startswith(prefix):
        return None
    digits = rest[len(prefix):].partition("-")[0]
    if not digits.isdigit() or len(digits) > 6 or int(digits) >= prompts:
        return None
    return int(digits) * n + j


def engine_choice(req: Any, parent_id: str, engine_id: str) -> int | None:
    """``choice_index`` of the decoder's engine request ``engine_id`` of ``req`` (a ``ClientRequest``,
    the parent's) under parent ``parent_id``."""
    return choice_index(engine_id, getattr(req, "n", 1), max(len(getattr(req, "prompts", ())), 1), parent_id)


def given(value: Any) -> bool:
    """A field counts as set unless it is null or false: 0, "" and [] are values (``logprobs: 0``
    asks for the sampled token's logprob)."""
    return value is not None and value is not False


class Prefilled(NamedTuple):
    """The prefill's 200 answer, as handed to the stream: its parent's id, its body, and whether
    the decoder continues from its first token (``relayable``). A streamed prefill's
    (``prefill_stream``) comes choice by choice: ``only`` names the choices ``data`` holds, and
    ``more`` (the first's) is the queue the later choices' come through. ``parsed``: a parsed chat's
    opening events (``parsed_relay.ParsedFirst``), which are relayed in place of ``data`` (empty).
    ``settle``: ``forced`` once every choice's decoder request said whether it continues from its
    token (``fanin.Parent.settle``), for an answer that came before they all did."""

    parent_id: str
    data: bytes
    forced: bool
    only: tuple[int, ...] | None = None
    more: Any = None
    parsed: Any = None
    settle: Callable[[], Awaitable[bool]] | None = None


def request_id(parent_id: str) -> str:
    return f"lw-{parent_id}"


class Relayed(NamedTuple):
    """One choice's relayed first token: its text, the token ids behind it when the prefill returned
    them (it is asked to: ``return_token_ids``), else None, and how many log-prob entries went out
    with it (0 when the client asked none): the decoder's first as many are cut."""

    text: str
    token_ids: list[int] | None
    logprobs: int = 0
    held: str = ""  # the token's text held back for stop strings (``held_back``), not in ``text``
    delta: dict[str, Any] | None = None  # a parsed chat's relayed delta as the prefiller sent it (parsed_relay)


class First(NamedTuple):
    """The relayed first events (``block``: chat, each choice's role event then each choice's first
    content), what each choice relayed (by choice index), the prompt's ids when the prefill returned
    them, and the prefill answer's ``created`` (the whole stream's: ``same_created``)."""

    block: bytes
    choices: dict[int, Relayed]
    prompt_ids: list[int] | None
    created: int | None = None


def first_event(data: bytes | None, parent_id: str, chat: bool = False, logprobs: bool = False,
                n: int = 1, *, ids: bool = False, usage: bool = False, hold: int = 0,
                only: tuple[int, ...] | None = None, roles: bool = True, echo: str | None = None) -> First | None:
    """The SSE events carrying the prefill answer's first token of each of its ``n`` choices (chat:
    the role events and the first contents) and, with ``logprobs`` (the client asked for them),
    their log-probs, which the answer must hold for each of its tokens; None when they must not be
    relayed (see the module docstring): every choice is relayed, or none. ``ids``: the client
    asked for token ids (``return_token_ids``): the events carry the prompt's and the token's, as
    a single engine's first events do; ``usage``: every event carries usage
    (``continuous_usage``), the prompt's count from the prefill's answer; ``hold``: the characters
    vLLM holds back for stop strings (``held_back``), which the first events do not show yet.
    ``only``: the answer holds just these choices of the ``n`` (a streamed prefill's, choice by
    choice: ``prefill_stream``), whose events are built; ``roles`` (chat): the role events go out
    first, one per choice of the ``n`` as a single engine opens its stream (a streamed prefill's
    later choices: False, they went out with the first). ``echo`` (a completion with ``echo: true``,
    whose prefill echoes nothing: ``echo_text``): the text each choice's first event begins with (the
    prompt's; empty when the client asked for ids), and that event carries the prompt's ids, as
    vLLM's echoing event does with or without ``return_token_ids``."""
    if not data:
        return None
    try:
        obj = msgspec.json.decode(data)
        chs = obj["choices"]
    except (msgspec.DecodeError, KeyError, TypeError, ValueError):
        return None
    want = list(range(n)) if only is None else sorted(only)
    if not isinstance(obj, dict) or not isinstance(chs, list) or len(chs) != len(want):
        return None
    if not all(isinstance(ch, dict) for ch in chs) or sorted(ch.get("index", 0) for ch in chs) != want:
        return None
    got: dict[int, tuple[Relayed, Any, str | None]] = {}
    pids: Any = obj.get("prompt_token_ids") if chat else None
    for ch in sorted(chs, key=lambda c: c.get("index", 0)):
        one = _relayed(ch, chat, logprobs, hold)
        if one is None:
            return None
        if echo:
            one = (one[0]._replace(text=echo + one[0].text), *one[1:])
        got[ch.get("index", 0)] = one
        if not chat and pids is None:
            pids = ch.get("prompt_token_ids")
    pids = pids if _ids(pids) else None
    if ids and (pids is None or any(r.token_ids is None for r, _, _ in got.values())):
        return None  # the ids a single engine's first events carry are not known
    if echo is not None and pids is None:
        return None  # vLLM's echoing event carries them
    if chat and reasoning_usage(obj):
        return None  # a reasoning parser's server: its one-token answer is not its stream's first event (parsed_relay)
    u = _usage(obj.get("usage"), chat) if usage else None
    if usage and u is None:
        return None
    created = obj.get("created")
    if chat:
        head = {"id": f"chatcmpl-{request_id(parent_id)}", "object": "chat.completion.chunk",
                "created": created, "model": obj.get("model")}
        opened = {i: role for i, (_, _, role) in got.items()}
        role0 = next(iter(opened.values()), None)
        block = b"".join(rc.sse_encode({**head, "choices": [{"index": i, "delta": {"role": opened.get(i, role0) or "assistant",
                                                                                   "content": ""},
                                                            "logprobs": None, "finish_reason": None}],
                                        "prompt_token_ids": pids if ids else None, "prompt_text": None,
                                        **({"usage": u(0)} if u else {})})
                         for i in (range(n) if roles else ()))
        block += b"".join(rc.sse_encode({**head, "choices": [{"index": i, "delta": {"content": r.text}, "logprobs": lp,
                                                             "finish_reason": None,
                                                             "token_ids": r.token_ids if ids else None}],
                                         **({"usage": u(1)} if u else {})})
                          for i, (r, lp, _) in got.items())
    else:
        block = b"".join(rc.sse_encode({"id": f"cmpl-{request_id(parent_id)}", "object": "text_completion",
                                        "created": created, "model": obj.get("model"),
                                        "choices": [{"index": i, "text": r.text, "logprobs": lp, "finish_reason": None,
                                                     "stop_reason": None,
                                                     "prompt_token_ids": pids if ids or echo is not None else None,
                                                     "token_ids": r.token_ids if ids else None}],
                                        **({"usage": u(1)} if u else {})})
                         for i, (r, lp, _) in got.items())
    return First(block, {i: r for i, (r, _, _) in got.items()}, pids, created if type(created) is int else None)


def _usage(usage: Any, chat: bool) -> Callable[[int], dict[str, Any]] | None:
    """The continuous usage of an event after ``k`` generated tokens of its choice, as vLLM stamps
    it (chat adds ``completion_tokens_details``, the prefill's), from the prefill answer's usage;
    None without its prompt count."""
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if type(prompt) is not int:
        return None
    assert isinstance(usage, dict)
    details = usage.get("completion_tokens_details")

    def at(k: int) -> dict[str, Any]:
        u = {"prompt_tokens": prompt, "total_tokens": prompt + k, "completion_tokens": k}
        return {**u, "completion_tokens_details": details} if chat else u
    return at


def plain_content(msg: Any) -> str | None:
    """A chat answer's ``message`` content when it is plain text: a string, no tool calls, and no
    reasoning a parser set (an empty one too: a reasoning block opened); else None."""
    if (not isinstance(msg, dict) or msg.get("tool_calls") or msg.get("reasoning_content") is not None
            or msg.get("reasoning") is not None):
        return None
    content = msg.get("content")
    return content if isinstance(content, str) else None


def _relayed(ch: dict[str, Any], chat: bool, logprobs: bool, hold: int = 0) -> tuple[Relayed, Any, str | None] | None:
    """One prefill choice's relayed token (its text but for the last ``hold`` characters), its
    log-probs as they go out and (chat) its role; None when it must not be relayed."""
    msg = ch.get("message") if chat else {}
    text = plain_content(msg) if chat else ch.get("text")
    if not isinstance(text, str) or ch.get("finish_reason") != "length":
        return None
    toks = ch.get("token_ids")
    cut = max(len(text) - hold, 0)
    text, held = text[:cut], text[cut:]
    if not text and not (_ids(toks) and len(toks) == 1):
        return None  # an empty text is relayed by its token id, which the decoder's stream is cut by
    lp = ch.get("logprobs") if logprobs else None
    n_lp = logprob_entries(lp, chat)
    if logprobs and (n_lp < 1 or (_ids(toks) and n_lp != len(toks))):
        return None  # asked for, but not one entry per relayed token
    role = msg.get("role") if chat and isinstance(msg, dict) and isinstance(msg.get("role"), str) else None
    return Relayed(text, toks if _ids(toks) else None, n_lp, held), lp, role


_CREATED = re.compile(rb'"created":\s*\d+')


def same_created(block: bytes, created: int) -> bytes:
    """``block``'s events stamped with ``created`` (a single engine's stream has one ``created``;
    the relayed event carries the prefill's). A string cannot hold ``"created":`` unescaped. A
    block from one decoder call carries one value: one already right (the usual case, both
    requests started in the same second) is passed on without a rewrite."""
    want = b'"created":%d' % created
    if b'"created"' not in block or want + b"," in block:
        return block
    return _CREATED.sub(want, block)


_LP_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")  # a completion's logprobs


def logprob_entries(lp: Any, chat: bool) -> int:
    """Tokens a choice's ``logprobs`` describes (0 for none or a shape it does not know)."""
    if not isinstance(lp, dict):
        return 0
    if chat:
        content = lp.get("content")
        return len(content) if isinstance(content, list) else 0
    tokens = lp.get("tokens")
    if not isinstance(tokens, list) or any(not isinstance(lp.get(k), list) or len(lp[k]) != len(tokens)
                                           for k in _LP_LISTS if lp.get(k) is not None):
        return 0
    return len(tokens)


def cut_logprobs(ch: dict[str, Any], n: int, chat: bool) -> int:
    """Drop choice ``ch``'s first ``n`` log-prob entries (those of the relayed tokens, which went out
    with the prefiller's); returns how many are still to be dropped. Emptied log-probs become null."""
    lp = ch.get("logprobs")
    if n <= 0 or not isinstance(lp, dict) or not (have := logprob_entries(lp, chat)):
        return n
    k = min(n, have)
    if chat:
        lp["content"] = lp["content"][k:]
    else:
        for key in _LP_LISTS:
            if isinstance(lp.get(key), list):
                lp[key] = lp[key][k:]
    if k == have:
        ch["logprobs"] = None
    return n - k


def _ids(v: Any) -> TypeGuard[list[int]]:
    return isinstance(v, list) and bool(v) and all(type(t) is int for t in v)


class Mismatch(Exception):
    """The decoder's text (or token ids) does not start with what was relayed."""


def cut(ch: dict[str, Any], skip: str, skip_ids: list[int] | None,
        chat: bool = False) -> tuple[str, list[int] | None]:
    """Drop from choice ``ch``'s text (chat: its delta's content) and token ids the part already
    relayed (``skip``, and ``skip_ids`` when the prefill returned its ids), checking it matches;
    returns what is still to be cut."""
    if not skip and not skip_ids:
        return skip, skip_ids
    delta = ch.get("delta") if chat else None
    text = ((delta.get("content") if isinstance(delta, dict) else None) if chat else ch.get("text")) or ""
    k = min(len(text), len(skip))
    if text[:k] != skip[:k]:
        raise Mismatch(f"the decoder's first text {text[:k]!r} differs from the prefiller's {skip[:k]!r}")
    if isinstance(delta, dict) and "content" in delta:
        delta["content"] = text[k:]
    elif not chat:
        ch["text"] = text[k:]
    skip = skip[k:]
    toks = ch.get("token_ids")
    if skip_ids and toks is None and text:
        skip_ids = None  # this decoder sends no ids: nothing to cut
    elif skip_ids and isinstance(toks, list) and toks:
        k = min(len(toks), len(skip_ids))
        if toks[:k] != skip_ids[:k]:
            raise Mismatch(f"the decoder's first token ids {toks[:k]} differ from the prefiller's {skip_ids[:k]}")
        ch["token_ids"] = toks[k:]
        skip_ids = skip_ids[k:] or None
    return skip, skip_ids
