"""Mooncake's negative status codes as lw-core errors (codes from mooncake-store's ErrorCode)."""

from __future__ import annotations

from lw_core.backend import BackendError, BackendUnavailable, ObjectMissing, PoolFull

NO_AVAILABLE_HANDLE = -200  # no segment has room for the object
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
RPC_FAIL = -900

_NAMES = {
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (no segment has room: lend more memory with `lw-mooncake hold`)",
    INVALID_PARAMS: "INVALID_PARAMS",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    RPC_FAIL: "RPC_FAIL (the master cannot be reached)",
}


def describe(code: int) -> str:
    return f"mooncake error {code} {_NAMES.get(code, '')}".rstrip()


def to_error(code: int, what: str) -> BackendError:
    """The lw-core error for a failed Mooncake call ``what`` with status ``code``."""
    text = f"{what}: {describe(code)}"
    if code == OBJECT_NOT_FOUND:
        return ObjectMissing(text)
    if code == NO_AVAILABLE_HANDLE:
        return PoolFull(text)
    # -9xx: RPC and transport failures; -1xxx and below: transfer/engine failures.
    if code <= -900 or code == -1:
        return BackendUnavailable(text)
    return BackendError(text)
