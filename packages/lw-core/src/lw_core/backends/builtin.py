"""The backends lw-core ships, as plugins: ``embedded`` (registered by entry point, the default)
and ``memory`` (an in-process fake: not registered; tests do ``register_backend("memory",
lambda: MEMORY)``). Light on purpose: the stores are imported when opened."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

from lw_core.backend import BackendError, StreamingBackend
from lw_core.backends.registry import BackendPlugin, NoKeys

if TYPE_CHECKING:  # the stores themselves are imported only when opened
    from lw_core.backends.embedded import EmbeddedHandle
    from lw_core.backends.memory import MemoryHandle

MIB = 1 << 20
MAX_CAPACITY_BYTES = 16 << 40  # 16 TiB (also checked against the filesystem's free space at creation)


SHM_DIR = "/dev/shm"
MOUNTS = "/proc/self/mounts"


def _fs_type(path: str) -> str | None:
    """The type of the filesystem holding ``path`` (its longest mount point in ``MOUNTS``), or None."""
    real, best, kind = os.path.realpath(path), "", None
    try:
        with open(MOUNTS, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # \040 is a space
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):  # the last of equal mount points is the one on top
                    best, kind = mnt, fields[2]
    except OSError:
        return None
    return kind


DEFAULT_CAPACITY_BYTES = 4 << 30


def private_runtime_dir() -> str | None:
    """``$XDG_RUNTIME_DIR`` when it is this user's own tmpfs directory (as systemd-logind makes
    ``/run/user/<uid>``: owned by the user, mode 0700): an absolute path to a directory owned by our
    effective uid, not writable by group or others, on tmpfs, large enough for a pool of the default
    capacity (logind sizes it at 10 % of RAM: a smaller host keeps ``/dev/shm``). Else None."""
    d = os.environ.get("XDG_RUNTIME_DIR", "")
    if not os.path.isabs(d):
        return None
    try:
        st = os.stat(d)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return None
    try:
        vfs = os.statvfs(d)
    except OSError:
        return None
    if vfs.f_blocks * vfs.f_frsize < DEFAULT_CAPACITY_BYTES:
        return None
    return d if _fs_type(d) == "tmpfs" else None


def default_embedded_path() -> str:
    """Per-user pool directory, on tmpfs (the pool is a cache of DRAM, not a disk store):
    ``$XDG_RUNTIME_DIR/lw-pool`` when that is the user's private tmpfs directory (nobody else can
    create a path there first), else ``/dev/shm/lw-pool-<uid>`` (the temporary directory when there
    is no writable ``/dev/shm``). Engines share a pool only when they resolve the same path: engines
    of one user started from environments that differ in ``XDG_RUNTIME_DIR`` (a login shell and a
    system service) should name ``embedded_path`` explicitly."""
    private = private_runtime_dir()
    if private is not None:
        return os.path.join(private, "lw-pool")
    base = SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"lw-pool-{os.getuid()}")


CapacityBytes = Annotated[int, Meta(ge=MIB, le=MAX_CAPACITY_BYTES)]
DISK_MIN_BYTES = 64 * MIB
DiskCapacityBytes = Annotated[int, Meta(ge=DISK_MIN_BYTES, le=MAX_CAPACITY_BYTES)]


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
