"""What host_tcp across machines needs from lw-memcache, checked without starting a pool: each
machine's client config carries its own data address, too few huge pages and a process started
without the bundled transport on LD_LIBRARY_PATH are refused with what to do."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from lw_memcache.cli import main as lw_memcache
from lw_memcache.conf import ConfError, check_hugepages, read_conf


def test_config_puts_the_data_port_on_this_machines_address(tmp_path, capsys) -> None:
    assert lw_memcache(["config", "--out-dir", str(tmp_path / "b"), "--protocol", "host_tcp", "--host", "10.0.0.1",
                        "--hcom-host", "10.0.0.2", "--hcom-port", "7005", "--dram-size", "0"]) == 0
    conf = read_conf(tmp_path / "b" / "mmc-local.conf")
    assert conf["ock.mmc.local_service.hcom_url"] == "tcp://10.0.0.2:7005"
    assert conf["ock.mmc.meta_service_url"] == "tcp://10.0.0.1:5000"
    assert conf["ock.mmc.local_service.config_store_url"] == "tcp://10.0.0.1:6000"
    assert conf["ock.mmc.local_service.dram.size"] == "0"
    # Without --hcom-host the data port is on --host (the MetaService's machine).
    assert lw_memcache(["config", "--out-dir", str(tmp_path / "a"), "--protocol", "host_tcp", "--host", "10.0.0.1"]) == 0
    assert read_conf(tmp_path / "a" / "mmc-local.conf")["ock.mmc.local_service.hcom_url"] == "tcp://10.0.0.1:7000"
    capsys.readouterr()


def _meminfo(tmp_path, free: int):
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal: 1 kB\nHugePages_Total:     {free}\nHugePages_Free:      {free}\nHugepagesize: 2048 kB\n")
    return p


def test_too_few_huge_pages_are_refused_with_the_setting_to_change(tmp_path) -> None:
    with pytest.raises(ConfError, match=r"--config x: host_tcp lends 67108864 bytes .* needs 32 free, but 31 .*nr_hugepages"):
        check_hugepages(64 << 20, "--config x", _meminfo(tmp_path, 31))
    check_hugepages(64 << 20, "--config x", _meminfo(tmp_path, 32))
    check_hugepages((64 << 20) + 1, "--config x", _meminfo(tmp_path, 33))
    with pytest.raises(ConfError, match="needs 33 free"):
        check_hugepages((64 << 20) + 1, "--config x", _meminfo(tmp_path, 32))


def test_hold_refuses_a_host_tcp_config_without_huge_pages(tmp_path, capsys, monkeypatch) -> None:
    import lw_memcache.cli as cli

    assert lw_memcache(["config", "--out-dir", str(tmp_path), "--protocol", "host_tcp", "--dram-size", "64MB"]) == 0
    monkeypatch.setattr(cli, "check_hugepages", lambda n, what: check_hugepages(n, what, _meminfo(tmp_path, 0)))
    capsys.readouterr()
    assert lw_memcache(["hold", "--config", str(tmp_path / "mmc-local.conf")]) == 2
    err = capsys.readouterr().err
    assert "lw-memcache hold: --config" in err and "needs 32 free, but 0" in err, err


@pytest.mark.skipif(importlib.util.find_spec("memcache_hybrid") is None, reason="memcache_hybrid is not installed")
def test_host_tcp_without_the_transport_on_ld_library_path_is_a_clear_error() -> None:
    from lw_memcache import standin

    code = "from lw_memcache import runtime; runtime.import_memcache('host_tcp'); print('imported')"
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "needs memfabric's bundled libhcom.so" in r.stderr, r.stderr[-2000:]
    assert "LD_LIBRARY_PATH=" in r.stderr and "lw-memcache standin" in r.stderr
    r = subprocess.run([sys.executable, "-c", code], env={**env, **standin.env(standin.build())},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr[-2000:]


def test_hcom_host_auto_is_this_machines_address_towards_the_metaservice(tmp_path, capsys) -> None:
    from lw_memcache.conf import resolve_auto_hcom

    assert lw_memcache(["config", "--out-dir", str(tmp_path), "--protocol", "host_tcp", "--hcom-host", "auto"]) == 0
    capsys.readouterr()
    conf = read_conf(tmp_path / "mmc-local.conf")
    assert conf["ock.mmc.local_service.hcom_url"] == "tcp://0.0.0.0:7000"
    # The route to a MetaService on 127.0.0.1 leaves from 127.0.0.1 (a UDP connect: nothing is sent).
    assert resolve_auto_hcom(conf)["ock.mmc.local_service.hcom_url"] == "tcp://127.0.0.1:7000"
    fixed = {**conf, "ock.mmc.local_service.hcom_url": "tcp://10.0.0.2:7000"}
    assert resolve_auto_hcom(fixed) == fixed


def test_bench_host_tcp_netns_refuses_bad_values(tmp_path) -> None:
    from lw_bench import netns as bench_netns

    def bench(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lw_bench.cli", "backend", *args], capture_output=True,
                              text=True, timeout=120)

    r = bench("--backend", "embedded", "--host-tcp-netns", "a,b")
    assert r.returncode != 0 and "--host-tcp-netns needs --backend memcache or mooncake (got 'embedded')" in r.stderr, r.stderr
    with pytest.raises(SystemExit, match="expected two network namespace names, A,B"):
        bench_netns.parse_pair("a")
    with pytest.raises(SystemExit, match="no network namespace 'lw-no-such-ns'"):
        bench_netns.parse_pair("lw-no-such-ns,lw-no-such-ns2")
