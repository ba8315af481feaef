"""The put arena (``lw_mooncake.arena``, ``put``) without a Mooncake client: reservations' local
objects live in memory registered once, puts and ranged puts send from it with no copy into the
put staging, a device-like caller fills it in place (``write_buffers``), the bytes stored equal
those of a zeroed array per reservation, and an extent is never given to another reservation
while a write or a late put may still use it."""

from __future__ import annotations

import ctypes
import threading
from collections import Counter

import numpy as np
import pytest
from test_mooncake_sessions_units import _Client
from test_mooncake_sessions_units import _Store as _SessionStore

from lw_core.backend import BackendUnavailable
from lw_mooncake.arena import ALIGN, Arena
from lw_mooncake.calls import Deadlines
from lw_mooncake.object_writer import ObjectWriter
from lw_mooncake.put_sessions import PutSessions
from lw_mooncake.puts import StagedPuts
from lw_mooncake.reservations import Reservations
from lw_mooncake.session_writer import SessionWriter
from lw_mooncake.stream_write import StreamWriter

STAGING = 1 << 16


class _Store(_SessionStore):
    """Put sessions and whole puts (``batch_put_from``); a ranged put waits for ``go`` while
    ``stall`` is set, then writes anyway (as a late Mooncake call would)."""

    def __init__(self) -> None:
        super().__init__()
        self.stall = threading.Event()
        self.go = threading.Event()
        self.returned = threading.Event()
        self.entered = threading.Event()  # a stalled ranged put has started
        self.stall_once = threading.Event()  # the next batch_put_from waits for ``go``
        self.refuse: set[int] = set()  # sizes of registrations to refuse
        self.range_ptrs: list[int] = []

    def register_buffer(self, ptr: int, n: int) -> int:
        return -1 if n in self.refuse else super().register_buffer(ptr, n)

    def unregister_buffer(self, ptr: int) -> int:
        self.registered = [(a, m) for a, m in self.registered if a != ptr]
        return 0

    def batch_remove(self, keys, force=False):
        for k in keys:
            self.stored.pop(k, None)
        return [0] * len(keys)

    def batch_put_from_multi_buffer_ranges(self, keys, ptrs, sizes, offsets):
        stalled = self.stall.is_set()
        if stalled:
            self.entered.set()
            self.go.wait(10)
        self.range_ptrs += [p for ps in ptrs for p in ps]
        out = super().batch_put_from_multi_buffer_ranges(keys, ptrs, sizes, offsets)
        if stalled:
            self.returned.set()
        return out

    def batch_put_from(self, keys, ptrs, sizes):
        if self.stall_once.is_set():  # this call only waits for ``go``
            self.stall_once.clear()
            self.entered.set()
            self.go.wait(10)
        out = []
        for k, p, n in zip(keys, ptrs, sizes):
            assert any(a <= p and p + n <= a + m for a, m in self.registered), "unregistered source"
            self.stored[k] = ctypes.string_at(p, n)
            out.append(0)
        return out


class _StreamingClient(_Client):
    def remove(self, keys, *, force: bool):
        return self.store.batch_remove(keys, force)


def _make(*, sessions: bool = True, arena_bytes: int = 4 * ALIGN, timeout_s: float = 5.0, store: _Store | None = None,
          streaming: bool = False):
    client = _StreamingClient(store or _Store())
    client.calls = Deadlines(timeout_s, "test", workers=2)
    arena = Arena(client.store, client.calls, arena_bytes, "put") if arena_bytes else None
    puts = StagedPuts(client, STAGING, arena)  # type: ignore[arg-type]
    res = Reservations(arena)
    sw = SessionWriter(PutSessions(client), puts, res, Counter()) if sessions else None  # type: ignore[arg-type]
    streams = StreamWriter(client, puts, res) if streaming else None  # type: ignore[arg-type]
    w = ObjectWriter(client, puts, res, staging_size=STAGING, streams=streams, sessions=sw)  # type: ignore[arg-type]
    return w, client, arena, puts


@pytest.fixture
def made():
    out: list = []

    def make(**kw):
        m = _make(**kw)
        out.append(m)
        return m

    yield make
    for _, client, arena, _ in out:
        if arena is not None:
            arena.close()
        client.calls.shutdown()


def test_ranged_puts_send_from_the_arena_and_unwritten_ranges_are_stored_as_zeros(made):
    w, client, arena, puts = made()
    arena.buf[:] = 0xAB  # what earlier reservations left there
    (h,) = w.reserve(["k"], 12)
    assert h.extent is not None and arena.covers(h.buf)
    w.write([h], [8], [b"3333"])
    w.write([h], [0], [memoryview(b"1111")])
    w.commit([h])
    assert client.store.stored["k"] == b"1111" + bytes(4) + b"3333"
    assert puts.counts["put_staged_bytes"] == 0 and puts.counts["put_direct_bytes"] == 12
    assert all(arena.base <= p < arena.base + arena.nbytes for p in client.store.range_ptrs)
    assert arena.free_bytes() == arena.nbytes  # the extent went back with the reservation


