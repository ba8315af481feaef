"""The object names of the segment-streaming protocol. Only a reservation's writer knows its
token, so only it creates names carrying it; a reader trusts bytes only from such names."""

from __future__ import annotations

HEAD_SUFFIX = "#h"


def head_key(key: str) -> str:
    """The head object naming the token of the reservation that holds ``key`` now."""
    return f"{key}{HEAD_SUFFIX}"


def seg_key(key: str, token: bytes, end: int) -> str:
    """The segment of reservation ``token`` of ``key`` that ends at byte ``end``."""
    return f"{key}#s{token.hex()}/{end}"


def abort_key(key: str, token: bytes) -> str:
    """The marker saying reservation ``token`` of ``key`` was aborted: it never commits."""
    return f"{key}#x{token.hex()}"
