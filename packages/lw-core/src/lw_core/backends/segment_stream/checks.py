"""The argument checks of the streaming calls, one copy for every backend: ``who`` names the
backend in the message ("memcache", "embedded pool", ...), ``what`` the call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def check_upto(who: str, what: str, h: Any, upto: int) -> None:
    """``upto`` of ``publish``/``wait_published`` on handle ``h`` (``key``, ``nbytes``)."""
    if isinstance(upto, bool) or not isinstance(upto, int) or not 0 <= upto <= h.nbytes:
        raise ValueError(f"{who}: {what} upto={upto!r} must be an int in [0, {h.nbytes}] for {h.key!r}")


def check_timeout(who: str, timeout_s: float) -> None:
    """``timeout_s`` of ``wait_published`` (NaN fails too)."""
    if not timeout_s >= 0:
        raise ValueError(f"{who}: wait_published timeout_s={timeout_s!r} must be >= 0")


def check_lengths(handles: Sequence[Any], offsets: Sequence[int], bufs: Sequence[Any]) -> None:
    """A batched read or write's three lists are as long as each other."""
    if not (len(handles) == len(offsets) == len(bufs)):
        raise ValueError(f"{len(handles)} handles, {len(offsets)} offsets, {len(bufs)} buffers: lengths differ")


def check_range(what: str, h: Any, off: int, n: int) -> None:
    """``[off, off + n)`` lies within handle ``h``'s object."""
    if off < 0 or off + n > h.nbytes:
        raise ValueError(f"{what} of {h.key}: range [{off}, {off + n}) outside the object's {h.nbytes} bytes")
