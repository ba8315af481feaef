"""Configuration and operation of the mooncake backend: its keys (strict, clear errors, the seed's
rpc-port alias), the master's bind addresses, the holder CLI, and the install hint."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from mc_cluster import start_cluster

from lw_core.backend import BackendError
from lw_core.config import ConfigError, parse_config

MASTER = {"backend": "mooncake", "mooncake_master": "10.0.0.5:50051"}


def test_keys_parse_with_defaults_and_the_seed_rpc_port_alias():
    cfg = parse_config({**MASTER, "lookup_rpc_port": 5555, "mooncake_protocol": "rdma",
                        "mooncake_global_segment_size": 1 << 30})
    k = cfg.backend_keys
    assert cfg.backend == "mooncake" and cfg.mooncake_rpc_port == "5555"
    assert (k.mooncake_master, k.mooncake_protocol, k.mooncake_global_segment_size) == ("10.0.0.5:50051", "rdma", 1 << 30)
    assert k.mooncake_metadata_server == "P2PHANDSHAKE" and k.mooncake_call_timeout_s == 5.0
    assert k.mooncake_load == "auto" and k.mooncake_whole_max_bytes == 256 << 20
    assert k.mooncake_get_arena_bytes == k.mooncake_put_arena_bytes == 256 << 20
    assert parse_config({**MASTER, "mooncake_rpc_port": "0"}).mooncake_rpc_port == "0"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"backend": "mooncake"}, ["mooncake_master is required", "host:port"]),
        ({**MASTER, "mooncake_protocol": "ib"}, ["mooncake_protocol", "'ib'", "'tcp'", "'rdma'"]),
        ({**MASTER, "mooncake_master": "10.0.0.5"}, ["mooncake_master", "'10.0.0.5'", "host:port"]),
        ({**MASTER, "mooncake_master": "h:70000"}, ["mooncake_master", "1-65535"]),
        ({**MASTER, "mooncake_staging_size": 10}, ["mooncake_staging_size", ">= 1048576"]),
        ({**MASTER, "mooncake_call_timeout_s": 0}, ["mooncake_call_timeout_s", "> 0"]),
        ({**MASTER, "mooncake_load": "lazy"}, ["mooncake_load", "'lazy'", "'auto'", "'per_layer'", "'whole'"]),
        ({**MASTER, "mooncake_whole_max_bytes": -1}, ["mooncake_whole_max_bytes", ">= 0"]),
        ({**MASTER, "mooncake_put_arena_bytes": -1}, ["mooncake_put_arena_bytes", ">= 0"]),
        ({**MASTER, "mooncake_metadata_server": "ftp://x"}, ["mooncake_metadata_server", "P2PHANDSHAKE", "http"]),
        ({**MASTER, "mooncake_mastr": "x:1"}, ["mooncake_mastr", "known keys", "mooncake_master"]),
    ],
)
def test_bad_keys_name_the_key_and_what_is_accepted(extra, words):
    with pytest.raises(ConfigError) as ei:
        parse_config(extra)
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


def test_missing_client_library_names_what_to_install(monkeypatch):
    from lw_mooncake.backend import MooncakeBackend

    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(BackendError, match=r"lw-mooncake\[store\].*libibverbs1"):
        MooncakeBackend("10.0.0.5:50051")


def test_importing_the_plugin_does_not_import_mooncake():
    code = "import lw_mooncake.plugin, sys; assert 'mooncake' not in sys.modules and 'mooncake.store' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_hold_bad_size_is_a_clear_error():
    p = subprocess.run([sys.executable, "-m", "lw_mooncake.cli", "hold", "--master", "h:1", "--host", "h",
                        "--size", "12 parsecs"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--size" in p.stderr and "256MB" in p.stderr


def test_master_refuses_bind_flags_that_bypass_host():
    p = subprocess.run([sys.executable, "-m", "lw_mooncake.cli", "master", "--host", "127.0.0.1", "--",
                        "--metrics_host=0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--host" in p.stderr


@pytest.mark.slow  # a master in network-namespace hosts
def test_master_binds_only_its_host_address_and_clients_unreachable_master_fail_fast(hosts):
    c = start_cluster(hosts, port=50101)
    try:
        listen = hosts.run("b", ["ss", "-Hltn"]).stdout.split("\n")
        master_ports = {str(c.port), str(c.metrics_port)}
        mine = [ln.split()[3] for ln in listen if ln.strip() and ln.split()[3].rsplit(":", 1)[1] in master_ports]
        assert sorted(mine) == sorted(f"{hosts.addr('b')}:{p}" for p in master_ports), listen
    finally:
        c.stop()
    from lw_core.backend import BackendUnavailable
    from lw_mooncake.backend import MooncakeBackend

    t0 = time.monotonic()
    with hosts.entered("a"), pytest.raises(BackendUnavailable, match="setup"):
        MooncakeBackend(c.address, local_hostname=hosts.addr("a"), setup_timeout_s=5.0)
    assert time.monotonic() - t0 < 10.0
