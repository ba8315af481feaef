"""lw-bench on Mooncake. ``lw-bench backend --backend mooncake --host-tcp-netns A,B``: the bench
pool (master + holder) and the writer on host A, the reader on host B; the cross-host rows come
with their memcpy ratio and their bytes really crossed B's link (~10 s: the quick sizes, one
repetition). ``lw-bench pipeline --backend mooncake`` in both load modes, and ``--backend-key``
checked as the connector checks its keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_backend_mooncake_across_hosts_reports_other_host_rows(hosts) -> None:
    rx0, _ = hosts.link_bytes("b")
    bench = Path(sys.executable).with_name("lw-bench")
    r = subprocess.run([str(bench), "backend", "--backend", "mooncake", "--quick", "--reps", "1", "--json",
                        "--host-tcp-netns", f"{hosts.ns('a')},{hosts.ns('b')}"],
                       capture_output=True, text=True, timeout=300)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1])
    assert out["backend"] == "mooncake" and out["hosts"] == [hosts.ns("a"), hosts.ns("b")]
    rows = [x for x in out["results"] if x["process"] == "other-host"]
    assert sorted(x["case"] for x in rows) == ["4MiB", "64KiB", "layer_16KiB"], out["results"]
    assert all(x["op"] == "get" and x["gbps"] > 0 and x["memcpy_gbps"] > 0 and x["ratio"] > 0 for x in rows), rows
    rx1, _ = hosts.link_bytes("b")
    assert rx1 - rx0 >= sum(x["bytes"] for x in rows)  # what B read came over its link
    # the layer case's whole load (open included) against memcpy, in each process
    loads = {g["process"]: g["load_ratio"] for g in out["breakdown"] if g["case"] == "layer_16KiB"}
    assert {"same", "other-host"} <= set(loads) and all(0 < r < 10 for r in loads.values()), out["breakdown"]
    assert all(g["load_ratio"] is None for g in out["breakdown"] if g["case"] != "layer_16KiB"), out["breakdown"]


@pytest.mark.slow
@pytest.mark.parametrize("load", ["per_layer", "whole"])
def test_bench_pipeline_mooncake_loads_exact_bytes_in_each_load_mode(hosts, load: str) -> None:
    """``lw-bench pipeline --backend mooncake`` on one host (its throwaway master and holder on the
    namespace host's loopback), the load mode set with ``--backend-key``: every load lands exactly
    the saved bytes. (~10 s each: --quick.)"""
    bench = Path(sys.executable).with_name("lw-bench")
    r = hosts.run("a", [str(bench), "pipeline", "--backend", "mooncake", "--quick", "--json",
                        "--backend-key", f"mooncake_load={load}", "--backend-key", "mooncake_call_timeout_s=10"],
                  timeout=180)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1])
    assert out["config"]["backend"] == "mooncake", out["config"]
    assert out["config"]["backend_keys"] == {"mooncake_load": load, "mooncake_call_timeout_s": 10}, out["config"]
    assert out["verified"] and out["load_failures"] == 0 and not out["errors"], out
    assert out["t_bulk_s"] > 0 and all(t > 0 for t in out["t_layerwise_s"].values()), out


@pytest.mark.slow
def test_bench_pipeline_mooncake_rates_move_every_mechanism_through_the_arenas(hosts) -> None:
    """What scripts/device-check.sh runs on a GPU where its bundle brings Mooncake, here on the
    ``cpu-torch`` device (its throwaway pools on the namespace host's loopback): every case and
    mechanism saves and loads exact bytes through the mechanism it names, and Mooncake moved them
    through its arenas: every save sent from the put arena (no byte through the put staging), every
    load landed in the get arena (whole or ranged), so the device copies move each byte straight
    between the arenas and the KV. (~30 s: --quick.)"""
    bench = Path(sys.executable).with_name("lw-bench")
    r = hosts.run("a", [str(bench), "pipeline", "--backend", "mooncake", "--quick", "--json", "--kv-device", "cpu-torch",
                        "--rates", "--backend-key", "mooncake_call_timeout_s=10"], timeout=240)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    rows = json.loads(lines[-1])["rates"]
    assert {(x["case"], x["mechanism"]) for x in rows} == {
        (c, m) for c in ("16 KiB", "64 KiB", "model") for m in ("staged", "kernel", "batch_dma")}, rows
    for x in rows:
        assert x["verified"] and x["error"] is None, x
        assert x["used"][x["mechanism"]] > 0 and sum(x["used"].values()) == x["used"][x["mechanism"]], x
        moved = x["store_counts"]
        assert moved.get("put_staged_bytes", 0) == 0 and moved["put_direct_bytes"] >= x["total_bytes"], x
        assert moved.get("arena_gets", 0) + moved.get("arena_range_gets", 0) > 0, x


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["backend", "--backend", "mooncake", "--backend-key", "mooncake_load=lazy"],
         ["--backend-key", "mooncake_load='lazy'", "'per_layer'", "'whole'"]),
        (["pipeline", "--backend", "mooncake", "--backend-key", "mooncake_lod=whole"],
         ["--backend-key", "'mooncake_lod'", "mooncake_load"]),
        (["pipeline", "--backend", "mooncake", "--backend-key", "mooncake_staging_size=10"],
         ["mooncake_staging_size=10", ">= 1048576"]),
        (["backend", "--backend", "mooncake", "--backend-key", "whole"], ["--backend-key 'whole'", "KEY=VALUE"]),
    ],
)
def test_bench_backend_keys_are_checked_before_any_pool_starts(argv: list[str], words: list[str]) -> None:
    bench = Path(sys.executable).with_name("lw-bench")
    r = subprocess.run([str(bench), *argv, "--quick"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0, r.stdout[-2000:]
    for w in words:
        assert w in r.stderr, (w, r.stderr[-2000:])
