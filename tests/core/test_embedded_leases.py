"""Embedded pool reads under eviction and stuck processes:

* a reader stalled past its lease gets an error, never another object's bytes (read and view);
* a dead reader's leases stop pinning objects at once (liveness, not the TTL), and a pid reused by
  another process does not keep them alive;
* a process stopped while holding the writer lock does not stop other processes' reads.

Children run this same file (``python test_embedded_leases.py ROLE PATH CAP KEYS...``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from lw_core.procs import current_owner

MiB = 1 << 20
CAP = 2 * MiB
N = 1 * MiB


def payload(key: str, n: int = N) -> np.ndarray:
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _child(role: str, path: str, keys: list[str]) -> None:
    from lw_core.backends.embedded import EmbeddedBackend

    b = EmbeddedBackend(path, capacity_bytes=CAP, lease_ttl_s=60.0)
    if role == "lease":  # lease KEYS and keep them (until killed)
        assert all(b.open(keys))
    elif role == "writer-lock":  # hold the writer lock and LMDB's write transaction (until stopped/killed)
        from lw_core.backends.embedded.writer_lock import WriterLock

        lock = WriterLock(b.path, timeout_s=1.0, capacity=CAP)
        lock.open_files()
        cm = lock.locked()  # kept referenced: a collected generator would release the lock
        cm.__enter__()
        txn = b._pool.env.begin(write=True)
        txn.put(b"x", b"y", db=b._pool.meta)
    print("ready", flush=True)
    time.sleep(60)


def _spawn(tmp_path, role: str, keys: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, __file__, role, str(tmp_path / "p"), *keys],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = ""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not line:
        line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise AssertionError(f"child {role} did not start: {line!r} {p.stderr.read()}")
    return p


def _end(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
    p.wait(timeout=10)
    p.stdout.close()
    p.stderr.close()


@pytest.fixture
def pools(tmp_path):
    from lw_core.backends.embedded import EmbeddedBackend

    made = []

    def make(**kw):
        b = EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=CAP, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def put(b, keys: list[str]) -> list:
    hs = b.reserve(keys, N)
    assert all(hs), hs
    b.write(hs, [0] * len(hs), [payload(k) for k in keys])
    b.commit(hs)
    return hs


def test_reader_stalled_past_its_lease_gets_an_error_not_the_new_objects_bytes(pools):
    from lw_core.backend import ObjectMissing

    reader, writer = pools(lease_ttl_s=0.2), pools()
    put(writer, ["a", "b"])
    (ha,) = reader.open(["a"])
    time.sleep(0.3)  # the reader stalls: its lease expires, "a" may be evicted
    writer.release(writer.open(["b"]))  # "b" was read since: CLOCK evicts "a"
    (hc,) = put(writer, ["c"])
    assert writer.lookup(["a"]) == 0 and hc._off == ha._off, "test premise: c took a's space"
    dst = np.zeros(N, np.uint8)
    with pytest.raises(ObjectMissing, match="evicted") as ei:
        reader.read([ha], [0], [dst])
    assert "'a'" in str(ei.value)
    assert not (dst == payload("c")).all(), "c's bytes were handed out as a's"
    with pytest.raises(ObjectMissing, match="evicted"):
        reader.view(ha, 0, 4096)
    reader.release([ha])
    st = reader.stats()
    assert st["reads_of_evicted_objects"] == 2 and st["stale_views"] == 1


def test_an_open_past_a_full_lease_row_misses_only_the_keys_past_it(pools):
    """One open leasing more than a row holds (batched leases): the first ENTRIES keys are hits
    that read their object's exact bytes and pin it against eviction; the rest are misses."""
    from lw_core.backends.embedded.leases import ENTRIES

    reader, writer = pools(), pools()
    put(writer, ["a"])
    hs = reader.open(["a"] * (ENTRIES + 2))
    assert [h is not None for h in hs] == [True] * ENTRIES + [False, False]
    assert len({h._lease for h in hs[:ENTRIES]}) == ENTRIES
    assert reader.stats()["lease_row_full"] == 2
    dst = np.zeros(N, np.uint8)
    reader.read([hs[-3]], [0], [dst])
    assert (dst == payload("a")).all()
    for k in "bcde":  # the pool holds two objects: each new one's space comes from the last, never from leased a
        put(writer, [k])
    assert writer.lookup(["a"]) == 1 and writer.lookup(["d"]) == 0
    reader.release(hs[:ENTRIES])
    (h,) = reader.open(["a"])
    assert h is not None and reader.stats()["lease_row_full"] == 2
    reader.release([h])


