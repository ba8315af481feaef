"""The disk tier's directory shared by several processes (embedded/disk_dir.py): its marker records the
capacity and another capacity is refused (naming the key and both values) instead of evicting the
others' files down to it; start-up lists the directory in the background and reads no header;
every process evicts against one byte count, so files other processes wrote since its last
listing count at once; a demotion's temporary file is removed only once its writer is known dead
by the pid-namespace-safe rule of ``lw_core.procs``, else once it is old."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from lw_core.backend import BackendError
from lw_core.backends.embedded import disk_dir, disk_tier
from lw_core.backends.embedded import disk_format as fmt
from lw_core.backends.embedded.disk_tier import DiskTier
from lw_core.procs import boot_id, current_owner

OBJ = 200_000
FILE = fmt.HEADER_BYTES + OBJ
CAP = 64 << 20


def _objects(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(fmt.SUFFIX))


def _demote(t: DiskTier, *keys: bytes) -> None:
    for k in keys:
        t.offer(k, memoryview(bytes(OBJ)))
        assert t.flush()
        time.sleep(0.02)  # modification times order the files


def test_the_marker_records_the_capacity_and_another_capacity_is_refused_naming_both(tmp_path):
    d = str(tmp_path / "disk")
    a = DiskTier(d, 3 * FILE, queue_bytes=8 << 20)
    try:
        _demote(a, b"a0", b"a1", b"a2")
        with pytest.raises(BackendError) as e:
            DiskTier(d, FILE, queue_bytes=8 << 20)  # it would evict two of a's files to fit its own limit
        for words in (f"embedded_disk_capacity_bytes={FILE} ", f"embedded_disk_capacity_bytes={3 * FILE} ", d):
            assert words in str(e.value)
        assert len(_objects(d)) == 3 and all(a.has(k) for k in (b"a0", b"a1", b"a2"))
        b = DiskTier(d, 3 * FILE, queue_bytes=8 << 20)  # the same capacity is welcome
        b.close()
        assert f"capacity_bytes={3 * FILE}\n" in (tmp_path / "disk" / disk_dir.MARKER).read_text()
    finally:
        a.close()


def test_a_marker_written_before_capacities_were_recorded_gets_the_first_openers(tmp_path):
    d = tmp_path / "disk"
    d.mkdir(mode=0o700)
    (d / disk_dir.MARKER).write_bytes(b"lw-pool disk tier 1\n")
    DiskTier(str(d), CAP, queue_bytes=8 << 20).close()
    assert (d / disk_dir.MARKER).read_text() == f"lw-pool disk tier 1\ncapacity_bytes={CAP}\n"
    with pytest.raises(BackendError, match="embedded_disk_capacity_bytes"):
        DiskTier(str(d), 2 * CAP, queue_bytes=8 << 20)


def test_start_up_reads_no_header_and_lists_the_directory_in_the_background(tmp_path, monkeypatch):
    d = str(tmp_path / "disk")
    t = DiskTier(d, CAP, queue_bytes=8 << 20)
    _demote(t, *(f"k{i}".encode() for i in range(6)))
    t.close()
    headers = []
    real_header, real_listing = fmt.read_header, disk_dir.TierDir.listing
    go = threading.Event()

    def counted(fd: int, bkey: bytes | None = None) -> fmt.Header:
        headers.append(bkey)
        return real_header(fd, bkey)

    def held_listing(self: disk_dir.TierDir) -> list[tuple[int, str, int]]:
        assert go.wait(30)
        return real_listing(self)

    monkeypatch.setattr(fmt, "read_header", counted)
    monkeypatch.setattr(disk_dir.TierDir, "listing", held_listing)
    t = DiskTier(d, CAP, queue_bytes=8 << 20)  # returns while the listing is held
    try:
        assert headers == [] and t.stats()["disk_objects"] == 0
        h = t.open("k3", b"k3")  # found by name meanwhile
        assert h is not None and headers == [b"k3"]
        t.release(h)
        go.set()
        assert t.flush()
        assert t.stats()["disk_objects"] == 6 and headers == [b"k3"]  # the listing opened no file
    finally:
        go.set()
        t.close()


@pytest.mark.parametrize("relist", [True, False])
def test_processes_count_each_others_new_files_between_listings(tmp_path, monkeypatch, relist):
    """With or without listing before an eviction, the directory stays under its capacity; with
    it, the least recently used file of all processes goes, else this process's own."""
    monkeypatch.setattr(disk_tier, "RESCAN_S", 3600.0)  # no periodic listing during the test
    monkeypatch.setattr(disk_tier, "RELIST_S", 0.0 if relist else 3600.0)
    d = str(tmp_path / "disk")
    a = DiskTier(d, 3 * FILE, queue_bytes=8 << 20)
    b = DiskTier(d, 3 * FILE, queue_bytes=8 << 20)
    try:
        assert a.flush() and b.flush()  # both listed the (empty) directory
        _demote(a, b"a0", b"a1")
        _demote(b, b"b0", b"b1")  # b never listed a's files: the shared count holds them
        names = _objects(d)
        gone = b"a0" if relist else b"b0"  # the oldest of all, or the oldest b knew of
        assert len(names) == 3 and fmt.file_name(gone) not in names
        sizes = sum(os.path.getsize(os.path.join(d, n)) for n in names)
        raw = (tmp_path / "disk" / disk_dir.COUNT).read_bytes()
        assert sizes == 3 * FILE == int.from_bytes(raw, "little")
        _demote(a, b"a2")  # a's own index still holds a0 (gone): it evicts by the count, not its view
        assert len(_objects(d)) == 3
    finally:
        a.close()
        b.close()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_temporary_is_removed_once_its_writer_is_known_dead_never_by_a_pid_of_another_namespace(tmp_path):
    d = tmp_path / "disk"
    DiskTier(str(d), CAP, queue_bytes=8 << 20).close()
    me, boot = current_owner(), boot_id().hex()
    dead = _dead_pid()
    names = {
        "dead here": f"{disk_dir.TMP_PREFIX}{boot}-{me.pidns}-{dead}-1-aa",
        "alive here": f"{disk_dir.TMP_PREFIX}{boot}-{me.pidns}-{me.pid}-{me.start}-bb",
        "other namespace": f"{disk_dir.TMP_PREFIX}{boot}-{me.pidns + 1}-{dead}-1-cc",
        "other namespace, old": f"{disk_dir.TMP_PREFIX}{boot}-{me.pidns + 1}-{dead}-1-dd",
        "older version's name": f"{disk_dir.TMP_PREFIX}{dead}-ee",  # a bare pid: whose namespace?
        "other boot": f"{disk_dir.TMP_PREFIX}{'0' * 32}-{me.pidns}-{dead}-1-ff",
    }
    for n in names.values():
        (d / n).write_bytes(b"x")
    old = time.time() - disk_dir.STALE_TMP_S - 60
    os.utime(d / names["other namespace, old"], (old, old))
    t = DiskTier(str(d), CAP, queue_bytes=8 << 20)
    try:
        assert t.flush()
        left = {what for what, n in names.items() if (d / n).exists()}
        assert left == {"alive here", "other namespace", "older version's name", "other boot"}
    finally:
        t.close()
