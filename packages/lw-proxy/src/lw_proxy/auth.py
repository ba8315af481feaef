"""Bearer tokens: reading ``Authorization: Bearer <token>`` and comparing secrets in constant time.

A header's bytes are whatever the client sent. aiohttp hands header values over decoded as UTF-8
with ``surrogateescape``, so a token that is not valid UTF-8 arrives holding lone surrogates, which
plain ``str.encode()`` refuses. Every comparison here encodes back with ``surrogateescape`` (the
exact bytes received), so such a token is simply one more wrong key: 401, never an error.
"""

from __future__ import annotations

import hmac

from aiohttp import web


def bearer(request: web.Request) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme in any case), else None."""
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def wire_bytes(token: str) -> bytes:
    """The bytes a client sent for ``token`` (see the module docstring)."""
    return token.encode("utf-8", "surrogateescape")


def same_secret(token: str, secret: bytes) -> bool:
    """``token`` equals ``secret``, compared in constant time; any token (even one that is not
    UTF-8) gives True or False."""
    return hmac.compare_digest(wire_bytes(token), secret)