def test_eviction_during_the_copy_is_caught_by_the_check_after_it(pools, monkeypatch):
    from lw_core.backend import ObjectMissing
    from lw_core.backends.embedded import object_reader as embedded  # the module whose numpy read() uses

    reader, writer = pools(lease_ttl_s=0.2), pools()
    put(writer, ["a", "b"])
    (ha,) = reader.open(["a"])
    time.sleep(0.3)
    writer.release(writer.open(["b"]))
    real = embedded.np

    class Hooked:  # numpy, except that wrapping the read's destination first lets a writer reuse a's space
        def __getattr__(self, name):
            return getattr(real, name)

        def frombuffer(self, *a, **kw):
            monkeypatch.setattr(embedded, "np", real)
            put(writer, ["c"])  # evicts "a" after read() checked it, before the bytes are copied
            return real.frombuffer(*a, **kw)

    monkeypatch.setattr(embedded, "np", Hooked())
    dst = np.zeros(N, np.uint8)  # N >= 1 MiB: read() copies through numpy
    with pytest.raises(ObjectMissing, match="evicted"):
        reader.read([ha], [0], [dst])
    assert writer.lookup(["a"]) == 0 and writer.lookup(["c"]) == 1
    assert (dst == payload("c")).all(), "test premise: the copy did read c's bytes"


def test_batch_read_names_only_the_evicted_object(pools):
    from lw_core.backend import ObjectMissing

    reader, writer = pools(lease_ttl_s=0.2), pools()
    put(writer, ["a", "b"])
    ha, hb = reader.open(["a", "b"])
    time.sleep(0.3)
    reader.lease_ttl_s = 60.0
    reader.release(reader.open(["b"]))  # b: read again (second chance); a: stale
    put(writer, ["c"])
    with pytest.raises(ObjectMissing) as ei:
        reader.read([ha, hb], [0, 0], [np.empty(N, np.uint8), np.empty(N, np.uint8)])
    assert "'a'" in str(ei.value) and "'b'" not in str(ei.value)
    out = np.empty(N, np.uint8)
    reader.read([hb], [0], [out])  # the pipeline retries item by item: b is intact
    np.testing.assert_array_equal(out, payload("b"))
    # view() renews b's expired lease: with c leased too, nothing may be evicted
    hc = writer.open(["c"])
    v = reader.view(hb, 0, 16)
    assert writer.reserve(["d"], N) == [None] and bytes(v) == payload("b")[:16].tobytes()
    del v
    reader.release([ha, hb])
    writer.release(hc)


def test_dead_readers_leases_are_reclaimed_at_once(pools, tmp_path):
    writer = pools(lease_ttl_s=60.0)
    put(writer, ["a", "b"])
    child = _spawn(tmp_path, "lease", ["a", "b"])
    try:
        assert writer.reserve(["c"], N) == [None], "a live reader's leases pin both objects"
        child.kill()
        child.wait(timeout=10)
        t0 = time.monotonic()
        while not all(hs := writer.reserve(["c", "d"], N)) and time.monotonic() - t0 < 5:
            writer.abort(hs)
            time.sleep(0.05)  # a "lives" verdict is reused for up to ALIVE_CACHE_S (1 s)
        assert all(hs), "a dead reader's leases pinned the pool for lease_ttl_s (60 s)"
        writer.abort(hs)
    finally:
        _end(child)


