"""``mooncake_load``: which opens fetch whole objects ("auto" chooses by size), what a whole fetch
hands out, and a whole fetch past its deadline; per-layer reads lent from the get arena; ``mooncake_prefer_local_segment``: a client that
lends a segment puts into it first (its own hits are then Mooncake's local memcpy). Against a real master and holder on host B, the
client on host A (every byte crosses the hosts' link)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lw_core.backend import BackendUnavailable
from lw_mooncake.plugin import MooncakeKeys

pytestmark = pytest.mark.slow

KiB, MiB = 1 << 10, 1 << 20


def _put(b, keys: list[str], nbytes: int, seed: int) -> dict[str, np.ndarray]:
    """Objects of ``nbytes`` random bytes each, written and committed by ``b``; their bytes."""
    rng = np.random.default_rng(seed)
    data = {k: rng.integers(0, 256, nbytes, dtype=np.uint8) for k in keys}
    hs = b.reserve(keys, nbytes)
    assert all(h is not None for h in hs)
    b.write(hs, [0] * len(keys), [data[k] for k in keys])
    b.commit(hs)
    return data


def test_default_load_is_auto_with_a_bound_in_bytes():
    k = MooncakeKeys(mooncake_master="h:1")
    assert k.mooncake_load == "auto" and k.mooncake_whole_max_bytes == 256 * MiB


def test_auto_fetches_opens_within_the_bound_whole_and_larger_ones_per_layer(cluster, make_client):
    b = make_client(cluster, load="auto", whole_max_bytes=192 * KiB)
    try:
        data = _put(b, ["a0", "a1", "a2", "a3"], 64 * KiB, seed=1)
        # 128 KiB <= 192 KiB: open fetches both objects whole, views serve them (no read call)
        before = b.stats().get("bytes_read", 0)
        hs = b.open(["a0", "a1"])
        assert b.stats()["bytes_read"] - before == 128 * KiB  # fetched at open
        for k, h in zip(["a0", "a1"], hs):
            v = b.view(h, 4 * KiB, 8 * KiB)
            assert v is not None and v.readonly and bytes(v) == data[k][4 * KiB : 12 * KiB].tobytes()
        b.release(hs)
        assert all(b.view(h, 0, 1) is None for h in hs)  # release dropped the copies
        # 256 KiB > 192 KiB: per layer (nothing fetched at open; reads are ranged gets)
        before = b.stats()["bytes_read"]
        hs = b.open(["a0", "a1", "a2", "a3"])
        assert b.stats()["bytes_read"] == before and all(b.view(h, 0, 16) is None for h in hs)
        dsts = [np.zeros(16 * KiB, np.uint8) for _ in hs]
        b.read(hs, [32 * KiB] * 4, dsts)
        assert b.stats()["bytes_read"] - before == 4 * 16 * KiB
        for k, d in zip(["a0", "a1", "a2", "a3"], dsts):
            assert np.array_equal(d, data[k][32 * KiB : 48 * KiB])
        b.release(hs)
    finally:
        b.store.remove_all(True)


def test_auto_reads_an_object_larger_than_the_staging_per_layer(cluster, make_client):
    b = make_client(cluster, load="auto", whole_max_bytes=64 * MiB, staging_size=1 * MiB)
    try:
        data = _put(make_client(cluster, staging_size=4 * MiB), ["big"], 2 * MiB, seed=2)
        (h,) = b.open(["big"])
        assert b.view(h, 0, 16) is None  # cannot be fetched whole through 1 MiB: read per layer
        out = np.zeros(512 * KiB, np.uint8)
        b.read([h], [1536 * KiB], [out])
        assert np.array_equal(out, data["big"][1536 * KiB :])
        b.release([h])
    finally:
        b.store.remove_all(True)


def test_whole_max_bytes_zero_never_fetches_whole(cluster, make_client):
    b = make_client(cluster, load="auto", whole_max_bytes=0)
    try:
        _put(b, ["z"], 4 * KiB, seed=3)
        (h,) = b.open(["z"])
        assert b.view(h, 0, 16) is None
        b.release([h])
    finally:
        b.store.remove_all(True)


def test_each_whole_fetch_has_its_own_copies(cluster, make_client):
    """Copies from one open stay as they were after later opens (each fetch has its own buffer,
    nothing shared is reused under a live handle); a key missing at open is a miss."""
    b = make_client(cluster, load="whole")
    try:
        data = _put(b, ["w0", "w1"], 256 * KiB, seed=4)
        (h0,) = b.open(["w0"])
        (h1,) = b.open(["w1"])
        (h0b, miss) = b.open(["w0", "gone"])
        assert miss is None
        assert bytes(b.view(h0, 0, 256 * KiB)) == data["w0"].tobytes()
        assert bytes(b.view(h1, 0, 256 * KiB)) == data["w1"].tobytes()
        assert bytes(b.view(h0b, 0, 256 * KiB)) == data["w0"].tobytes()
        b.release([h0, h1, h0b])
    finally:
        b.store.remove_all(True)


class _SlowGets:
    """The client, but ``batch_get_into`` starts ``delay_s`` late (the first ``n`` calls), then runs."""

    def __init__(self, store, delay_s: float, n: int = 1) -> None:
        self._store, self.delay_s, self.n = store, delay_s, n
        self.done = threading.Event()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def batch_get_into(self, *args):
        if self.n > 0:
            self.n -= 1
            time.sleep(self.delay_s)
            try:
                return self._store.batch_get_into(*args)
            finally:
                self.done.set()
        return self._store.batch_get_into(*args)


def test_a_whole_fetch_past_its_deadline_is_unavailable_and_its_buffer_is_never_handed_out(cluster, make_client):
    b = make_client(cluster, load="whole", call_timeout_s=0.3, get_arena_bytes=0)  # a buffer per fetch
    try:
        data = _put(b, ["t0"], 128 * KiB, seed=5)
        slow = _SlowGets(b.client.store, delay_s=1.0)
        b.client.store = slow
        with pytest.raises(BackendUnavailable, match="batch_get_into"):
            b.open(["t0"])
        assert len(b.gets._late) == 1  # kept (and registered): the late call may still write it
        (late,) = b.gets._late.held()
        assert slow.done.wait(10)  # the late call finished writing into the retired buffer
        assert np.array_equal(late, data["t0"])  # it did write there: handing it out would race
        time.sleep(0.1)  # the late call's future is done just after it returns
        (h,) = b.open(["t0"])  # the next fetch has a buffer of its own
        assert len(b.gets._late) == 0  # the late call returned: its buffer was unregistered, let go
        v = b.view(h, 0, 128 * KiB)
        assert bytes(v) == data["t0"].tobytes()
        assert np.shares_memory(np.frombuffer(v, np.uint8), late) is False
        b.release([h])
    finally:
        b.client.store = b.client.store._store if isinstance(b.client.store, _SlowGets) else b.client.store
        b.store.remove_all(True)


def test_whole_fetches_land_in_the_get_arena_the_device_is_given_and_reuse_it(cluster, make_client):
    """The arena is registered with Mooncake once and is what ``host_regions`` hands a device
    copier; fetched objects lie in it, a release gives the space back, a fetch past its deadline
    keeps its pages from every later fetch until it returned, and an open without room fetches
    into a buffer of its own. Bytes exact throughout."""
    b = make_client(cluster, load="whole", call_timeout_s=0.3, get_arena_bytes=768 * KiB)
    try:
        data = _put(b, [f"g{i}" for i in range(6)], 128 * KiB, seed=7)
        region, _ = b.host_regions()  # the get arena, then the put arena
        lo = np.frombuffer(region, np.uint8).ctypes.data
        inside = lambda v: lo <= np.frombuffer(v, np.uint8).ctypes.data < lo + region.nbytes  # noqa: E731
        for rep in range(4):
            keys = [f"g{(rep + i) % 6}" for i in range(4)]
            hs = b.open(keys)
            for k, h in zip(keys, hs):
                v = b.view(h, 0, 128 * KiB)
                assert inside(v) and bytes(v) == data[k].tobytes()
            b.release(hs)
        assert b.arena.free_bytes() == 768 * KiB and b.stats()["arena_gets"] == 4
        (h0,) = b.open(["g0"])
        slow = _SlowGets(b.client.store, delay_s=1.0)
        b.client.store = slow
        with pytest.raises(BackendUnavailable, match="batch_get_into"):
            b.open(["g1"])
        assert b.arena.free_bytes() == 768 * KiB - 2 * 128 * KiB  # h0's pages and the late get's
        b.client.store = slow._store
        hs = b.open(["g2", "g3", "g4", "g5"])  # fills what is left
        assert all(inside(b.view(h, 0, 1)) for h in hs)
        (big,) = b.open(["g1"])  # no room: a buffer of its own
        assert not inside(b.view(big, 0, 1)) and b.stats()["get_arena_full"] == 1
        assert slow.done.wait(10)
        for k, h in zip(["g0", "g2", "g3", "g4", "g5", "g1"], [h0, *hs, big]):
            assert bytes(b.view(h, 0, 128 * KiB)) == data[k].tobytes(), k  # the late get wrote its own pages
        b.release([h0, *hs, big])
        time.sleep(0.1)  # the late call's future is done just after it returns
        b.arena.prune()
        assert b.arena.free_bytes() == 768 * KiB
    finally:
        b.client.store = b.client.store._store if isinstance(b.client.store, _SlowGets) else b.client.store
        b.store.remove_all(True)


def test_per_layer_reads_are_lent_from_the_get_arena_and_fall_back_to_staging_without_room(cluster, make_client):
    """With ``per_layer`` loads each batch is one ranged get straight into the get arena (the memory
    ``host_regions`` gives a device copier), lent until given back: bytes exact, no staging; with
    the arena full the same read goes through ``read`` (staging) and gives the same bytes."""
    b = make_client(cluster, load="per_layer", get_arena_bytes=256 * KiB)
    try:
        data = _put(b, [f"p{i}" for i in range(4)], 96 * KiB, seed=8)
        region, _ = b.host_regions()  # the get arena, then the put arena
        lo = np.frombuffer(region, np.uint8).ctypes.data
        hs = b.open(list(data))
        lends = []
        for layer in range(3):  # 4 x 32 KiB a layer: two layers fit the arena, the third does not
            lend = b.read_lent(hs, [layer * 32 * KiB] * 4, 32 * KiB)
            if layer == 2:
                assert lend is None and b.stats()["get_arena_full"] == 1
                dsts = [np.zeros(32 * KiB, np.uint8) for _ in hs]
                b.read(hs, [layer * 32 * KiB] * 4, dsts)
                views = dsts
            else:
                assert lend is not None
                lends.append(lend)
                views = lend.views
                assert all(lo <= v.ctypes.data < lo + region.nbytes for v in views)
            for k, v in zip(data, views):
                assert np.array_equal(v, data[k][layer * 32 * KiB : (layer + 1) * 32 * KiB]), (k, layer)
        assert b.stats()["arena_range_gets"] == 2
        for lend in lends:
            lend.give_back()
        assert b.arena.free_bytes() == 256 * KiB
        b.release(hs)
    finally:
        b.store.remove_all(True)


def _homes(b, keys: list[str]) -> list[str]:
    """The host part of each object's replica endpoint (where its bytes live)."""
    desc = b.store.batch_get_replica_desc(keys)
    return [r.get_memory_descriptor().buffer_descriptor.transport_endpoint.rsplit(":", 1)[0]
            for k in keys for r in desc[k] if r.is_memory_replica()]


