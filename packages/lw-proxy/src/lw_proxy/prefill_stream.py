"""A streamed prefill of several choices (``PrefillStream``, fed by ``prefill_dispatch``): the
prefiller's SSE events assembled, choice by choice, into what its non-streamed answer holds for
that choice, so each choice's first token can be handed on (to its decoder request and, with
``--prefill-first``, to the client's stream) as soon as the prefiller has it rather than once
every choice has one.

vLLM runs a request's choices as engine requests of their own, which the prefiller may finish
apart (one computes, the next loads what the first saved), and streams each choice's event as it
finishes. The prefill asks one token per choice, its token ids and continuous usage, so each
choice's event carries its text (chat: after a role event per choice), token id, log-probs when
asked, ``finish_reason`` and the prompt's count; completions carry the prompt's ids in each
choice's first event, chat in the stream's first event. ``answer`` turns what came into the
non-streamed answer's shape (``text`` or ``message``, merged ``logprobs``, ``token_ids``, the
usage of those choices), which ``relay.first_tokens_of`` and ``relay.first_event`` read as they read a
non-streamed prefill answer.

A parsed chat's prefill (``parsed_relay``: two tokens, ``first_events``) hands each choice on at its
first token's event instead of its finish, and keeps the events that opened it as they came
(``parsed_first``): every choice's role event and that first token's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from lw_core.wire import MetaserverResponse, prompt_digest

from .errors import ProxyError
from .parsed_relay import ParsedFirst, first_token

MAX_PENDING_BYTES = 16 << 20  # the most bytes of one unfinished SSE event held while waiting for its end


@dataclass(slots=True)
class _Choice:
    text: str = ""
    role: str | None = None
    other: dict[str, Any] = field(default_factory=dict)  # chat delta keys but role and content (tool calls, reasoning)
    token_ids: list[int] | None = None
    logprobs: Any = None
    prompt_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    role_event: dict[str, Any] | None = None  # the event that opened the choice (``first_events``)
    usage: dict[str, Any] | None = None  # the usage of its last event (continuous: its prompt's count)
    first_event: dict[str, Any] | None = None  # the event that carried its first token (``first_events``)


class PrefillStream:
    """``chat``: a chat completion's events (deltas), else a completion's. ``first_events``: a choice
    is handed on at its first token's event (a parsed chat's prefill), not at its finish."""

    def __init__(self, chat: bool, first_events: bool = False) -> None:
        self.chat = chat
        self.first_events = first_events
        self.head: dict[str, Any] = {}  # id, created, model of the first event
        self.prompt_ids: list[int] | None = None  # chat: the stream's first event's
        self.usage: dict[str, Any] | None = None  # the last usage seen (continuous: the prompt's count)
        self.choices: dict[int, _Choice] = {}
        self.done = False  # [DONE] came
        self._buf = b""

    def feed(self, data: bytes) -> list[int]:
        """Take the next bytes of the stream; the indices of the choices it finished (their
        ``finish_reason`` came; ``first_events``: their first token came). Raises ``ProxyError`` on an error event or a stream that is not SSE."""
        self._buf += data
        cut = self._buf.rfind(b"\n\n")
        if cut < 0:
            if len(self._buf) > MAX_PENDING_BYTES:
                raise ProxyError(502, "the prefiller's stream sent an event too large to read", kind="prefill_failed")
            return []
        block, self._buf = self._buf[: cut + 2], self._buf[cut + 2 :]
        finished: list[int] = []
        for ev in block.split(b"\n\n"):
            line = ev.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            try:
                obj = msgspec.json.decode(payload)
            except msgspec.DecodeError:
                raise ProxyError(502, "the prefiller's stream sent an event that is not JSON", kind="prefill_failed") from None
            if not isinstance(obj, dict) or "error" in obj:
                raise ProxyError(502, f"the prefiller's stream ended with an error: {payload[:300].decode(errors='replace')}",
                                 kind="prefill_failed")
            finished += self._event(obj)
        return finished

    def _event(self, obj: dict[str, Any]) -> list[int]:
        if not self.head:
            self.head = {k: obj.get(k) for k in ("id", "created", "model")}
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        if self.chat and self.prompt_ids is None and isinstance(obj.get("prompt_token_ids"), list):
            self.prompt_ids = obj["prompt_token_ids"]
        finished = []
        for ch in obj.get("choices") or ():
            if not isinstance(ch, dict) or type(ch.get("index", 0)) is not int:
                continue
            i = ch.get("index", 0)
            c = self.choices.setdefault(i, _Choice())
            if isinstance(obj.get("usage"), dict) and len(obj["choices"]) == 1:
                c.usage = obj["usage"]
            if self.chat:
                d = ch.get("delta")
                delta: dict[str, Any] = d if isinstance(d, dict) else {}
                if isinstance(delta.get("role"), str):
                    c.role = delta["role"]
                    c.role_event = c.role_event or obj
                if isinstance(delta.get("content"), str):
                    c.text += delta["content"]
                c.other.update({k: v for k, v in delta.items() if k not in ("role", "content") and v})
            elif isinstance(ch.get("text"), str):
                c.text += ch["text"]
            if isinstance(ch.get("token_ids"), list):
                if self.first_events and ch["token_ids"] and c.first_event is None:
                    c.first_event = obj
                    finished.append(i)
                c.token_ids = (c.token_ids or []) + ch["token_ids"]
            if isinstance(ch.get("prompt_token_ids"), list) and c.prompt_ids is None:
                c.prompt_ids = ch["prompt_token_ids"]
            c.logprobs = _merge_logprobs(c.logprobs, ch.get("logprobs"), self.chat)
            if ch.get("finish_reason") is not None and c.finish_reason is None:
                c.finish_reason, c.stop_reason = ch["finish_reason"], ch.get("stop_reason")
                if not self.first_events:
                    finished.append(i)
        return finished

    def parsed_first(self, i: int) -> ParsedFirst:
        """Choice ``i``'s opening events (``first_events``; its first token came)."""
        first = self.choices[i].first_event
        assert first is not None
        roles = tuple(c.role_event for _, c in sorted(self.choices.items()) if c.role_event is not None)
        return ParsedFirst(roles, first)

    def first_answer(self, i: int) -> bytes | None:
        """The metaserver answer of choice ``i`` (``first_events``): its first token and the prompt's
        digest, when the choice goes on after that token and the prompt's ids came; else None."""
        t = first_token(self.parsed_first(i).first)
        if t is None or not self.prompt_ids or not all(type(x) is int for x in self.prompt_ids):
            return None
        return msgspec.json.encode(MetaserverResponse(first_token=t, prompt_digest=prompt_digest(self.prompt_ids)))

    def answer(self, indices: Iterable[int]) -> bytes:
        """The non-streamed answer's JSON holding the choices at ``indices`` (finished ones)."""
        chs = []
        generated = 0
        idx = sorted(indices)
        for i in idx:
            c = self.choices[i]
            generated += len(c.token_ids or ()) or 1
            if self.chat:
                msg = {"role": c.role or "assistant", "content": c.text, **c.other}
                chs.append({"index": i, "message": msg, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason, "token_ids": c.token_ids})
            else:
                chs.append({"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason, "prompt_token_ids": c.prompt_ids, "token_ids": c.token_ids})
        obj: dict[str, Any] = {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                               "choices": chs}
        # One choice's answer counts its own prompt (a prompt list's differ); several, the last seen.
        src = (self.choices[idx[0]].usage if len(idx) == 1 else None) or self.usage or {}
        prompt = src.get("prompt_tokens")
        if type(prompt) is int:
            usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + generated,
                                     "completion_tokens": generated}
            if self.chat:
                usage["completion_tokens_details"] = src.get("completion_tokens_details")
            obj["usage"] = usage
        if self.chat:
            obj["prompt_token_ids"] = self.prompt_ids
        return msgspec.json.encode(obj)


def _merge_logprobs(have: Any, more: Any, chat: bool) -> Any:
    """One choice's log-probs so far with an event's appended (chat: ``content`` entries; a
    completion: its parallel lists)."""
    if not isinstance(more, dict):
        return have
    if have is None:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in more.items()}
    for k, v in more.items():
        if isinstance(v, list) and isinstance(have.get(k), list):
            have[k] = have[k] + v
        elif k not in have:
            have[k] = v
    return have
