"""The streaming contract (lw_dev.streaming_contract.StreamingContract, as tests/core runs it) over
MemcacheBackend(streaming=True) on a real MetaService, plus what memcache adds: reads never come from an address alone (tests/memcache/test_memcache_stream_reuse.py has
the reuse of an aborted reservation's address by another writer)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from mc_support import HAVE_MEMCACHE, needs_memcache

from lw_core.backend import BackendError, ObjectMissing, publish_layers, wait_layers
from lw_core.backends.segment_stream import head_key, seg_key

# The contract, unchanged: TestStreamingContract runs its tests on the fixture ``be`` below.
from lw_dev import streaming_contract
from lw_dev.streaming_contract import LB, NB, NL, StreamingContract

pytestmark = [needs_memcache, pytest.mark.slow, pytest.mark.timeout(120)]


class TestStreamingContract(StreamingContract):
    """The whole contract over ``be``: one key space per test on the module's memcache client."""


_KEYED = ("lookup", "reserve", "open", "open_streaming")
_n = itertools.count()


class Prefixed:
    """One memcache client serves the module (one per process, seconds to close): each test gets
    its own key space, so the contract's fixed key names do not meet earlier tests' objects."""

    def __init__(self, backend, prefix: str) -> None:
        self._b, self._p = backend, prefix

    def __getattr__(self, name):
        f = getattr(self._b, name)
        if name in _KEYED:
            return lambda keys, *a, **kw: f([self._p + k for k in keys], *a, **kw)
        return f


@pytest.fixture(scope="module")
def mc(tmp_path_factory):
    if not HAVE_MEMCACHE:
        pytest.skip(needs_memcache.kwargs["reason"])
    from lw_memcache.backend import MemcacheBackend
    from lw_memcache.local import LocalMemcache

    m = LocalMemcache(dram_size="64MB", workdir=tmp_path_factory.mktemp("mcpool") / "pool", stop_timeout_s=3)
    m.start()
    b = None
    try:
        b = MemcacheBackend(str(m.client_conf), streaming=True)
        yield b
    finally:
        if b is not None:
            b.close()
        m.stop()


@pytest.fixture
def be(mc):
    return Prefixed(mc, f"t{next(_n)}/")


