"""The optional streaming extension (lw_core.backend: publish / open_streaming / wait_published):
lw_dev.streaming_contract over every in-core backend that offers it (in-process MemoryBackend and the
embedded pool; tests/memcache runs the same contract on memcache). A writer killed mid-chunk
(another process) is in test_streaming_embedded_procs.py."""

from __future__ import annotations

import threading
import time

import pytest

from lw_core.backend import wait_layers
from lw_core.backends import embedded, memory
from lw_dev.streaming_contract import LB, NB, StreamingContract

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["memory", "embedded"])
def be(request, pool_path):
    b = memory.MemoryBackend(capacity_bytes=16 << 20) if request.param == "memory" else embedded.EmbeddedBackend(pool_path, capacity_bytes=16 << 20)
    yield b
    b.close()


class TestStreamingContract(StreamingContract):
    """The whole contract over ``be``: memory and embedded."""


def test_memory_close_ends_a_waiter_before_its_deadline():
    b = memory.MemoryBackend(capacity_bytes=1 << 20)
    b.reserve(["k"], NB)
    (r,) = b.open_streaming(["k"])
    res: list = []

    def wait() -> None:
        try:
            res.append(wait_layers(b, [r], 0, LB, 20.0))
        except Exception as e:  # noqa: BLE001 - what ended the wait is the result
            res.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    b.close()
    t.join(5)
    assert not t.is_alive() and res and not res[0] == [True]
