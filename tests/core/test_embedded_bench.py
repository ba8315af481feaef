"""Smoke test of ``lw-bench backend --quick --json``: documented keys, positive figures (the bench
reports timings; nothing here asserts them)."""

from __future__ import annotations

import json

import msgspec
import pytest

from lw_bench.backend_result import BackendBenchResult, BackendRow, MetadataRow
from lw_bench.cli import main

ROW_KEYS = {"case", "op", "process", "object_bytes", "objects", "bytes", "gbps", "memcpy_gbps", "ratio", "ms_per_call"}


def test_backend_bench_quick_json(capsys, tmp_path):
    assert main(["backend", "--quick", "--json", "--path", str(tmp_path / "pool")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "embedded" and out["quick"] is True and out["setup_s"] >= 0
    cases = {(r["case"], r["op"], r["process"]) for r in out["results"]}
    for case in ("64KiB", "4MiB", "layer_16KiB"):
        assert {(case, "put", "same"), (case, "get", "same"), (case, "get", "other")} <= cases
    for r in out["results"]:
        assert set(r) == ROW_KEYS
        for k in ("gbps", "memcpy_gbps", "ratio", "ms_per_call", "bytes", "objects"):
            assert r[k] > 0, (k, r)
    assert {m["op"] for m in out["metadata"]} == {"reserve+commit", "open+release"}
    assert all(m["ms_per_call"] > 0 and m["keys_per_call"] == 32 for m in out["metadata"])
    assert out["stats"]["objects"] > 0 and out["stats"]["capacity_bytes"] > 0
    # every get row has its breakdown: open, read, release and the memcpy of the same bytes, per call
    gets = {(r["case"], r["process"]) for r in out["results"] if r["op"] == "get"}
    assert {(g["case"], g["process"]) for g in out["breakdown"]} == gets
    for g in out["breakdown"]:
        assert g["read_ms"] > 0 and g["memcpy_ms"] > 0 and g["open_ms"] > 0 and g["release_ms"] >= 0, g
        assert g["keys_per_call"] == {"64KiB": 32, "4MiB": 4, "layer_16KiB": 32}[g["case"]], g  # --quick: 64 and 4 objects
    # the JSON is the result struct: its fields (no hosts without --host-tcp-netns), its types
    assert set(out) == set(BackendBenchResult.__struct_fields__) - {"hosts"}
    assert ROW_KEYS == set(BackendRow.__struct_fields__) and set(out["metadata"][0]) == set(MetadataRow.__struct_fields__)
    assert msgspec.convert(out, BackendBenchResult).results[0].case == "64KiB"


def test_backend_bench_memcache_without_its_store_fails_clearly(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lw_memcache.local", None)  # import fails like a missing package
    with pytest.raises(SystemExit) as ei:
        main(["backend", "--quick", "--backend", "memcache"])
    assert "--backend memcache" in str(ei.value.code) and "lw_memcache.local" in str(ei.value.code)


def test_backend_bench_without_the_backend_plugin_names_the_package(monkeypatch):
    from lw_core.backends import registry

    real = registry._entry_points
    monkeypatch.setattr(registry, "_entry_points", lambda: {k: v for k, v in real().items() if k != "memcache"})
    monkeypatch.setattr(registry, "_loaded", {})
    with pytest.raises(SystemExit) as ei:
        main(["backend", "--quick", "--backend", "memcache"])
    msg = str(ei.value.code)
    assert "pip install 'lw-memcache[store]'" in msg and "'embedded'" in msg, msg


def test_backend_bench_refuses_a_batch_past_the_embedded_pools_leases(tmp_path):
    """Every case's last set stays leased for the reads: past the pool's leases per process an open
    answers misses, which used to fail late as "layer objects vanished (pool too small?)"."""
    with pytest.raises(SystemExit, match=r"--batch=2048: the embedded pool holds at most 2048 leases .* --batch <= 1980"):
        main(["backend", "--quick", "--batch", "2048", "--path", str(tmp_path / "pool")])
