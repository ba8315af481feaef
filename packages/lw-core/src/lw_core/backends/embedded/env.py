"""Process-wide pieces of the embedded pool: one LMDB environment per index file per process,
``flock`` with a deadline, and the boot id a pool records (a pool from before a reboot is rebuilt)."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import lmdb

from lw_core.backend import BackendError, BackendUnavailable

# py-lmdb refuses to open one environment twice in a process, yet a process may hold several
# backends on one pool (vLLM without multiprocessing runs scheduler and worker in one process):
# they share the environment. Our flock files are per backend, so they still take turns to write.
_ENV_LOCK = threading.Lock()
_ENVS: dict[tuple[int, str, tuple[int, int]], list[Any]] = {}  # (pid, real path, (dev, ino)) -> [environment, users]


def acquire_env(idx: str, ident: tuple[int, int], **kwargs: Any) -> Any:
    # Keyed by the file's identity too: a pool rebuilt (or re-created after its directory was
    # deleted) at the same path is another environment.
    key = (os.getpid(), os.path.realpath(idx), ident)
    with _ENV_LOCK:
        entry = _ENVS.get(key)
        if entry is None:
            try:
                env = lmdb.open(idx, subdir=False, **kwargs)
            except lmdb.Error as e:
                if "already open" in str(e):  # opened by the process we were forked from
                    raise BackendError(
                        f"embedded pool: {idx!r} was open in the parent of this forked process and py-lmdb "
                        "cannot reopen it here; start workers with spawn, or open the pool only after fork"
                    ) from e
                raise
            entry = _ENVS[key] = [env, 0]
        entry[1] += 1
        return entry[0]


def release_env(env: Any) -> None:
    with _ENV_LOCK:
        for key, entry in list(_ENVS.items()):
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] == 0:
                    del _ENVS[key]
                    env.close()
                return


def flock_by(fd: int, deadline: float, message: Callable[[], str]) -> None:
    """Take an exclusive flock, polling until ``deadline`` (flock itself has no timeout)."""
    delay = 20e-6
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise BackendUnavailable(message()) from None
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)


def boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:
        return b"unknown"
