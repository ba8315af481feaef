"""PD-disaggregation wire protocol (docs/design/architecture.md §6), shared by lw-vllm's connector and lw-proxy.

Flow: proxy -> decoder carries ``DecodeTransferParams``; the decoder's connector POSTs one
``MetaserverRequest`` per engine request to ``DecodeTransferParams.metaserver``; once the proxy holds
``lw_children`` distinct request ids it sends ONE prefill carrying ``PrefillTransferParams``, and
answers every waiting metaserver POST with ``MetaserverResponse`` (HTTP 200) or an ``ErrorBody``
(any other status). A decoder treats anything but 200 as "recompute locally".

Structs are encoded with ``msgspec.json``; ``omit_defaults`` is off so every field is on the wire.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Annotated, Any, Literal

import msgspec

# Ids travel in URLs and logs; bound them so a hostile caller cannot make the proxy hold megabytes.
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# Children of one parent: prompts x n of one client request. The cap matches the proxy's own limit.
MAX_CHILDREN = 4096
Children = Annotated[int, msgspec.Meta(ge=1, le=MAX_CHILDREN)]

# Generated tokens a continued prefill's prompt may end with (``DecodeTransferParams.lw_prefilled``).
MAX_PREFILLED = 1

METASERVER_PATH = "/v1/metaserver"


class DecodeTransferParams(msgspec.Struct, kw_only=True):
    """``kv_transfer_params`` the proxy puts on the decoder's request (kv_consumer side)."""

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    metaserver: str  # "http://<proxy host>:<port>/v1/metaserver"
    lw_parent_id: Id
    lw_children: Children = 1
    # Per-parent secret: the decoder sends it back on its metaserver POSTs as ``Authorization: Bearer``
    # (the proxy requires it when it has an API key). None from a proxy that issues none.
    lw_token: Id | None = None
    # The proxy asks for the prefill's first token: the metaserver's answer will carry it
    # (``MetaserverResponse.first_token``) when the prefill's answer allows, so this decoder waits
    # for that answer rather than starting when the pool holds the prompt.
    lw_first_token: bool = False
    # The prefill has answered and the proxy continues it: the prompt's last ``lw_prefilled`` tokens
    # are the tokens the prefill generated, and the pool holds the prompt before them (its partial
    # chunk under ``lw_parent_id``). The decoder loads that without calling the metaserver and
    # computes only what follows. 0: an ordinary remote prefill.
    lw_prefilled: Annotated[int, msgspec.Meta(ge=0, le=MAX_PREFILLED)] = 0


class PrefillTransferParams(msgspec.Struct, kw_only=True):
    """``kv_transfer_params`` the proxy puts on the single prefill request (kv_producer side)."""

    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    lw_parent_id: Id


class MetaserverRequest(msgspec.Struct, kw_only=True):
    """Body of the decoder's POST to the metaserver: one per engine request.

    Unknown fields are accepted (and ignored) so that a newer connector may add information
    without breaking an older proxy; the two fields below are required and type-checked.
    """

    lw_parent_id: Id
    request_id: Id
    # Optional (an older decoder omits it; ``None`` = unknown, dispatch the prefill as before).
    # ``False``: this decoder's local prefix cache plus the pool already hold every full chunk of the
    # request's prompt, it does not wait for this POST's answer and needs no prefill; the proxy may
    # skip the parent's prefill when every child says ``False`` (and must still answer the POSTs).
    # ``True``: the decoder waits for the prefill.
    needs_prefill: bool | None = None
    # ``True``: this decoder's engine makes the request's first generated token the answer's
    # ``first_token`` (lw-vllm's logits processor), so its answer continues from the prefill's token.
    forces_first: bool | None = None


# Token ids of one sequence; a prompt of up to vLLM's largest context lengths.
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]


class MetaserverResponse(msgspec.Struct, kw_only=True):
    """HTTP 200 answer to a metaserver POST: the prefill for this parent is committed in the pool.

    ``first_token``: the token the prefill generated, when the proxy knows it and the request may
    continue from it (one choice, its prefill ended on a plain token); ``prompt_digest``: the
    ``prompt_digest`` of the prompt it followed, which the decoder checks against its own before it
    uses the token. Both null otherwise."""

    status: Literal["ok"] = "ok"
    first_token: TokenId | None = None
    prompt_digest: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")] | None = None


def prompt_digest(token_ids: list[int]) -> str:
    """A digest of a prompt's token ids (BLAKE2b, 16 bytes, over little-endian int64s): the proxy
    and the decoder name the same prompt by it."""
    a = array("q", token_ids)
    if sys.byteorder != "little":
        a.byteswap()
    return hashlib.blake2b(a.tobytes(), digest_size=16).hexdigest()


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str  # e.g. "invalid_request_error", "not_found_error", "upstream_error"
    param: str | None = None
    code: int | None = None  # the HTTP status, as vLLM's own error bodies do


class ErrorBody(msgspec.Struct, kw_only=True):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class BackendState(msgspec.Struct, kw_only=True):
    url: str
    role: Literal["prefiller", "decoder"]
    healthy: bool
    in_flight: int
    load: int  # estimated tokens: pending prompt work (prefiller) or active tokens (decoder)


class HealthcheckResponse(msgspec.Struct, kw_only=True):
    """``GET /healthcheck``: "ok" when at least one prefiller and one decoder are healthy."""

    status: Literal["ok", "degraded"]
    prefill_instances: int
    decode_instances: int
    healthy_prefill_instances: int
    healthy_decode_instances: int
    backends: list[BackendState] = []


class BackendFailure(msgspec.Struct, kw_only=True):
    url: str
    status: int | None  # HTTP status, or None when the backend could not be reached
    message: str


class ResetPrefixCacheResponse(msgspec.Struct, kw_only=True):
    """``POST /reset_prefix_cache`` fans out to every backend; ``failed`` lists who did not succeed."""

    status: Literal["ok", "partial"]
    succeeded: list[str] = []
    failed: list[BackendFailure] = []


def error_body(status: int, message: str, type_: str, param: str | None = None) -> bytes:
    return msgspec.json.encode(ErrorBody(error=ErrorDetail(message=message, type=type_, param=param, code=status)))


_metaserver_request_decoder = msgspec.json.Decoder(MetaserverRequest)


def decode_metaserver_request(raw: bytes) -> MetaserverRequest:
    """Raises ``msgspec.DecodeError`` / ``msgspec.ValidationError`` (its message names the field)."""
    return _metaserver_request_decoder.decode(raw)


def decode_transfer_params(obj: Any) -> DecodeTransferParams | PrefillTransferParams:
    """Read a request's ``kv_transfer_params`` dict (as vLLM hands it to the connector)."""
    if not isinstance(obj, dict):
        raise msgspec.ValidationError(f"kv_transfer_params must be an object, got {type(obj).__name__}")
    if obj.get("do_remote_prefill"):
        return msgspec.convert(obj, DecodeTransferParams)
    if obj.get("do_remote_decode"):
        return msgspec.convert(obj, PrefillTransferParams)
    raise msgspec.ValidationError(
        "kv_transfer_params: exactly one of do_remote_prefill / do_remote_decode must be true"
    )
