"""The handles MemcacheBackend hands out, and the placed ranges its collaborators copy through.

Invariants:

* A handle's ``nbytes`` is the size the caller asked for; the object in the store is ``TRAILER``
  bytes longer (``lw_memcache.streaming``), and ``gva`` is the object's global address.
* ``MemcacheHandle.state`` only moves from 0 (writing) to 1 (committed) or 2 (aborted), under
  ``ObjectWriter``'s lock; a read handle stays 0.
* Anything with ``key``, ``nbytes`` and ``gva`` (``Placed``) can be copied by ``Copier``: handles,
  and ``Seg`` for the streaming extension's head, segment and trailer ranges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lw_core.procs import Owner


class Placed(Protocol):
    """What ``Copier`` reads of a handle: the object's name, size and global address."""

    key: str
    nbytes: int
    gva: int


@dataclass(eq=False, slots=True)
class MemcacheHandle:
    key: str
    nbytes: int
    gva: int
    writable: bool
    state: int = 0  # reservations: 0 writing, 1 committed, 2 aborted


@dataclass(eq=False, slots=True)
class Seg:
    """A range of the store by address: a segment object the writer allocated (``start``: the
    offset of the reservation it copies), a head, or an object's trailer."""

    key: str
    nbytes: int
    gva: int
    start: int
    writable: bool = True
    published: bool = False


@dataclass(eq=False, slots=True)
class MemcacheStreamHandle:
    """A reader's handle from ``open_streaming``: on a committed object (``leased``, read at
    ``gva``) or on a reservation (``token``)."""

    key: str
    nbytes: int
    token: bytes | None
    boot: bytes = b""
    owner: Owner | None = None
    gva: int = 0
    leased: bool = False
    dead: bool = False
    writable: bool = False


def nbytes_of(buf: Any) -> int:
    """The size of a buffer (an array, a tensor region, anything with a buffer interface)."""
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else memoryview(buf).nbytes


__all__ = ["MemcacheHandle", "MemcacheStreamHandle", "Placed", "Seg", "nbytes_of"]