def test_write_buffers_are_filled_in_place_and_written_with_no_copy(made):
    w, client, arena, puts = made()
    hs = w.reserve(["a", "b"], 16)
    bufs = w.write_buffers(hs, [0, 0], 8)
    assert bufs is not None and all(arena.covers(b) for b in bufs)
    for i, b in enumerate(bufs):
        b[:] = i + 1  # a device copy writing the layer
    w.write(hs, [0, 0], bufs)
    tail = [np.full(8, 9, np.uint8)] * 2
    w.write(hs, [8, 8], tail)
    w.commit(hs)
    assert client.store.stored["a"] == bytes([1] * 8 + [9] * 8) and client.store.stored["b"] == bytes([2] * 8 + [9] * 8)
    assert puts.counts["put_staged_bytes"] == 0
    assert w.write_buffers(hs, [0, 0], 8) is None  # committed: none of their memory is lent any more


def test_whole_puts_send_from_the_arena_and_zero_what_was_never_written(made):
    w, client, arena, puts = made(sessions=False)
    arena.buf[:] = 0xCD
    (h,) = w.reserve(["k"], 10)
    v = w.view(h, 2, 4)
    np.frombuffer(v, np.uint8)[:] = 7
    w.commit([h])
    assert client.store.stored["k"] == bytes(2) + bytes([7] * 4) + bytes(4)
    assert puts.counts["put_direct_bytes"] == 10 and puts.counts["put_staged_bytes"] == 0


def test_without_room_or_registration_reservations_take_arrays_and_puts_are_staged(made):
    w, client, arena, puts = made(arena_bytes=ALIGN)
    hs = w.reserve(["a", "b"], ALIGN)  # the first fills the arena
    assert hs[0].extent is not None and hs[1].extent is None and arena.counts["put_arena_full"] == 1
    w.write(hs, [0, 0], [np.full(ALIGN, 1, np.uint8), np.full(ALIGN, 2, np.uint8)])
    w.commit(hs)
    assert client.store.stored["a"] == bytes([1] * ALIGN) and client.store.stored["b"] == bytes([2] * ALIGN)
    assert puts.counts["put_direct_bytes"] == ALIGN and puts.counts["put_staged_bytes"] == ALIGN
    store = _Store()
    store.refuse = {4 * ALIGN}  # the arena's
    w2, client2, arena2, puts2 = made(store=store)
    (h,) = w2.reserve(["c"], 64)
    assert h.extent is None and arena2.counts["put_arena_refused"] == 1
    w2.write([h], [0], [b"x" * 64])
    w2.commit([h])
    assert store.stored["c"] == b"x" * 64 and puts2.counts["put_staged_bytes"] == 64


def test_an_extent_stays_taken_while_a_write_using_it_runs_past_its_reservation(made):
    w, client, arena, puts = made(arena_bytes=ALIGN)
    (h,) = w.reserve(["k"], 64)
    client.store.stall.set()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            w.write([h], [0], [b"y" * 64])
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion below
            errors.append(e)

    t = threading.Thread(target=write)
    t.start()
    assert client.store.entered.wait(10)  # the write's ranged put is in the store now
    w.abort([h])  # the pipeline gave up on the step meanwhile
    assert arena.free_bytes() == 0  # the write still holds the extent
    assert w.reserve(["other"], 64)[0].extent is None  # so another reservation does not get it
    client.store.go.set()
    t.join(10)
    assert arena.free_bytes() == arena.nbytes


def test_a_ranged_put_past_its_deadline_holds_its_extent_until_it_returns(made):
    w, client, arena, puts = made(arena_bytes=ALIGN, timeout_s=0.2)
    (h,) = w.reserve(["k"], 64)
    client.store.stall.set()
    with pytest.raises(BackendUnavailable):
        w.write([h], [0], [b"z" * 64])
    w.abort([h])
    assert arena.free_bytes() == 0  # the late call may still read it
    arena.prune()
    assert arena.free_bytes() == 0
    client.store.stall.clear()
    client.store.go.set()
    assert client.store.returned.wait(10)
    deadline = threading.Event()
    for _ in range(100):  # the call's future completes just after the store returned
        arena.prune()
        if arena.free_bytes() == arena.nbytes:
            break
        deadline.wait(0.01)
    assert arena.free_bytes() == arena.nbytes
    assert w.reserve(["k2"], 64)[0].extent == 0


def test_a_streaming_segment_put_holds_the_extent_it_reads_until_it_returned(made):
    w, client, arena, puts = made(arena_bytes=ALIGN, sessions=False, streaming=True)
    (h,) = w.reserve(["k"], 64)
    assert h.extent is not None
    w.write([h], [0], [b"s" * 64])
    client.store.stall_once.set()
    t = threading.Thread(target=w.streams.publish, args=([h], 64))
    t.start()
    assert client.store.entered.wait(10)  # the segment's put is in the store now
    w.reservations.end([h])  # the reservation ends meanwhile (a commit's or abort's last step)
    assert arena.free_bytes() == 0  # the publish still holds the extent
    client.store.go.set()
    t.join(10)
    assert arena.free_bytes() == arena.nbytes
    seg = [k for k, v in client.store.stored.items() if v.endswith(b"s" * 64)]
    assert seg  # the segment carried the reservation's bytes
