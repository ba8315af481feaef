"""The streaming contract (lw_dev.streaming_contract.StreamingContract, as tests/core and tests/memcache
run) over MooncakeBackend(streaming=True) against a real master and holder on host B, the clients
on host A, plus what Mooncake adds: heads that do not verify are not used, reads only at published
ranges, head and segments removed after commit (a segment a reader leased, once the lease ends), a
killed writer failing its waiters promptly, and the refusal of publish without streaming.

The module's cluster has a 1 s read lease (``--default_kv_lease_ttl``) so a leased segment's
removal can be watched in a test."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from mc_cluster import freeze, start_cluster

from lw_core.backend import BackendError, BackendUnavailable, ObjectMissing, publish_layers, wait_layers
from lw_dev.streaming_contract import LB, NB, NL, StreamingContract, layer_bytes, read_layer, write_layer

# Slow tier: these tests need a Mooncake master and holder in network-namespace hosts.
pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
LEASE_MS = 1000


class TestStreamingContract(StreamingContract):
    """The whole contract over ``be``: the module's Mooncake client, emptied after each test."""


@pytest.fixture(scope="module")
def cluster(hosts):
    c = start_cluster(hosts, port=50131, lease_ttl_ms=LEASE_MS)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster, hosts):
    from lw_mooncake.backend import MooncakeBackend

    with hosts.entered("a"):
        b = MooncakeBackend(cluster.address, local_hostname=hosts.addr("a"), streaming=True)
    yield b
    b.close(timeout_s=5)


@pytest.fixture
def be(client):
    yield client
    # Objects of one test must not be seen by the next (force: reads lease objects for a while).
    assert client.store.remove_all(True) >= 0
    client.stream_writer.collector.clear()


def exists(be, keys: list[str]) -> list[int]:
    return list(be.store.batch_is_exist(keys))


def test_a_head_that_does_not_verify_is_not_used(be):
    from lw_core.backends.segment_stream import head_key
    from lw_mooncake.streaming import HEAD_SIZE

    (w,) = be.reserve(["k"], NB)
    (ok,) = be.open_streaming(["k"])
    assert ok is not None and ok.token is not None and ok.nbytes == NB
    from lw_core.procs import boot_id, current_owner
    from lw_mooncake.streaming import pack_head

    good = bytes(pack_head("k", ok.token, NB, boot_id(), current_owner()))
    other_key = bytes(pack_head("other", ok.token, NB, boot_id(), current_owner()))
    changed = good[:20] + bytes([good[20] ^ 1]) + good[21:]
    for bad in (other_key, bytes(HEAD_SIZE), changed, good[:-1]):
        assert be.store.remove(head_key("k"), True) == 0
        assert be.store.put(head_key("k"), bad) == 0
        assert be.open_streaming(["k"]) == [None]  # another key's head, zeros, a changed byte, short
    assert be.store.remove(head_key("k"), True) == 0
    assert be.store.put(head_key("k"), good) == 0
    (again,) = be.open_streaming(["k"])
    assert again is not None and again.token == ok.token  # the same bytes, put back, verify
    be.abort([w])


def test_reads_only_at_published_ranges(be):
    (w,) = be.reserve(["k"], NB)
    be.write([w], [0], [np.concatenate([layer_bytes(4, 0), layer_bytes(4, 1)])])  # one write range [0, 2 LB)
    publish_layers(be, [w], 1, LB)  # one segment
    (r,) = be.open_streaming(["k"])
    assert wait_layers(be, [r], 1, LB, 1.0) == [True]
    with pytest.raises(ObjectMissing, match="not one published range"):
        read_layer(be, r, 1)  # the segment ending there starts at 0: not these bytes
    out = np.empty(2 * LB, np.uint8)
    be.read([r], [0], [out])
    assert np.array_equal(out, np.concatenate([layer_bytes(4, 0), layer_bytes(4, 1)]))
    be.abort([w])


