"""LocalMemcache and ``lw-memcache meta``: one MetaService per machine, bounded start-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import needs_memcache, wait_until

from lw_memcache.local import LocalMemcache, LocalMemcacheError, free_ports, meta_lock_holder

pytestmark = [needs_memcache]


def test_second_pool_waits_for_the_machine_lock_and_names_the_holder(pool, tmp_path):
    holder = meta_lock_holder()
    assert holder == pool.proc.pid
    other = LocalMemcache(workdir=tmp_path / "other", lock_wait_s=1)
    with pytest.raises(LocalMemcacheError, match=rf"another MetaService \(pid {holder}\) holds /tmp/mmc_meta_service.lock"):
        other.start()
    assert other.proc is None


@pytest.mark.slow
def test_cli_meta_binds_the_given_address_and_stops_on_sigterm(tmp_path):
    if meta_lock_holder() is not None:
        pytest.skip("another MetaService runs on this machine")
    port, store_port, metrics_port = free_ports(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lw_memcache.cli", "meta", "--host", "127.0.0.1", "--port", str(port),
         "--config-store-port", str(store_port), "--metrics-port", str(metrics_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        probe = LocalMemcache(workdir=tmp_path)
        probe._ports = [port, store_port, metrics_port, 0]
        assert wait_until(probe.healthy, 30), "MetaService never answered /health"
        assert meta_lock_holder() == proc.pid
        listening = {line.split()[1] for line in open("/proc/net/tcp").read().splitlines()[1:] if line.split()[3] == "0A"}
        assert f"0100007F:{port:04X}" in listening  # 127.0.0.1, not a wildcard bind
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
