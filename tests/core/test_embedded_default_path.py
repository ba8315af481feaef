"""The embedded pool's default directory (``lw_core.backends.embedded_defaults.default_embedded_path``).

``/dev/shm/lw-pool-<uid>`` can be made first by another local user (the pool then refuses it), so
the default is the user's private runtime directory (``$XDG_RUNTIME_DIR``, ``/run/user/<uid>``)
when that is one: ours, not writable by group or others, on tmpfs. Otherwise ``/dev/shm``.
Environment, ``/dev/shm`` and the mount table are monkeypatched here.
"""

from __future__ import annotations

import os

import pytest

from lw_core.backend import BackendError
from lw_core.backends import embedded_defaults
from lw_core.config import parse_config


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A runtime dir (0700, ours) on a tmpfs mount, and a writable stand-in for /dev/shm."""
    run = tmp_path / "run" / "user" / "1000"
    run.mkdir(parents=True, mode=0o700)
    run.chmod(0o700)
    shm = tmp_path / "shm"
    shm.mkdir()
    mounts = tmp_path / "mounts"

    def mount(fstype: str, where=run) -> None:
        mounts.write_text(
            f"/dev/root / ext4 rw 0 0\nnone {tmp_path} ext4 rw 0 0\ntmpfs {shm} tmpfs rw 0 0\n"
            f"tmpfs {where} {fstype} rw,nosuid,nodev,relatime,mode=700 0 0\n"
        )

    mount("tmpfs")
    monkeypatch.setattr(embedded_defaults, "MOUNTS", str(mounts))
    monkeypatch.setattr(embedded_defaults, "SHM_DIR", str(shm))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    return run, shm, mount


def test_private_runtime_dir_is_the_default(host):
    run, _, _ = host
    assert embedded_defaults.default_embedded_path() == str(run / "lw-pool")
    assert parse_config({}).backend_keys.embedded_path == str(run / "lw-pool")


def test_runtime_dir_whose_mount_point_has_a_space(host, tmp_path, monkeypatch):
    _, _, mount = host
    spaced = tmp_path / "run user"
    spaced.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(spaced))
    mount("tmpfs", str(spaced).replace(" ", "\\040"))  # as /proc/self/mounts writes it
    assert embedded_defaults.default_embedded_path() == str(spaced / "lw-pool")


def test_a_runtime_dir_too_small_for_the_default_pool_keeps_dev_shm(host, monkeypatch):
    """logind sizes /run/user/<uid> at 10 % of RAM: a 4 GiB default pool must not be refused there."""
    _, shm, _ = host
    real = os.statvfs

    def small(path):
        v = real(path)
        return os.statvfs_result((v.f_bsize, 4096, (3 << 30) // 4096, *v[3:]))

    monkeypatch.setattr(os, "statvfs", small)
    assert embedded_defaults.default_embedded_path() == _shm_default(shm)


def _shm_default(shm) -> str:
    return str(shm / f"lw-pool-{os.getuid()}")


def test_no_runtime_dir_falls_back_to_dev_shm(host, monkeypatch):
    _, shm, _ = host
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert embedded_defaults.default_embedded_path() == _shm_default(shm)


@pytest.mark.parametrize("value", ["", "relative/run", "/no/such/dir"])
def test_unusable_runtime_dir_value_falls_back(host, monkeypatch, value):
    _, shm, _ = host
    monkeypatch.setenv("XDG_RUNTIME_DIR", value)
    assert embedded_defaults.default_embedded_path() == _shm_default(shm)


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o702])
def test_runtime_dir_writable_by_others_falls_back(host, mode):
    run, shm, _ = host
    run.chmod(mode)
    assert embedded_defaults.default_embedded_path() == _shm_default(shm)


def test_runtime_dir_of_another_user_falls_back(host, monkeypatch):
    _, shm, _ = host  # e.g. `su` kept the first user's XDG_RUNTIME_DIR
    monkeypatch.setattr(embedded_defaults.os, "geteuid", lambda: os.stat(host[0]).st_uid + 1)
    assert embedded_defaults.default_embedded_path() == _shm_default(shm)


def test_runtime_dir_not_on_tmpfs_falls_back(host):
    run, shm, mount = host
    mount("ext4")
    assert embedded_defaults.default_embedded_path() == _shm_default(shm)


def test_runtime_dir_that_is_a_file_falls_back(host, tmp_path, monkeypatch):
    _, shm, _ = host
    f = tmp_path / "file"
    f.write_text("")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(f))
    assert embedded_defaults.default_embedded_path() == _shm_default(shm)


def test_default_pool_opens_in_the_runtime_dir(host):
    from lw_core.backends.embedded import EmbeddedBackend

    run, _, _ = host
    with EmbeddedBackend.from_keys(parse_config({"embedded_capacity_bytes": 1 << 20}).backend_keys) as b:
        assert b.path == str(run / "lw-pool") and b.lookup(["x"]) == 0
    assert (run / "lw-pool" / "LW_POOL").is_file() and (run / "lw-pool").stat().st_mode & 0o777 == 0o700


def test_dev_shm_default_taken_by_another_user_is_refused_naming_the_owner(host, monkeypatch):
    """The fallback's risk, which the private default avoids: the refusal says what to do."""
    from lw_core.backends.embedded import EmbeddedBackend

    _, shm, _ = host
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    squatted = shm / f"lw-pool-{os.getuid()}"
    squatted.mkdir(mode=0o700)
    other = os.stat(squatted).st_uid + 1
    monkeypatch.setattr(embedded_defaults.os, "geteuid", lambda: other)  # we are now not its owner
    with pytest.raises(BackendError, match="owned by another user.*set embedded_path"):
        EmbeddedBackend(embedded_defaults.default_embedded_path(), capacity_bytes=1 << 20)
