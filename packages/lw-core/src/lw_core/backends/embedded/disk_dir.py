"""``TierDir``: the disk tier's directory (``embedded_disk_path``) as every process sharing it sees it.

* **Ownership and the marker.** The directory must be ours, not a symlink, not writable by group
  or others, and new, empty or marked as a disk tier (``MARKER``): anything else is refused, naming
  ``embedded_disk_path``, so files there are never replaced or removed. The marker records the
  directory's capacity (``capacity_bytes=``): a process given another
  ``embedded_disk_capacity_bytes`` is refused, naming both values, since one with a smaller
  capacity would otherwise delete the others' files down to its own limit. A marker written before
  the capacity was recorded gets the first opener's.
* **One lock, one count.** Every change to which object files the directory holds (a file renamed
  in, one evicted or found damaged) and every listing that recounts them is made under ``lock``:
  an ``flock`` of the directory (every process, across pid namespaces) and a thread lock. The
  directory's total bytes of object files is kept in ``COUNT`` (8 bytes), read and updated under
  that lock, so each process evicts against what all of them wrote, not only what it saw at its
  last listing. A process killed between a change and its count leaves the count off by that file
  until the next listing (``recount``) sets it from the directory itself.
* **Temporaries.** A demotion writes ``tmp_name()``, whose name carries its writer's boot id, pid
  namespace, pid and start time (``lw_core.procs.Owner``): a listing removes it once that writer is
  known dead (the same machine since boot, our pid namespace: ``owner_alive``), or once it is older
  than ``STALE_TMP_S`` whoever made it (a writer in another container's pid namespace is never
  judged by a pid that means another process here).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator

from lw_core.backend import BackendError
from lw_core.backends.embedded import files
from lw_core.backends.embedded.disk_format import SUFFIX, BadFile, read_header
from lw_core.procs import Owner, boot_id, current_owner, owner_alive

MARKER = "LW_DISK_TIER"
MARKER_HEAD = b"lw-pool disk tier 1\n"
CAPACITY_KEY = "capacity_bytes"
COUNT = MARKER + ".bytes"  # the directory's object bytes, shared by every process (under ``lock``)
_MARKER_NEW = MARKER + ".new"  # the marker being written (renamed over ``MARKER``)
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 600.0  # a temporary file this old is a dead demotion's, whoever made it


class TierDir:
    """The directory ``path`` (absolute) of a disk tier of ``capacity`` bytes: checked, marked and
    locked by ``__init__`` (``BackendError`` naming the key when refused)."""

    def __init__(self, path: str, capacity: int) -> None:
        self.path = path
        self.capacity = capacity
        self._me, self._boot = current_owner(), boot_id()
        self._tmp_owner = f"{self._boot.hex()}-{self._me.pidns}-{self._me.pid}-{self._me.start}"
        self._thread_lock = threading.Lock()
        _check_dir(path)
        self._dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with self.lock():
                _mark(path, capacity)
                self._count_fd = files.open_file(os.path.join(path, COUNT), os.O_RDWR | os.O_CREAT,
                                                 what="disk tier count")
        except BaseException:
            os.close(self._dir_fd)
            raise

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the directory's lock (every process's, and this process's other threads')."""
        with self._thread_lock:
            fcntl.flock(self._dir_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._dir_fd, fcntl.LOCK_UN)

    def total(self) -> int:
        """The directory's bytes of object files (call under ``lock``)."""
        raw = os.pread(self._count_fd, 8, 0)
        return int.from_bytes(raw, "little") if len(raw) == 8 else 0

    def set_total(self, n: int) -> None:
        """Record the directory's bytes of object files (call under ``lock``)."""
        os.pwrite(self._count_fd, max(0, n).to_bytes(8, "little"), 0)

    def recount(self) -> list[tuple[int, str, int]]:
        """List the object files, (mtime ns, name, bytes) each, and set the count from them (call
        under ``lock``); dead demotions' temporaries are removed."""
        found = self.listing()
        self.set_total(sum(size for _, _, size in found))
        return found

    def listing(self) -> list[tuple[int, str, int]]:
        """The object files, (mtime ns, name, bytes) each (a stat per file, no open); dead
        demotions' temporaries are removed."""
        found: list[tuple[int, str, int]] = []
        now = time.time()
        for ent in os.scandir(self.path):
            if ent.name.startswith(TMP_PREFIX):
                if self.stale_tmp(ent.name, ent.path, now):
                    unlink(ent.path)
                continue
            if not ent.name.endswith(SUFFIX):
                continue
            try:
                st = ent.stat(follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
            if stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime_ns, ent.name, st.st_size))
        return found

    def tmp_name(self) -> str:
        """A new temporary file's path, named by its writer (this process)."""
        return os.path.join(self.path, f"{TMP_PREFIX}{self._tmp_owner}-{secrets.token_hex(8)}")

    def stale_tmp(self, name: str, p: str, now: float) -> bool:
        """Whether the temporary ``name`` (at ``p``) is a dead demotion's: its writer is known dead
        (``owner_alive``, same boot), or it is older than ``STALE_TMP_S``."""
        try:
            boot, ns, pid, start, _ = name[len(TMP_PREFIX):].split("-")
            owner = Owner(int(ns), int(pid), int(start))
            if bytes.fromhex(boot) == self._boot and owner_alive(owner, self._me) is False:
                return True
        except ValueError:
            pass  # not a name we write (an older version's): its age alone says
        try:
            return now - os.stat(p, follow_symlinks=False).st_mtime > STALE_TMP_S
        except OSError:
            return False

    def close(self) -> None:
        for fd in (self._count_fd, self._dir_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def unlink(p: str) -> bool:
    """Remove ``p``; whether this call removed it."""
    try:
        os.unlink(p)
    except OSError:
        return False
    return True


def _check_dir(path: str) -> None:
    try:
        os.makedirs(path, 0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise BackendError(f"embedded disk tier: cannot create embedded_disk_path={path!r}: {e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise BackendError(f"embedded disk tier: embedded_disk_path={path!r} is not a directory (or is a symbolic link)")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise BackendError(
            f"embedded disk tier: embedded_disk_path={path!r} is owned by uid {st.st_uid} or writable by group or "
            f"others (mode {st.st_mode & 0o7777:04o}); this process runs as uid {os.geteuid()}: use a directory of your own"
        )


def _mark(path: str, capacity: int) -> None:
    """Check the marker (under the directory's lock): ours, and of ``capacity``; write it in a new
    directory, or record ``capacity`` in one written before capacities were recorded."""
    names = set(os.listdir(path)) - {_MARKER_NEW}
    marker = os.path.join(path, MARKER)
    if MARKER in names:
        recorded = _read_capacity(marker)
        if recorded == capacity:
            return
        if recorded is not None:
            raise BackendError(
                f"embedded disk tier: embedded_disk_capacity_bytes={capacity} but embedded_disk_path={path!r} holds "
                f"a disk tier of embedded_disk_capacity_bytes={recorded} (its {MARKER} file): every process sharing "
                f"the directory must give the same capacity, or the smallest would evict the others' files down to "
                f"its own. Set embedded_disk_capacity_bytes={recorded}, or use another directory; to change the "
                f"capacity, stop every process using the directory and edit the {CAPACITY_KEY}= line of {MARKER}"
            )
    elif names:
        shown = ", ".join(map(repr, sorted(names)[:5])) + (" ..." if len(names) > 5 else "")
        raise BackendError(
            f"embedded disk tier: embedded_disk_path={path!r} is neither empty nor an lw-pool disk tier (no {MARKER} "
            f"file; it holds {shown}); refusing to write there: set embedded_disk_path to a new or empty directory"
        )
    new = os.path.join(path, _MARKER_NEW)
    fd = files.open_file(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, what="disk tier marker")
    try:
        os.write(fd, MARKER_HEAD + f"{CAPACITY_KEY}={capacity}\n".encode())
    finally:
        os.close(fd)
    os.replace(new, marker)


def _read_capacity(marker: str) -> int | None:
    """The capacity the marker records; None for a marker written before capacities were (or
    left empty by a process killed as it wrote it)."""
    fd = files.open_file(marker, os.O_RDONLY, what="disk tier marker")
    try:
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    if raw and not raw.startswith(MARKER_HEAD[:18]):
        raise BackendError(f"embedded disk tier: {marker!r} is not an lw-pool disk tier marker (embedded_disk_path)")
    for line in raw.decode(errors="replace").splitlines()[1:]:
        key, _, value = line.partition("=")
        if key.strip() == CAPACITY_KEY:
            try:
                return int(value.strip())
            except ValueError:
                raise BackendError(
                    f"embedded disk tier: {marker!r} has {line!r}, not a number of bytes: fix the {CAPACITY_KEY}= "
                    f"line (the directory's embedded_disk_capacity_bytes) or use another embedded_disk_path"
                ) from None
    return None


def purge_dir(path: str, prefix: bytes) -> list[tuple[str, int]]:
    """Remove the tier's object files whose key starts with ``prefix`` (every one for ``b""``);
    their names and sizes. A file whose header cannot be read is left to the tier (a miss it
    removes). The directory must be a disk tier (its ``MARKER``): nothing is removed anywhere else."""
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise BackendError(f"embedded disk tier: {path!r} is not a disk tier (no {MARKER} file); nothing removed")
    removed = []
    for ent in os.scandir(path):
        if not ent.name.endswith(SUFFIX) or ent.name.startswith(TMP_PREFIX) or not ent.is_file(follow_symlinks=False):
            continue
        try:
            size = ent.stat(follow_symlinks=False).st_size
        except OSError:
            continue  # removed meanwhile
        if prefix:
            try:
                fd = os.open(ent.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # removed meanwhile
            try:
                if not read_header(fd).bkey.startswith(prefix):
                    continue
            except (BadFile, OSError):
                continue
            finally:
                os.close(fd)
        try:
            os.unlink(ent.path)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise BackendError(f"embedded disk tier: cannot remove {ent.path!r}: {e}") from e
        removed.append((ent.name, size))
    return removed