@pytest.mark.parametrize("sessions", [True, False], ids=["sessions", "whole_puts"])
def test_a_client_with_a_segment_puts_into_it_first_and_reads_its_own_hits_back(cluster, hosts, make_client, sessions):
    keys = [f"own{i}" for i in range(16)]
    b = make_client(cluster, global_segment_size=64 * MiB, put_sessions=sessions)
    try:
        assert b.client.put_config is not None and b.client.put_config.preferred_segment
        data = _put(b, keys, 64 * KiB, seed=6)
        assert _homes(b, keys) == [hosts.addr("a")] * len(keys)  # all in this client's segment (host A)
        hs = b.open(keys)
        for k, h in zip(keys, hs):
            assert bytes(b.view(h, 0, 64 * KiB)) == data[k].tobytes()
        b.release(hs)
        # without the preference, puts spread over the pool's segments (here: A's and the holder's on B)
        c = make_client(cluster, global_segment_size=64 * MiB, put_sessions=sessions, prefer_local_segment=False)
        assert c.client.put_config is None
        other = [f"spread{i}" for i in range(32)]
        _put(c, other, 64 * KiB, seed=7)
        assert hosts.addr("b") in _homes(c, other)
    finally:
        b.store.remove_all(True)


def test_puts_that_do_not_fit_the_own_segment_go_elsewhere(cluster, hosts, make_client):
    b = make_client(cluster, global_segment_size=16 * MiB)
    try:
        keys = [f"over{i}" for i in range(24)]
        data = _put(b, keys, 1 * MiB, seed=8)  # 24 MiB: more than this client's 16 MiB segment
        homes = _homes(b, keys)
        assert len(homes) == len(keys) and hosts.addr("b") in homes, homes
        hs = b.open(keys)
        assert all(h is not None for h in hs)
        for k, h in zip(keys, hs):
            assert bytes(b.view(h, 0, 1 * MiB)) == data[k].tobytes()
        b.release(hs)
    finally:
        b.store.remove_all(True)
