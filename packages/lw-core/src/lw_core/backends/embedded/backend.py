"""``EmbeddedBackend``: the single-host pool (see the package docstring and docs/embedded.md)."""

from __future__ import annotations

import mmap
import os
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import Meta

from lw_core.backends.builtin import CapacityBytes
from lw_core.backends.embedded import fences
from lw_core.backends.embedded.attach import AttachMixin
from lw_core.backends.embedded.env import release_env
from lw_core.backends.embedded.leases import LeaseTable
from lw_core.backends.embedded.ops import OpsMixin
from lw_core.procs import current_owner
from lw_core.backends.embedded.records import PAGE
from lw_core.backends.embedded.stream import StreamMixin
from lw_core.backends.embedded.sweep import SweepMixin
from lw_core.backends.embedded.txn import TxnMixin
from lw_core.backends.embedded.verify import VerifyMixin
from lw_core.backends.embedded.writer_lock import WriterLock
from lw_core.config import Seconds
from lw_core.validation import convert_strict


class EmbeddedSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The constructor's arguments, checked once with the config keys' field types."""

    path: Annotated[str, Meta(min_length=1)]
    capacity_bytes: CapacityBytes
    lease_ttl_s: Seconds
    reservation_timeout_s: Seconds
    lock_timeout_s: Seconds


class EmbeddedBackend(AttachMixin, TxnMixin, SweepMixin, OpsMixin, StreamMixin, VerifyMixin):
    """Single-host pool shared by every process that opens the same ``path`` (a directory)."""

    name = "embedded"

    def __init__(
        self,
        path: str,
        *,
        capacity_bytes: int,
        lease_ttl_s: float = 60.0,
        reservation_timeout_s: float = 600.0,
        lock_timeout_s: float = 10.0,
        populate: bool = True,
    ) -> None:
        st = convert_strict(
            {"path": path, "capacity_bytes": capacity_bytes, "lease_ttl_s": lease_ttl_s,
             "reservation_timeout_s": reservation_timeout_s, "lock_timeout_s": lock_timeout_s},
            EmbeddedSettings, prefix="EmbeddedBackend: ",
        )
        self.path = os.path.abspath(st.path)
        fences.require_fence(self.path)  # a weakly ordered CPU without a real fence: refused, with what to do
        self.capacity = st.capacity_bytes // PAGE * PAGE
        self.lease_ttl_s = st.lease_ttl_s
        self.reservation_timeout_s = st.reservation_timeout_s
        self.lock_timeout_s = st.lock_timeout_s
        self._pid = os.getpid()
        self._me = current_owner()
        self._lock = WriterLock(self.path, timeout_s=self.lock_timeout_s, capacity=self.capacity)
        self._closed = False
        self._env: Any = None
        self._mm: mmap.mmap | None = None
        self._mv: memoryview | None = None
        self._np: np.ndarray | None = None
        self._last_sweep = 0.0
        self._leases: LeaseTable | None = None
        self._local = {
            "open_hits": 0,
            "open_misses": 0,
            "reads_of_evicted_objects": 0,
            "lease_row_full": 0,
            "stale_views": 0,
            "reattached": 0,
        }
        self._epoch = 0
        self._ident: tuple[int, int] | None = None
        self._next_check = 0.0
        self._populate = populate
        self._attach_fd: int | None = None
        self._attach()

    @classmethod
    def from_keys(cls, keys: Any, **kwargs: Any) -> EmbeddedBackend:
        """Open the pool a parsed config's ``EmbeddedKeys`` (``lw_core.backends.builtin``) names."""
        return cls(keys.embedded_path, capacity_bytes=keys.embedded_capacity_bytes, **kwargs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            self._teardown()

    def _teardown(self, keep_mappings: bool = False) -> None:
        """Let go of the pool. ``keep_mappings``: other threads may still copy through the old
        arena mapping, so it is only dropped (it goes when its last user does)."""
        self._np = None
        if self._leases is not None:
            self._leases.close(keep_mappings)
            self._leases = None
        if self._mv is not None and not keep_mappings:
            self._mv.release()
        self._mv = None
        if self._mm is not None and not keep_mappings:
            try:
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a view(): the mapping goes when that view does
        self._mm = None
        if self._env is not None:
            release_env(self._env)
            self._env = None
        self._lock.close_files()  # also drops our flocks
        if self._attach_fd is not None:
            os.close(self._attach_fd)  # also drops our shared attach lock
            self._attach_fd = None

    def __enter__(self) -> "EmbeddedBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmbeddedBackend({self.path!r}, capacity_bytes={self.capacity})"
