"""``GetArena``: the ``Arena`` gets land in: whole gets take one extent per object (``take``), the
objects' read handles hold them (``hold``, counted: one open may name a key twice) and ``release``
gives them back (``hold`` -1). A batch of ranged gets (one layer of several objects) takes one
extent, lent to the pipeline as an ``ArenaLend`` (``lw_core.backend.Lent``) until the copy out of it
is done (``give_back``). The invariants are ``lw_mooncake.arena``'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lw_mooncake.arena import ALIGN, Arena
from lw_mooncake.calls import Deadlines

__all__ = ["ALIGN", "ArenaLend", "GetArena"]


class GetArena(Arena):
    def __init__(self, store: Any, calls: Deadlines, nbytes: int) -> None:
        super().__init__(store, calls, nbytes, "get")


class ArenaLend:
    """One extent of ``arena`` at ``off`` that ranged gets filled, lent out (``lw_core.backend.Lent``):
    ``views`` are its ranges; ``give_back`` frees the extent (once; a second call is a no-op)."""

    def __init__(self, arena: GetArena, off: int, views: list[np.ndarray]) -> None:
        self.arena, self.off, self.views = arena, off, views
        self._out = True

    def give_back(self) -> None:
        if self._out:
            self._out = False
            self.arena.hold_at(self.off, 0)
