"""lw-memcache pieces that need no running pool: configs, errors, CLI, stand-in, copy directions."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from mc_support import HAVE_MEMCACHE, needs_memcache

from lw_core.backend import BackendError, BackendUnavailable, ObjectMissing
from lw_core.config import parse_config
from lw_memcache import backend as mb
from lw_memcache import copies, errors
from lw_memcache.conf import ConfError, local_config_fields, parse_size, read_conf, write_local_conf, write_meta_conf
from lw_memcache.handles import MemcacheHandle


def test_importing_lw_memcache_does_not_import_memcache_hybrid():
    code = "import sys, lw_memcache; print('memcache_hybrid' in sys.modules, '_pymmc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize(("value", "n"), [(134217728, 134217728), ("2048K", 2 << 20), ("200MB", 200 << 20), ("2.5GB", int(2.5 * (1 << 30))), ("1tb", 1 << 40)])
def test_parse_size(value, n):
    assert parse_size(value) == n


@pytest.mark.parametrize("bad", ["", "12 parsecs", "-1MB", 0, "2TB", True])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfError, match="dram_size"):
        parse_size(bad)


def test_written_confs_round_trip(tmp_path):
    meta = write_meta_conf(tmp_path / "m.conf", meta_url="tcp://127.0.0.1:1", config_store_url="tcp://127.0.0.1:2", metrics_url="http://127.0.0.1:3")
    local = write_local_conf(tmp_path / "l.conf", meta_url="tcp://127.0.0.1:1", config_store_url="tcp://127.0.0.1:2", protocol="host_tcp", dram_size="1GB", hcom_url="tcp://127.0.0.1:4")
    m, lc = read_conf(meta), read_conf(local)
    assert m["ock.mmc.meta_service.metrics_url"] == "http://127.0.0.1:3"
    assert lc["ock.mmc.local_service.protocol"] == "host_tcp"
    assert lc["ock.mmc.local_service.dram.size"] == "1GB"
    known = {"meta_service_url", "config_store_url", "log_level", "world_size", "protocol", "dram_size", "client_timeout_seconds", "hcom_url"}
    assert local_config_fields(lc, known)["client_timeout_seconds"] == "10"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"protocol": "carrier_pigeon"}, "protocol='carrier_pigeon'; accepted: host_shm"),
        ({"meta_url": "http://127.0.0.1:1"}, "meta_url='http://127.0.0.1:1': expected tcp://HOST:PORT"),
        ({"world_size": 0}, "world_size=0"),
        ({"log_level": "loud"}, "log_level='loud'; accepted: debug"),
    ],
)
def test_local_conf_rejects_bad_settings(tmp_path, kwargs, match):
    args = {"meta_url": "tcp://127.0.0.1:1", "config_store_url": "tcp://127.0.0.1:2", **kwargs}
    with pytest.raises(ConfError, match=match.replace("(", r"\(").replace("[", r"\[")):
        write_local_conf(tmp_path / "l.conf", **args)
    assert not (tmp_path / "l.conf").exists()


def test_unknown_client_keys_are_refused():
    with pytest.raises(ConfError, match="ock.mmc.local_service.storage.enabled"):
        local_config_fields({"ock.mmc.local_service.storage.enabled": "true"}, {"protocol"})


@pytest.mark.parametrize(
    ("code", "cls", "words"),
    [
        (-3014, BackendUnavailable, "MetaService is unreachable"),
        (-3102, ObjectMissing, "no such object"),
        (-3101, ObjectMissing, "not yet committed"),
        (-2, BackendError, "L2G/G2L"),
        (-77, BackendError, "client log"),
    ],
)
def test_error_codes_map_to_exceptions_with_code_and_hint(code, cls, words):
    e = errors.error_for(code, "lookup (batch_is_exist)")
    assert type(e) is cls
    assert str(code) in str(e) and words in str(e) and "lookup" in str(e)


def test_cli_config_writes_files_and_prints_extra_config(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "lw_memcache.cli", "config", "--out-dir", str(tmp_path), "--protocol", "host_tcp",
         "--dram-size", "512MB", "--port", "15000", "--hcom-port", "17000"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    extra = json.loads(r.stdout)
    cfg = parse_config(extra)
    assert cfg.backend == "memcache" and cfg.backend_keys.memcache_protocol == "host_tcp"
    local = read_conf(cfg.backend_keys.memcache_config_path)
    assert local["ock.mmc.meta_service_url"] == "tcp://127.0.0.1:15000"
    assert local["ock.mmc.local_service.hcom_url"] == "tcp://127.0.0.1:17000"
    assert local["ock.mmc.local_service.dram.size"] == "512MB"
    assert read_conf(tmp_path / "mmc-meta.conf")["ock.mmc.meta_service_url"] == "tcp://127.0.0.1:15000"


def test_cli_config_bad_size_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lw_memcache.cli", "config", "--out-dir", str(tmp_path), "--dram-size", "lots"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "dram_size='lots'" in r.stderr


def test_backend_config_errors_name_the_field(tmp_path):
    with pytest.raises(BackendError, match="memcache_config_path is empty"):
        mb.MemcacheBackend("")
    with pytest.raises(BackendError, match="memcache_config_path=.*cannot read"):
        mb.MemcacheBackend(str(tmp_path / "missing.conf"))
    path = write_local_conf(tmp_path / "l.conf", meta_url="tcp://127.0.0.1:1", config_store_url="tcp://127.0.0.1:2", protocol="host_tcp")
    with pytest.raises(BackendError, match="memcache_protocol='host_shm' but .* host_tcp"):
        mb.MemcacheBackend(str(path), protocol="host_shm")


def test_missing_memcache_hybrid_gives_install_hint(monkeypatch):
    import importlib.util

    from lw_memcache import runtime

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "memcache_hybrid" else real(name, *a))
    with pytest.raises(BackendError, match=r"pip install 'lw-memcache\[store\]'"):
        runtime.import_memcache("host_shm")


def test_device_protocol_without_ascend_runtime_is_refused(monkeypatch):
    if not HAVE_MEMCACHE:
        pytest.skip("memcache_hybrid not installed")
    from lw_memcache import runtime

    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.setenv("LW_MEMCACHE_STANDIN", "auto")
    with pytest.raises(BackendError, match="device_rdma.*needs the Ascend runtime"):
        runtime.import_memcache("device_rdma")


@needs_memcache
def test_unreachable_metaservice_fails_fast(tmp_path):
    import time

    from lw_dev.ports import free_port

    port = free_port()  # nobody listens on it
    path = write_local_conf(tmp_path / "l.conf", meta_url=f"tcp://127.0.0.1:{port}", config_store_url=f"tcp://127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable, match=f"127.0.0.1:{port}.*not reachable.*lw-memcache meta"):
        mb.MemcacheBackend(str(path))
    assert time.monotonic() - t0 < 10  # init() itself would block ~80 s per attempt


@needs_memcache
def test_standin_build_is_cached_and_exports_the_runtime_symbols():
    import ctypes

    from lw_memcache import standin

    home = standin.build()
    assert standin.build() == home and standin.is_standin(home)
    for name in standin.LIB_NAMES:
        lib = ctypes.CDLL(str(home / "lib64" / name))
        assert lib.aclrtMemcpy and lib.halHostRegister
    lib = ctypes.CDLL(str(home / "lib64" / "libascendcl.so"))
    src, dst = ctypes.create_string_buffer(b"layerwise", 9), ctypes.create_string_buffer(9)
    lib.aclrtMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert lib.aclrtMemcpy(dst, 9, src, 9, 0) == 0 and dst.raw == b"layerwise"
    assert lib.aclrtMemcpy(dst, 4, src, 9, 0) != 0  # never past the destination
    assert "Innerversion=" in (home / "driver" / "version.info").read_text()


class _RecordingStore:
    """Stands in for DistributedObjectStore to observe the copy directions chosen."""

    def __init__(self):
        self.copies = []

    def batch_copy(self, gvas, ptrs, sizes, direction, flag):
        self.copies.append((direction, list(gvas), list(sizes)))
        return 0

    def register_buffer(self, ptr, n):
        return 0


def _copier():
    from lw_memcache.client import StoreClient

    return copies.Copier(StoreClient(_RecordingStore()))


def _writer(copier):
    from lw_memcache.object_writer import ObjectWriter
    from lw_memcache.orphans import Sightings
    from lw_memcache.stream_write import StreamWriter

    streams = StreamWriter(copier.client, copier, enabled=False, write_lease_ms=1000)
    return ObjectWriter(copier.client, copier, Sightings(1.0), streams, write_lease_ms=1000, full_wait_s=0)


def test_copy_direction_follows_where_memory_lives():
    c = _copier()
    h = MemcacheHandle("k", 4096, 0x1000_0000, True)
    host = np.zeros(1024, np.uint8)
    c.copy([h, h], [0, 1024], [host, copies.DeviceRegion(0xDEAD000, 1024)], to_store=True)
    assert sorted((d, g) for d, g, _ in c.client.store.copies) == [(copies.L2G, [0x1000_0000 + 1024]), (copies.H2G, [0x1000_0000])]
    c.client.store.copies.clear()
    dev = np.zeros(2048, np.uint8)
    c.register(dev, device=True)  # e.g. an NPU KV cache handed over as a region
    c.copy([h, h], [0, 2048], [dev[:1024], bytearray(512)], to_store=False)
    assert sorted(d for d, _, _ in c.client.store.copies) == [copies.G2L, copies.G2H]
    assert c.client.counters()["copy_calls"] == 4


def test_copy_rejects_out_of_range_and_readonly():
    c = _copier()
    h = MemcacheHandle("k", 4096, 0x1000_0000, True)
    with pytest.raises(ValueError, match=r"range \[4000, 4200\) outside the object's 4096 bytes"):
        c.copy([h], [4000], [bytes(200)], to_store=True)
    with pytest.raises(ValueError, match="read-only"):
        c.copy([h], [0], [bytes(16)], to_store=False)
    with pytest.raises(BackendError, match="not a reservation"):
        _writer(c).write([MemcacheHandle("other", 4096, 1, True)], [0], [bytes(16)])
    assert c.client.store.copies == []


def test_copy_passes_each_buffers_own_address_on_every_path():
    # The per-layer hot path takes ndarray addresses through ctypes; read-only, non-contiguous and
    # non-numpy buffers take the general path. Both must hand the store the same addresses.
    c = _copier()
    store = c.client.store
    store.batch_copy = lambda g, p, n, d, f: store.copies.append((d, list(g), list(p), list(n))) or 0
    h = MemcacheHandle("k", 1 << 16, 0x1000_0000, True)
    staging = np.arange(4096, dtype=np.uint8)
    ro = staging[1024:2048].copy()
    ro.flags.writeable = False
    ba = bytearray(100)
    srcs = [staging[:1024], staging[2048:3072], ro, ba]
    c.copy([h] * 4, [0, 1024, 2048, 3072], srcs, to_store=True)
    (d, gvas, ptrs, sizes), = store.copies
    assert d == copies.H2G and gvas == [h.gva, h.gva + 1024, h.gva + 2048, h.gva + 3072]
    assert ptrs == [staging.ctypes.data, staging.ctypes.data + 2048, ro.ctypes.data, np.frombuffer(ba, np.uint8).ctypes.data]
    assert sizes == [1024, 1024, 1024, 100]
    with pytest.raises(ValueError, match="read-only"):
        c.copy([h], [0], [ro], to_store=False)
    with pytest.raises(ValueError, match="C-contiguous"):
        c.copy([h], [0], [staging.reshape(64, 64)[:, :8]], to_store=False)
    c.copy([h], [0], [np.zeros(0, np.uint8)], to_store=False)  # nothing to copy: no call
    assert len(store.copies) == 1


def test_a_closed_client_refuses_copies():
    c = _copier()
    assert c.client.mark_closed() and not c.client.mark_closed()
    with pytest.raises(BackendError, match="closed"):
        c.copy([MemcacheHandle("k", 16, 1, True)], [0], [bytes(16)], to_store=True)


def test_memcache_keys_belong_to_its_plugin_and_stay_top_level():
    from lw_core.config import ConfigError
    from lw_memcache.plugin import MemcacheKeys

    cfg = parse_config({"backend": "memcache", "memcache_protocol": "host_tcp", "memcache_config_path": "/etc/l.conf"})
    assert cfg.backend_keys == MemcacheKeys(memcache_config_path="/etc/l.conf", memcache_protocol="host_tcp")
    assert parse_config({"memcache_protocol": "host_tcp"}).backend == "embedded"  # checked, no effect
    with pytest.raises(ConfigError) as ei:
        parse_config({"backend": "memcache", "memcache_protocol": "carrier_pigeon"})
    assert str(ei.value) == (
        "kv_connector_extra_config.memcache_protocol='carrier_pigeon' is not accepted; accepted: "
        "'device_rdma', 'device_sdma', 'host_rdma', 'host_shm', 'host_tcp'"
    )
