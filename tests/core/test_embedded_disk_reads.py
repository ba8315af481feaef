"""The disk tier's read path (embedded/disk_tier.py, disk_format.py format 3): ``open_many``
checks only the headers; each segment (64 KiB) is read and checked against its CRC-32 before any
byte of it is handed out, by reader threads segment-major (the first layers first) or by the read
that wants it. A damaged segment in the middle of a file, a file torn before or after open, an
old-format file: misses or ``ObjectMissing``, never wrong bytes. Ranged reads across segment
boundaries, held in memory or read from the file, give the bytes written. Released payload
buffers are recycled for the next hit (never one a view still points into) and never serve
stale bytes."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

import numpy as np
import pytest

from lw_core.backend import ObjectMissing
from lw_core.backends.embedded import disk_format as fmt
from lw_core.backends.embedded import disk_tier
from lw_core.backends.embedded.disk_format import DiskHandle
from lw_core.backends.embedded.disk_tier import DiskTier

OBJ = 300_000  # 4 whole segments and a partial one
SEG = fmt.SEGMENT


def _tier(tmp_path, n: int) -> tuple[DiskTier, dict[bytes, bytes]]:
    t = DiskTier(str(tmp_path / "disk"), 64 << 20, queue_bytes=32 << 20)
    rng = np.random.default_rng(7)
    data = {f"k{i}".encode(): rng.integers(0, 256, OBJ, dtype=np.uint8).tobytes() for i in range(n)}
    for k, v in data.items():
        t.offer(k, memoryview(v))
    assert t.flush()
    return t, data


def _path(tmp_path, bkey: bytes) -> str:
    return os.path.join(str(tmp_path / "disk"), fmt.file_name(bkey))


def _garble(p: str, at: int) -> None:
    with open(p, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


def _on_demand(monkeypatch) -> None:
    """No reader threads: every segment is read by the read that wants it (deterministic)."""
    monkeypatch.setattr(DiskTier, "_schedule", lambda self, handles: None)


def _whole(t: DiskTier, h: DiskHandle) -> bytes:
    out = bytearray(h.nbytes)
    t.read(h, 0, out)
    return bytes(out)


def test_open_checks_headers_only_and_a_damaged_payload_is_a_failed_read_never_wrong_bytes(tmp_path):
    t, data = _tier(tmp_path, 24)
    try:
        keys = list(data)
        head = fmt.header_bytes(2, OBJ)
        payload_bad = {keys[3]: head + OBJ - 1, keys[10]: head}  # the last segment, the first
        header_bad = {keys[17]: 40}
        for k, at in {**payload_bad, **header_bad}.items():
            _garble(_path(tmp_path, k), at)
        asked = [*keys, b"absent"]
        hs = t.open_many([k.decode() for k in asked], asked)
        assert [h is None for h in hs] == [k in header_bad or k == b"absent" for k in asked]
        for k, h in zip(asked, hs):
            if h is None:
                continue
            assert h.key == k.decode()
            if k in payload_bad:
                with pytest.raises(ObjectMissing, match="checksum mismatch"):
                    _whole(t, h)
                with pytest.raises(ObjectMissing):
                    t.view(h, 0, 10)  # the object failed: no range of it is handed out
                continue
            assert _whole(t, h) == data[k]
            assert bytes(t.view(h, 777, 1000)) == data[k][777:1777]
        st = t.stats()
        assert st["disk_corrupt"] == 3 and st["disk_hits"] == 23 and st["disk_objects"] == 21
        assert not any(os.path.exists(_path(tmp_path, k)) for k in (*payload_bad, *header_bad))
        for h in hs:
            if h is not None:
                t.release(h)
        assert t._kept == 0
    finally:
        t.close()


def test_a_damaged_segment_in_the_middle_fails_every_read_that_reaches_it(tmp_path, monkeypatch):
    _on_demand(monkeypatch)
    t, data = _tier(tmp_path, 1)
    try:
        _garble(_path(tmp_path, b"k0"), fmt.header_bytes(2, OBJ) + 2 * SEG + 100)  # segment 2 of 5
        h = t.open("k0", b"k0")
        assert h is not None and h.state is not None
        assert bytes(t.view(h, 10, SEG)) == data[b"k0"][10 : SEG + 10]  # segments 0 and 1 only
        assert list(h.state) == [DiskHandle.OK, DiskHandle.OK, 0, 0, 0]  # read per range, not whole
        out = np.zeros(SEG, np.uint8)
        with pytest.raises(ObjectMissing, match="segment 2 checksum mismatch"):
            t.read(h, 2 * SEG - 5, out)  # crosses into segment 2
        assert not out.any()  # nothing of it reached dst
        with pytest.raises(ObjectMissing):
            t.view(h, 0, 10)  # checked before, but the object is damaged: a miss from now on
        t.release(h)
        assert t.stats()["disk_corrupt"] == 1 and not os.path.exists(_path(tmp_path, b"k0"))
        assert t.open("k0", b"k0") is None
    finally:
        t.close()


@pytest.mark.parametrize("held", [True, False])
def test_ranged_reads_across_segment_boundaries_give_the_bytes_written(tmp_path, monkeypatch, held):
    if not held:
        monkeypatch.setattr(disk_tier, "KEEP_BYTES", 0)
    t, data = _tier(tmp_path, 3)
    rng = np.random.default_rng(3)
    ranges = [(0, OBJ), (0, SEG), (SEG, SEG), (4 * SEG, OBJ - 4 * SEG), (SEG - 1, 2), (SEG - 7, 2 * SEG + 14),
              (OBJ - 1, 1), (OBJ, 0), (3 * SEG, 0)]
    ranges += [(int(o), int(rng.integers(0, OBJ - o + 1))) for o in rng.integers(0, OBJ, 40)]
    try:
        keys = list(data)
        hs = t.open_many([k.decode() for k in keys], keys)
        for k, h in zip(keys, hs):
            assert h is not None and (h.state is not None) == held
            for off, n in ranges:
                out = bytearray(n)
                t.read(h, off, out)
                assert out == data[k][off : off + n], (off, n)
                assert bytes(t.view(h, off, n)) == data[k][off : off + n], (off, n)
        assert t.stats()["disk_corrupt"] == 0
        for h in hs:
            assert h is not None
            t.release(h)
    finally:
        t.close()


@pytest.mark.parametrize("held", [True, False])
def test_a_file_torn_under_an_open_handle_is_a_failed_read(tmp_path, monkeypatch, held):
    _on_demand(monkeypatch)
    if not held:
        monkeypatch.setattr(disk_tier, "KEEP_BYTES", 0)
    t, data = _tier(tmp_path, 2)
    try:
        h = t.open("k0", b"k0")
        assert h is not None
        assert bytes(t.view(h, 0, 100)) == data[b"k0"][:100]
        with open(_path(tmp_path, b"k0"), "r+b") as f:
            f.truncate(fmt.header_bytes(2, OBJ) + 3 * SEG + 10)
        with pytest.raises(ObjectMissing, match="short"):
            t.view(h, OBJ - 100, 100)
        t.release(h)
        with open(_path(tmp_path, b"k1"), "r+b") as f:  # torn before open: its header says more
            f.truncate(fmt.header_bytes(2, OBJ) + OBJ // 2)
        assert t.open_many(["k0", "k1"], [b"k0", b"k1"]) == [None, None]
        assert t.stats()["disk_corrupt"] == 2
    finally:
        t.close()


def _format_2_header(bkey: bytes, payload: bytes) -> bytes:
    """The header the format before this one wrote: one CRC-32 over the whole payload."""
    fields = struct.pack("<8sIIQQ32s", fmt.MAGIC, 2, len(bkey), len(payload), 5,
                         zlib.crc32(payload).to_bytes(4, "little") + bytes(28))
    head = fields + hashlib.blake2b(fields + bkey, digest_size=16).digest() + bkey
    return head + bytes(4096 - len(head))


def test_old_format_files_are_misses_and_removed(tmp_path):
    t, _ = _tier(tmp_path, 0)
    payload = os.urandom(OBJ)
    with open(_path(tmp_path, b"old-0"), "wb") as f:
        f.write(_format_2_header(b"old-0", payload) + payload)
    try:
        assert t.open_many(["old-0", "old-1"], [b"old-0", b"old-1"]) == [None, None]
        assert t.stats()["disk_corrupt"] == 1 and not os.path.exists(_path(tmp_path, b"old-0"))
    finally:
        t.close()
    with open(_path(tmp_path, b"old-1"), "wb") as f:
        f.write(_format_2_header(b"old-1", payload) + payload)
    t = DiskTier(str(tmp_path / "disk"), 64 << 20, queue_bytes=1)  # a restart's scan removes them
    try:
        assert t.stats()["disk_corrupt"] == 1 and t.stats()["disk_objects"] == 0
        assert not os.path.exists(_path(tmp_path, b"old-1"))
    finally:
        t.close()


def test_segments_are_queued_run_major_across_a_hits_objects(tmp_path, monkeypatch):
    got: list[tuple[str, int]] = []
    monkeypatch.setattr(DiskTier, "_drain", lambda self: None)  # the queue stays as queued
    monkeypatch.setattr(disk_tier, "READERS", 1)
    t, data = _tier(tmp_path, 3)
    try:
        hs = t.open_many(["k0", "k1", "k2"], list(data))
        got = [(h.key, a, b) for h, a, b in t._jobs]
        runs = [(a, min(a + disk_tier.RUN, 5)) for a in range(0, 5, disk_tier.RUN)]
        assert got == [(f"k{i}", a, b) for a, b in runs for i in range(3)]
        t._jobs.clear()
        for h in hs:
            assert h is not None
            assert _whole(t, h) == data[h.key.encode()]  # reads read what no reader took
            t.release(h)
    finally:
        t.close()


def test_reads_serve_the_bytes_checked_not_what_the_file_holds_later(tmp_path):
    t, data = _tier(tmp_path, 1)
    try:
        (h,) = t.open_many(["k0"], [b"k0"])
        assert h is not None and h.data is not None
        assert _whole(t, h) == data[b"k0"]  # every segment read and checked
        _garble(_path(tmp_path, b"k0"), fmt.header_bytes(2, OBJ) + 5)  # damaged after the check
        out = np.zeros(OBJ, np.uint8)
        t.read(h, 0, out)
        assert out.tobytes() == data[b"k0"]
        v = t.view(h, 0, OBJ)
        assert v.readonly and bytes(v) == data[b"k0"]
        t.release(h)
        assert bytes(v) == data[b"k0"]  # a view outlives its handle's release
        with pytest.raises(ObjectMissing, match="released"):
            t.read(h, 0, out)
    finally:
        t.close()


def test_a_new_process_checks_each_file_again_and_a_damaged_one_fails(tmp_path):
    t, data = _tier(tmp_path, 2)
    h = t.open("k0", b"k0")
    assert h is not None and _whole(t, h) == data[b"k0"]
    t.release(h)
    assert t._verified  # checked whole: this process's later opens skip the checksums
    t.close()
    _garble(_path(tmp_path, b"k0"), fmt.header_bytes(2, OBJ) + OBJ // 2)
    t = DiskTier(str(tmp_path / "disk"), 64 << 20, queue_bytes=32 << 20)
    try:
        h0, h1 = t.open_many(["k0", "k1"], [b"k0", b"k1"])
        assert h0 is not None and h1 is not None
        with pytest.raises(ObjectMissing, match="checksum"):
            _whole(t, h0)
        assert _whole(t, h1) == data[b"k1"]
        t.release(h0)
        t.release(h1)
        assert t.stats()["disk_corrupt"] == 1
    finally:
        t.close()


def test_past_the_memory_budget_handles_read_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "KEEP_BYTES", 2 * OBJ)
    t, data = _tier(tmp_path, 4)
    try:
        keys = list(data)
        _garble(_path(tmp_path, keys[3]), fmt.header_bytes(2, OBJ) + SEG + 1)
        hs = t.open_many([k.decode() for k in keys], keys)
        assert all(h is not None for h in hs)
        assert sum(h.data is not None for h in hs) == 2 and t._kept == 2 * OBJ
        for k, h in zip(keys[:3], hs):
            out = bytearray(300)
            t.read(h, OBJ - 300, out)
            assert out == data[k][-300:] and bytes(t.view(h, 1, 2)) == data[k][1:3]
        out = bytearray(SEG)
        with pytest.raises(ObjectMissing, match="segment 1 checksum mismatch"):
            t.read(hs[3], SEG, out)  # segment-aligned: read straight into dst, then failed
        for h in hs:
            t.release(h)
        assert t._kept == 0 and t.stats()["disk_corrupt"] == 1
    finally:
        t.close()


def test_released_payload_buffers_are_recycled_and_serve_the_next_hits_own_bytes(tmp_path):
    t, data = _tier(tmp_path, 4)
    try:
        keys = list(data)
        a, b = t.open_many([k.decode() for k in keys[:2]], keys[:2])
        assert a is not None and b is not None
        bufs = {id(a.data), id(b.data)}
        assert _whole(t, a) == data[keys[0]] and _whole(t, b) == data[keys[1]]
        t.release(a)
        t.release(b)
        assert t._free_bytes == 2 * OBJ and t._kept == 0
        c, d = t.open_many([k.decode() for k in keys[2:]], keys[2:])
        assert c is not None and d is not None
        assert {id(c.data), id(d.data)} == bufs and t._free_bytes == 0  # no fresh pages
        for k, h in zip(keys[2:], (c, d)):  # the new objects' bytes, nothing left of the old ones
            assert bytes(t.view(h, 0, OBJ)) == data[k]
            assert _whole(t, h) == data[k]
        t.release(c)
        t.release(d)
    finally:
        t.close()


def test_a_handle_released_with_reads_in_flight_is_closed_by_the_last_one(tmp_path, monkeypatch):
    _on_demand(monkeypatch)
    t, data = _tier(tmp_path, 1)
    try:
        h = t.open("k0", b"k0")
        assert h is not None and h.data is not None
        with t._rd:  # a reader has claimed segment 0
            h.state[0] = DiskHandle.READING
            h.inflight += 1
            fd, buf = h._fd, h.data
        t.release(h)
        assert h._fd < 0 and h.closing is not None and t._kept == OBJ  # not closed, not recycled yet
        with pytest.raises(ObjectMissing, match="released"):
            t.view(h, 0, 10)
        t._read_segments(h, 0, 1, fd, buf)  # the reader finishes: closes the file, recycles the buffer
        assert h.closing is None and t._kept == 0 and t._free_bytes == OBJ
        with pytest.raises(OSError):
            os.fstat(fd)
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
        assert t._free_bytes == OBJ
    finally:
        t.close()


def test_recycled_buffers_stay_within_free_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "FREE_BYTES", OBJ + OBJ // 2)
    t, data = _tier(tmp_path, 3)
    try:
        keys = list(data)
        hs = t.open_many([k.decode() for k in keys], keys)
        for h in hs:
            assert h is not None
            _whole(t, h)
            t.release(h)
        assert t._free_bytes == OBJ and t._kept == 0
    finally:
        t.close()
