"""``--prefill-first`` for streamed chats whose first event a parser shapes: chats with ``tools``
(vLLM's tool parser) and, once a prefiller showed it runs a reasoning parser, every streamed chat.

A one-token prefill cannot show such a chat's first event: vLLM parses a one-token answer's token
as its stream's last (``parse_delta(finished=True)``: unstreamed tool arguments appended, a
reasoning parser's fallback to content, engine-based parsers flushed), where a single engine's
first event parses it as one of many. So their prefill is streamed and asks two tokens
(``PREFILL_TOKENS``) and the token ids: vLLM sends an event per token when ids are asked, even one
the parser holds back (an empty delta), and the first token's event is parsed with
``finished=False``, exactly as a single engine parses it. The proxy relays the prefiller's own
events verbatim (``first_event``: each choice's role event, then the first token's, renamed as
the whole stream is and stripped of what the client did not ask: token ids, continuous usage),
and the first token's event only when a single engine would send one (a held-back token without
ids or log-probs asked sends none). The prefill's token is handed to the decoder's engine request
with its metaserver answer as soon as its event came (``prefill_stream``), so the decoder, which
runs the client's request with the same template and parsers, continues from it; the second token
costs the prefiller one decode step the client does not wait for.

Only a decoder that continues from the token (``forced``) is relayed to: the decoder's event for
the first token is cut by its id (``cut``), its delta checked against the relayed one (tool-call
ids aside: vLLM draws them at random) and, where the decoder's API server merged the first token
with the next into one event, what the relayed delta showed is cut from it (text by prefix, a tool
call's id, type and name, its arguments by prefix).

Whether a server runs a reasoning parser is not in the request; its answers say it: a chat
answer's ``usage.completion_tokens_details`` is set only then (``reasoning_server``). The first
such prefill answer is not relayed (``relay.first_event``) nor continued
(``prefill_continue.plan``), and from then on streamed chats take this path
(``prefill_dispatch.PrefillDispatcher.reasoning``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from . import recompute as rc
from . import token_ids
from .relay import First, Mismatch, Relayed, continuous_usage, given, logprob_entries, reasoning_usage, request_id
from .validate import ClientRequest

TOOLS = ("tools", "functions")
PREFILL_TOKENS = 2  # the first token's event is parsed as one of many, not as the stream's last


def parsed(req: ClientRequest, reasoning: bool) -> bool:
    """A streamed chat whose first event comes from a streamed two-token prefill: one with tools,
    or any once the prefillers run a reasoning parser (``reasoning``)."""
    return req.chat and req.stream and (reasoning or any(given(req.body.get(k)) for k in TOOLS))


def reasoning_server(data: bytes) -> bool:
    """A chat answer (its JSON) from a server that runs a reasoning parser (``relay.reasoning_usage``)."""
    try:
        return reasoning_usage(msgspec.json.decode(data))
    except msgspec.DecodeError:
        return False


class ParsedFirst(NamedTuple):
    """A streamed two-token prefill's events for one choice: every choice's role event (vLLM sends
    them all before any token's) and that choice's first token's event, as the prefiller sent them."""

    roles: tuple[dict[str, Any], ...]
    first: dict[str, Any]


def first_token(ev: dict[str, Any]) -> int | None:
    """The token a first token's event carries when the choice goes on after it (no finish: not an
    EOS, a stop or the last token the client asked), else None."""
    chs = ev.get("choices")
    ch = chs[0] if isinstance(chs, list) and len(chs) == 1 and isinstance(chs[0], dict) else None
    toks = ch.get("token_ids") if ch is not None else None
    if ch is None or ch.get("finish_reason") is not None or not isinstance(toks, list) or len(toks) != 1:
        return None
    t = toks[0]
    return t if type(t) is int and 0 <= t < 1 << 31 else None


def first_event(pf: ParsedFirst, parent_id: str, req: ClientRequest, roles: bool) -> First | None:
    """The relayed events of ``pf`` (see the module docstring); None when its choice must not be
    relayed (it ended at its first token, or the events are not a chat stream's)."""
    t = first_token(pf.first)
    if t is None or len(pf.roles) != req.n:
        return None
    ch = pf.first["choices"][0]
    delta = ch.get("delta")
    idx = ch.get("index", 0)
    if not isinstance(delta, dict) or type(idx) is not int:
        return None
    ids = token_ids.client_asked(req.body)
    usage = continuous_usage(req) is True
    pids = next((ev.get("prompt_token_ids") for ev in pf.roles if isinstance(ev.get("prompt_token_ids"), list)), None)
    lp = ch.get("logprobs")
    shown = any(rc.filled(v) for v in delta.values()) or lp is not None or ids  # as vLLM decides (module docstring)
    events = [*(pf.roles if roles else ()), *((pf.first,) if shown else ())]
    block = b"".join(_out(ev, parent_id, usage, ids) for ev in events)
    created = pf.first.get("created")
    relayed = Relayed(delta.get("content") or "", [t], logprob_entries(lp, True), delta=delta)
    return First(block, {idx: relayed}, pids, created if type(created) is int else None)


def _out(ev: dict[str, Any], parent_id: str, usage: bool, ids: bool) -> bytes:
    """One of the prefiller's events as the client's stream carries it."""
    ev = {**ev, "id": f"chatcmpl-{request_id(parent_id)}"}
    if not usage:
        ev.pop("usage", None)
    data = rc.sse_encode(ev)
    return data if ids else token_ids.strip(data)


def cut(ch: dict[str, Any], delta: dict[str, Any], first: int) -> bool:
    """Cut from the decoder's choice event ``ch`` the first token (``first``) and what its relayed
    ``delta`` showed; whether it was in this event (an event without token ids, a role event, is
    left as it is). Raises ``Mismatch`` when the decoder's first token or its delta differs."""
    toks = ch.get("token_ids")
    if not isinstance(toks, list) or not toks:
        return False
    if toks[0] != first:
        raise Mismatch(f"the decoder's first token {toks[0]} differs from the prefiller's {first}")
    d = ch.get("delta")
    got: dict[str, Any] = d if isinstance(d, dict) else {}
    if len(toks) == 1:
        if _without_ids(got) != _without_ids(delta):
            raise Mismatch(f"the decoder's first delta {got!r} differs from the prefiller's {delta!r}")
        ch["delta"] = {}
    else:
        ch["delta"] = _minus(got, delta)
    ch["token_ids"] = toks[1:]
    return True


def _without_ids(delta: dict[str, Any]) -> dict[str, Any]:
    """``delta`` with its tool calls' ids left out (vLLM draws them at random per request) and its
    empty fields."""
    out = {k: v for k, v in delta.items() if rc.filled(v)}
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} if isinstance(c, dict) else c
                             for c in out["tool_calls"]]
    return out


