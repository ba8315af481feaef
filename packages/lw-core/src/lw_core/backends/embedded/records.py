"""The embedded pool's on-disk record formats (LMDB values), counters and the handle type."""

from __future__ import annotations

import itertools
import logging
import mmap
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

from lw_core.backend import Buffer
from lw_core.procs import OWNER_SIZE, Owner

log = logging.getLogger(__name__)

FORMAT = b"lw-embedded/4"
PAGE = mmap.PAGESIZE
NP_COPY_MIN = 1 << 20  # numpy copies release the GIL (worth it for long copies); memoryview costs less per call
MAX_KEY_BYTES = 500  # LMDB's default key limit is 511
SWEEP_INTERVAL_S = 5.0
POOL_CHECK_S = 1.0  # how often open/reserve/lookup check that the pool directory is still ours
# Assumed pace of creating an arena, for how long openers wait on a creator: far below tmpfs's
# ~10 GB/s posix_fallocate, so only a stopped or stuck creator runs past it.
CREATE_BYTES_PER_S = 128 << 20

BE_U64 = struct.Struct(">Q")
CAP_REC = struct.Struct("<QQ")  # capacity, page size

COMMITTED, RESERVED = 1, 2


# Object record, kept as a plain list on the hot paths (a NamedTuple per record cost more than the
# LMDB operations): state, object id, arena offset, allocated bytes, object bytes, LRU stamp (while
# reserved: the bytes published to streaming readers, stream.py). Leases live in the lease table
# (leases.py), not here.
OBJ_REC = struct.Struct("<B7xQQQQQ")
ST, OID, OFF, ALLOC, NBYTES, STAMP = range(6)


class Resv(NamedTuple):
    owner: Owner
    t0: float
    off: int
    alloc: int
    orphan: int  # 1: key taken away after the timeout; extent kept until the owner ends


RESV_TAIL = struct.Struct("<dQQB")

COUNTERS = (
    "next_id",
    "objects",
    "bytes",
    "committed_alloc_bytes",
    "reserved_objects",
    "reserved_bytes",
    "free_bytes",
    "evictions",
    "evicted_bytes",
    "reclaimed_reservations",
    "orphaned_reservations",
    "reserve_rejected_exists",
    "reserve_rejected_full",
    "commits",
    "aborts",
)
CIDX = {name: i for i, name in enumerate(COUNTERS)}
COUNTERS_REC = struct.Struct("<" + "q" * len(COUNTERS))

T = TypeVar("T")


class StateClock:
    """Ticks after any change of a handle's mutable state (``_writable``, ``_leased``, ``_stream``):
    a commit, an abort, a release, a switch to streaming. A reader that cached those states when
    the clock read ``now`` knows they still hold while it reads the same value (``AddressTable``),
    so it need not look at each handle again. Values are never reused (``next`` on a counter is
    atomic), so a tick cannot be mistaken for an earlier reading even when two threads store their
    values out of order."""

    __slots__ = ("now", "_ticks")

    def __init__(self) -> None:
        self._ticks = itertools.count(1)
        self.now = 0

    def tick(self) -> None:
        """Call after the states changed (never before: a reader could cache the old ones)."""
        self.now = next(self._ticks)


class EmbeddedHandle:
    """A reservation (writable) or a lease (read-only) on one object; valid in its process only.
    Whoever changes ``_writable``, ``_leased`` or ``_stream`` of a handle that may be in an
    ``AddressTable`` ticks its pool's ``StateClock`` afterwards."""

    __slots__ = ("key", "nbytes", "_bkey", "_off", "_alloc", "_oid", "_writable", "_leased", "_pg", "_lease", "_epoch", "_stream")

    def __init__(
        self, key: str, bkey: bytes, nbytes: int, off: int, alloc: int, oid: int, writable: bool, epoch: int = 0, lease: int = -1
    ) -> None:
        self.key = key
        self.nbytes = nbytes
        self._bkey = bkey
        self._off = off
        self._alloc = alloc
        self._oid = oid
        self._writable = writable
        self._leased = not writable
        self._pg = off // PAGE  # generation slot (leases.py)
        self._lease = lease  # entry in this backend's lease row
        self._epoch = epoch  # which attachment of the pool (a re-attach makes old handles stale)
        self._stream = False  # from open_streaming (stream.py): no lease, each read checks its record

    def __repr__(self) -> str:
        kind = "reserved" if self._writable else "streaming" if self._stream else "leased" if self._leased else "closed"
        return f"EmbeddedHandle({self.key!r}, nbytes={self.nbytes}, {kind})"


def bytes_view(buf: Buffer, *, writable: bool, what: str) -> memoryview:
    m = buf if isinstance(buf, memoryview) else memoryview(buf)
    if m.format != "B" or m.ndim != 1:
        if not m.c_contiguous:
            raise ValueError(f"{what}: buffer must be C-contiguous (got shape {m.shape}, strides {m.strides})")
        m = m.cast("B")
    if writable and m.readonly:
        raise ValueError(f"{what}: destination buffer is read-only")
    return m


def unpack_resv(v: bytes) -> tuple[Resv, bytes]:
    owner = Owner.unpack(v)
    t0, off, alloc, orphan = RESV_TAIL.unpack_from(v, OWNER_SIZE)
    return Resv(owner, t0, off, alloc, orphan), bytes(v[OWNER_SIZE + RESV_TAIL.size :])


def encode_keys(keys: Sequence[str]) -> list[bytes]:
    """The keys as LMDB keys; a key that is not a non-empty str, or too long, is a ValueError."""
    if all(type(k) is str for k in keys):  # the usual case, checked in bulk
        out = [k.encode() for k in keys]
        if not out or 0 < min(map(len, out)) and max(map(len, out)) <= MAX_KEY_BYTES:
            return out
    out = []
    for k in keys:
        if not isinstance(k, str) or not k:
            raise ValueError(f"embedded pool: keys must be non-empty str, got {k!r}")
        b = k.encode()
        if len(b) > MAX_KEY_BYTES:
            raise ValueError(f"embedded pool: key of {len(b)} bytes is longer than {MAX_KEY_BYTES}: {k[:60]!r}...")
        out.append(b)
    return out


def own_handle(h: Any, what: str) -> EmbeddedHandle:
    """``h`` when it is this backend's handle; a TypeError naming the operation otherwise."""
    if not isinstance(h, EmbeddedHandle):
        raise TypeError(f"embedded pool: {what} needs handles from this backend, got {type(h).__name__}")
    return h
