"""Resuming a choice the decoder ended with ``stop_reason == "recomputed"``.

The decoder gave up on the request (its KV was lost) after generating part of the answer. The
proxy resubmits the *rest*: prompt + generated text (token ids for token prompts; for chat an
assistant message continued with ``continue_final_message``) with the token budget reduced by
what was already generated, and splices the continuation into the client's answer.

The generated-token count comes from the choice's ``token_ids`` when the client asked for them,
else from ``usage.completion_tokens`` (exact for one choice; split evenly over several choices,
an estimate, since vLLM's usage is per response) or, in streams, from the number of content events.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from .errors import ProxyError
from .validate import ClientRequest

RECOMPUTED = "recomputed"


def is_recomputed(choice: dict[str, Any]) -> bool:
    return choice.get("stop_reason") == RECOMPUTED or choice.get("finish_reason") == RECOMPUTED


def choice_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        src = choice.get("message") or choice.get("delta") or {}
        return src.get("content") or ""
    return choice.get("text") or ""


def continuation(req: ClientRequest, index: int, text: str, token_ids: list[int] | None,
                 generated: int) -> ClientRequest | None:
    """The request for the rest of choice ``index``; None when its token budget is already spent."""
    remaining = None
    if req.max_tokens is not None:
        remaining = req.max_tokens - generated
        if remaining < 1:
            return None
    body = dict(req.body)
    body["n"] = 1
    body.pop("stream_options", None)
    if req.chat:
        body["messages"] = list(req.body["messages"]) + [{"role": "assistant", "content": text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
        if remaining is not None:
            key = "max_completion_tokens" if req.body.get("max_completion_tokens") is not None else "max_tokens"
            body[key] = remaining
        return ClientRequest(True, body, req.stream, 1, [], 1, remaining, req.prompt_tokens, req.prompt_tokens)
    prompt = req.prompts[index // req.n]
    if isinstance(prompt, str):
        new_prompt: Any = prompt + text
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
    """Append continuation choice ``cont`` to ``choice`` (non-streaming)."""
    if chat:
        msg = choice.setdefault("message", {"role": "assistant"})
        msg["content"] = (msg.get("content") or "") + choice_text(cont, True)
    else:
        choice["text"] = (choice.get("text") or "") + choice_text(cont, False)
    if cont.get("token_ids") is not None:
        choice["token_ids"] = (choice.get("token_ids") or []) + cont["token_ids"]
    choice["finish_reason"] = cont.get("finish_reason")
    choice["stop_reason"] = cont.get("stop_reason")


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


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)


class StreamLedger:
    """What a stream told the client so far, per choice index: only what resuming a recomputed
    choice needs (its text as UTF-8, its token ids, a count of content events), fed as blocks go
    out. The events themselves are not kept. Text and token ids together are capped at ``limit``
    bytes per stream; past it ``overflowed`` is set, nothing more is stored (counts go on), and a
    choice recomputed after that cannot be resumed."""

    def __init__(self, chat: bool, limit: int) -> None:
        self.chat = chat
        self.limit = limit
        self.size = 0  # bytes held in _text and _tokens
        self.overflowed = False
        self._text: dict[int, bytearray] = {}
        self._tokens: dict[int, array] = {}
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
                self._feed_choice(ch)

    def _feed_choice(self, ch: _Choice) -> None:
        t = (ch.delta.content if ch.delta is not None else None) if self.chat else ch.text
        toks = ch.token_ids
        if not t and not toks:
            return
        i = ch.index
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

    def text(self, i: int) -> str:
        return self._text.get(i, b"").decode()

    def tokens(self, i: int) -> list[int] | None:
        if i not in self.token_counts:
            return None
        return list(self._tokens.get(i, ()))

    def generated(self, i: int) -> int:
        return self.token_counts[i] if i in self.token_counts else self.events.get(i, 0)


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