def _minus(got: dict[str, Any], shown: dict[str, Any]) -> dict[str, Any]:
    """A delta of several tokens (``got``) less what the first token's (``shown``) showed."""
    out = dict(got)
    for k, v in shown.items():
        if not rc.filled(v):
            continue
        if isinstance(v, str):
            have = out.get(k)
            if not isinstance(have, str) or not have.startswith(v):
                raise Mismatch(f"the decoder's {k} {have!r} does not begin with the relayed {v!r}")
            out[k] = have[len(v):]
        elif k == "tool_calls" and isinstance(v, list):
            out[k] = _calls_minus(out.get(k), v)
        else:
            raise Mismatch(f"the relayed delta's {k} cannot be cut from the decoder's")
    return out


def _calls_minus(got: Any, shown: list[Any]) -> list[dict[str, Any]]:
    if not isinstance(got, list):
        raise Mismatch("the decoder's delta lacks the relayed tool call")
    calls = {c.get("index"): dict(c) for c in got if isinstance(c, dict)}
    for s in shown:
        c = calls.get(s.get("index")) if isinstance(s, dict) else None
        if c is None:
            raise Mismatch("the decoder's delta lacks the relayed tool call")
        sf, cf = s.get("function") or {}, dict(c.get("function") or {})
        if sf.get("name") and cf.pop("name", None) != sf["name"]:
            raise Mismatch(f"the decoder's tool call is not the relayed {sf['name']!r}")
        for k in ("id", "type"):
            if s.get(k) is not None:
                c.pop(k, None)
        args = sf.get("arguments") or ""
        have = cf.get("arguments") or ""
        if not have.startswith(args):
            raise Mismatch(f"the decoder's tool arguments {have!r} do not begin with the relayed {args!r}")
        if "arguments" in cf:
            cf["arguments"] = have[len(args):]
        c["function"] = cf
        calls[s.get("index")] = c
    return [c for c in calls.values() if any(rc.filled(v) for k, v in c.items() if k not in ("index", "function"))
            or any(rc.filled(v) for v in (c.get("function") or {}).values())]
