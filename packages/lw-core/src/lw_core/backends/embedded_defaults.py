"""The embedded store's defaults and bounds, in lw-core's base: where its pool lies by default
(``default_embedded_path``) and the sizes its keys accept. Read by the config (which re-exports
``default_embedded_path`` and ``MAX_CAPACITY_BYTES``), by the embedded plugin's keys
(``lw_core.backends.builtin``) and by the store itself (``lw_core.backends.embedded``), so none of
them imports another for these. Standard library and msgspec only."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from typing import Annotated

from msgspec import Meta

MIB = 1 << 20
MAX_CAPACITY_BYTES = 16 << 40  # 16 TiB (also checked against the filesystem's free space at creation)
LEASES_PER_PROCESS = 2048  # leases one attached backend holds at once; more opens answer misses


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
