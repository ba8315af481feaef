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


def test_a_lease_near_its_end_is_renewed_and_an_evicted_object_is_refused(tmp_path):
    path = str(tmp_path / "p")
    reader = EmbeddedBackend(path, capacity_bytes=2 * MiB, lease_ttl_s=2.0)
    writer = EmbeddedBackend(path, capacity_bytes=2 * MiB)
    try:
        _put(writer, ["a", "b"], MiB)
        hs = reader.open(["a", "b"])
        time.sleep(1.2)  # past half the lease: view_addresses renews it
        reader.view_addresses(hs, 0, 16)
        time.sleep(1.0)  # the first lease has ended by now
        assert writer.reserve(["c"], MiB) == [None], "a renewed lease still pins both objects"
        time.sleep(1.1)  # now the renewed one has too: the writer evicts one and takes its space
        _put(writer, ["c"], MiB)
        with pytest.raises(ObjectMissing, match="evicted"):
            reader.view_addresses(hs, 0, 16)
    finally:
        reader.close()
        writer.close()


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
