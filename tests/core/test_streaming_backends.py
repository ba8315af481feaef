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
from lw_dev import streaming_contract
from lw_dev.streaming_contract import (  # noqa: F401  (pytest collects the contract's tests here)
    LB,
    NB,
    test_supports_streaming,
    test_layers_become_readable_in_order_with_the_published_bytes,
    test_published_is_not_visible_to_lookup_or_open_until_commit,
    test_waiter_times_out_at_its_deadline,
    test_concurrent_writer_and_waiting_reader,
    test_abort_fails_waiters_promptly_and_leaves_nothing,
    test_reader_never_gets_a_layer_of_a_later_reservation_of_the_same_key,
    test_bad_arguments_name_the_field,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["memory", "embedded"])
def be(request, pool_path):
    b = memory.MemoryBackend(capacity_bytes=16 << 20) if request.param == "memory" else embedded.EmbeddedBackend(pool_path, capacity_bytes=16 << 20)
    yield b
    b.close()


def test_this_module_runs_the_whole_contract():
    assert all(name in globals() for name in streaming_contract.TESTS), streaming_contract.TESTS


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
