"""The head object's layout: what a reader needs to follow a reservation (its token and size) and
to judge its writer's liveness (boot id, pid namespace, pid, start time). Each backend stamps its
own 8-byte magic, so one store's heads are never taken for another's; a backend may append more
(Mooncake appends a keyed digest, as its heads may be replaced while read)."""

from __future__ import annotations

import struct
from typing import NamedTuple

from lw_core.procs import Owner

# magic, token, object bytes, boot id (16 bytes), owner (pid namespace, pid, start time)
HEAD = struct.Struct("<8s8sQ16sQIQ")
TOKEN_BYTES = 8


class StreamHead(NamedTuple):
    token: bytes
    nbytes: int
    boot: bytes
    owner: Owner


def pack_head(magic: bytes, token: bytes, nbytes: int, boot: bytes, owner: Owner) -> bytes:
    if len(magic) != 8 or len(token) != TOKEN_BYTES:
        raise ValueError(f"head: magic {magic!r} and token {token!r} must be 8 bytes each")
    return HEAD.pack(magic, token, nbytes, boot, *owner)


def unpack_head(magic: bytes, raw: bytes) -> StreamHead | None:
    """The head in ``raw`` (exactly ``HEAD.size`` bytes); None unless it carries ``magic``."""
    if len(raw) != HEAD.size:
        return None
    got, token, nbytes, boot, pidns, pid, start = HEAD.unpack(raw)
    if got != magic:
        return None
    return StreamHead(token, nbytes, boot, Owner(pidns, pid, start))
