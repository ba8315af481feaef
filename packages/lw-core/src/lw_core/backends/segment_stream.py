"""Shared by the backends that stream through token-named segment objects (the memcache and the
Mooncake backend packages: stores whose objects become readable only whole, so a reservation's
published prefix is a series of committed segment objects; each package's ``streaming`` module
has its design): the object names, the poll pacing, and the judgment of a writer's liveness from
what its head object recorded."""

from __future__ import annotations

from lw_core.backends.embedded.procs import Owner, boot_id, current_owner, owner_alive

# A waiter polls the store (one metadata call) with a pause growing from the first to the second.
POLL_MIN_S, POLL_MAX_S = 0.0005, 0.02


def head_key(key: str) -> str:
    """The head object naming the token of the reservation that holds ``key`` now."""
    return f"{key}#h"


def seg_key(key: str, token: bytes, end: int) -> str:
    """The segment of reservation ``token`` of ``key`` that ends at byte ``end``."""
    return f"{key}#s{token.hex()}/{end}"


def abort_key(key: str, token: bytes) -> str:
    """The marker saying reservation ``token`` of ``key`` was aborted: it never commits."""
    return f"{key}#x{token.hex()}"


class WriterJudge:
    """Whether a writer is known dead: only one on this machine (same boot id) in our pid
    namespace can be judged, each once per poll (``next_poll``); any other is taken as alive and
    its readers fall back to their deadline."""

    def __init__(self) -> None:
        self.me, self.boot = current_owner(), boot_id()
        self._seen: dict[Owner, bool | None] = {}

    def next_poll(self) -> None:
        self._seen.clear()

    def dead(self, boot: bytes, owner: Owner | None) -> bool:
        if owner is None or boot != self.boot:
            return False
        if owner not in self._seen:
            self._seen[owner] = owner_alive(owner, self.me)
        return self._seen[owner] is False
