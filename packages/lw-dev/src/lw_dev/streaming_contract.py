"""The streaming extension's contract (lw_core.backend: publish / open_streaming / wait_published):
the base class ``StreamingContract``, whose pytest tests take a fixture ``be``, a fresh backend with
streaming. A test module subclasses it and defines ``be`` (tests/core: memory and embedded;
tests/memcache: memcache; tests/mooncake: Mooncake), so every backend runs every test."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lw_core.backend import ObjectMissing, publish_layers, supports_streaming, wait_layers

NL, LB = 4, 8192  # layers per object, bytes per layer (objects are layer-major)
NB = NL * LB


def layer_bytes(seed: int, layer: int) -> np.ndarray:
    return np.random.default_rng(seed * 100 + layer).integers(0, 256, LB, dtype=np.uint8)


def write_layer(be, h, seed: int, layer: int) -> None:
    be.write([h], [layer * LB], [layer_bytes(seed, layer)])


def read_layer(be, h, layer: int) -> np.ndarray:
    out = np.empty(LB, np.uint8)
    be.read([h], [layer * LB], [out])
    return out


class StreamingContract:
    """The contract's tests. A test module subclasses it (``class TestStreamingContract(StreamingContract)``)
    and defines the fixture ``be``: a fresh backend with streaming for each test."""

    def test_supports_streaming(self, be):
        assert supports_streaming(be)
        assert not supports_streaming(object())

    def test_layers_become_readable_in_order_with_the_published_bytes(self, be):
        (w,) = be.reserve(["k"], NB)
        (r,) = be.open_streaming(["k"])
        assert r is not None and be.view(r, 0, LB) is None  # no zero-copy window without a lease
        assert wait_layers(be, [r], 0, LB, 0) == [False]
        for layer in range(NL):
            write_layer(be, w, 7, layer)
            publish_layers(be, [w], layer, LB)
            assert wait_layers(be, [r], layer, LB, 1.0) == [True]
            assert np.array_equal(read_layer(be, r, layer), layer_bytes(7, layer))
            if layer + 1 < NL:
                assert wait_layers(be, [r], layer + 1, LB, 0) == [False]
                with pytest.raises(ObjectMissing):  # never bytes beyond the published prefix
                    read_layer(be, r, layer + 1)
        publish_layers(be, [w], 0, LB)  # a smaller prefix is a no-op, not a retraction
        assert wait_layers(be, [r], NL - 1, LB, 0) == [True]
        be.commit([w])
        assert wait_layers(be, [r], NL - 1, LB, 0) == [True]
        assert np.array_equal(read_layer(be, r, NL - 1), layer_bytes(7, NL - 1))
        be.release([r])

    def test_published_is_not_visible_to_lookup_or_open_until_commit(self, be):
        (w,) = be.reserve(["k"], NB)
        for layer in range(NL):
            write_layer(be, w, 1, layer)
        publish_layers(be, [w], NL - 1, LB)  # every layer published, still not committed
        assert be.lookup(["k"]) == 0 and be.open(["k"]) == [None]
        assert be.reserve(["k"], NB) == [None]  # write-once holds while streaming
        be.commit([w])
        assert be.lookup(["k"]) == 1
        (h,) = be.open(["k"])
        assert h is not None
        be.release([h])
        (s,) = be.open_streaming(["k"])  # a streaming handle on a committed object reads all of it
        assert wait_layers(be, [s], NL - 1, LB, 0) == [True]
        assert np.array_equal(read_layer(be, s, 2), layer_bytes(1, 2))
        assert be.open_streaming(["nothing"]) == [None]

    def test_waiter_times_out_at_its_deadline(self, be):
        (w,) = be.reserve(["k"], NB)
        (r,) = be.open_streaming(["k"])
        t0 = time.monotonic()
        assert wait_layers(be, [r], 0, LB, 0.3) == [False]
        assert 0.3 <= time.monotonic() - t0 < 3.0
        be.abort([w])

    def test_concurrent_writer_and_waiting_reader(self, be):
        (w,) = be.reserve(["k"], NB)
        (r,) = be.open_streaming(["k"])
        got: list = []

        def reader() -> None:
            for layer in range(NL):
                ok = wait_layers(be, [r], layer, LB, 10.0)
                got.append((ok, read_layer(be, r, layer) if ok == [True] else None))

        t = threading.Thread(target=reader)
        t.start()
        for layer in range(NL):
            time.sleep(0.02)
            write_layer(be, w, 3, layer)
            publish_layers(be, [w], layer, LB)
        t.join(15)
        assert not t.is_alive()
        assert [ok for ok, _ in got] == [[True]] * NL
        for layer, (_, data) in enumerate(got):
            assert np.array_equal(data, layer_bytes(3, layer))
        be.commit([w])

    def test_abort_fails_waiters_promptly_and_leaves_nothing(self, be):
        (w,) = be.reserve(["k"], NB)
        write_layer(be, w, 5, 0)
        publish_layers(be, [w], 0, LB)
        (r,) = be.open_streaming(["k"])
        res: list = []
        t = threading.Thread(target=lambda: res.append((wait_layers(be, [r], 1, LB, 20.0), time.monotonic())))
        t.start()
        time.sleep(0.1)
        t_abort = time.monotonic()
        be.abort([w])
        t.join(15)
        assert not t.is_alive() and res[0][0] == [False]
        assert res[0][1] - t_abort < 2.0  # prompt, far before the 20 s deadline
        assert wait_layers(be, [r], 0, LB, 0) == [False]  # even the published layer is gone
        with pytest.raises(ObjectMissing):
            read_layer(be, r, 0)
        assert be.lookup(["k"]) == 0 and be.open(["k"]) == [None]
        with pytest.raises(ObjectMissing):
            be.commit([w])  # an aborted chunk never becomes complete
        assert be.lookup(["k"]) == 0

    def test_reader_never_gets_a_layer_of_a_later_reservation_of_the_same_key(self, be):
        (a,) = be.reserve(["k"], NB)
        write_layer(be, a, 1, 0)
        publish_layers(be, [a], 0, LB)
        (ra,) = be.open_streaming(["k"])
        be.abort([a])
        (b,) = be.reserve(["k"], NB)  # the embedded pool may give it the very same space
        assert b is not None
        for layer in range(NL):
            write_layer(be, b, 2, layer)
        publish_layers(be, [b], NL - 1, LB)
        assert wait_layers(be, [ra], 0, LB, 0.2) == [False]
        with pytest.raises(ObjectMissing):
            read_layer(be, ra, 0)
        (rb,) = be.open_streaming(["k"])
        assert wait_layers(be, [rb], NL - 1, LB, 0) == [True]
        assert np.array_equal(read_layer(be, rb, 0), layer_bytes(2, 0))
        be.commit([b])
        with pytest.raises(ObjectMissing):
            read_layer(be, ra, 0)

    def test_bad_arguments_name_the_field(self, be):
        (w,) = be.reserve(["k"], NB)
        (r,) = be.open_streaming(["k"])
        with pytest.raises(ValueError, match="upto"):
            be.publish([w], NB + 1)
        with pytest.raises(ValueError, match="upto_layer"):
            publish_layers(be, [w], -1, LB)
        with pytest.raises(ValueError, match="layer_nbytes"):
            wait_layers(be, [r], 0, 0, 1.0)
        with pytest.raises(ValueError, match="timeout_s"):
            be.wait_published([r], 0, -1.0)
        with pytest.raises(Exception, match="reserve"):
            be.publish([r], 0)  # a reader cannot publish
        be.abort([w])
        with pytest.raises(ObjectMissing):
            be.publish([w], LB)