def test_dead_reader_in_another_pid_namespace_is_reclaimed_too(pools, tmp_path):
    """Its pid cannot be checked from here (containers sharing /dev/shm): its row lock can."""
    if subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "true"], capture_output=True).returncode:
        pytest.skip("cannot create a pid namespace here (unshare --pid needs root or user namespaces)")
    writer = pools(lease_ttl_s=60.0)
    put(writer, ["a", "b"])
    child = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, __file__, "lease", str(tmp_path / "p"), "a", "b"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        lt = writer._pool.leases
        rows = [r for r in range(len(lt.rows)) if lt.rows[r, 1] and r != lt.row]
        assert len(rows) == 1 and int(lt.rows[rows[0], 0]) != current_owner().pidns, "test premise: another namespace"
        assert writer.reserve(["c"], N) == [None]
        child.kill()  # unshare, and with it (--kill-child) the reader
        child.wait(timeout=10)
        t0 = time.monotonic()
        while not all(hs := writer.reserve(["c", "d"], N)) and time.monotonic() - t0 < 5:
            writer.abort(hs)
            time.sleep(0.05)
        assert all(hs), "a dead reader of another pid namespace pinned the pool for lease_ttl_s (60 s)"
        writer.abort(hs)
    finally:
        _end(child)


def test_reused_pid_does_not_keep_a_dead_readers_leases(pools):
    reader, writer = pools(), pools()
    put(writer, ["a", "b"])
    assert all(reader.open(["a", "b"]))
    assert writer.reserve(["c"], N) == [None]
    # The reader "died" and a new process got its pid: same pid, another start time.
    lt = reader._pool.leases
    lt.rows[lt.row, 2] = int(lt.rows[lt.row, 2]) + 12345
    hs = writer.reserve(["c", "d"], N)
    assert all(hs)
    writer.abort(hs)


def test_failed_eviction_transaction_leaves_the_object_readable(pools, monkeypatch):
    import lmdb

    from lw_core.backend import BackendError
    from lw_core.backends.embedded import txn as embedded

    b = pools()
    put(b, ["a", "b"])
    flush = embedded.Tx.flush

    def failing(self):
        monkeypatch.setattr(embedded.Tx, "flush", flush)
        raise lmdb.Error("injected")

    monkeypatch.setattr(embedded.Tx, "flush", failing)
    with pytest.raises(BackendError, match="injected"):
        b.reserve(["c"], N)  # evicts "a" inside a transaction that then fails
    assert b.lookup(["a", "b"]) == 2
    (h,) = b.open(["a"])
    assert h is not None, "the rolled-back eviction left 'a' unreadable"
    out = np.empty(N, np.uint8)
    b.read([h], [0], [out])
    np.testing.assert_array_equal(out, payload("a"))
    b.release([h])


def test_process_stopped_holding_the_writer_lock_does_not_stop_reads(pools, tmp_path):
    from lw_core.backend import BackendUnavailable

    b = pools(lock_timeout_s=1.0)
    put(b, ["a"])
    child = _spawn(tmp_path, "writer-lock", [])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert b.lookup(["a", "z"]) == 1
        (h,) = b.open(["a"])
        assert h is not None
        out = np.empty(N, np.uint8)
        b.read([h], [0], [out])
        np.testing.assert_array_equal(out, payload("a"))
        assert bytes(b.view(h, 0, 8)) == payload("a")[:8].tobytes()
        b.release([h])
        assert b.stats()["objects"] == 1
        assert time.monotonic() - t0 < 0.9, "a read waited for the stopped writer"
        with pytest.raises(BackendUnavailable, match="lock_timeout_s"):
            b.reserve(["w"], N)  # writers still wait, with a deadline
    finally:
        _end(child)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3:])
