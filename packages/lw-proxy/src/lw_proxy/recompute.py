"""Resuming a choice the decoder ended with ``stop_reason == "recomputed"``.

The decoder gave up on the request (its KV was lost) after generating part of the answer. The
proxy resubmits the *rest* with the token budget reduced by what was already generated, and splices
the continuation into the client's answer. The rest is resubmitted by token ids whenever the
decoder returned them (``lw_proxy.token_ids``: the proxy asks for them), so the engine continues
exactly the sequence a single engine would:

- completions: ``prompt`` = the prompt's token ids + the generated token ids (vLLM takes a token-id
  prompt), ``truncate_prompt_tokens`` dropped (those ids are already the truncated prompt);
- chat: the chat endpoint takes no token-id prompt, but vLLM 0.32 feeds
  ``kv_transfer_params.prompt_token_ids`` straight to the engine, skipping the template, for
  text-only messages without ``echo``; the continuation carries those ids (``ClientRequest.prompt_ids``)
  and, for the cases where vLLM renders the messages instead, the messages plus an assistant message
  with the generated text, continued with ``continue_final_message``.

Without ids (``echo``, a decoder that sent none) the rest is resubmitted by text: prompt + generated
text (token ids for token prompts; chat as above), which the engine re-tokenizes and so may continue
differently from a single engine.

The generated-token count comes from the choice's ``token_ids`` when known, else from
``usage.completion_tokens`` (exact for one choice; split evenly over several choices, an estimate,
since vLLM's usage is per response) or, in streams, from the number of content events.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from . import token_ids as tids
from .errors import ProxyError
from .validate import ClientRequest

RECOMPUTED = "recomputed"


def is_recomputed(choice: dict[str, Any]) -> bool:
    return choice.get("stop_reason") == RECOMPUTED or choice.get("finish_reason") == RECOMPUTED


def filled(v: Any) -> bool:
    """A value that says something: not null, an empty string, list or object."""
    return v is not None and v != "" and v != [] and v != {}


def carries(choice: dict[str, Any]) -> bool:
    """The choice of a stream event tells the client something: a finish reason, text, any delta
    field (content, ``tool_calls``, ``reasoning_content``, a role), token ids or logprobs. Events
    whose choices carry nothing (an emptied recomputed finish, text already relayed) are dropped."""
    if choice.get("finish_reason") is not None:
        return True
    for k, v in choice.items():
        if k in ("index", "stop_reason"):
            continue
        if k == "delta" and isinstance(v, dict):
            if any(filled(x) for x in v.values()):
                return True
        elif filled(v):
            return True
    return False


def choice_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        src = choice.get("message") or choice.get("delta") or {}
        return src.get("content") or ""
    return choice.get("text") or ""


def echo_prefix(req: ClientRequest, index: int = 0) -> str:
    """The text vLLM puts before choice ``index``'s generated text: with ``echo`` (JSON ``true``) on a
    completion of a text prompt, the prompt as given (``RequestOutput.prompt``), unless the client
    asked for token ids (vLLM then echoes the prompt's ids only); else nothing. A chat's echo (the
    last message's content when its role is the answer's) is not read here."""
    if req.chat or req.body.get("echo") is not True or tids.client_asked(req.body):
        return ""
    prompt = req.prompts[index // req.n] if index // req.n < len(req.prompts) else None
    return prompt if isinstance(prompt, str) else ""


def continuation(req: ClientRequest, index: int, text: str, token_ids: list[int] | None,
                 generated: int, prompt_ids: list[int] | None = None) -> ClientRequest | None:
    """The request for the rest of choice ``index``; None when its token budget is already spent.

    ``text``: the choice's text so far as the client got it (an echoed prompt included: it is cut,
    and the continuation echoes nothing, ``echo_prefix``); ``token_ids``: the choice's generated
    token ids so far, ``prompt_ids``: its prompt's, each None when the decoder did not return them
    (see the module docstring)."""
    remaining = None
    if req.max_tokens is not None:
        remaining = req.max_tokens - generated
        if remaining < 1:
            return None
    echoed = echo_prefix(req, index)
    if echoed and text.startswith(echoed):
        text = text[len(echoed):]
    body = dict(req.body)
    body["n"] = 1
    body.pop("stream_options", None)
    body.pop("echo", None)  # the client has the echo already
    mt = body.get("min_tokens")
    if type(mt) is int and mt > 0:  # what is left of it: vLLM counts the output, which the rest starts anew
        body["min_tokens"] = max(mt - generated, 0)
    ids = list(prompt_ids) + list(token_ids) if prompt_ids is not None and token_ids is not None else None
    if req.chat:
        body["messages"] = list(req.body["messages"]) + [{"role": "assistant", "content": text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
        if remaining is not None:
            key = "max_completion_tokens" if req.body.get("max_completion_tokens") is not None else "max_tokens"
            body[key] = remaining
        ptoks = len(ids) if ids is not None else req.prompt_tokens
        return ClientRequest(True, body, req.stream, 1, [], 1, remaining, ptoks, ptoks, prompt_ids=ids)
    prompt = req.prompts[index // req.n]
    if ids is not None:
        new_prompt: Any = ids
        body.pop("truncate_prompt_tokens", None)
        ptoks = len(ids)
    elif isinstance(prompt, str):
        new_prompt = prompt + text
        ptoks = req.prompt_tokens + len(text) // 4
    else:
        if token_ids is None:
            raise ProxyError(502, "the decoder recomputed a token-id prompt but returned no token_ids; "
                             "send return_token_ids: true so the proxy can resume it", kind="recompute_exhausted")
        new_prompt = list(prompt) + list(token_ids)
        ptoks = len(new_prompt)
    body["prompt"] = new_prompt
    if remaining is not None:
        body["max_tokens"] = remaining
    return ClientRequest(False, body, req.stream, 1, [new_prompt], 1, remaining, ptoks, ptoks + (remaining or 16))


def generated_tokens(choice: dict[str, Any], usage: dict[str, Any] | None, n_choices: int) -> int:
    if choice.get("token_ids") is not None:
        return len(choice["token_ids"])
    done = (usage or {}).get("completion_tokens") or 0
    return -(-done // max(n_choices, 1))


def splice(choice: dict[str, Any], cont: dict[str, Any], chat: bool) -> None:
    """Append continuation choice ``cont`` to ``choice`` (non-streaming). Chat: the message's text
    fields (content, reasoning) are concatenated, a field neither part has stays as it was (null);
    tool calls parsed from the continuation are appended."""
    if chat:
        msg = choice.setdefault("message", {"role": "assistant"})
        more = cont.get("message") or {}
        for k in ("content", "reasoning_content", "reasoning"):
            if isinstance(more.get(k), str) and more[k]:
                msg[k] = (msg.get(k) or "") + more[k]
        if more.get("tool_calls"):
            msg["tool_calls"] = list(msg.get("tool_calls") or []) + list(more["tool_calls"])
    else:
        choice["text"] = (choice.get("text") or "") + choice_text(cont, False)
    if cont.get("token_ids") is not None:
        choice["token_ids"] = (choice.get("token_ids") or []) + cont["token_ids"]
    splice_logprobs(choice, cont, chat)
    choice["finish_reason"] = cont.get("finish_reason")
    choice["stop_reason"] = cont.get("stop_reason")


def splice_logprobs(choice: dict[str, Any], cont: dict[str, Any], chat: bool) -> None:
    """Append ``cont``'s log-prob entries to ``choice``'s when both have them: chat's ``content``
    list; completions' parallel lists, ``text_offset`` continuing from the last entry's token as
    vLLM counts it (each offset is the one before plus that token's length)."""
    lp, more = choice.get("logprobs"), cont.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(more, dict):
        return
    if chat:
        if isinstance(lp.get("content"), list) and isinstance(more.get("content"), list):
            lp["content"] = lp["content"] + more["content"]
        return
    offsets, toks = lp.get("text_offset"), lp.get("tokens")
    shift = (offsets[-1] + len(toks[-1]) if isinstance(offsets, list) and offsets and isinstance(toks, list)
             and len(toks) == len(offsets) and isinstance(toks[-1], str) and isinstance(offsets[-1], int) else None)
    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        a, b = lp.get(k), more.get(k)
        if not isinstance(a, list) or not isinstance(b, list):
            continue
        if k == "text_offset":
            if shift is None or not all(isinstance(o, int) for o in b):
                continue
            b = [o + shift for o in b]
        lp[k] = a + b


def add_usage(usage: dict[str, Any] | None, more: dict[str, Any] | None) -> None:
    if usage is None or not more:
        return
    extra = more.get("completion_tokens") or 0
    usage["completion_tokens"] = (usage.get("completion_tokens") or 0) + extra
    usage["total_tokens"] = (usage.get("total_tokens") or 0) + extra


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    delta: _Delta | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None  # completions: in each choice's first event


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    prompt_token_ids: list[int] | None = None  # chat: in the first event


_chunk_decoder = msgspec.json.Decoder(_Chunk)


class StreamLedger:
    """What a stream told the client so far, per choice index: only what resuming a recomputed
    choice needs (its text as UTF-8, its token ids, a count of content events, its prompt's token
    ids), fed with the decoder's events (before the ids the client did not ask for are stripped).
    The events themselves are not kept. Text and token ids together are capped at ``limit`` bytes
    per stream; past it ``overflowed`` is set, nothing more is stored (counts go on), and a choice
    recomputed after that cannot be resumed. Prompt token ids are held apart from that cap (8 bytes
    a prompt token, once per prompt: the first seen for a prompt is kept, a continuation's longer
    one is not): a request's prompt is bounded by --max-body-bytes already."""

    def __init__(self, chat: bool, limit: int, n: int = 1) -> None:
        self.chat = chat
        self.limit = limit
        self.n = max(n, 1)  # completions: choice i answers prompt i // n
        self.size = 0  # bytes held in _text and _tokens
        self.overflowed = False
        self._text: dict[int, bytearray] = {}
        self._tokens: dict[int, array] = {}
        self._prompt: dict[int, array] = {}
        self._no_ids: set[int] = set()  # choices with text that came without its token ids
        self.events: dict[int, int] = {}
        self.token_counts: dict[int, int] = {}

    def feed_block(self, block: bytes) -> None:
        for ev in sse_events(block):
            line = ev.strip()
            if not line.startswith(b"data:"):
                continue
            try:
                chunk = _chunk_decoder.decode(line[5:])
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # [DONE], an error event, or not ours
            for ch in chunk.choices or ():
                t = (ch.delta.content if ch.delta is not None else None) if self.chat else ch.text
                self.feed(ch.index, t, ch.token_ids, ch.prompt_token_ids or chunk.prompt_token_ids)

    def feed_choice(self, ch: dict[str, Any], prompt_ids: Any = None) -> None:
        """One choice of a parsed event; ``prompt_ids``: the event's top-level ``prompt_token_ids`` (chat)."""
        t = choice_text(ch, self.chat)
        toks, pids = ch.get("token_ids"), ch.get("prompt_token_ids") or prompt_ids
        self.feed(ch.get("index", 0), t if isinstance(t, str) else None, toks if isinstance(toks, list) else None,
                  pids if isinstance(pids, list) else None)

    def feed(self, i: int, t: str | None, toks: list[int] | None, prompt_ids: list[int] | None = None,
             ids_follow: bool = False) -> None:
        """``ids_follow``: ``t`` comes without its token ids, which a later event brings (relayed text)."""
        if prompt_ids:
            key = 0 if self.chat else i // self.n
            if key not in self._prompt:
                self._prompt[key] = array("q", prompt_ids)
        if not t and not toks:
            return
        if t and toks is None and not ids_follow:
            self._no_ids.add(i)
        self.events[i] = self.events.get(i, 0) + 1
        if toks is not None:
            self.token_counts[i] = self.token_counts.get(i, 0) + len(toks)
        raw = t.encode() if t else b""
        more = len(raw) + 8 * len(toks or ())
        if self.overflowed or self.size + more > self.limit:
            self.overflowed = True
            self._text.clear()
            self._tokens.clear()
            self.size = 0
            return
        self.size += more
        if raw:
            self._text.setdefault(i, bytearray()).extend(raw)
        if toks is not None:
            self._tokens.setdefault(i, array("q")).extend(toks)

    def drop_tokens(self, i: int) -> None:
        """Forget choice ``i``'s token ids (they are not known to be right): it resumes by text."""
        self.token_counts.pop(i, None)
        got = self._tokens.pop(i, None)
        if got is not None:
            self.size -= 8 * len(got)

    def text(self, i: int) -> str:
        return self._text.get(i, b"").decode()

    def tokens(self, i: int) -> list[int] | None:
        """Choice ``i``'s generated token ids, or None unless every piece of its text came with them."""
        if not self.tokens_known(i):
            return None
        return list(self._tokens.get(i, ()))

    def prompt_tokens(self, i: int) -> list[int] | None:
        got = self._prompt.get(0 if self.chat else i // self.n)
        return None if got is None else list(got)

    def generated(self, i: int) -> int:
        return self.token_counts[i] if self.tokens_known(i) else self.events.get(i, 0)

    def tokens_known(self, i: int) -> bool:
        return i in self.token_counts and i not in self._no_ids


def sse_events(block: bytes) -> list[bytes]:
    """Split complete SSE events ("data: ...\\n\\n") keeping their terminators."""
    return [e + b"\n\n" for e in block.split(b"\n\n") if e]


def sse_json(event: bytes) -> dict[str, Any] | None:
    """The JSON payload of a ``data:`` event; None for [DONE] or anything that is not JSON."""
    line = event.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return None
    try:
        obj = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def sse_encode(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"
