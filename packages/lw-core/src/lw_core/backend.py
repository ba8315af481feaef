"""The Backend protocol: what the layer pipeline needs from a pool store.

An object holds all layers of one chunk, layer-major (``[L0][L1]...``), so one layer of it is a
ranged read or write at a fixed offset. Rules every backend keeps:

* Only committed objects are visible: ``lookup`` and ``open`` never return an object that is
  reserved but not yet committed, and a writer that dies before ``commit`` leaves nothing visible.
* Objects are write-once: ``reserve`` returns ``None`` for a key that is already committed or being
  written by someone else (the caller just skips saving it).
* ``open`` takes a lease: a leased object is not evicted until ``release`` (or the lease expires).
* Calls are batched (one call per layer for a whole step, never one per block).
* Failures raise ``BackendError`` subclasses with a clear message; they never hang: a backend that
  talks to a server bounds every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

# Anything exposing the buffer protocol (memoryview, bytearray, numpy array). Writable for reads.
Buffer = Any


class BackendError(RuntimeError):
    """A pool operation failed; the caller recomputes (loads) or skips publishing (saves)."""


class BackendUnavailable(BackendError):
    """The store cannot be reached (server down, partitioned); retry later."""


class ObjectMissing(BackendError):
    """An object that was looked up (or leased) is gone."""


class PoolFull(BackendError):
    """No room for a new object even after eviction."""


class Handle(Protocol):
    key: str
    nbytes: int


@runtime_checkable
class Backend(Protocol):
    name: str

    def lookup(self, keys: Sequence[str]) -> int:
        """Number of leading keys that are committed (stop at the first miss)."""

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[Handle | None]:
        """Reserve space for new objects of ``nbytes`` each; ``None`` where a key exists already,
        is being written by another writer, or cannot fit."""

    def write(self, handles: Sequence[Handle], offsets: Sequence[int], srcs: Sequence[Buffer]) -> None:
        """Copy ``srcs[i]`` into reserved object ``handles[i]`` at ``offsets[i]``."""

    def commit(self, handles: Sequence[Handle]) -> None:
        """Publish fully written objects, each atomically."""

    def abort(self, handles: Sequence[Handle]) -> None:
        """Drop reservations; nothing becomes visible."""

    def open(self, keys: Sequence[str]) -> list[Handle | None]:
        """Lease committed objects for reading; ``None`` where missing."""

    def read(self, handles: Sequence[Handle], offsets: Sequence[int], dsts: Sequence[Buffer]) -> None:
        """Copy ``len(dsts[i])`` bytes of object ``handles[i]`` from ``offsets[i]`` into ``dsts[i]``."""

    def release(self, handles: Sequence[Handle]) -> None:
        """End read leases."""

    def view(self, handle: Handle, offset: int, nbytes: int) -> memoryview | None:
        """A zero-copy window into an object (writable for reserved handles), or ``None`` when the
        store is not host-addressable; callers then use ``read``/``write``."""

    def stats(self) -> dict[str, int]:
        """Counters (objects, bytes, evictions, ...) for metrics."""

    def close(self) -> None: ...


def open_backend(cfg: Any, **kwargs: Any) -> Backend:
    """Build the backend ``cfg.backend`` names (a ``PoolConfig``). Imports lazily so that
    memcache_hybrid is only needed when selected."""
    if cfg.backend == "embedded":
        from lw_core.backends.embedded import EmbeddedBackend

        return EmbeddedBackend(cfg.embedded_path, capacity_bytes=cfg.embedded_capacity_bytes, **kwargs)
    if cfg.backend == "memcache":
        try:
            from lw_memcache import MemcacheBackend  # type: ignore[import-not-found]
        except ImportError as e:
            raise BackendError(
                'kv_connector_extra_config.backend="memcache" needs the lw-memcache package and '
                "memcache_hybrid: pip install 'lw-memcache[store]' "
                f"({e})"
            ) from e
        return MemcacheBackend.from_config(cfg, **kwargs)
    raise BackendError(f"unknown backend {cfg.backend!r}")
