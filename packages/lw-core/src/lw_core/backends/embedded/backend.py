"""``EmbeddedBackend``: the single-host pool (see the package docstring and docs/embedded.md)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from lw_core.backend import TIER_DRAM, BackendError, Buffer
from lw_core.backends.embedded import fences
from lw_core.backends.embedded.disk_tier import DISK_STATS, DiskTier
from lw_core.backends.embedded.object_reader import ObjectReader
from lw_core.backends.embedded.object_writer import ObjectWriter
from lw_core.backends.embedded.pool_files import PoolFiles
from lw_core.backends.embedded.purge import Purger
from lw_core.backends.embedded.records import PAGE, POOL_CHECK_S, EmbeddedHandle, T, encode_keys, log
from lw_core.backends.embedded.stream import StreamIndex
from lw_core.backends.embedded.sweep import Sweeper
from lw_core.backends.embedded.tiered import TieredReads
from lw_core.backends.embedded.txn import Tx
from lw_core.backends.embedded.verify import Verifier
from lw_core.backends.embedded.writer_lock import WriterLock
from lw_core.backends.embedded_defaults import CapacityBytes, DiskCapacityBytes
from lw_core.config import Seconds
from lw_core.procs import current_owner
from lw_core.validation import convert_strict

DISK_CAPACITY_DEFAULT = 16 << 30  # as EmbeddedKeys.embedded_disk_capacity_bytes
DISK_QUEUE_BYTES = 256 << 20  # evicted objects waiting to be written to disk, at most


class EmbeddedSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The constructor's arguments, checked once with the config keys' field types."""

    path: Annotated[str, Meta(min_length=1)]
    capacity_bytes: CapacityBytes
    lease_ttl_s: Seconds
    reservation_timeout_s: Seconds
    lock_timeout_s: Seconds
    disk_path: Annotated[str, Meta(min_length=1)] | None
    disk_capacity_bytes: DiskCapacityBytes
    disk_direct_io: bool


