"""Client request validation: the body is decoded once to a dict (forwarded as-is, plus our params)
and the fields the proxy relies on are type-checked with msgspec. Anything else is the backend's
business: vLLM validates its own sampling parameters and answers with its own 4xx."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from lw_core.wire import MAX_CHILDREN

from .errors import ProxyError

MAX_TOKENS = 1 << 31
TokenCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
N = Annotated[int, msgspec.Meta(ge=1, le=256)]


class _Completion(msgspec.Struct):
    prompt: str | list[Any]
    model: str | None = None
    max_tokens: TokenCount | None = None
    n: N = 1
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None


class _Message(msgspec.Struct):
    role: str
    content: Any = None


class _Chat(msgspec.Struct):
    messages: Annotated[list[_Message], msgspec.Meta(min_length=1)]
    model: str | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    n: N = 1
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None


@dataclass(slots=True)
class ClientRequest:
    chat: bool
    body: dict[str, Any]
    stream: bool
    children: int  # engine requests the decoder will create: prompts x n
    prompts: list[Any]  # completions: one entry per prompt (str or list[int]); chat: []
    n: int
    max_tokens: int | None
    prompt_tokens: int  # estimate, for balancing: prefiller pending work
    decode_tokens: int  # estimate, for balancing: decoder active tokens
    raw: bytes | None = None  # the client's bytes: forwarded with our params spliced in, never re-encoded
    # A resumed chat choice's prompt as token ids (prompt + generated so far), sent to the backends as
    # kv_transfer_params.prompt_token_ids (see lw_proxy.recompute); None otherwise.
    prompt_ids: list[int] | None = None
    # A continuation of an answered prefill (lw_proxy.prefill_continue): the prompt ends with this many
    # tokens the prefill generated (DecodeTransferParams.lw_prefilled); 0 otherwise.
    prefilled: int = 0


def _token_estimate(s: str) -> int:
    # No tokenizer in the proxy: ~4 characters per token is close enough to rank backends.
    return len(s) // 4 + 1


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ProxyError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ProxyError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ProxyError(400, f"request body must be a JSON object, got {type(body).__name__}")
    if "kv_transfer_params" in body:
        raise ProxyError(400, "kv_transfer_params is set by the proxy; clients must not send it",
                         param="kv_transfer_params")
    return body


def _convert(body: dict[str, Any], typ: type) -> Any:
    try:
        return msgspec.convert(body, typ)
    except msgspec.ValidationError as e:
        # msgspec says e.g. "Expected `int`, got `str` - at `$.max_tokens`": name the field as param.
        msg = str(e)
        param = msg.rsplit("`$.", 1)[1].rstrip("`") if "`$." in msg else None
        raise ProxyError(400, f"invalid request: {msg}", param=param) from None


def _prompts(prompt: str | list[Any]) -> tuple[list[Any], int]:
    """Split ``prompt`` into engine prompts (as vLLM does) and estimate its tokens."""
    if isinstance(prompt, str):
        return [prompt], _token_estimate(prompt)
    if not prompt:
        raise ProxyError(400, "prompt: must not be an empty list", param="prompt")
    first = prompt[0]
    if isinstance(first, int) and not isinstance(first, bool):
        _check_tokens(prompt, "prompt")
        return [prompt], len(prompt)
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise ProxyError(400, "prompt: a list must hold only strings or only token lists", param="prompt")
        return list(prompt), sum(_token_estimate(p) for p in prompt)
    if isinstance(first, list):
        for i, p in enumerate(prompt):
            if not isinstance(p, list) or not p:
                raise ProxyError(400, f"prompt[{i}]: expected a non-empty list of token ids", param="prompt")
            _check_tokens(p, f"prompt[{i}]")
        return list(prompt), sum(len(p) for p in prompt)
    raise ProxyError(
        400, "prompt: accepted forms are a string, a list of strings, a list of token ids (int) "
        "or a list of token-id lists", param="prompt")


def _check_tokens(toks: list[Any], where: str) -> None:
    for t in toks:
        if type(t) is not int or not 0 <= t < MAX_TOKENS:
            raise ProxyError(400, f"{where}: token ids must be integers in [0, 2^31), got {t!r}", param="prompt")


def parse_completion(raw: bytes) -> ClientRequest:
    body = _decode(raw)
    c = _convert(body, _Completion)
    prompts, ptoks = _prompts(c.prompt)
    children = len(prompts) * c.n
    _check_children(children)
    gen = (c.max_tokens or 16) * children
    return ClientRequest(False, body, bool(c.stream), children, prompts, c.n, c.max_tokens, ptoks,
                         ptoks * c.n + gen, raw)


def parse_chat(raw: bytes) -> ClientRequest:
    body = _decode(raw)
    c = _convert(body, _Chat)
    ptoks = sum(_token_estimate(m.content if isinstance(m.content, str) else str(m.content)) for m in c.messages)
    _check_children(c.n)
    max_tokens = c.max_completion_tokens if c.max_completion_tokens is not None else c.max_tokens
    gen = (max_tokens or 256) * c.n
    return ClientRequest(True, body, bool(c.stream), c.n, [], c.n, max_tokens, ptoks, ptoks * c.n + gen, raw)


def _check_children(children: int) -> None:
    if children > MAX_CHILDREN:
        raise ProxyError(400, f"prompt x n expands into {children} engine requests; at most {MAX_CHILDREN} "
                         "are accepted per request", param="prompt")
