"""LocalMemcache and ``lw-memcache meta``: one MetaService per machine, bounded start-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from mc_support import expected, needs_memcache, wait_until

from lw_memcache.local import LocalMemcache, LocalMemcacheError, free_ports
from lw_memcache.machine import meta_lock_holder

pytestmark = [needs_memcache]


@pytest.mark.slow  # a MetaService
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


def test_hold_refuses_a_config_that_lends_no_memory(tmp_path):
    from lw_memcache.conf import write_local_conf

    conf = write_local_conf(tmp_path / "c.conf", meta_url="tcp://127.0.0.1:1", config_store_url="tcp://127.0.0.1:2", dram_size=0)
    r = subprocess.run([sys.executable, "-m", "lw_memcache.cli", "hold", "--config", str(conf)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "dram.size is 0" in r.stderr


@pytest.mark.slow
def test_holder_keeps_objects_after_their_writer_is_killed(tmp_path, make_client):
    # Objects live in the memory of the client they are placed on: with a holder lending the
    # pool's DRAM and writers lending none, a writer's death loses nothing it committed.
    with LocalMemcache(dram_size="64MB", holder=True, workdir=tmp_path / "pool", stop_timeout_s=3) as extra:
        assert "dram.size = 0" in open(extra["memcache_config_path"]).read()
        keys = [f"lw1/test/held/{i}" for i in range(16)]
        w = make_client(extra)
        assert all(w.ok("reserve", keys=keys, layers=2, layer_nbytes=32 << 10))
        w.write(keys, [0, 1], 32 << 10)
        w.ok("commit", keys=keys)
        w.kill()
        r = make_client(extra)
        assert wait_until(lambda: r.ok("lookup", keys=keys) == 16, 3)
        assert all(r.ok("open", keys=keys))
        assert r.read([(k, 32 << 10, 32 << 10) for k in keys]) == [expected(k, 1, 32 << 10) for k in keys]
        r.ok("release", keys=keys)
        r.close()
