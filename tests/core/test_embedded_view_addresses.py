"""``view_addresses``: where a batch's ``view`` windows lie (what a device copier moves by address),
with exactly ``view``'s checks: the same windows, a lease near its end renewed, an evicted, released
or streaming object refused as ``view`` refuses it, and ``host_regions`` holding them all."""

from __future__ import annotations

import time

import numpy as np
import pytest

from lw_core.backend import ObjectMissing
from lw_core.backends.embedded import EmbeddedBackend

MiB = 1 << 20


def _put(b: EmbeddedBackend, keys: list[str], n: int) -> None:
    hs = b.reserve(keys, n)
    for i, h in enumerate(hs):
        b.write([h], [0], [bytes([i + 1]) * n])
    b.commit(hs)


def _addr(v: memoryview) -> int:
    return int(np.frombuffer(v, dtype=np.uint8).ctypes.data)


def test_the_addresses_are_the_view_windows_in_the_host_region(tmp_path):
    b = EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=4 * MiB)
    try:
        _put(b, ["a", "b", "c"], 64 << 10)
        hs = b.open(["c", "a", "b"])
        addrs = b.view_addresses(hs, 4096, 8192)
        assert list(addrs) == [_addr(b.view(h, 4096, 8192)) for h in hs]
        (arena,) = b.host_regions()
        base = _addr(arena)
        assert all(base <= a and a + 8192 <= base + len(arena) for a in addrs)
        assert [bytes(np.frombuffer(arena, dtype=np.uint8)[a - base : a - base + 4]) for a in addrs] == [
            b"\x03" * 4, b"\x01" * 4, b"\x02" * 4]
        (w,) = b.reserve(["d"], 64 << 10)  # a reservation's window too
        assert list(b.view_addresses([w], 0, 100)) == [_addr(b.view(w, 0, 100))]
        b.abort([w])
        with pytest.raises(ValueError, match="outside object"):
            b.view_addresses(hs, 60 << 10, 8192)
        b.release(hs)
        with pytest.raises(ObjectMissing, match="not leased"):
            b.view_addresses(hs, 0, 16)
    finally:
        b.close()


@pytest.fixture
def full_pool(tmp_path):
    """A reader (leases of 2 s) and a writer on a 2 MiB pool that two 1 MiB objects fill."""
    path = str(tmp_path / "p")
    reader = EmbeddedBackend(path, capacity_bytes=2 * MiB, lease_ttl_s=2.0)
    writer = EmbeddedBackend(path, capacity_bytes=2 * MiB)
    try:
        _put(writer, ["a", "b"], MiB)
        yield reader, writer
    finally:
        reader.close()
        writer.close()


def test_a_lease_near_its_end_is_renewed_and_an_evicted_object_is_refused(full_pool):
    reader, writer = full_pool
    hs = reader.open(["a", "b"])
    time.sleep(1.2)  # past half the lease: view_addresses renews it
    reader.view_addresses(hs, 0, 16)
    time.sleep(1.0)  # the first lease has ended by now
    assert writer.reserve(["c"], MiB) == [None], "a renewed lease still pins both objects"
    time.sleep(1.1)  # now the renewed one has too: the writer evicts one and takes its space
    _put(writer, ["c"], MiB)
    with pytest.raises(ObjectMissing, match="evicted"):
        reader.view_addresses(hs, 0, 16)


def test_a_streaming_handle_has_no_addresses(tmp_path):
    b = EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=2 * MiB)
    try:
        (w,) = b.reserve(["s"], 4096)
        b.publish([w], 4096)
        (s,) = b.open_streaming(["s"])
        assert b.view(s, 0, 16) is None and b.view_addresses([s], 0, 16) is None
        b.abort([w])
    finally:
        b.close()


def test_a_steps_table_answers_as_view_addresses_and_sees_every_change_after_it_was_built(tmp_path):
    """``address_table`` is built once per step; what a handle's state becomes afterwards (released,
    committed, aborted, evicted) is what the table's answers follow, never the state it was built in;
    ``table_intact`` answers as ``intact``."""
    path = str(tmp_path / "p")
    b = EmbeddedBackend(path, capacity_bytes=2 * MiB, lease_ttl_s=2.0)
    writer = EmbeddedBackend(path, capacity_bytes=2 * MiB)
    try:
        _put(b, ["a", "b", "c"], 64 << 10)
        hs = b.open(["c", "a", "b"])
        t = b.address_table(hs)
        rows = np.array([2, 0])
        assert list(b.table_addresses(t, rows, 4096, 8192)) == list(b.view_addresses([hs[2], hs[0]], 4096, 8192))
        with pytest.raises(ValueError, match="outside object"):
            b.table_addresses(t, rows, 60 << 10, 8192)
        b.release([hs[0]])  # "c" released after the table was built
        assert list(b.table_addresses(t, np.array([1, 2]), 0, 16)) == list(b.view_addresses(hs[1:], 0, 16))
        with pytest.raises(ObjectMissing, match="not leased"):
            b.table_addresses(t, np.array([1, 0]), 0, 16)

        (w, x) = b.reserve(["d", "e"], 64 << 10)
        wt = b.address_table([w, x])
        assert list(b.table_addresses(wt, np.array([0, 1]), 0, 100)) == [_addr(b.view(w, 0, 100)), _addr(b.view(x, 0, 100))]
        b.abort([w])  # no window of an aborted reservation: its space may be reused
        b.commit([x])  # nor of a committed one through its reservation handle (no lease on it)
        for row in (0, 1):
            with pytest.raises(ObjectMissing):
                b.table_addresses(wt, np.array([row]), 0, 100)

        assert b.table_intact(t, np.array([1, 2])).tolist() == b.intact(hs[1:]) == [True, True]
        assert b.table_intact(b.address_table([None, hs[1]]), np.array([0, 1])).tolist() == [False, True]
        time.sleep(2.2)  # the leases of "a" and "b" end; the writer evicts them and takes the space
        size = 2 * MiB
        while (got := writer.reserve(["f"], size)) == [None]:  # the largest object the pool takes: it evicts them all
            size -= 64 << 10
        writer.commit(got)
        assert size >= MiB
        with pytest.raises(ObjectMissing, match="evicted"):
            b.table_addresses(t, np.array([1, 2]), 0, 16)
        assert b.table_intact(t, np.array([1, 2])).tolist() == b.intact(hs[1:]) == [False, False]  # on arrays, as intact
    finally:
        b.close()
        writer.close()


def test_a_steps_table_renews_its_leases_while_its_layers_go_by(full_pool):
    """Layers after the first are answered from what the table's last full check proved, only for as
    long as that proof holds: once a lease is within half its time-to-live of ending, the next query
    looks again and renews it, so a step's later layers never read an object whose lease ran out."""
    reader, writer = full_pool
    hs = reader.open(["a", "b"])
    t = reader.address_table(hs)
    rows = np.array([0, 1])
    first = reader.table_addresses(t, rows, 0, 16)
    assert list(reader.table_addresses(t, rows, 16, 16)) == list(first + 16)  # answered from the proof
    time.sleep(1.2)  # past half the lease: the proof has run out
    assert list(reader.table_addresses(t, rows, 32, 16)) == list(first + 32)
    time.sleep(1.0)  # the leases taken at open would have ended by now
    assert writer.reserve(["c"], MiB) == [None], "the table's query renewed both leases"
