"""The argument checks of the streaming calls, one copy for every backend: ``who`` names the
backend in the message ("memcache", "embedded pool", ...), ``what`` the call. Errors name the
argument and the accepted values."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lw_core.backend import BackendError, ObjectMissing


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


def check_publish(who: str, handles: Sequence[Any], upto: int, is_reservation: Callable[[Any], bool]) -> None:
    """``publish``'s handles are this backend's reservations, and ``upto`` fits each."""
    for h in handles:
        if not is_reservation(h):
            raise BackendError(f"{who}: publish needs handles from reserve, got {h!r}")
        check_upto(who, "publish", h, upto)


def require_streaming(who: str, streaming: bool, backend: str, why: str) -> None:
    """``publish`` on a backend opened without streaming names the switch that turns it on."""
    if not streaming:
        raise BackendError(f"{who}: publish on a backend opened without streaming; set "
                           f"kv_connector_extra_config.pd_streaming=true ({backend}(streaming=True)) so that {why}")


def unpublishable(who: str, lost: Sequence[str]) -> ObjectMissing:
    """The error for reservations aborted before ``publish``."""
    return ObjectMissing(f"{who}: {len(lost)} reservation(s) cannot be published: aborted: {list(lost[:3])}")