def test_streaming_reads_never_touch_an_unfinished_object(be):
    """The reservation itself is never read before commit (memcache refuses it anyway): published
    layers come from committed segment objects named by the reservation's token."""
    (w,) = be.reserve(["k"], NB)
    (r,) = be.open_streaming(["k"])
    assert r.token is not None and not r.leased
    streaming_contract.write_layer(be, w, 4, 0)
    publish_layers(be, [w], 0, LB)
    assert wait_layers(be, [r], 0, LB, 1.0) == [True]
    assert np.array_equal(streaming_contract.read_layer(be, r, 0), streaming_contract.layer_bytes(4, 0))
    with pytest.raises(ObjectMissing, match="write ranges"):  # half a layer: not a range the writer wrote
        be.read([r], [0], [np.empty(LB // 2, np.uint8)])
    be.commit([w])
    # The segment outlives the commit by a grace (REMOVE_GRACE_S): a read now may still come from it.
    assert np.array_equal(streaming_contract.read_layer(be, r, 0), streaming_contract.layer_bytes(4, 0))
    assert wait_layers(be, [r], 0, LB, 1.0) == [True]
    assert r.leased  # the next wait switched to the committed object, after checking its token
    assert np.array_equal(streaming_contract.read_layer(be, r, 0), streaming_contract.layer_bytes(4, 0))
    be.release([r])


def test_publish_without_streaming_names_the_switch(mc):
    mc.stream_writer.enabled = False
    try:
        be = Prefixed(mc, "nostream/")
        (w,) = be.reserve(["k"], NB)
        with pytest.raises(BackendError, match="pd_streaming=true"):
            be.publish([w], LB)
        be.abort([w])
    finally:
        mc.stream_writer.enabled = True


def test_from_config_follows_pd_streaming():
    from types import SimpleNamespace

    from lw_memcache.backend import MemcacheBackend

    seen = {}

    class Probe(MemcacheBackend):
        def __init__(self, path, **kw):
            seen.update(kw)

    keys = SimpleNamespace(memcache_config_path="/x", memcache_protocol="host_shm", memcache_write_lease_s=None)
    for on in (True, False):
        Probe.from_config(SimpleNamespace(save_timeout_s=5.0, layer_wait_timeout_s=5.0, backend_keys=keys, pd_streaming=on))
        assert seen["streaming"] is on
    # A reservation must outlive a long forward pass (a CPU prefill step can take tens of seconds).
    assert seen["write_lease_ms"] == 120_000
    Probe.from_config(SimpleNamespace(save_timeout_s=60.0, layer_wait_timeout_s=5.0, backend_keys=keys))
    assert seen["write_lease_ms"] == 240_000
    keys.memcache_write_lease_s = 7.5
    Probe.from_config(SimpleNamespace(save_timeout_s=5.0, layer_wait_timeout_s=5.0, backend_keys=keys))
    assert seen["write_lease_ms"] == 7500


def test_a_released_handle_on_a_committed_object_reads_nothing(be):
    (w,) = be.reserve(["k"], NB)
    for layer in range(NL):
        streaming_contract.write_layer(be, w, 6, layer)
    be.commit([w])
    (r,) = be.open_streaming(["k"])
    assert r.leased and wait_layers(be, [r], NL - 1, LB, 0) == [True]
    be.release([r])  # the lease that pinned the object is gone: so is the handle
    assert wait_layers(be, [r], 0, LB, 0) == [False]
    with pytest.raises(ObjectMissing):
        streaming_contract.read_layer(be, r, 0)


class _StoreHook:
    """The memcache client, with ``batch_get_key_info`` (called by a streaming read between its
    lease on a segment and the copy) running ``hook`` once, after it answered."""

    def __init__(self, store, hook) -> None:
        self._s, self._hook = store, hook

    def batch_get_key_info(self, *a, **kw):
        out = self._s.batch_get_key_info(*a, **kw)
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()
        return out

    def __getattr__(self, name):
        return getattr(self._s, name)


def test_a_segment_removed_between_its_lease_and_the_copy_is_read_from_the_committed_object(mc, be):
    """The writer commits (and removes its segments, leased or not) while a reader holds a lease
    on one: the copy from the segment fails, and the reader reads the committed object instead
    (seen as a -3102 read failure, then a recompute, in about 4 % of streamed reservations)."""
    (w,) = be.reserve(["k"], NB)
    for layer in range(NL):
        streaming_contract.write_layer(be, w, 9, layer)
    publish_layers(be, [w], NL - 1, LB)
    (r,) = be.open_streaming(["k"])
    assert wait_layers(be, [r], 1, LB, 1.0) == [True]
    real = mc.client.store
    mc.client.store = _StoreHook(real, lambda: be.commit([w]))
    try:
        assert np.array_equal(streaming_contract.read_layer(be, r, 1), streaming_contract.layer_bytes(9, 1))
    finally:
        mc.client.store = real
    assert be.lookup(["k"]) == 1


def _exists(mc, names) -> list[int]:
    return list(mc.client.store.batch_is_exist(list(names)))


def test_a_lease_taken_just_before_the_commit_is_released_cleanly(mc, be):
    """The writer removes its head and segments only a grace after the commit: a reader that
    leased one for a copy just before releases it while it still exists. (memcache removes leased
    objects too, and a lease on a removed object outlives its release: that client could then lease
    nothing placed at that address again, so a later prompt's head or segment there failed to
    stream and was recomputed: 'failed to register gva interval' in the decoder's log.)"""
    grace, mc.stream_writer.reaper.grace_s = mc.stream_writer.reaper.grace_s, 0.5
    try:
        (w,) = be.reserve(["k"], NB)
        streaming_contract.write_layer(be, w, 3, 0)
        publish_layers(be, [w], 0, LB)
        (r,) = be.open_streaming(["k"])
        assert r.token is not None
        key = be._p + "k"
        names = [head_key(key), seg_key(key, r.token, LB)]
        assert list(mc.client.store.batch_add_lease(names, 5000)) == [0, 0]  # a reader mid-copy
        be.commit([w])
        assert _exists(mc, names) == [1, 1]  # not removed under the reader
        assert mc.client.store.batch_remove_lease(names) == 0
        deadline = time.monotonic() + 5
        while _exists(mc, names) != [0, 0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _exists(mc, names) == [0, 0], "the head and the segment were never removed"
        assert be.lookup(["k"]) == 1
    finally:
        mc.stream_writer.reaper.grace_s = grace


def test_a_head_removed_between_its_lease_and_the_copy_is_no_error(mc, be):
    """open_streaming races a head's removal (memcache removes leased objects): no exception; the
    key is simply not open yet (the receive tries again), and once committed it opens leased."""
    (w,) = be.reserve(["k"], NB)
    real = mc.client.store
    mc.client.store = _StoreHook(real, lambda: real.remove_batch([head_key(be._p + "k")]))
    try:
        assert be.open_streaming(["k"]) == [None]
    finally:
        mc.client.store = real
    for layer in range(NL):
        streaming_contract.write_layer(be, w, 5, layer)
    be.commit([w])
    (r,) = be.open_streaming(["k"])
    assert r is not None and r.leased
    assert np.array_equal(streaming_contract.read_layer(be, r, 2), streaming_contract.layer_bytes(5, 2))
    be.release([r])
