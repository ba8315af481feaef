"""What the proxy's parts share about a call to a decoder: the open call a stream reads
(``DecoderCall``), the errors and statuses that mean "this backend cannot serve now" (retry
another), and ``Upstream``, the calls the SSE relay (``sse_relay.SseRelay``) makes on the
proxy. ``Proxy`` implements ``Upstream``; the relay never sees the proxy's pools or registry.

Invariant: every ``DecoderCall`` that ``Upstream.decode`` returns is handed to
``Upstream.finish`` exactly once (it holds a connection, a decoder's load and a parent)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

import aiohttp

if TYPE_CHECKING:
    from .backends import Backend
    from .fanin import Parent
    from .relay import Prefilled
    from .validate import ClientRequest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"  # the generation endpoints, the backends' and ours
# Statuses that say "this backend cannot serve now" (not "this request is wrong"): try another one.
RETRY_STATUSES = frozenset({502, 503, 504})
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class DecoderCall:
    """An open decoder response whose body the caller streams (``first``: its first bytes, already
    read); ``Upstream.finish`` frees everything."""

    __slots__ = ("dec", "parent", "resp", "work", "t0", "first")

    def __init__(self, dec: Backend, parent: Parent, resp: aiohttp.ClientResponse, work: int, t0: float,
                 first: bytes) -> None:
        self.dec, self.parent, self.resp, self.work, self.t0, self.first = dec, parent, resp, work, t0, first


class Upstream(Protocol):
    async def decode(self, req: ClientRequest, path: str, read: bool, relay: asyncio.Future | None = None,
                     parent: Parent | None = None) -> tuple[int, bytes, str] | DecoderCall:
        """Send ``req`` to a decoder (with retries). ``read``: the whole answer as (status, body,
        content type); otherwise the open call once a 200's first bytes arrived, or a non-200 as
        that tuple. ``relay``: the future the prefill's answer is handed to (``--prefill-first``).
        ``parent``: one the caller opened, whose prefill already ran (``prefill_alone``); an open
        call holds it (``finish`` closes it), otherwise the caller closes it."""
        ...

    def continues_stream(self, req: ClientRequest) -> bool:
        """Whether the stream ``req`` is continued after its prefill (``prefill_alone``)."""
        ...

    async def prefill_alone(self, req: ClientRequest) -> tuple[Parent, Prefilled | None]:
        """``req``'s prefill, sent alone and waited for: its parent (``close_parent``) and its 200
        answer, or None when no prefiller gave one."""
        ...

    def close_parent(self, parent: Parent, answered: bool) -> None:
        ...

    def finish(self, call: DecoderCall) -> None:
        """Release the call's connection, decoder load and parent."""
        ...
