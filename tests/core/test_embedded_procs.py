"""EmbeddedBackend across real processes: one writes, another reads the exact bytes; uncommitted
objects stay invisible to other processes; a writer killed with SIGKILL mid-object leaves nothing
visible and its space comes back; concurrent writers keep the index consistent.

Children run this same file (``python test_embedded_procs.py ROLE ...``), so the payload
function is shared and nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np

MiB = 1 << 20


def payload(key: str, n: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def digest(a) -> str:
    return hashlib.sha256(memoryview(a).cast("B")).hexdigest()


# ----------------------------------------------------------------------------- child roles


def _child(argv: list[str]) -> None:
    from lw_core.backends.embedded import EmbeddedBackend

    role, path, cap = argv[0], argv[1], int(argv[2])
    b = EmbeddedBackend(path, capacity_bytes=cap)
    if role == "write":  # write KEYS... of NBYTES in batches, commit; report what was committed
        nbytes, batch, keys = int(argv[3]), int(argv[4]), argv[5:]
        go, deadline = os.environ.get("LW_TEST_GO"), time.monotonic() + 30
        while go and not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.005)  # start together with the other writers
        done = []
        for i in range(0, len(keys), batch):
            ks = keys[i : i + batch]
            hs = b.reserve(ks, nbytes)
            got = [(k, h) for k, h in zip(ks, hs) if h is not None]
            if got:
                b.write([h for _, h in got], [0] * len(got), [payload(k, nbytes) for k, _ in got])
                b.commit([h for _, h in got])
                done += [k for k, _ in got]
        print(json.dumps({"committed": done}), flush=True)
    elif role == "hold":  # reserve and fill KEY, then wait for "commit" or "abort" on stdin
        nbytes, keys = int(argv[3]), argv[4:]
        hs = b.reserve(keys, nbytes)
        assert all(hs), hs
        b.write(hs, [0] * len(hs), [payload(k, nbytes) for k in keys])
        print("RESERVED", flush=True)
        cmd = sys.stdin.readline().strip()
        (b.commit if cmd == "commit" else b.abort)(hs)
        print("DONE", flush=True)
    elif role == "die":  # reserve KEY, write half of it, then wait to be killed
        nbytes, key = int(argv[3]), argv[4]
        (h,) = b.reserve([key], nbytes)
        b.write([h], [0], [payload(key, nbytes)[: nbytes // 2]])
        print("HALF", flush=True)
        time.sleep(60)
        sys.exit("not killed")  # the test failed to kill us: make it visible
    elif role == "lease":  # open KEYS and hold the leases until told to go
        keys = argv[3:]
        hs = b.open(keys)
        print("LEASED" if all(hs) else "MISSING", flush=True)
        sys.stdin.readline()
        b.release(hs)
        print("DONE", flush=True)
    elif role == "read":  # lookup and read KEYS of NBYTES; report visibility and digests
        nbytes, keys = int(argv[3]), argv[4:]
        found = b.lookup(keys)
        hs = b.open(keys)
        out = {}
        for k, h in zip(keys, hs):
            if h is not None:
                dst = np.empty(nbytes, np.uint8)
                b.read([h], [0], [dst])
                out[k] = digest(dst)
        b.release([h for h in hs if h is not None])
        print(json.dumps({"lookup": found, "digests": out, "stats": b.stats()}), flush=True)
    b.close()


# ----------------------------------------------------------------------------- helpers


def spawn(*args: object, stdin: bool = False, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *map(str, args)],
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def run(*args: object, timeout: float = 60) -> dict:
    p = subprocess.run([sys.executable, __file__, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def readline(p: subprocess.Popen, timeout: float = 30) -> str:
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    if not ready:
        p.kill()
        raise AssertionError(f"child {p.args[2:]} said nothing within {timeout}s")
    return p.stdout.readline().strip()


# ----------------------------------------------------------------------------- tests


def test_one_process_writes_another_reads_exact_bytes(tmp_path):
    path, cap, n = str(tmp_path / "pool"), 8 * MiB, 100_000
    keys = [f"lw1/m/l/tp0/{i:032x}" for i in range(20)]
    w = run("write", path, cap, n, 8, *keys)
    assert w["committed"] == keys
    r = run("read", path, cap, n, *keys)
    assert r["lookup"] == len(keys)
    assert r["digests"] == {k: digest(payload(k, n)) for k in keys}
    assert r["stats"]["objects"] == len(keys)


def test_reader_process_never_sees_uncommitted_object(tmp_path):
    from lw_core.backends.embedded import EmbeddedBackend

    path, cap, n = str(tmp_path / "pool"), 4 * MiB, 64 << 10
    keys = ["a", "b", "c"]
    me = EmbeddedBackend(path, capacity_bytes=cap)
    w = spawn("hold", path, cap, n, *keys, stdin=True)
    try:
        assert readline(w) == "RESERVED"
        r = run("read", path, cap, n, *keys)
        assert r["lookup"] == 0 and r["digests"] == {}, "reserved-but-uncommitted objects must be invisible"
        assert r["stats"]["reserved_objects"] == 3
        assert me.lookup(keys) == 0 and me.open(keys) == [None] * 3
        assert me.reserve(["b"], n) == [None], "another process's in-flight key is not reservable"
        w.stdin.write("commit\n")
        w.stdin.flush()
        assert readline(w) == "DONE"
        assert w.wait(timeout=30) == 0
        r = run("read", path, cap, n, *keys)
        assert r["lookup"] == 3 and r["digests"] == {k: digest(payload(k, n)) for k in keys}
    finally:
        w.kill()
        me.close()


def test_aborting_process_publishes_nothing(tmp_path):
    path, cap, n = str(tmp_path / "pool"), 4 * MiB, 8192
    w = spawn("hold", path, cap, n, "x", stdin=True)
    try:
        assert readline(w) == "RESERVED"
        w.stdin.write("abort\n")
        w.stdin.flush()
        assert readline(w) == "DONE" and w.wait(timeout=30) == 0
    finally:
        w.kill()
    r = run("read", path, cap, n, "x")
    assert r["lookup"] == 0 and r["stats"]["reserved_objects"] == 0 and r["stats"]["free_bytes"] == cap


def test_writer_killed_mid_object_leaves_nothing_and_space_returns(tmp_path):
    from lw_core.backends.embedded import EmbeddedBackend

    path, cap = str(tmp_path / "pool"), 4 * MiB
    big = 3 * MiB
    w = spawn("die", path, cap, big, "victim")
    try:
        assert readline(w) == "HALF"
        os.kill(w.pid, signal.SIGKILL)
        assert w.wait(timeout=30) == -signal.SIGKILL
    finally:
        w.kill()
    r = run("read", path, cap, big, "victim")
    assert r["lookup"] == 0 and r["digests"] == {}, "a killed writer's object must stay invisible"
    b = EmbeddedBackend(path, capacity_bytes=cap)
    try:
        # Only 1 MiB is free unless the dead writer's 3 MiB comes back.
        (h,) = b.reserve(["other"], big)
        assert h is not None, "the dead writer's space was not reclaimed"
        st = b.stats()
        assert st["reclaimed_reservations"] == 1 and st["reserved_objects"] == 1
        b.abort([h])
        # its key is free again too
        (h,) = b.reserve(["victim"], big)
        assert h is not None
        b.write([h], [0], [payload("victim", big)])
        b.commit([h])
        assert b.verify()["objects"] == 1
        assert b.stats()["free_bytes"] == cap - big
    finally:
        b.close()
    r = run("read", path, cap, big, "victim")
    assert r["digests"] == {"victim": digest(payload("victim", big))}


def test_concurrent_writers_with_eviction_keep_index_consistent(tmp_path):
    from lw_core.backends.embedded import EmbeddedBackend

    path, cap, n = str(tmp_path / "pool"), 2 * MiB, 64 << 10  # 60 objects x 64 KiB > 2 MiB: evicts
    keys = [f"k{i:02d}" for i in range(60)]
    EmbeddedBackend(path, capacity_bytes=cap).close()  # create once, so children only attach
    go = {"LW_TEST_GO": str(tmp_path / "go")}
    ws = [spawn("write", path, cap, n, 4, *keys[:40], env=go), spawn("write", path, cap, n, 4, *keys[20:], env=go)]
    time.sleep(0.5)  # let both import and attach
    (tmp_path / "go").touch()
    committed = []
    for w in ws:
        try:
            out, _ = w.communicate(timeout=60)
        finally:
            w.kill()
        assert w.returncode == 0
        committed += json.loads(out.strip().splitlines()[-1])["committed"]
    # A key can be committed twice only if the first copy was evicted in between (write-once holds
    # while an object exists); every commit is counted once and every eviction balances one.
    assert set(committed) == set(keys)
    b = EmbeddedBackend(path, capacity_bytes=cap)
    try:
        b.verify()
        st = b.stats()
        assert st["commits"] == len(committed) and st["evictions"] == len(committed) - st["objects"] > 0
        assert st["reserved_objects"] == 0 and st["free_bytes"] + st["committed_alloc_bytes"] == cap
        alive = [k for k in keys if b.lookup([k])]
        assert len(alive) == st["objects"]
        hs = b.open(alive)
        for k, h in zip(alive, hs):
            dst = np.empty(n, np.uint8)
            b.read([h], [0], [dst])
            assert digest(dst) == digest(payload(k, n)), k
        b.release(hs)
    finally:
        b.close()


def test_lease_held_by_another_process_blocks_eviction(tmp_path):
    from lw_core.backends.embedded import EmbeddedBackend

    path, cap, n = str(tmp_path / "pool"), 4 * MiB, 1 * MiB
    b = EmbeddedBackend(path, capacity_bytes=cap)
    r = None
    try:
        for k in ("a", "b", "c", "d"):
            (h,) = b.reserve([k], n)
            b.commit([h])
        r = spawn("lease", path, cap, "a", "b", stdin=True)
        assert readline(r) == "LEASED"
        hs = b.reserve(["x", "y", "z"], n)
        assert hs[0] is not None and hs[1] is not None and hs[2] is None, "only c and d were evictable"
        assert b.lookup(["a", "b"]) == 2 and b.lookup(["c"]) == 0 and b.lookup(["d"]) == 0
        b.abort(hs)
        r.stdin.write("go\n")
        r.stdin.flush()
        assert readline(r) == "DONE" and r.wait(timeout=30) == 0
        # released by the other process: now they can go (after their second chance)
        hs = b.reserve(["x", "y", "z", "w"], n)
        assert all(hs) and b.lookup(["a"]) == 0 and b.lookup(["b"]) == 0
        b.abort(hs)
    finally:
        if r is not None:
            r.kill()
        b.close()


def test_use_across_fork_is_refused(tmp_path):
    from lw_core.backend import BackendError
    from lw_core.backends.embedded import EmbeddedBackend

    b = EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=4 * MiB)
    try:
        pid = os.fork()
        if pid == 0:  # child: must refuse, never touch the parent's LMDB handles
            try:
                b.lookup(["a"])
                code = 1
            except BackendError as e:
                code = 0 if "forked" in str(e) else 2
            os._exit(code)
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, "forked child hung"
            time.sleep(0.01)
        assert os.waitstatus_to_exitcode(status) == 0
        assert b.lookup(["a"]) == 0  # the parent is unaffected
    finally:
        b.close()


if __name__ == "__main__":
    _child(sys.argv[1:])
