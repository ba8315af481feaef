"""Who owns a reservation or a lease (of the embedded pool, or a streamed object of another store),
and whether that owner still lives. Standard library only: lw-memcache and lw-mooncake use it too,
and they do not install the embedded pool's LMDB.

A pid alone is not enough: pids are reused (a new process may get a dead writer's pid) and two
containers sharing ``/dev/shm`` have separate pid namespaces. An owner is therefore
``(pid namespace inode, pid, process start time)``, read from ``/proc``. Only owners in our own
namespace can be checked; for others the caller falls back to a timeout.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

_OWNER = struct.Struct("<QIQ")


class Owner(NamedTuple):
    pidns: int  # inode of /proc/<pid>/ns/pid; 0 when /proc is not there
    pid: int
    start: int  # start time in clock ticks since boot (field 22 of /proc/<pid>/stat); 0 if unknown

    def pack(self) -> bytes:
        return _OWNER.pack(*self)

    @classmethod
    def unpack(cls, b: bytes | memoryview) -> Owner:
        return cls(*_OWNER.unpack_from(b))


OWNER_SIZE = _OWNER.size


def _pidns() -> int:
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
        return int(link[link.index("[") + 1 : -1])
    except (OSError, ValueError):
        return 0


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of ``pid``, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = raw[raw.rindex(b")") + 2 :].split()
    return rest[0].decode(), int(rest[19])


def boot_id() -> bytes:
    """This machine's boot id (16 bytes; zeros when unknown): an owner is only judged by processes
    that share it, i.e. run on the same machine since the same boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return bytes.fromhex(f.read().strip().decode().replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return bytes(16)


def current_owner() -> Owner:
    pid = os.getpid()
    st = _stat(pid) if os.path.isdir("/proc/self") else None
    return Owner(_pidns(), pid, st[1] if st else 0)


def owner_alive(owner: Owner, me: Owner) -> bool | None:
    """True/False when we can tell, None when the owner lives in another pid namespace."""
    if owner.pidns != me.pidns:
        return None
    if owner.pid == me.pid and owner.start == me.start:
        return True
    if owner.start == 0 or me.start == 0:  # no /proc: signal 0 is all we have
        try:
            os.kill(owner.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    st = _stat(owner.pid)
    if st is None:
        return False
    state, start = st
    # A zombie (killed, not yet reaped by its parent) holds no memory views any more: dead.
    return start == owner.start and state not in ("Z", "X", "x")
