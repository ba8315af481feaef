"""Faults with a real Mooncake cluster in namespace hosts: master killed (misses, no hang, hits
again after a restart -- Mooncake loses its objects with the master), holder killed, master
frozen (every call returns by its deadline), putter killed mid-chunk (nothing partial visible)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mc_cluster import freeze, start_cluster
from mc_putter import content

from lw_core.backend import BackendError, BackendUnavailable

# Slow tier: these tests need a Mooncake master and holder in network-namespace hosts.
pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
MiB = 1 << 20


def put(b, key: str, data: bytes) -> None:
    (h,) = b.reserve([key], len(data))
    if h is None:  # with put sessions the master answers at reserve: no room means None
        raise BackendError(f"reserve of {key!r}: None (stored, being written, or no room)")
    b.write([h], [0], [data])
    b.commit([h])


def read_all(b, key: str) -> bytes | None:
    (h,) = b.open([key])
    if h is None:
        return None
    out = bytearray(h.nbytes)
    b.read([h], [0], [out])
    return bytes(out)


def wait_for(pred, timeout_s: float, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            v = pred()
        except BackendError:
            v = None
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval_s)


def test_master_killed_misses_fast_then_hits_after_restart(hosts, make_client):
    c = start_cluster(hosts, port=50061)
    try:
        a, b = make_client(c, call_timeout_s=2.0), make_client(c, call_timeout_s=2.0)
        put(a, "m1", b"x" * 4096)
        assert b.lookup(["m1"]) == 1
        c.kill_master()
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable):
            b.lookup(["m1"])
        with pytest.raises(BackendError):
            a.reserve(["m2"], 4096)
        assert time.monotonic() - t0 < 5.0  # failed fast: the pipeline recomputes instead of waiting
        c.start_master()
        # The old objects are gone with the master; the holder and clients re-register on their own.
        assert wait_for(lambda: b.lookup(["m1"]) == 0, 30.0)
        assert wait_for(lambda: (put(a, "m3", b"y" * 4096), True)[1], 30.0)
        assert read_all(b, "m3") == b"y" * 4096
    finally:
        c.stop()


def test_holder_killed_objects_are_misses_not_errors_or_hangs(hosts, make_client):
    c = start_cluster(hosts, port=50071)
    try:
        a, b = make_client(c), make_client(c)
        put(a, "h1", b"z" * 8192)
        assert read_all(b, "h1") == b"z" * 8192
        c.kill_holder()
        # Once the master notices (client_ttl) the holder's segment and its objects are dropped.
        assert wait_for(lambda: b.lookup(["h1"]) == 0, 30.0)
        assert b.open(["h1"]) == [None]
        with pytest.raises(BackendError, match="NO_AVAILABLE_HANDLE|room"):
            put(a, "h2", b"w" * 4096)  # nobody lends memory now
        c.start_holder()
        assert wait_for(lambda: (put(a, "h3", b"v" * 4096), True)[1], 30.0)
        assert read_all(b, "h3") == b"v" * 4096
    finally:
        c.stop()


def test_frozen_master_every_call_returns_by_its_deadline(hosts, make_client):
    c = start_cluster(hosts, port=50081)
    try:
        a = make_client(c, call_timeout_s=1.0)
        put(a, "f1", b"f" * 4096)
        freeze(c.master)  # `ip netns exec` execs: this pid is the master
        try:
            for call in (lambda: a.lookup(["f1"]), lambda: a.open(["f1"]), lambda: a.reserve(["f2"], 4096)):
                t0 = time.monotonic()
                with pytest.raises(BackendError):
                    call()
                assert time.monotonic() - t0 < 3.0
        finally:
            c.master.send_signal(signal.SIGCONT)
    finally:
        c.stop()


def test_putter_killed_mid_chunk_leaves_nothing_partial(hosts, make_client):
    c = start_cluster(hosts, port=50091, segment=256 * MiB)
    nbytes = 8 * MiB
    p = hosts.popen("b", [sys.executable, str(HERE / "mc_putter.py"), c.address, hosts.addr("b"), str(nbytes)],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        done: list[int] = []
        threading.Thread(target=lambda: [done.append(int(line.split()[1])) for line in p.stdout], daemon=True).start()
        assert wait_for(lambda: len(done) >= 3, 60.0), "the putter never committed"
        p.send_signal(signal.SIGKILL)  # somewhere in the next reserve/write/put
        p.wait(10)
        b = make_client(c)
        last = done[-1]
        keys = [f"p{i}" for i in range(last + 3)]
        visible = [k for k in keys if b.lookup([k]) == 1]
        assert set(keys[: last + 1]) <= set(visible)  # everything it reported committed is there
        for k in visible:  # and whatever is visible is whole
            assert read_all(b, k) == content(int(k[1:]), nbytes).tobytes(), k
    finally:
        if p.poll() is None:
            p.kill()
        c.stop()
