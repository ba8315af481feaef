"""The get arena (``lw_mooncake.get_arena``) without a Mooncake client: whole gets land in one
memory registered once, each extent is held by its read handles until they are released, a late
call's extents are never handed out until it returns, and an arena without room or refused by
Mooncake falls back to a buffer per fetch (the bytes are the same either way)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from lw_core.backend import BackendError
from lw_mooncake.calls import CallTimedOut, Deadlines
from lw_mooncake.errors import OBJECT_NOT_FOUND
from lw_mooncake.get_arena import ALIGN, GetArena
from lw_mooncake.gets import StagedGets
from lw_mooncake.object_reader import ObjectReader


def _content(key: str, n: int) -> np.ndarray:
    return np.frombuffer((key.encode() * (n // len(key) + 1))[:n], np.uint8)


class _Store:
    """Objects by key; ``batch_get_into`` writes their bytes at the pointers it is given, and
    waits for ``go`` while ``stall`` is set (then writes anyway, as a late Mooncake call would)."""

    def __init__(self, objects: dict[str, int]) -> None:
        self.objects = objects
        self.registered: dict[int, int] = {}
        self.register_calls = 0
        self.refuse = 0  # registrations still to refuse
        self.stall = threading.Event()
        self.go = threading.Event()
        self.returned = threading.Event()
        self.gets: list[list[int]] = []  # the pointers of each batch_get_into
        self.vanished: set[str] = set()  # sizes lists them, gets find nothing (evicted between)

    def register_buffer(self, base: int, n: int) -> int:
        self.register_calls += 1
        if self.refuse:
            self.refuse -= 1
            return -1
        self.registered[base] = n
        return 0

    def unregister_buffer(self, base: int) -> int:
        self.registered.pop(base, None)
        return 0

    def batch_get_into(self, keys, ptrs, sizes):
        stalled = self.stall.is_set()
        if stalled:
            self.go.wait(10)
        self.gets.append(list(ptrs))
        for p in ptrs:  # every pointer lies in registered memory, as Mooncake demands
            assert any(b <= p < b + n for b, n in self.registered.items()), "a get into unregistered memory"
        out = []
        for k, p, n in zip(keys, ptrs, sizes):
            if k not in self.objects or k in self.vanished:
                out.append(OBJECT_NOT_FOUND)
                continue
            np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(p))[:] = _content(k, n)
            out.append(n)
        if stalled:
            self.returned.set()
        return out


class _Client:
    def __init__(self, store: _Store, timeout_s: float = 5.0) -> None:
        self.store = store
        self.calls = Deadlines(timeout_s, "test", workers=2)

    def check_open(self) -> None:
        pass

    def sizes(self, keys: list[str]) -> dict[str, int]:
        return {k: self.store.objects[k] for k in keys if k in self.store.objects}


def readers(store_cls: type, load: str):
    """A fixture body: ``make(objects, arena_bytes, timeout_s)`` builds a ``store_cls`` store and an
    ``ObjectReader`` (``load``) over a get arena on it; every client is shut down after the test."""
    made: list[_Client] = []

    def make(objects: dict[str, int], arena_bytes: int, timeout_s: float = 5.0):
        store = store_cls(objects)
        client = _Client(store, timeout_s)
        made.append(client)
        arena = GetArena(store, client.calls, arena_bytes)
        gets = StagedGets(client, 1 << 20, arena)  # type: ignore[arg-type]
        return store, ObjectReader(client, gets, load=load, staging_size=1 << 20), arena  # type: ignore[arg-type]

    yield make
    for c in made:
        c.store.go.set()
        c.calls.shutdown()


@pytest.fixture
def make():
    yield from readers(_Store, "whole")


def _check(handles, sizes) -> None:
    for h in handles:
        assert h is not None and np.array_equal(h.data, _content(h.key, sizes[h.key]))


def test_whole_gets_land_in_the_arena_registered_once_and_its_space_comes_back_on_release(make):
    sizes = {f"k{i}": 5000 + i for i in range(6)}
    store, reader, arena = make(sizes, 16 * ALIGN)
    for _ in range(5):
        hs = reader.open(list(sizes))
        _check(hs, sizes)
        assert all(arena.covers(h.data) for h in hs)  # the memory host_regions gives the device
        assert arena.free_bytes() == 4 * ALIGN  # six objects of two pages each held
        reader.release(hs)
        assert arena.free_bytes() == 16 * ALIGN
    assert store.register_calls == 1 and store.registered == {arena.base: 16 * ALIGN}
    arena.close()
    assert store.registered == {}


def test_a_key_opened_twice_keeps_its_extent_until_both_handles_are_released(make):
    sizes = {"a": 3 * ALIGN, "b": ALIGN}
    store, reader, arena = make(sizes, 8 * ALIGN)
    a1, b, a2 = reader.open(["a", "b", "a"])
    assert a1.data.ctypes.data == a2.data.ctypes.data
    reader.release([a1, b])
    assert arena.free_bytes() == 5 * ALIGN  # a's three pages are still held by a2
    (c,) = reader.open(["b"])
    assert not (a2.data.ctypes.data <= c.data.ctypes.data < a2.data.ctypes.data + a2.nbytes)
    _check([a2, c], sizes)  # a2's bytes were not overwritten by the later get
    reader.release([a2, c])
    reader.release([a2, c])  # a second release of the same handles gives nothing back twice
    assert arena.free_bytes() == 8 * ALIGN


def test_an_object_gone_before_its_get_frees_its_extent_at_once(make):
    sizes = {"a": ALIGN, "b": 2 * ALIGN}
    store, reader, arena = make(sizes, 4 * ALIGN)
    store.vanished.add("b")  # its size was read, then it was evicted
    a, b, gone = reader.open(["a", "b", "gone"])
    assert b is None and gone is None
    _check([a], sizes)
    assert arena.free_bytes() == 3 * ALIGN
    reader.release([a])
    assert arena.free_bytes() == 4 * ALIGN


def test_a_late_gets_extents_are_never_handed_out_before_it_returns(make):
    sizes = {"a": 2 * ALIGN, "b": 2 * ALIGN}
    store, reader, arena = make(sizes, 4 * ALIGN, timeout_s=0.2)
    store.stall.set()
    with pytest.raises(CallTimedOut):
        reader.open(["a"])  # its get is stuck, holding the first two pages; it writes them later
    store.stall.clear()
    assert arena.free_bytes() == 2 * ALIGN
    (b,) = reader.open(["b"])
    assert b.data.ctypes.data == arena.base + 2 * ALIGN  # not the late get's pages
    store.go.set()
    assert store.returned.wait(5)  # the late get writes a's bytes into its own pages now
    _check([b], sizes)
    reader.release([b])
    for _ in range(100):  # freed once its call has returned (the future completes just after)
        arena.prune()
        if arena.free_bytes() == 4 * ALIGN:
            break
        threading.Event().wait(0.02)
    assert arena.free_bytes() == 4 * ALIGN


def test_an_open_that_does_not_fit_fetches_into_a_buffer_of_its_own(make):
    sizes = {"a": 3 * ALIGN, "b": 3 * ALIGN}
    store, reader, arena = make(sizes, 4 * ALIGN)
    (a,) = reader.open(["a"])
    (b,) = reader.open(["b"])  # no room left beside a
    assert arena.covers(a.data) and not arena.covers(b.data)
    _check([a, b], sizes)
    assert arena.counts["get_arena_full"] == 1
    reader.release([a, b])
    assert arena.free_bytes() == 4 * ALIGN


def test_an_arena_mooncake_refuses_to_register_is_never_used(make):
    sizes = {"a": ALIGN}
    store, reader, arena = make(sizes, 4 * ALIGN)
    store.refuse = 1  # the arena's (the first registration)
    for _ in range(3):
        (a,) = reader.open(["a"])
        assert not arena.covers(a.data)
        _check([a], sizes)
        reader.release([a])
    # the arena's registration, tried once, then one buffer registered per fetch
    assert arena.counts["get_arena_refused"] == 1 and store.register_calls == 1 + 3


def test_a_failed_batch_lets_go_of_what_the_open_fetched_before_it(make):
    sizes = {"a": 200_000, "b": 1_000_000}  # two batches: the staging holds 1 MiB
    store, reader, arena = make(sizes, 512 * ALIGN)
    real = store.batch_get_into

    def second_fails(keys, ptrs, ns):
        if "b" in keys:
            return [-1] * len(keys)
        return real(keys, ptrs, ns)

    store.batch_get_into = second_fails  # type: ignore[method-assign]
    with pytest.raises(BackendError):
        reader.open(["a", "b"])
    assert arena.free_bytes() == 512 * ALIGN


def test_freeing_an_extent_twice_is_a_loud_error(make):
    _, _, arena = make({}, 4 * ALIGN)
    (o,) = arena.take([ALIGN])
    arena.hold_at(o, 0)
    with pytest.raises(RuntimeError, match="not held"):
        arena.hold(arena.buf[o : o + ALIGN], -1)
