"""The embedded pool's directory and files:

* a directory or file of another user, or writable by others, or a symlink, is refused with a
  message naming the path, owner and mode; everything is created 0600 / 0700;
* only an empty directory or a pool (``LW_POOL`` marker) is used;
* a full filesystem gives BackendError/PoolFull, never SIGBUS (a real small tmpfs, filled up);
* a truncated arena is rebuilt (alone) or refused (others attached), and a pool directory
  deleted while attached is noticed and re-attached.

The full-filesystem child runs this same file (``python test_embedded_files.py PATH``).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys

import numpy as np
import pytest

from lw_core.backend import BackendError, ObjectMissing
from lw_core.backends import embedded
from lw_core.backends.embedded import EmbeddedBackend

MiB = 1 << 20
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown files to another uid / mount a tmpfs")


def _pool(path, **kw) -> EmbeddedBackend:
    return EmbeddedBackend(str(path), capacity_bytes=kw.pop("capacity_bytes", 1 * MiB), **kw)


def test_everything_is_created_private(tmp_path):
    _pool(tmp_path / "p").close()
    p = tmp_path / "p"
    assert stat.S_IMODE(p.stat().st_mode) == 0o700
    names = sorted(os.listdir(p))
    assert {"LW_POOL", "index.lmdb", "index.lmdb-lock", "arena", "leases"} <= set(names)
    for n in names:
        assert stat.S_IMODE((p / n).stat().st_mode) == 0o600, (n, oct((p / n).stat().st_mode))


@needs_root
@pytest.mark.parametrize("what", ["dir-owner", "dir-mode", "file-owner", "file-mode"])
def test_foreign_or_loose_pool_is_refused(tmp_path, what):
    p = tmp_path / "p"
    _pool(p).close()
    target = p if what.startswith("dir") else p / "arena"
    if what.endswith("owner"):
        os.chown(target, 65534, 65534)
    else:
        os.chmod(target, 0o777 if target == p else 0o666)
    with pytest.raises(BackendError) as ei:
        _pool(p)
    msg = str(ei.value)
    assert repr(str(target)) in msg
    if what.endswith("owner"):
        assert "owned by another user" in msg and "uid 65534" in msg
    else:
        assert "writable by group or others" in msg and ("0777" in msg or "0666" in msg)
    assert "embedded_path" in msg


@needs_root
def test_pool_precreated_by_another_user_is_not_joined(tmp_path):
    p = tmp_path / "p"
    p.mkdir(mode=0o777)
    os.chmod(p, 0o777)
    os.chown(p, 65534, 65534)
    with pytest.raises(BackendError, match="owned by another user"):
        _pool(p)
    assert os.listdir(p) == [], "nothing may be created in a directory we refused"


def test_symlinks_are_refused(tmp_path):
    real = tmp_path / "real"
    _pool(real).close()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(BackendError, match="symbolic link"):
        _pool(tmp_path / "link")
    # a pool file replaced by a symlink (to a file we own) is not followed
    os.rename(real / "leases", tmp_path / "leases.moved")
    (real / "leases").symlink_to(tmp_path / "leases.moved")
    with pytest.raises(BackendError, match="symbolic link"):
        _pool(real)


@pytest.mark.parametrize("contents", [["passwd", "hosts"], ["arena", "notes.txt"]])
def test_directory_with_unrelated_files_is_refused(tmp_path, contents):
    d = tmp_path / "etc"
    d.mkdir()
    for n in contents:
        (d / n).write_text("precious\n")
    with pytest.raises(BackendError, match="neither empty nor an lw-pool directory") as ei:
        _pool(d)
    assert "notes.txt" in str(ei.value) or "passwd" in str(ei.value)
    assert sorted(os.listdir(d)) == sorted(contents)
    assert all((d / n).read_text() == "precious\n" for n in contents), "a file there was replaced"


def test_root_directory_is_refused():
    with pytest.raises(BackendError, match="neither empty nor an lw-pool directory"):
        _pool("/")


def test_empty_directory_and_unmarked_old_pool_are_used(tmp_path):
    d = tmp_path / "empty"
    d.mkdir(mode=0o700)
    _pool(d).close()
    assert (d / "LW_POOL").read_bytes().startswith(b"lw-pool ")
    (d / "LW_POOL").unlink()  # a pool made before the marker existed: only our own file names
    with _pool(d) as b:
        assert b.lookup(["x"]) == 0
    assert (d / "LW_POOL").exists()


def test_capacity_beyond_free_space_is_a_clear_error(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    # refused before allocating anything (not by filling the disk until fallocate fails)
    with pytest.raises(BackendError, match="bytes free") as ei:
        _pool(tmp_path / "p", capacity_bytes=(free // MiB + 1024) * MiB)
    assert "embedded_capacity_bytes" in str(ei.value)
    assert not (tmp_path / "p" / "arena").exists()


def test_truncated_arena_is_rebuilt_when_alone_and_refused_when_not(tmp_path):
    p = tmp_path / "p"
    with _pool(p) as b:
        hs = b.reserve(["k"], 4096)
        b.commit(hs)
    os.truncate(p / "arena", 4096)
    with _pool(p) as b:  # alone: it is a cache, rebuild
        assert b.lookup(["k"]) == 0 and os.path.getsize(p / "arena") == 1 * MiB
        os.truncate(p / "arena", 4096)  # damaged while another process is attached
        with pytest.raises(BackendError, match="truncated or damaged") as ei:
            _pool(p)
        assert "other processes use it" in str(ei.value)


def test_deleted_pool_directory_is_noticed_and_reattached(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded.backend, "POOL_CHECK_S", 0.0)
    p = tmp_path / "p"
    a = _pool(p)
    try:
        (ha,) = a.reserve(["old"], 4096)
        a.commit([ha])
        (ra,) = a.open(["old"])
        (wa,) = a.reserve(["pending"], 4096)
        shutil.rmtree(p)
        with _pool(p) as b:  # a new process makes a new pool at the same path
            (hb,) = b.reserve(["new"], 4096)
            b.write([hb], [0], [np.full(4096, 7, np.uint8)])
            b.commit([hb])
            assert a.lookup(["new"]) == 1, "the attached process kept using the deleted pool"
            assert a.stats()["reattached"] == 1
            out = np.zeros(4096, np.uint8)
            (h,) = a.open(["new"])
            a.read([h], [0], [out])
            assert (out == 7).all()
            a.release([h])
            with pytest.raises(ObjectMissing, match="deleted|re-created"):
                a.read([ra], [0], [out])  # a handle on the old pool is stale
            with pytest.raises(ObjectMissing):
                a.write([wa], [0], [bytes(16)])  # its offset means nothing in the new arena
            with pytest.raises(ObjectMissing):
                a.commit([wa])  # nor its id in the new index
            assert b.lookup(["pending"]) == 0
            (w,) = a.reserve(["w"], 4096)
            assert w is not None and b.lookup(["w"]) == 0  # one pool: b sees the reservation's key as in flight
            a.abort([w])
    finally:
        a.close()


# ----------------------------------------------------------------------------- full filesystem


def _fill_child(path: str) -> None:
    """Use the pool after the filesystem filled up: every outcome must be an exception."""
    from lw_core.backend import BackendError as BE

    b = EmbeddedBackend(path, capacity_bytes=2 * MiB)
    ok = errors = 0
    for i in range(1000):  # long keys grow the index past its first pages
        keys = [f"{i:06d}-{j}-" + "k" * 400 for j in range(4)]
        try:
            hs = [h for h in b.reserve(keys, 4096) if h is not None]
            b.write(hs, [0] * len(hs), [bytes(4096)] * len(hs))
            b.commit(hs)
            b.release(b.open(keys))
            ok += 1
        except BE:
            errors += 1
    try:
        b.verify()
        print(f"ok={ok} errors={errors} consistent", flush=True)
    except BE as e:
        print(f"ok={ok} errors={errors} verify: {e}", flush=True)


@needs_root
def test_full_filesystem_is_an_error_never_sigbus(tmp_path):
    mnt = tmp_path / "shm"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        path = str(mnt / "pool")
        _pool(path, capacity_bytes=2 * MiB).close()
        with open(mnt / "filler", "wb", buffering=0) as f:  # another tenant fills /dev/shm, to the last page
            for chunk in (1 << 20, 1 << 16, 1 << 12):
                try:
                    while True:
                        f.write(bytes(chunk))
                except OSError:
                    pass
        assert shutil.disk_usage(mnt).free < 4096
        p = subprocess.run([sys.executable, __file__, path], capture_output=True, text=True, timeout=240)
        assert p.returncode >= 0, f"killed by {signal.Signals(-p.returncode).name}: {p.stderr[-2000:]}"
        assert p.returncode == 0, p.stderr[-2000:]
        assert "ok=" in p.stdout and "ok=0 " not in p.stdout, p.stdout  # the reserved space keeps it working
        assert "consistent" in p.stdout, p.stdout
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


if __name__ == "__main__":
    _fill_child(sys.argv[1])
