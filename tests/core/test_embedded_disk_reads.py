"""The disk tier's read path (embedded/disk_tier.py ``open_many``, disk_format.py): a hit's files
are opened and checked in parallel, each small object's payload read once and its checksum
(CRC-32, format 2) compared before any byte is handed out; reads and views are served from those
checked bytes. Damaged files among many are misses, never wrong bytes; format-1 files (BLAKE2b)
are still read; past the memory budget handles read the file. Released payload buffers are
recycled for the next hit (never one a view still points into) and never serve stale bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest
from disk_support import demoted_tier

from lw_core.backends.embedded import disk_format as fmt
from lw_core.backends.embedded import disk_tier
from lw_core.backends.embedded.disk_payload_reads import aligned
from lw_core.backends.embedded.disk_tier import DiskTier

OBJ = 100_000
BUF = aligned(OBJ)  # a payload buffer: direct I/O reads whole 4 KiB blocks


def _tier(tmp_path, n: int) -> tuple[DiskTier, dict[bytes, bytes]]:
    return demoted_tier(tmp_path, n, OBJ, seed=7)


def _path(tmp_path, bkey: bytes) -> str:
    return os.path.join(str(tmp_path / "disk"), fmt.file_name(bkey))


def _garble(p: str, at: int) -> None:
    with open(p, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


def test_open_many_opens_in_order_and_damaged_files_among_many_are_misses(tmp_path):
    t, data = _tier(tmp_path, 24)
    try:
        keys = list(data)
        bad = {keys[3]: fmt.HEADER_BYTES + OBJ - 1, keys[10]: fmt.HEADER_BYTES, keys[17]: 40}  # payload, payload, header
        for k, at in bad.items():
            _garble(_path(tmp_path, k), at)
        asked = [*keys, b"absent"]
        hs = t.open_many([k.decode() for k in asked], asked)
        assert [h is None for h in hs] == [k in bad or k == b"absent" for k in asked]
        for k, h in zip(asked, hs):
            if h is None:
                continue
            assert h.key == k.decode() and h.data[: h.nbytes] == data[k]
            out = bytearray(OBJ)
            t.read(h, 0, out)
            assert out == data[k]
            assert bytes(t.view(h, 777, 1000)) == data[k][777:1777]
        st = t.stats()
        assert st["disk_corrupt"] == 3 and st["disk_hits"] == 21 and st["disk_objects"] == 21
        assert not any(os.path.exists(_path(tmp_path, k)) for k in bad)
        for h in hs:
            if h is not None:
                t.release(h)
        assert t._kept == 0
    finally:
        t.close()


def test_reads_serve_the_bytes_checked_at_open_not_what_the_file_holds_later(tmp_path):
    t, data = _tier(tmp_path, 1)
    try:
        (h,) = t.open_many(["k0"], [b"k0"])
        assert h is not None and h.data is not None
        _garble(_path(tmp_path, b"k0"), fmt.HEADER_BYTES + 5)  # damaged after the check
        out = np.zeros(OBJ, np.uint8)
        t.read(h, 0, out)
        assert out.tobytes() == data[b"k0"]
        v = t.view(h, 0, OBJ)
        assert v.readonly and bytes(v) == data[b"k0"]
        t.release(h)
        assert bytes(v) == data[b"k0"]  # a view outlives its handle's release
        with pytest.raises(Exception, match="released"):
            t.read(h, 0, out)
    finally:
        t.close()


def test_a_new_process_checks_each_file_again_and_a_damaged_one_is_a_miss(tmp_path):
    t, data = _tier(tmp_path, 2)
    h = t.open("k0", b"k0")
    assert h is not None
    t.release(h)
    t.close()
    _garble(_path(tmp_path, b"k0"), fmt.HEADER_BYTES + OBJ // 2)
    t = DiskTier(str(tmp_path / "disk"), 64 << 20, queue_bytes=32 << 20)
    try:
        assert t.open_many(["k0", "k1"], [b"k0", b"k1"])[0] is None
        assert t.stats()["disk_corrupt"] == 1
    finally:
        t.close()


def test_a_format_1_file_with_a_blake2b_checksum_is_still_read(tmp_path):
    t, _ = _tier(tmp_path, 0)
    try:
        payload = os.urandom(OBJ)
        for damaged in (False, True):
            bkey = b"old-%d" % damaged
            head = fmt.build_header(bkey, OBJ, 5, fmt.payload_digest(payload, 1), version=1)
            body = bytearray(payload)
            if damaged:
                body[OBJ // 3] ^= 1
            with open(_path(tmp_path, bkey), "wb") as f:
                f.write(head + body)
        assert fmt.payload_digest(payload, 1) != fmt.payload_digest(payload)  # two different checksums
        ok, bad = t.open_many(["old-0", "old-1"], [b"old-0", b"old-1"])
        assert ok is not None and ok.data[: ok.nbytes] == payload and bad is None
        t.release(ok)
    finally:
        t.close()


def test_past_the_memory_budget_handles_read_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "KEEP_BYTES", 2 * OBJ)
    t, data = _tier(tmp_path, 4)
    try:
        keys = list(data)
        hs = t.open_many([k.decode() for k in keys], keys)
        assert all(h is not None for h in hs)
        assert sum(h.data is not None for h in hs) == 2 and t._kept == 2 * OBJ
        for k, h in zip(keys, hs):
            out = bytearray(300)
            t.read(h, OBJ - 300, out)
            assert out == data[k][-300:] and bytes(t.view(h, 1, 2)) == data[k][1:3]
        for h in hs:
            t.release(h)
        assert t._kept == 0
    finally:
        t.close()


def test_released_payload_buffers_are_recycled_and_serve_the_next_hits_own_bytes(tmp_path):
    t, data = _tier(tmp_path, 4)
    try:
        keys = list(data)
        a, b = t.open_many([k.decode() for k in keys[:2]], keys[:2])
        assert a is not None and b is not None
        bufs = {id(a.data), id(b.data)}
        t.release(a)
        t.release(b)
        assert t._free_bytes == 2 * BUF and t._kept == 0
        c, d = t.open_many([k.decode() for k in keys[2:]], keys[2:])
        assert c is not None and d is not None
        assert {id(c.data), id(d.data)} == bufs and t._free_bytes == 0  # no fresh pages
        for k, h in zip(keys[2:], (c, d)):  # the new objects' bytes, nothing left of the old ones
            assert bytes(t.view(h, 0, OBJ)) == data[k]
            out = bytearray(OBJ)
            t.read(h, 0, out)
            assert out == data[k]
        t.release(c)
        t.release(d)
    finally:
        t.close()


def test_a_buffer_a_view_still_points_into_is_never_recycled(tmp_path):
    t, data = _tier(tmp_path, 2)
    try:
        (h,) = t.open_many(["k0"], [b"k0"])
        assert h is not None
        v = t.view(h, 0, OBJ)
        arr = np.frombuffer(t.view(h, 10, 100), np.uint8)  # numpy over a view: an export too
        t.release(h)
        assert t._free_bytes == 0  # kept by its views
        (h2,) = t.open_many(["k1"], [b"k1"])
        assert h2 is not None and bytes(t.view(h2, 0, OBJ)) == data[b"k1"]
        assert bytes(v) == data[b"k0"] and arr.tobytes() == data[b"k0"][10:110]  # not overwritten
        t.release(h2)
        assert t._free_bytes == BUF
    finally:
        t.close()


def test_a_damaged_file_read_into_a_recycled_buffer_is_still_a_miss(tmp_path):
    t, data = _tier(tmp_path, 3)
    try:
        (h,) = t.open_many(["k0"], [b"k0"])
        assert h is not None
        t.release(h)
        assert t._free_bytes == BUF
        _garble(_path(tmp_path, b"k1"), fmt.HEADER_BYTES + 17)
        with open(_path(tmp_path, b"k2"), "r+b") as f:  # torn
            f.truncate(fmt.HEADER_BYTES + OBJ // 2)
        assert t.open_many(["k1", "k2"], [b"k1", b"k2"]) == [None, None]
        assert t.stats()["disk_corrupt"] == 2 and t._kept == 0 and t._free_bytes == BUF
    finally:
        t.close()


def test_recycled_buffers_stay_within_free_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "FREE_BYTES", BUF + BUF // 2)
    t, data = _tier(tmp_path, 3)
    try:
        keys = list(data)
        hs = t.open_many([k.decode() for k in keys], keys)
        for h in hs:
            assert h is not None
            t.release(h)
        assert t._free_bytes == BUF and t._kept == 0
    finally:
        t.close()
