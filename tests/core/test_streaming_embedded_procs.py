"""Streaming across processes on the embedded pool: a writer in another process publishes layer 0
of a chunk and is SIGKILLed; the reader sees exactly the published bytes, its waiters fail
promptly (not at their deadline), and nothing of the chunk becomes visible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from lw_core.backend import ObjectMissing, wait_layers
from lw_core.backends.embedded import EmbeddedBackend

pytestmark = pytest.mark.timeout(60)

NL, LB, CAP = 4, 8192, 16 << 20

WRITER = f"""
import sys, time
import numpy as np
from lw_core.backend import publish_layers
from lw_core.backends.embedded import EmbeddedBackend
b = EmbeddedBackend(sys.argv[1], capacity_bytes={CAP})
(h,) = b.reserve(["chunk"], {NL} * {LB})
b.write([h], [0], [np.random.default_rng(11).integers(0, 256, {LB}, dtype=np.uint8)])
publish_layers(b, [h], 0, {LB})
print("published", flush=True)
time.sleep(120)
"""


@pytest.fixture
def writer(pool_path):
    be = EmbeddedBackend(pool_path, capacity_bytes=CAP)  # create the pool before the writer opens it
    p = subprocess.Popen([sys.executable, "-c", WRITER, pool_path], stdout=subprocess.PIPE, text=True)
    try:
        line = [""]
        t = threading.Thread(target=lambda: line.__setitem__(0, p.stdout.readline()), daemon=True)
        t.start()
        t.join(30)
        assert line[0].strip() == "published", f"writer did not publish (rc={p.poll()})"
        yield be, p
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        p.stdout.close()
        be.close()


def test_killed_writer_leaves_nothing_and_fails_waiters_promptly(writer):
    be, p = writer
    assert list(be.open_reservations().values()) == [("chunk", LB, NL * LB)]  # the other process's, layer 0 out
    (r,) = be.open_streaming(["chunk"])
    assert r is not None
    assert wait_layers(be, [r], 0, LB, 5.0) == [True]
    out = np.empty(LB, np.uint8)
    be.read([r], [0], [out])
    assert np.array_equal(out, np.random.default_rng(11).integers(0, 256, LB, dtype=np.uint8))
    assert be.lookup(["chunk"]) == 0 and be.open(["chunk"]) == [None]
    res: list = []
    t = threading.Thread(target=lambda: res.append((wait_layers(be, [r], 1, LB, 30.0), time.monotonic())))
    t.start()
    time.sleep(0.2)
    assert not res  # the writer lives: the waiter waits
    t_kill = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    t.join(20)
    assert not t.is_alive() and res[0][0] == [False]
    assert res[0][1] - t_kill < 3.0  # judged dead by liveness, far before the 30 s deadline
    assert be.lookup(["chunk"]) == 0 and be.open(["chunk"]) == [None]
    # The dead writer's reservation is reclaimed: the key can be written again, and the old
    # streaming handle never reads the new reservation's bytes.
    (w,) = be.reserve(["chunk"], NL * LB)
    assert w is not None
    be.write([w], [0], [np.zeros(NL * LB, np.uint8)])
    be.publish([w], NL * LB)
    assert list(be.open_reservations().values()) == [("chunk", NL * LB, NL * LB)]  # only the new one
    assert wait_layers(be, [r], 0, LB, 0) == [False]
    with pytest.raises(ObjectMissing):
        be.read([r], [0], [out])
    be.commit([w])
    assert be.lookup(["chunk"]) == 1 and be.open_reservations() == {}
    be.verify()