class EmbeddedBackend:
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
        disk_path: str | None = None,
        disk_capacity_bytes: int = DISK_CAPACITY_DEFAULT,
        disk_direct_io: bool = False,
        create: bool = True,
    ) -> None:
        """``create``: False attaches to an existing pool of this capacity only, never building or
        rebuilding one (``lw-pool purge``)."""
        st = convert_strict(
            {"path": path, "capacity_bytes": capacity_bytes, "lease_ttl_s": lease_ttl_s,
             "reservation_timeout_s": reservation_timeout_s, "lock_timeout_s": lock_timeout_s,
             "disk_path": disk_path, "disk_capacity_bytes": disk_capacity_bytes,
             "disk_direct_io": disk_direct_io},
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
        self._pool = PoolFiles(self.path, self.capacity, populate=populate, create=create)
        self._verifier = Verifier(self._pool)
        self._disk: DiskTier | None = None  # the opt-in disk tier (disk_tier.py), opened once attached
        self._tiered: TieredReads | None = None  # reads over DRAM then disk, while the tier is on
        self._sweeper = Sweeper(
            self._pool, self._me, reservation_timeout_s=self.reservation_timeout_s,
            on_evict=None if st.disk_path is None else self._demote,
        )
        self._local = {
            "open_hits": 0,
            "open_misses": 0,
            "reads_of_evicted_objects": 0,
            "lease_row_full": 0,
            "stale_views": 0,
            "reattached": 0,
        }
        self._next_check = 0.0
        self._reader = ObjectReader(
            self._pool, lease_ttl_s=self.lease_ttl_s, usable=self._usable, check_pool=self._check_pool, local=self._local,
        )
        self._writer = ObjectWriter(
            self._pool, self._lock, self._sweeper, self._me,
            reservation_timeout_s=self.reservation_timeout_s, usable=self._usable, check_pool=self._check_pool,
        )
        self._streams = StreamIndex(
            self._pool, self._lock, self._me,
            reservation_timeout_s=self.reservation_timeout_s, usable=self._usable, local=self._local,
        )
        self._purger = Purger(self._pool, self._me, self._write)
        self._attach()
        if st.disk_path is not None:
            dpath = os.path.abspath(st.disk_path)
            if dpath == self.path:
                self._teardown()
                raise BackendError(f"embedded pool: embedded_disk_path={dpath!r} is embedded_path itself: give the disk tier its own directory")
            try:
                self._disk = DiskTier(dpath, st.disk_capacity_bytes, queue_bytes=min(DISK_QUEUE_BYTES, st.disk_capacity_bytes),
                                      direct_io=st.disk_direct_io)
            except BaseException:
                self._teardown()
                raise
            self._tiered = TieredReads(
                self._disk, self._reader, self._writer, read_dram=self._read_dram, usable=self._usable, local=self._local,
            )

    @classmethod
    def from_keys(cls, keys: Any, **kwargs: Any) -> EmbeddedBackend:
        """Open the pool a parsed config's ``EmbeddedKeys`` (``lw_core.backends.builtin``) names."""
        return cls(
            keys.embedded_path, capacity_bytes=keys.embedded_capacity_bytes, disk_path=keys.embedded_disk_path,
            disk_capacity_bytes=keys.embedded_disk_capacity_bytes, disk_direct_io=keys.embedded_disk_direct_io, **kwargs,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            if self._disk is not None:
                self._disk.close()
            self._teardown()

    def _demote(self, bkey: bytes, off: int, nbytes: int) -> None:
        """The sweeper evicts an object: its bytes, still in the arena, go to the disk tier's queue."""
        mv, disk = self._pool.mv, self._disk
        if mv is not None and disk is not None:
            disk.offer(bkey, mv[off : off + nbytes])

    def _attach(self) -> None:
        self._pool.attach(self._lock, self._me, lambda: self._pool.write(self._sweeper.sweep))

    def _teardown(self, keep_mappings: bool = False) -> None:
        """Let go of the pool (``PoolFiles.close``) and the lock files."""
        self._pool.close(keep_mappings)
        self._lock.close_files()  # also drops our flocks

    def _check_pool(self) -> None:
        """Notice a pool directory deleted (or replaced) under us and attach to the new one, so
        processes never keep using two different pools at one path. At most once a second."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + POOL_CHECK_S
        if not self._pool.replaced():
            return
        with self._lock.exclusive():
            if not self._pool.replaced():
                return
            log.warning(
                "embedded pool %r: the pool directory was deleted or replaced while attached; attaching to the "
                "pool now at that path (objects of the old one are gone, handles on them fail)",
                self.path,
            )
            self._teardown(keep_mappings=True)
            self._pool.epoch += 1
            self._local["reattached"] += 1
            self._attach()

    # ----------------------------------------------------------------- the protocol (ObjectReader, ObjectWriter)

    def lookup(self, keys: Sequence[str]) -> int:
        return self._reader.lookup(keys) if self._tiered is None else self._tiered.lookup(keys)

    def lookup_tiers(self, keys: Sequence[str]) -> list[str]:
        """``lookup``, naming the tier of each leading key held (``TIER_DRAM``, ``TIER_DISK``)."""
        if self._tiered is None:
            return [TIER_DRAM] * self._reader.lookup(keys)
        return self._tiered.lookup_tiers(keys)

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[EmbeddedHandle | None]:
        return self._writer.reserve(keys, nbytes) if self._tiered is None else self._tiered.reserve(keys, nbytes)

    def write(self, handles: Sequence[EmbeddedHandle], offsets: Sequence[int], srcs: Sequence[Buffer]) -> None:
        self._writer.write(handles, offsets, srcs)

    def read(self, handles: Sequence[EmbeddedHandle], offsets: Sequence[int], dsts: Sequence[Buffer]) -> None:
        if self._tiered is not None:
            self._tiered.read(handles, offsets, dsts)
        else:
            self._read_dram(handles, offsets, dsts)

    def _read_dram(self, handles: Sequence[EmbeddedHandle], offsets: Sequence[int], dsts: Sequence[Buffer]) -> None:
        if handles and getattr(handles[0], "_stream", False):
            self._streams.read(handles, offsets, dsts)
        else:
            self._reader.read(handles, offsets, dsts)

    def view(self, handle: EmbeddedHandle, offset: int, nbytes: int) -> memoryview | None:
        return self._reader.view(handle, offset, nbytes) if self._tiered is None else self._tiered.view(handle, offset, nbytes)

    def view_addresses(self, handles: Sequence[EmbeddedHandle], offset: int, nbytes: int) -> Any:
        """Where ``view``'s windows lie (int64 host addresses in ``host_regions``), with its checks
        and lease renewals, or None (the optional protocol method)."""
        if self._tiered is not None:
            return self._tiered.view_addresses(handles, offset, nbytes)
        return self._reader.view_addresses(handles, offset, nbytes)

    def address_table(self, handles: Sequence[Any]) -> Any:
        """A step's table of ``handles`` for ``table_addresses`` (None when some have no window in
        the arena: disk hits), built once so each batch of each layer costs array work only."""
        return self._reader.address_table(handles) if self._tiered is None else self._tiered.address_table(handles)

    def table_addresses(self, table: Any, rows: Any, offset: int, nbytes: int) -> Any:
        """``view_addresses`` of the table's handles at ``rows`` (same checks, same renewals)."""
        return self._reader.table_addresses(table, rows, offset, nbytes)

    def host_regions(self) -> list[memoryview]:
        """The arena's mapping, where every ``view`` window lies (the optional protocol method): a
        new export of it, so the mapping stays while a device copier keeps it registered."""
        self._usable()
        mm = self._pool.mm
        return [] if mm is None else [memoryview(mm)]

    def host_regions_epoch(self) -> int:
        """Changes whenever ``host_regions`` would answer differently (the optional protocol
        method): each re-attach maps a new arena."""
        return self._pool.epoch

    def intact(self, handles: Sequence[EmbeddedHandle]) -> list[bool]:
        return self._reader.intact(handles) if self._tiered is None else self._tiered.intact(handles)

    def table_intact(self, table: Any, rows: Any) -> Any:
        """``intact`` of the handles of a step's ``address_table`` at ``rows`` (bool array), on
        arrays: a table is built only when every handle has its window in the arena."""
        return self._reader.table_intact(table, rows)

    def commit(self, handles: Sequence[EmbeddedHandle]) -> None:
        self._writer.commit(handles)

    def abort(self, handles: Sequence[EmbeddedHandle]) -> None:
        self._writer.abort(handles)

    def open(self, keys: Sequence[str]) -> list[EmbeddedHandle | None]:
        return self._reader.open(keys) if self._tiered is None else self._tiered.open(keys)

    def release(self, handles: Sequence[EmbeddedHandle]) -> None:
        if self._tiered is None:
            self._reader.release(handles)
        else:
            self._tiered.release(handles)

    # ----------------------------------------------------------------- streaming (StreamIndex)

    def publish(self, handles: Sequence[EmbeddedHandle], upto: int) -> None:
        self._streams.publish(handles, upto)

    def open_streaming(self, keys: Sequence[str]) -> list[EmbeddedHandle | None]:
        bkeys = encode_keys(keys)
        self._usable()
        self._check_pool()
        return self._streams.open(keys, bkeys)

    def wait_published(self, handles: Sequence[EmbeddedHandle], upto: int, timeout_s: float) -> list[bool]:
        return self._streams.wait_published(handles, upto, timeout_s)

    # ----------------------------------------------------------------- purge (purge.py)

    def purge(self, prefix: str, timeout_s: float = 10.0) -> dict[str, int]:
        """Remove every object whose key starts with ``prefix`` ("" = every object), from DRAM and
        from the disk tier when it is on; reservations under it will not be published. Returns
        ``objects``/``bytes`` removed from DRAM, ``reservations`` that lost their key,
        ``disk_objects`` files removed, and ``leased``: objects still being read at
        ``timeout_s``, which stay (purge again)."""
        self._usable()
        self._check_pool()
        return self._purger.purge(prefix, timeout_s, self._disk)

    # ----------------------------------------------------------------- counters and checks

    def stats(self) -> dict[str, int]:
        self._usable()
        out = self._verifier.counters()
        out.update(self._local)  # this process's own counters
        out.update(self._disk.stats() if self._disk is not None else dict.fromkeys(DISK_STATS, 0))
        return out

    def open_reservations(self) -> dict[int, tuple[str, int, int]]:
        """Every reservation not yet committed: object id -> (key, published bytes, size). A
        reservation that was never published (a non-streaming writer) shows 0 published bytes."""
        self._usable()
        return self._verifier.open_reservations()

    def verify(self) -> dict[str, int]:
        """Walk the whole index and check that objects, reservations and free extents tile the arena
        exactly and that the counters agree; raises ``BackendError`` on any contradiction."""
        self._usable()
        return self._verifier.verify()

    # ----------------------------------------------------------------- transactions

    def _usable(self) -> None:
        if self._closed:
            raise BackendError(f"embedded pool {self.path!r}: backend is closed")
        if os.getpid() != self._pid:
            raise BackendError(
                f"embedded pool {self.path!r}: opened in pid {self._pid}, used in forked pid {os.getpid()}; "
                "open a new EmbeddedBackend in each process"
            )

    def _write(self, fn: Callable[[Tx], T]) -> T:
        self._usable()
        with self._lock.locked():
            return self._pool.write(fn)

    @contextmanager
    def _read(self) -> Iterator[Any]:
        self._usable()
        with self._pool.read() as txn:
            yield txn

    def __enter__(self) -> EmbeddedBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmbeddedBackend({self.path!r}, capacity_bytes={self.capacity})"
