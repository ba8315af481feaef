"""memcache streaming across processes, on a pool whose memory only the reader lends (so a freed
or orphaned reservation's space is handed out again at the same address, as asserted):

* a writer aborts; a second writer's reservation of the same key lands at the very address and
  publishes other bytes there: the first reservation's reader fails (promptly), it never gets the
  new bytes, which a fresh reader does get at that address;
* a writer is SIGKILLed after publishing layer 0: the reader got exactly that layer, its waiter
  fails within a poll (not at its 30 s deadline), nothing becomes visible to lookup/open, and the
  key's next writer (taking the orphan over at the same address) is never read through the old handle.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import numpy as np
import pytest
from mc_support import HAVE_MEMCACHE, ScriptProcess, needs_memcache

from lw_core.backend import ObjectMissing, wait_layers

pytestmark = [needs_memcache, pytest.mark.slow, pytest.mark.timeout(180)]

NL, LB = 4, 8192
NB = NL * LB

WRITER = f"""
import sys
import numpy as np
from lw_core.backend import publish_layers
from lw_memcache.backend import MemcacheBackend
b = MemcacheBackend(sys.argv[1], streaming=True, write_lease_ms=int(sys.argv[2]), full_wait_s=0)
seed = int(sys.argv[3])
h = None
print("ready", flush=True)
for line in sys.stdin:
    op, *a = line.split()
    if op == "reserve":
        (h,) = b.reserve([a[0]], {NB})
        print("ok", h is not None and h.gva, flush=True)
    elif op == "write":
        layer = int(a[0])
        b.write([h], [layer * {LB}], [np.random.default_rng(seed * 100 + layer).integers(0, 256, {LB}, dtype=np.uint8)])
        publish_layers(b, [h], layer, {LB})
        print("ok", flush=True)
    elif op in ("abort", "commit"):
        getattr(b, op)([h])
        print("ok", flush=True)
    elif op == "close":
        b.close()
        print("ok", flush=True)
        break