def test_commit_removes_head_and_segments_and_a_leased_segment_once_its_lease_ends(be):
    """Mooncake's master leases what a get or an exists call finds: such a segment's removal is
    refused until the lease ends, and is retried."""
    from lw_core.backends.segment_stream import head_key, seg_key

    (w,) = be.reserve(["k"], NB)
    token = be.stream_writer.stream("k").token
    (r,) = be.open_streaming(["k"])
    for layer in range(NL):
        write_layer(be, w, 6, layer)
        publish_layers(be, [w], layer, LB)
    segs = [seg_key("k", token, (layer + 1) * LB) for layer in range(NL)]
    assert be.stream_writer.stream("k").segs == segs  # one segment per written layer
    assert np.array_equal(read_layer(be, r, 2), layer_bytes(6, 2))  # leases layer 2's segment
    be.commit([w])
    assert be.stats()["stream_leftovers"] == 1  # the leased one, queued for removal
    assert exists(be, ["k", head_key("k"), segs[0], segs[1], segs[3]]) == [1, 0, 0, 0, 0]
    deadline = time.monotonic() + 10 * LEASE_MS / 1000
    while be.stats()["stream_leftovers"] and time.monotonic() < deadline:
        time.sleep(0.2)
        be.stream_writer.collect()  # what later publish/commit calls do
    assert be.stats()["stream_leftovers"] == 0 and exists(be, segs) == [0] * NL
    assert np.array_equal(read_layer(be, r, 2), layer_bytes(6, 2))  # the reader reads the object now


def test_abort_leaves_only_its_marker(be):
    from lw_core.backends.segment_stream import abort_key, head_key, seg_key

    (w,) = be.reserve(["k"], NB)
    token = be.stream_writer.stream("k").token
    write_layer(be, w, 2, 0)
    publish_layers(be, [w], 0, LB)
    be.abort([w])
    assert exists(be, ["k", head_key("k"), seg_key("k", token, LB), abort_key("k", token)]) == [0, 0, 0, 1]


def test_killed_writer_fails_waiters_promptly_and_leaves_nothing_visible(be, cluster, hosts):
    p = hosts.popen("b", [sys.executable, str(HERE / "mc_stream_writer.py"), cluster.address, hosts.addr("b"), "kw",
                          str(NL), str(LB)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("published"), line
        (r,) = be.open_streaming(["kw"])
        assert r is not None and wait_layers(be, [r], 0, LB, 1.0) == [True]
        from mc_stream_writer import content

        out = np.empty(LB, np.uint8)
        be.read([r], [0], [out])
        assert np.array_equal(out, content(NL * LB)[:LB])  # the writer's published bytes
        res: list = []
        t = threading.Thread(target=lambda: res.append((wait_layers(be, [r], 1, LB, 30.0), time.monotonic())))
        t.start()
        time.sleep(0.2)
        t_kill = time.monotonic()
        p.kill()
        p.wait(10)
        t.join(40)
        assert res and res[0][0] == [False]
        assert res[0][1] - t_kill < 3.0  # judged dead within a poll, not at the 30 s deadline
        assert be.lookup(["kw"]) == 0 and be.open(["kw"]) == [None]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_publish_without_streaming_names_the_switch(cluster, make_client):
    b = make_client(cluster)
    (w,) = b.reserve(["plain"], NB)
    with pytest.raises(BackendError, match="pd_streaming"):
        b.publish([w], LB)
    b.abort([w])
    assert b.open_streaming(["plain"]) == [None]  # the reader's calls work without streaming


def test_a_frozen_master_costs_one_deadline_not_one_per_layer(hosts, make_client):
    """A master that stops answering: the first publish waits out its deadline, then streaming's
    own calls (later publishes, the abort's marker and clean-up) are skipped at once instead of each
    costing a deadline in the save path."""
    c = start_cluster(hosts, port=50141)
    try:
        b = make_client(c, call_timeout_s=1.0, streaming=True)
        (w,) = b.reserve(["q"], NB)
        freeze(c.master)  # `ip netns exec` execs: this pid is the master
        try:
            t0 = time.monotonic()
            for layer in range(NL):
                write_layer(b, w, 1, layer)
                with pytest.raises(BackendUnavailable):
                    publish_layers(b, [w], layer, LB)
            assert time.monotonic() - t0 < 2.5, "every publish waited for its own deadline"
            t0 = time.monotonic()
            b.abort([w])
            assert time.monotonic() - t0 < 0.5
        finally:
            c.master.send_signal(signal.SIGCONT)
    finally:
        c.stop()
