"""Creating an embedded pool while others open it: the slow pre-fault of a new arena must not hold
the writer lock, so processes starting together (two vLLM engines, or scheduler and worker) all
open the pool instead of failing after ``lock_timeout_s``.

Children run this same file (``python test_embedded_create.py PATH CAP ME OTHER``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

MiB = 1 << 20
N = 256 << 10


def payload(key: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, N, dtype=np.uint8)


def _child(path: str, cap: int, me: str, other: str, go: str) -> None:
    from lw_core.backends.embedded import EmbeddedBackend

    deadline = time.monotonic() + 30
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.002)  # start together with the other opener
    t0 = time.monotonic()
    b = EmbeddedBackend(path, capacity_bytes=cap, lock_timeout_s=0.5)
    opened_s = time.monotonic() - t0
    (h,) = b.reserve([me], N)
    b.write([h], [0], [payload(me)])
    b.commit([h])
    while not b.lookup([other]) and time.monotonic() < deadline:
        time.sleep(0.005)
    (h,) = b.open([other])
    dst = np.empty(N, np.uint8)
    b.read([h], [0], [dst])
    b.release([h])
    b.close()
    print(json.dumps({"opened_s": opened_s, "other_ok": bool((dst == payload(other)).all())}), flush=True)


def test_concurrent_openers_of_a_new_pool_both_succeed(tmp_path):
    # On the disk under tmp_path, MAP_POPULATE of 512 MiB takes ~1 s here: well past the 0.5 s
    # lock timeout, so a creator pre-faulting under the writer lock made the other opener fail.
    path, cap, go = str(tmp_path / "pool"), 512 * MiB, str(tmp_path / "go")
    kids = [
        subprocess.Popen([sys.executable, __file__, path, str(cap), a, b, go], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for a, b in (("a", "b"), ("b", "a"))
    ]
    time.sleep(1.0)  # let both import
    open(go, "w").close()
    outs = []
    for p in kids:
        try:
            out, err = p.communicate(timeout=60)
        finally:
            p.kill()
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o["other_ok"] for o in outs), outs
    from lw_core.backends.embedded import EmbeddedBackend

    with EmbeddedBackend(path, capacity_bytes=cap, populate=False) as b:
        assert b.verify()["objects"] == 2


def test_creation_lock_held_too_long_is_a_clear_error(tmp_path):
    from lw_core.backend import BackendUnavailable
    from lw_core.backends.embedded import EmbeddedBackend

    path = str(tmp_path / "p")
    os.makedirs(path)
    fd = os.open(os.path.join(path, "create.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a creator that is stopped or stuck
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable, match="create.lock") as e:
            EmbeddedBackend(path, capacity_bytes=4 * MiB, lock_timeout_s=0.2)
        assert path in str(e.value)
        assert time.monotonic() - t0 < 5
        fcntl.flock(fd, fcntl.LOCK_UN)
        EmbeddedBackend(path, capacity_bytes=4 * MiB, lock_timeout_s=0.2).close()
    finally:
        os.close(fd)


def test_creator_killed_before_the_index_is_complete_is_rebuilt(tmp_path):
    from lw_core.backends.embedded import EmbeddedBackend

    path = str(tmp_path / "p")
    with EmbeddedBackend(path, capacity_bytes=4 * MiB) as b:
        (h,) = b.reserve(["k"], 4096)
        b.commit([h])
    # What a creator killed mid-creation leaves: the files, but an index without its format mark.
    import lmdb

    env = lmdb.open(os.path.join(path, "index.lmdb"), subdir=False, max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.delete(b"format")
    env.close()
    with EmbeddedBackend(path, capacity_bytes=4 * MiB) as b:
        assert b.lookup(["k"]) == 0 and b.verify()["objects"] == 0


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