"""


def layer_bytes(seed: int, layer: int) -> np.ndarray:
    return np.random.default_rng(seed * 100 + layer).integers(0, 256, LB, dtype=np.uint8)


class Writer(ScriptProcess):
    def __init__(self, conf: str, seed: int, write_lease_ms: int = 30_000) -> None:
        super().__init__(WRITER, conf, str(write_lease_ms), str(seed))


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """One pool and one reader (this process, the only client lending memory, so every object is
    placed in it) for the module; writers lend none. Not a holder process: a client that imported
    another's memory leaves that address range behind in this process, and a later in-process
    client that lends memory (tests/memcache/test_memcache_inprocess.py) could not start."""
    if not HAVE_MEMCACHE:
        pytest.skip(needs_memcache.kwargs["reason"])
    from lw_memcache.backend import MemcacheBackend
    from lw_memcache.local import LocalMemcache

    m = LocalMemcache(dram_size="64MB", workdir=tmp_path_factory.mktemp("held") / "pool", stop_timeout_s=3)
    m.start()
    be = None
    try:
        # Short read leases: a lease on an object another client removed (a stale head taken over)
        # outlives its release in memcache-hybrid 1.3.0, and the client holding it waits for it
        # when it leaves.
        be = MemcacheBackend(str(m.local_conf), streaming=True, read_lease_ms=5000)
        writer_conf = m.workdir / "mmc-writer.conf"
        text = m.local_conf.read_text()
        assert re.search(r"^ock\.mmc\.local_service\.dram\.size\s*=", text, re.M), text
        writer_conf.write_text(re.sub(r"^(ock\.mmc\.local_service\.dram\.size\s*=).*$", r"\1 0", text, flags=re.M))
        yield writer_conf, be
    finally:
        if be is not None:
            be.close()
        m.stop()


@pytest.fixture
def held(pool):
    conf, be = pool
    writers: list[Writer] = []

    def writer(seed: int, **kw) -> Writer:
        writers.append(Writer(str(conf), seed, **kw))
        return writers[-1]

    try:
        yield be, writer
    finally:
        threads = [threading.Thread(target=w.stop) for w in writers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)


def gva_of(be, key: str) -> int:
    info = be.client.store.batch_get_key_info([key], 0)[0]
    return int(info.gva_list()[0]) if info.size() else 0


def read_layer(be, h, layer: int) -> np.ndarray:
    out = np.empty(LB, np.uint8)
    be.read([h], [layer * LB], [out])
    return out


def test_abort_then_a_new_reservation_at_the_same_address_is_never_read_through_the_old_handle(held):
    be, writer = held
    w1 = writer(1, write_lease_ms=300)  # its aborted space is free again once the lease ends
    g1 = int(w1.do("reserve k1").split()[1])
    w1.do("write 0")
    (old,) = be.open_streaming(["k1"])
    assert wait_layers(be, [old], 0, LB, 5.0) == [True]
    assert np.array_equal(read_layer(be, old, 0), layer_bytes(1, 0))
    res: list = []
    t = threading.Thread(target=lambda: res.append((wait_layers(be, [old], 1, LB, 20.0), time.monotonic())))
    t.start()
    time.sleep(0.2)
    t_abort = time.monotonic()
    w1.do("abort")
    t.join(15)
    assert res and res[0][0] == [False] and res[0][1] - t_abort < 2.0  # prompt, not at the deadline
    time.sleep(0.5)
    w2 = writer(2)
    assert int(w2.do("reserve k1").split()[1]) == g1 == gva_of(be, "k1")  # the premise: the same space
    for layer in range(NL):
        w2.do(f"write {layer}")
    (new,) = be.open_streaming(["k1"])  # the bytes now at that address are the second writer's
    assert wait_layers(be, [new], NL - 1, LB, 5.0) == [True]
    assert np.array_equal(read_layer(be, new, 1), layer_bytes(2, 1))
    # The old handle: never ready, never reads (not even the layer it read before the abort).
    assert wait_layers(be, [old], 0, LB, 0.5) == [False]
    for layer in range(NL):
        with pytest.raises(ObjectMissing):
            read_layer(be, old, layer)
    w2.do("commit")
    assert be.lookup(["k1"]) == 1
    assert wait_layers(be, [old], NL - 1, LB, 0.5) == [False]
    with pytest.raises(ObjectMissing):
        read_layer(be, old, 1)
    assert np.array_equal(read_layer(be, new, 3), layer_bytes(2, 3))  # through the committed object now
    be.release([new, old])


def test_killed_writer_fails_waiters_promptly_and_its_key_is_taken_over_safely(held):
    be, writer = held
    w1 = writer(1, write_lease_ms=2000)  # the reader, holding its memory, waits this long at close
    g1 = int(w1.do("reserve k2").split()[1])
    w1.do("write 0")
    (old,) = be.open_streaming(["k2"])
    assert wait_layers(be, [old], 0, LB, 5.0) == [True]
    assert np.array_equal(read_layer(be, old, 0), layer_bytes(1, 0))
    res: list = []
    t = threading.Thread(target=lambda: res.append((wait_layers(be, [old], 1, LB, 30.0), time.monotonic())))
    t.start()
    time.sleep(0.3)
    assert not res  # the writer lives: the waiter waits
    t_kill = time.monotonic()
    os.kill(w1.p.pid, signal.SIGKILL)
    w1.p.wait(10)
    t.join(20)
    assert res and res[0][0] == [False] and res[0][1] - t_kill < 3.0  # judged dead, far before 30 s
    assert be.lookup(["k2"]) == 0 and be.open(["k2"]) == [None]  # never complete, never visible
    (again,) = be.open_streaming(["k2"])  # its head outlives it; the handle fails at once
    t0 = time.monotonic()
    assert again is None or wait_layers(be, [again], 1, LB, 20.0) == [False]
    assert time.monotonic() - t0 < 3.0
    # The orphan (unfinished, in the reader's memory) is taken over by the next writer once it has
    # watched it unfinished for longer than its write lease (sightings less than a lease apart):
    # at the same address.
    w2 = writer(2, write_lease_ms=200)
    deadline = time.monotonic() + 20
    got = "ok False"
    while got == "ok False" and time.monotonic() < deadline:
        got = w2.do("reserve k2")
        time.sleep(0.05)
    assert int(got.split()[1]) == g1
    for layer in range(NL):
        w2.do(f"write {layer}")
    w2.do("commit")
    assert be.lookup(["k2"]) == 1
    assert wait_layers(be, [old], NL - 1, LB, 0.5) == [False]
    for layer in range(NL):
        with pytest.raises(ObjectMissing):
            read_layer(be, old, layer)
    (h,) = be.open(["k2"])
    out = np.empty(LB, np.uint8)
    be.read([h], [2 * LB], [out])
    assert np.array_equal(out, layer_bytes(2, 2))
    be.release([h])
