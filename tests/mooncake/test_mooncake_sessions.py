"""Put sessions on a real master and holder (host B), writers and readers on host A: each write is
in the store at once but invisible; commit (session end) makes exactly the written bytes readable,
the unwritten ones zeros; abort (revoke) leaves nothing and frees the key at once."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow
N, LAYERS = 1 << 16, 4


@pytest.fixture
def pair(cluster, make_client):
    a, b = make_client(cluster), make_client(cluster)
    assert a.writer.sessions is not None  # the installed client has put sessions
    yield a, b
    a.store.remove_all(True)


def _read(b, key: str, n: int) -> bytes:
    (r,) = b.open([key])
    assert r is not None
    out = bytearray(n)
    b.read([r], [0], [out])
    b.release([r])
    return bytes(out)


def test_layers_go_out_as_written_and_only_commit_makes_them_visible(pair):
    a, b = pair
    data = np.random.default_rng(1).integers(0, 256, N, dtype=np.uint8)
    other = data[::-1].copy()
    hs = a.reserve(["s0", "s1"], N)
    per = N // LAYERS
    for layer in range(LAYERS):
        a.write(hs, [layer * per] * 2, [data[layer * per : (layer + 1) * per], other[layer * per : (layer + 1) * per]])
        assert b.lookup(["s0"]) == 0 and b.open(["s1"]) == [None] and a.store.batch_is_exist(["s0", "s1"]) == [0, 0]
    assert a.stats()["bytes_ranged"] == 2 * N  # in the store before commit
    assert b.reserve(["s0"], N) == [None]  # another writer's session: not reservable
    a.commit(hs)
    assert b.lookup(["s0", "s1"]) == 2
    assert _read(b, "s0", N) == data.tobytes() and _read(b, "s1", N) == other.tobytes()


def test_unwritten_ranges_are_zeros_not_the_segments_old_bytes(pair):
    a, b = pair
    (h,) = a.reserve(["old"], N)
    a.write([h], [0], [np.full(N, 0xAB, np.uint8)])
    a.commit([h])
    assert a.store.batch_remove(["old"], True) == [0]  # its space is free for the next object
    (h,) = a.reserve(["z"], N)
    a.write([h], [N // 2], [np.full(N // 4, 7, np.uint8)])
    a.commit([h])
    assert _read(b, "z", N) == bytes(N // 2) + b"\x07" * (N // 4) + bytes(N // 4)


def test_abort_revokes_nothing_visible_and_the_key_is_free_at_once(pair):
    a, b = pair
    (h,) = a.reserve(["r"], N)
    a.write([h], [0], [np.ones(N, np.uint8)])
    a.abort([h])
    assert b.lookup(["r"]) == 0 and b.open(["r"]) == [None]
    (h2,) = b.reserve(["r"], N)  # another writer, at once
    assert h2 is not None
    b.write([h2], [0], [np.full(N, 2, np.uint8)])
    b.commit([h2])
    assert _read(a, "r", N) == b"\x02" * N


def test_stored_keys_are_not_reserved_and_close_revokes_open_sessions(cluster, make_client, pair):
    a, b = pair
    (h,) = a.reserve(["done"], N)
    a.commit([h])
    assert a.reserve(["done"], N) == [None] and b.reserve(["done"], N) == [None]
    c = make_client(cluster)
    (h,) = c.reserve(["open"], N)
    assert b.reserve(["open"], N) == [None]
    c.close()
    assert b.reserve(["open"], N)[0] is not None  # revoked at close: free at once


@pytest.mark.parametrize("arena", [True, False], ids=["put_arena", "no_arena"])
def test_reservations_filled_in_place_put_from_the_arena_and_without_it_through_staging(cluster, make_client, arena):
    """Reservations live in the put arena (registered with Mooncake, offered as ``host_regions``):
    a caller fills them in place (``write_buffers``, what a device copier does), ranged puts send
    from there (nothing staged), and what was never written reads as zeros though the extent held
    an earlier object's bytes. Without the arena the same writes go through the put staging."""
    a = make_client(cluster, put_arena_bytes=(1 << 20) if arena else 0)
    try:
        assert len(a.host_regions()) == (2 if arena else 1)  # the get arena, and the put arena
        (h,) = a.reserve(["first"], N)
        a.write([h], [0], [np.full(N, 0xAB, np.uint8)])
        a.commit([h])
        hs = a.reserve(["w0", "w1"], N)
        per = N // LAYERS
        data = np.random.default_rng(3).integers(0, 256, (2, N), dtype=np.uint8)
        for layer in range(LAYERS - 1):  # the last layer is never written
            bufs = a.write_buffers(hs, [layer * per] * 2, per)
            if not arena:
                assert bufs is None
                a.write(hs, [layer * per] * 2, [data[i, layer * per : (layer + 1) * per] for i in range(2)])
                continue
            assert bufs is not None
            for i, buf in enumerate(bufs):
                buf[:] = data[i, layer * per : (layer + 1) * per]
            a.write(hs, [layer * per] * 2, bufs)
        a.commit(hs)
        for i, k in enumerate(("w0", "w1")):
            assert _read(a, k, N) == data[i, : N - per].tobytes() + bytes(per)
        st = a.stats()
        assert st["store_register_refusals"] == 0  # Mooncake took both arenas (vllm:lw_pool_store_register_refusals_total)
        if arena:
            assert st["put_staged_bytes"] == 0 and st["put_direct_bytes"] == 3 * N
            assert a.put_arena is not None and a.put_arena.free_bytes() == a.put_arena.nbytes
        else:
            assert st["put_direct_bytes"] == 0 and st["put_staged_bytes"] == 3 * N
    finally:
        a.store.remove_all(True)
