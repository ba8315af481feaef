"""The backends lw-core ships, as plugins: ``embedded`` (registered by entry point, the default)
and ``memory`` (an in-process fake: not registered; tests do ``register_backend("memory",
lambda: MEMORY)``). Light on purpose: the stores are imported when opened."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from lw_core.backend import Backend, BackendError
from lw_core.backends.registry import BackendPlugin, NoKeys

MIB = 1 << 20
MAX_CAPACITY_BYTES = 16 << 40  # 16 TiB (also checked against the filesystem's free space at creation)


def default_embedded_path() -> str:
    """Per-user pool directory: tmpfs when present (the pool is a cache of DRAM, not a disk store)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"lw-pool-{os.getuid()}")


CapacityBytes = Annotated[int, Meta(ge=MIB, le=MAX_CAPACITY_BYTES)]


class EmbeddedKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    embedded_path: str = msgspec.field(default_factory=default_embedded_path)
    embedded_capacity_bytes: CapacityBytes = 4 << 30


def _check_embedded(keys: EmbeddedKeys) -> str | None:
    if not keys.embedded_path or "\0" in keys.embedded_path:
        return (
            f"embedded_path={keys.embedded_path!r} must be a directory path "
            "(empty or missing, or an existing lw-pool directory)"
        )
    return None


EMBEDDED_EXTRA = "pip install 'lw-core[embedded]'"


def _open_embedded(cfg: Any, **kwargs: Any) -> Backend:
    try:
        from lw_core.backends.embedded import EmbeddedBackend
    except ModuleNotFoundError as e:  # lw-core's base install has msgspec only
        if e.name not in ("lmdb", "numpy"):
            raise
        raise BackendError(f"backend='embedded' needs {e.name}, which lw-core's base install lacks: {EMBEDDED_EXTRA}") from e

    return EmbeddedBackend.from_keys(cfg.backend_keys, **kwargs)


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
    notes={"embedded_capacity_bytes": "1 MiB to 16 TiB"},
    bench_pool=_embedded_bench_pool,
)


def _open_memory(cfg: Any, **kwargs: Any) -> Backend:
    from lw_core.backends.memory import MemoryBackend

    return MemoryBackend(**kwargs)


MEMORY = BackendPlugin(name="memory", open=_open_memory, keys=NoKeys)
