"""``lw-bench backend --backend memcache --host-tcp-netns A,B``: the pool and the writer on host A,
the reader on host B over host_tcp; the cross-host rows come with their memcpy ratio and their
bytes really crossed the link. (~30 s: a MetaService, two clients, the quick sizes.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import HUGEPAGES, Cluster

pytestmark = pytest.mark.slow


def test_bench_backend_across_hosts_reports_other_host_rows(cluster: Cluster) -> None:
    old = HUGEPAGES.read_text().strip()
    HUGEPAGES.write_text(str(int(old) + 80))  # both bench clients lend ~66 MB over host_tcp
    rx0, _ = cluster.hosts.link_bytes("b")
    try:
        bench = Path(sys.executable).with_name("lw-bench")
        r = subprocess.run([str(bench), "backend", "--backend", "memcache", "--quick", "--json", "--host-tcp-netns",
                            f"{cluster.hosts.ns('a')},{cluster.hosts.ns('b')}"],
                           env=cluster.env, capture_output=True, text=True, timeout=300)
    finally:
        HUGEPAGES.write_text(old)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1])
    assert out["backend"] == "memcache" and out["hosts"] == [cluster.hosts.ns("a"), cluster.hosts.ns("b")]
    rows = [x for x in out["results"] if x["process"] == "other-host"]
    assert sorted(x["case"] for x in rows) == ["4MiB", "64KiB", "layer_16KiB"], out["results"]
    assert all(x["op"] == "get" and x["gbps"] > 0 and x["memcpy_gbps"] > 0 and x["ratio"] > 0 for x in rows), rows
    rx1, _ = cluster.hosts.link_bytes("b")
    assert rx1 - rx0 >= sum(x["bytes"] for x in rows)  # what B read came over its link
