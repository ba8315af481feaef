"""``lw-bench serve --backend a,b,c --disk-dir DIR``: without an engine, which engines run on which
pool, the per-backend rows and the disk row computed from hand-made engine records, the report's
struct, and the disk tier's helpers (page-cache drop, sequential read) on a real directory; then one
quick run on real vLLM whose disk hits are counted by the connector as read from disk."""

from __future__ import annotations

import argparse
import os

import pytest

from lw_bench.serve import backends, disk
from lw_bench.serve import mode as bench_serve
from lw_bench.serve.result import checked


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    bench_serve.add_arguments(p)
    return p.parse_args(list(argv))


def _cfg(tmp_path, *argv: str) -> dict:
    cfg = bench_serve._config(_args("--model", "tiny", "--reps", "1", "--depths", "2", *argv))
    cfg["pool_path"] = str(tmp_path / "pool")
    return cfg


EXTRAS = {"embedded": {"embedded_path": "/p", "embedded_capacity_bytes": 1 << 26},
          "memcache": {"backend": "memcache", "memcache_config_path": "/c"},
          "mooncake": {"backend": "mooncake", "mooncake_master": "127.0.0.1:1"}}


def test_first_backend_gets_every_mode_others_a_save_and_a_hit_on_their_own_pool(tmp_path) -> None:
    cfg = _cfg(tmp_path, "--backend", "memcache,embedded,mooncake", "--lengths", "64")
    modes = {name: (extra, pc) for name, extra, pc in bench_serve._modes(cfg, EXTRAS)}
    assert list(modes) == ["save", "recompute", "bulk", "layerwise_d2", "embedded/save", "embedded/layerwise_d2",
                           "mooncake/save", "mooncake/layerwise_d2"]
    assert modes["save"][0]["backend"] == "memcache" and modes["bulk"][0]["backend"] == "memcache"
    assert modes["recompute"] == (None, True)
    assert modes["embedded/save"] == ({**EXTRAS["embedded"], "use_layerwise": True}, False)
    assert modes["mooncake/layerwise_d2"] == (
        {**EXTRAS["mooncake"], "use_layerwise": True, "layerwise_prefetch_layers": 2}, True)
    assert bench_serve._schedule(list(modes), 1)[:3] == ["save", "embedded/save", "mooncake/save"]


def test_disk_modes_share_the_tier_and_the_hit_gets_a_new_empty_dram_pool(tmp_path) -> None:
    cfg = _cfg(tmp_path, "--lengths", "64,128", "--disk-dir", str(tmp_path))
    modes = {name: (extra, pc) for name, extra, pc in bench_serve._modes(cfg, EXTRAS)}
    (save, save_pc), (hit, hit_pc) = modes[disk.SAVE], modes[disk.HIT]
    assert save["embedded_disk_path"] == hit["embedded_disk_path"] == cfg["disk_dir"]
    assert save["embedded_disk_direct_io"] is hit["embedded_disk_direct_io"] is False  # buffered unless asked
    assert os.path.dirname(cfg["disk_dir"]) == str(tmp_path)
    assert save["embedded_capacity_bytes"] == cfg["disk_dram_bytes"] < cfg["pool_capacity_bytes"]
    assert not save_pc and hit_pc
    a, b = disk.fresh_dram({"extra": hit}, cfg), disk.fresh_dram({"extra": hit}, cfg)
    assert a["extra"]["embedded_path"] != b["extra"]["embedded_path"]
    assert save["embedded_path"] not in (a["extra"]["embedded_path"], b["extra"]["embedded_path"])
    # The saver runs flush prompts of the longest length that together exceed its DRAM pool.
    items = bench_serve._items(cfg, bench_serve._prompts(cfg), second=False, flush=True)
    flush = [it for it in items if it["id"].startswith("flush/")]
    assert len(flush) == disk.flush_count(cfg) and all(it["id"].startswith("flush/128/") for it in flush)
    assert len(flush) * 128 * cfg["kv_bytes_per_token"] > cfg["disk_dram_bytes"]


def test_disk_direct_io_reaches_both_disk_engines(tmp_path) -> None:
    cfg = _cfg(tmp_path, "--lengths", "64", "--disk-dir", str(tmp_path), "--disk-direct-io")
    modes = {name: extra for name, extra, _ in bench_serve._modes(cfg, EXTRAS)}
    assert modes[disk.SAVE]["embedded_disk_direct_io"] is modes[disk.HIT]["embedded_disk_direct_io"] is True
    assert "embedded_disk_direct_io" not in modes["save"]  # the DRAM-only engines have no tier


