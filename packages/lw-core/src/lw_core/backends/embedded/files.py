"""The embedded pool's directory and files: who may own them, how they are opened and sized.

Another local user must not be able to hand us a pool (and then read our KV or plant KV we load),
and a full filesystem must never turn a write into SIGBUS. So:

* The pool directory must be ours (owned by our effective uid), not a symlink, and not writable
  by group or others; it is created 0700. Since nobody else can then add, replace or rename its
  entries, checking each file's owner and mode on the opened descriptor (``fstat``) is enough.
* Every file is opened with ``O_NOFOLLOW | O_CLOEXEC`` and created 0600 (LMDB's two files too:
  they are pre-created here before LMDB opens them).
* Only an empty directory, or one marked as a pool (``LW_POOL``, written when the pool is first
  set up) is used: ``embedded_path`` pointing at ``/``, ``/etc`` or a directory holding anything
  else is refused, so files there are never replaced. A directory holding only our own file names
  (a pool made before the marker existed) is adopted.
* Space is reserved up front with ``posix_fallocate`` for every file that is written through a
  mapping (the arena and the lease table here; LMDB's lock file after LMDB sized it). The index
  itself is written by LMDB with ``pwrite`` (no ``writemap``), which reports ``ENOSPC`` as an error.
"""

from __future__ import annotations

import errno
import os
import stat

from lw_core.backend import BackendError

MARKER = "LW_POOL"
MARKER_TEXT = b"lw-pool embedded 1\n"
# Everything a pool directory may hold (a pool made before the marker existed holds a subset).
POOL_FILES = frozenset(
    {MARKER, "index.lmdb", "index.lmdb-lock", "arena", "leases", "writer.lock", "attach.lock", "create.lock"}
)
_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC


def _who(st: os.stat_result) -> str:
    try:
        import pwd

        name = pwd.getpwuid(st.st_uid).pw_name
    except (ImportError, KeyError):
        name = "?"
    return f"owner uid {st.st_uid} ({name}), mode {stat.filemode(st.st_mode)} ({st.st_mode & 0o7777:04o})"


def _check_owned(path: str, st: os.stat_result, what: str) -> None:
    me = os.geteuid()
    if st.st_uid != me or st.st_mode & 0o022:
        why = "is owned by another user" if st.st_uid != me else "is writable by group or others"
        raise BackendError(
            f"embedded pool: {what} {path!r} {why} ({_who(st)}); this process runs as uid {me}. "
            "Another user could read or plant KV through it, so it is refused: remove it (or "
            f"`chown {me} {path}; chmod go-w {path}` if it is really yours), or set embedded_path "
            "to a directory of your own"
        )


def prepare_dir(path: str) -> None:
    """Create the pool directory (0700), or check that an existing one is ours and is a pool."""
    try:
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise BackendError(f"embedded pool: cannot create embedded_path={path!r}: {e}") from e
    try:
        st = os.lstat(path)
    except OSError as e:
        raise BackendError(f"embedded pool: cannot use embedded_path={path!r}: {e}") from e
    if stat.S_ISLNK(st.st_mode):
        raise BackendError(
            f"embedded pool: embedded_path={path!r} is a symbolic link (to {os.readlink(path)!r}); "
            "it is refused so nobody can redirect the pool: give the real directory"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise BackendError(f"embedded pool: embedded_path={path!r} exists and is not a directory")
    _check_owned(path, st, "embedded_path")
    names = set(os.listdir(path))
    for n in sorted(names & POOL_FILES):
        f = os.path.join(path, n)
        fst = os.lstat(f)
        if stat.S_ISLNK(fst.st_mode) or not stat.S_ISREG(fst.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(fst.st_mode) else "not a regular file"
            raise BackendError(f"embedded pool: {f!r} is {kind}; refused so nobody can redirect the pool: remove it")
        _check_owned(f, fst, "pool file")
    if MARKER in names:
        fd = open_file(os.path.join(path, MARKER), os.O_RDONLY)
        try:
            head = os.read(fd, 64)
        finally:
            os.close(fd)
        if head and not head.startswith(b"lw-pool "):  # empty: another opener is writing it now
            raise BackendError(f"embedded pool: {os.path.join(path, MARKER)!r} is not an lw-pool marker")
        return
    foreign = sorted(names - POOL_FILES)
    if foreign:
        shown = ", ".join(map(repr, foreign[:5])) + (" ..." if len(foreign) > 5 else "")
        raise BackendError(
            f"embedded pool: embedded_path={path!r} is neither empty nor an lw-pool directory (no {MARKER} "
            f"file; it holds {shown}); refusing to create pool files there: set embedded_path to a new or "
            "empty directory"
        )
    try:
        fd = open_file(os.path.join(path, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except BackendError as e:
        if isinstance(e.__cause__, FileExistsError):
            return  # another opener marked it just now
        raise
    try:
        os.write(fd, MARKER_TEXT)
    finally:
        os.close(fd)


def open_file(path: str, flags: int, *, what: str = "pool file") -> int:
    """``os.open`` without following symlinks, 0600 when created; refuses a file that is not ours."""
    try:
        fd = os.open(path, flags | _OPEN, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BackendError(f"embedded pool: {what} {path!r} is a symbolic link; refused (remove it)") from e
        raise BackendError(f"embedded pool: cannot open {path!r}: {e}") from e
    try:
        _check_owned(path, os.fstat(fd), what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def touch(path: str) -> tuple[int, int]:
    """Create ``path`` 0600 if missing and check it; its (device, inode)."""
    fd = open_file(path, os.O_RDWR | os.O_CREAT)
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def reserve_space(fd: int, nbytes: int, path: str) -> None:
    """Allocate ``nbytes`` of ``fd`` now, so writes through a mapping can never hit a full filesystem."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        hint = (
            " (not enough free space: lower embedded_capacity_bytes or free the filesystem)"
            if e.errno == errno.ENOSPC
            else ""
        )
        raise BackendError(f"embedded pool: cannot allocate {nbytes} bytes for {path!r}: {e}{hint}") from e


def check_free_space(path: str, need: int) -> None:
    """Refuse up front when the filesystem cannot hold ``need`` more bytes (clear message, no partial pool)."""
    try:
        sv = os.statvfs(path)
    except OSError:
        return
    free = sv.f_bavail * sv.f_frsize
    if need > free:
        raise BackendError(
            f"embedded pool: {path!r} needs {need} bytes (embedded_capacity_bytes plus index and leases) but its "
            f"filesystem has {free} bytes free: lower embedded_capacity_bytes, free space, or use another embedded_path"
        )


def full_hint(path: str) -> str:
    """A note for an index error when the pool's filesystem is full (LMDB reports EIO)."""
    try:
        sv = os.statvfs(path)
    except OSError:
        return ""
    if sv.f_bavail * sv.f_frsize >= 1 << 20:
        return ""
    return " (the filesystem holding the pool is full: this write is dropped; free space there)"


def identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the pool's marker, or None when the pool directory is gone."""
    try:
        st = os.stat(os.path.join(path, MARKER), follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino
