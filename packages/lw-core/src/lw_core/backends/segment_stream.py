"""Shared by the backends that stream through token-named segment objects (the memcache and the
Mooncake backend packages: stores whose objects become readable only whole, so a reservation's
published prefix is a series of committed segment objects; each package's ``streaming`` module
has its design): the object names, the poll pacing, the judgment of a writer's liveness from
what its head object recorded, and the reading of one poll."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lw_core.procs import Owner, boot_id, current_owner, owner_alive

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


def poll_names(todo: Sequence[Any], upto: int) -> list[str]:
    """What one poll asks the store whether it exists, for readers' handles (``key``, ``token``):
    each one's segment ending at ``upto``, then each one's abort marker, then each one's object."""
    return ([seg_key(h.key, h.token, upto) for h in todo] + [abort_key(h.key, h.token) for h in todo]
            + [h.key for h in todo])


def read_poll(todo: Sequence[Any], exists: Sequence[int], judge: WriterJudge) -> tuple[list[int], list[int]]:
    """The answer to ``poll_names(todo, upto)`` (1 = exists), per handle (``dead``, ``boot``,
    ``owner``): marks aborted handles and those whose writer is judged dead (``dead = True``), and
    returns the indices into ``todo`` of the committed ones and of those published up to ``upto``."""
    n = len(todo)
    judge.next_poll()
    committed: list[int] = []
    published: list[int] = []
    for j, h in enumerate(todo):
        if exists[n + j] == 1:
            h.dead = True  # aborted
        elif exists[2 * n + j] == 1:
            committed.append(j)
        elif exists[j] == 1:
            published.append(j)
        elif judge.dead(h.boot, h.owner):
            h.dead = True  # the writer is gone and never commits
    return committed, published