def _rec(mode: str, rid: str, ttft: float, L: int, bs: int = 32) -> dict:
    which = rid.rsplit("/", 1)[1]
    pool = None
    if bench_serve.role(mode) == "save":
        pool = {"saved_chunks": L // bs}
    elif mode != "recompute":
        first = which == "first"
        pool = {"promised_tokens": L if first else 0, "loaded_tokens": L if first else 0, "failed_blocks": 0,
                "loaded_bytes": L * 1000 if first else 0}
    return {"id": rid, "ttft_s": ttft, "cached_tokens": L if which == "second" else 0, "pool": pool}


def _records(modes: list[str], first: dict[str, float], second: float = 0.05) -> dict:
    out = {}
    for m in modes:
        recs = []
        for L in (64, 128):
            recs.append(_rec(m, f"warm/{L}/0/first", 99.0, L))
            recs.append(_rec(m, f"meas/{L}/0/first", first[m] * L / 128, L))
            if bench_serve.role(m) != "save":
                recs.append(_rec(m, f"meas/{L}/0/second", second, L))
        out[m] = recs
    return out


def test_backend_rows_and_disk_row_from_records(tmp_path) -> None:
    cfg = _cfg(tmp_path, "--lengths", "64,128", "--backend", "embedded,mooncake", "--disk-dir", str(tmp_path))
    modes = [m[0] for m in bench_serve._modes(cfg, EXTRAS)]
    first = {"save": 1.1, "recompute": 1.0, "bulk": 0.2, "layerwise_d2": 0.1, "mooncake/save": 1.5,
             "mooncake/layerwise_d2": 0.4, disk.SAVE: 1.2, disk.HIT: 0.25}
    r = bench_serve.summarize(cfg, modes, _records(modes, first))
    assert r["checks"]["pool_hits_ok"] and r["checks"]["saved_ok"] and r["checks"]["local_hits_ok"]
    rows = backends.rows(cfg, r["ttft_s"])
    assert rows["embedded"]["save_vs_recompute"]["128"] == pytest.approx(1.1)
    assert rows["mooncake"]["save_vs_recompute"]["64"] == pytest.approx(1.5)
    assert rows["mooncake"]["hit_vs_recompute"]["128"] == pytest.approx(0.4)
    assert rows["mooncake"]["hit_mode"] == "mooncake/layerwise_d2"
    d = disk.rows(cfg, r, backends.hit_mode(cfg, "embedded"), [0.5, 0.7], [{"disk_hits": 6.0, "disk_read_bytes": 1e6}])
    assert d["vs_dram_hit"]["128"] == pytest.approx(2.5) and d["vs_recompute"]["64"] == pytest.approx(0.25)
    # 128 tokens x 1000 bytes read in (0.25 - 0.05) s, against the median sequential read 0.6 GB/s
    assert d["read_gbps"]["128"] == pytest.approx(128_000 / 0.2 / 1e9)
    assert d["read_vs_seq"]["128"] == pytest.approx(128_000 / 0.2 / 1e9 / 0.6)
    assert d["disk_hits_ok"] and d["expected_hits"] == 2 * (64 + 128) // 32
    assert not disk.rows(cfg, r, "layerwise_d2", [0.5], [{"disk_hits": 0}])["disk_hits_ok"]
    # The whole report converts to its struct, the new rows included.
    r.update(backend_rows=rows, disk=d, engine_start_s={m: 1.0 for m in modes}, runtime_s=9.0,
             loadavg={"before": 1.0, "after": 1.0})
    out = checked(r)
    assert out.disk is not None and out.disk.seq_read_gbps == [0.5, 0.7]
    assert out.config.backends == ["embedded", "mooncake"] and set(out.backend_rows) == {"embedded", "mooncake"}


def test_table_prints_one_row_per_backend_and_the_disk_row(tmp_path, capsys) -> None:
    cfg = _cfg(tmp_path, "--lengths", "64,128", "--backend", "embedded,memcache", "--disk-dir", str(tmp_path))
    modes = [m[0] for m in bench_serve._modes(cfg, EXTRAS)]
    first = dict.fromkeys(modes, 0.5) | {"recompute": 1.0}
    r = bench_serve.summarize(cfg, modes, _records(modes, first))
    r["backend_rows"] = backends.rows(cfg, r["ttft_s"])
    r["disk"] = disk.rows(cfg, r, "layerwise_d2", [1.0], [{"disk_hits": 3}])
    bench_serve.print_table(r)
    out = capsys.readouterr().out
    assert "  embedded        0.500      0.500      0.500      0.500" in out
    assert "  memcache        0.500" in out
    assert "disk tier" in out and "disk_hits_ok=True" in out


def test_drop_cache_and_sequential_read_on_a_real_directory(tmp_path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 70_000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 5_000)
    assert disk.drop_cache(str(tmp_path)) == 75_000
    assert disk.sequential_read_gbps(str(tmp_path), 9 << 20) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "sub"]  # the read's file is gone


def test_cleanup_removes_the_tier_and_the_disk_engines_dram_pools(tmp_path) -> None:
    cfg = _cfg(tmp_path, "--lengths", "64", "--disk-dir", str(tmp_path))
    for p in (cfg["disk_dir"], cfg["pool_path"] + "-disk-save", cfg["pool_path"] + "-disk-hit-1", cfg["pool_path"]):
        os.makedirs(p)
    disk.cleanup(cfg)
    assert sorted(os.listdir(tmp_path)) == ["pool"]  # the main pool is run()'s to remove


@pytest.mark.slow
@pytest.mark.timeout(1500)  # six fresh engines of the tiny model (~70 s on an idle 2-core machine; the run is shared)
def test_quick_run_serves_the_disk_row_from_disk(quick_serve_run) -> None:
    r, disk_dir = quick_serve_run
    ck, d = r["checks"], r["disk"]
    assert ck["pool_hits_ok"] and ck["saved_ok"] and ck["local_hits_ok"], ck["problems"]
    assert r["modes"][-2:] == [disk.SAVE, disk.HIT] and r["pool_hit_tokens"][disk.HIT]["128"] == 128
    # Every chunk the disk/hit engine loaded was opened from disk: its DRAM pool was new and empty.
    assert d["disk_hits_ok"] and d["disk_hits"] == [d["expected_hits"]], d
    assert d["disk_read_bytes"][0] >= d["expected_hits"] * 32 * r["config"]["kv_bytes_per_token"]
    assert d["read_gbps"]["128"] is None or d["read_gbps"]["128"] > 0
    assert d["seq_read_gbps"][0] > 0 and d["hit_ttft_s"]["128"] > 0
    assert os.listdir(disk_dir) == []  # the tier's directory and the read's file are gone
