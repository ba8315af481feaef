"""The backends lw-core ships, as plugins: ``embedded`` (registered by entry point, the default)
and ``memory`` (an in-process fake: not registered; tests do ``register_backend("memory",
lambda: MEMORY)``). Light on purpose: the stores are imported when opened."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import msgspec

from lw_core.backend import BackendError, StreamingBackend
from lw_core.backends.embedded_defaults import (
    DEFAULT_CAPACITY_BYTES,
    CapacityBytes,
    DiskCapacityBytes,
    default_embedded_path,
)
from lw_core.backends.registry import BackendPlugin, NoKeys

if TYPE_CHECKING:  # the stores themselves are imported only when opened
    from lw_core.backends.embedded import EmbeddedHandle
    from lw_core.backends.memory import MemoryHandle


class EmbeddedKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    embedded_path: str = msgspec.field(default_factory=default_embedded_path)
    embedded_capacity_bytes: CapacityBytes = DEFAULT_CAPACITY_BYTES
    # The opt-in disk tier (embedded/disk_tier.py): unset, objects evicted from DRAM are dropped.
    embedded_disk_path: str | None = None
    embedded_disk_capacity_bytes: DiskCapacityBytes = 16 << 30
    # A hit's payloads not in the page cache are read with O_DIRECT (embedded/disk_payload_reads.py).
    embedded_disk_direct_io: bool = False


def _check_embedded(keys: EmbeddedKeys) -> str | None:
    if not keys.embedded_path or "\0" in keys.embedded_path:
        return (
            f"embedded_path={keys.embedded_path!r} must be a directory path "
            "(empty or missing, or an existing lw-pool directory)"
        )
    d = keys.embedded_disk_path
    if d is not None and (not d or "\0" in d):
        return f"embedded_disk_path={d!r} must be a directory path (new, empty, or an lw-pool disk tier), or unset for no disk tier"
    if d is not None and os.path.abspath(d) == os.path.abspath(keys.embedded_path):
        return f"embedded_disk_path={d!r} must not be embedded_path: give the disk tier its own directory (on a local disk)"
    return None


EMBEDDED_EXTRA = "pip install 'lw-core[embedded]'"


def _open_embedded(cfg: Any, **kwargs: Any) -> StreamingBackend[EmbeddedHandle]:
    try:
        from lw_core.backends.embedded import EmbeddedBackend
    except ModuleNotFoundError as e:  # lw-core's base install has msgspec only
        if e.name not in ("lmdb", "numpy"):
            raise
        raise BackendError(f"backend='embedded' needs {e.name}, which lw-core's base install lacks: {EMBEDDED_EXTRA}") from e

    return EmbeddedBackend.from_keys(cfg.backend_keys, **kwargs)


def _purge_embedded(cfg: Any, prefix: str, timeout_s: float) -> dict[str, int]:
    try:
        from lw_core.backends.embedded import purge_offline
    except ModuleNotFoundError as e:
        if e.name not in ("lmdb", "numpy"):
            raise
        raise BackendError(f"backend='embedded' needs {e.name}, which lw-core's base install lacks: {EMBEDDED_EXTRA}") from e

    return purge_offline(cfg.backend_keys, prefix, timeout_s)


@contextmanager
def _embedded_bench_pool(capacity: int, path: str | None) -> Iterator[dict[str, Any]]:
    tmp = None
    if path is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        tmp = tempfile.mkdtemp(prefix="lw-bench-", dir=base)
        path = os.path.join(tmp, "pool")
    try:
        yield {"backend": "embedded", "embedded_path": path, "embedded_capacity_bytes": capacity}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


EMBEDDED = BackendPlugin(
    name="embedded",
    open=_open_embedded,
    keys=EmbeddedKeys,
    check=_check_embedded,
    notes={"embedded_capacity_bytes": "1 MiB to 16 TiB", "embedded_disk_capacity_bytes": "64 MiB to 16 TiB"},
    bench_pool=_embedded_bench_pool,
    purge=_purge_embedded,
)


def _open_memory(cfg: Any, **kwargs: Any) -> StreamingBackend[MemoryHandle]:
    from lw_core.backends.memory import MemoryBackend

    return MemoryBackend(**kwargs)


MEMORY = BackendPlugin(name="memory", open=_open_memory, keys=NoKeys)
