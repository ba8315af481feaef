"""``lw-bench serve``: the smoke run on real vLLM (tiny model, one length, one rep), plus the
argument checks and the figures' arithmetic on hand-made engine records (no engine needed)."""

from __future__ import annotations

import argparse

import pytest

from lw_bench.serve import mode as bench_serve


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    bench_serve.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.slow
@pytest.mark.timeout(1500)  # six fresh engines on a shared 2-core machine (the run is shared)
def test_quick_json_run_reports_pool_hits_and_positive_times(quick_serve_run) -> None:
    r, _ = quick_serve_run
    for key in ("config", "modes", "ttft_s", "local_ttft_s", "pool_hit_tokens", "pool_load_s", "samples", "ratios",
                "headline", "checks", "engine_start_s", "runtime_s", "loadavg"):
        assert key in r, key
    modes = r["modes"][:4]  # then the disk rows (test_bench_serve_backends checks them)
    assert modes == ["save", "recompute", "bulk", "layerwise_d2"]
    (L,) = [str(x) for x in r["config"]["lengths"]]
    for m in modes:
        assert r["ttft_s"][m][L] > 0 and r["engine_start_s"][m] > 0
        if m != "save":
            assert r["local_ttft_s"][m][L] > 0
    for m in ("bulk", "layerwise_d2"):
        assert r["pool_hit_tokens"][m][L] == int(L), "a pool mode's first request must load the whole prefix"
    assert r["pool_hit_tokens"]["recompute"][L] == 0
    assert r["pool_hit_tokens"]["save"][L] == int(L)
    ck = r["checks"]
    assert ck["pool_hits_ok"] and ck["local_hits_ok"] and ck["saved_ok"], ck["problems"]
    h = r["headline"]
    assert h["hit_vs_recompute"] > 0 and h["layerwise_vs_bulk"] > 0 and h["layered_vs_local"] > 0


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--lengths", "100"], "--lengths"),
        (["--lengths", "a,b"], "--lengths"),
        (["--tail", "32"], "--tail"),
        (["--depths", "0"], "--depths"),
        (["--reps", "0"], "--reps"),
        (["--rounds", "0"], "--rounds"),
        (["--lengths", "16384"], "16384"),
        (["--backend", "redis"], "--backend"),
        (["--backend", "embedded,embedded"], "--backend"),
        (["--backend", "memcache", "--disk-dir", "/tmp"], "embedded"),
        (["--disk-dir", "/nonexistent-dir-of-lw-bench"], "--disk-dir"),
        (["--disk-direct-io"], "--disk-dir"),
    ],
)
def test_bad_arguments_fail_naming_the_flag(argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as ei:
        bench_serve._config(_args(*argv))
    assert needle in str(ei.value)


def test_schedule_saves_once_then_alternates_the_measured_modes() -> None:
    names = ["save", "recompute", "bulk", "layerwise_d2"]
    assert bench_serve._schedule(names, 1) == names
    assert bench_serve._schedule(names, 3) == [
        "save", "recompute", "bulk", "layerwise_d2", "layerwise_d2", "bulk", "recompute", "recompute", "bulk", "layerwise_d2"]


def _rec(mode: str, rid: str, ttft: float, L: int, bs: int = 32) -> dict:
    which = rid.rsplit("/", 1)[1]
    pool = None
    if mode == "save":
        pool = {"saved_chunks": L // bs}
    elif mode != "recompute":
        pool = {"promised_tokens": L, "loaded_tokens": L, "failed_blocks": 0} if which == "first" else {
            "promised_tokens": 0, "loaded_tokens": 0, "failed_blocks": 0}
    return {"id": rid, "ttft_s": ttft, "cached_tokens": L if which == "second" else 0, "pool": pool}


def test_summary_medians_and_ratios_from_records() -> None:
    cfg = bench_serve._config(_args("--lengths", "64,128", "--reps", "3", "--depths", "1,2", "--model", "tiny"))
    modes = ["save", "recompute", "bulk", "layerwise_d1", "layerwise_d2"]
    # first-request TTFT per mode at 128 tokens; the three reps are base, 2*base and 1.1*base.
    base = {"save": 1.2, "recompute": 1.0, "bulk": 0.4, "layerwise_d1": 0.3, "layerwise_d2": 0.2}
    records = {}
    for m in modes:
        recs = []
        for L in (64, 128):
            recs.append(_rec(m, f"warm/{L}/0/first", 99.0, L))  # warm-ups never count
            for i, f in enumerate((1.0, 2.0, 1.1)):
                recs.append(_rec(m, f"meas/{L}/{i}/first", base[m] * f * L / 128, L))
                if m != "save":
                    recs.append(_rec(m, f"meas/{L}/{i}/second", 0.1 * f * (1.5 if m == "bulk" else 1.0), L))
        records[m] = recs
    r = bench_serve.summarize(cfg, modes, records)
    assert r["ttft_s"]["recompute"]["128"] == pytest.approx(1.1)
    assert r["ttft_s"]["bulk"]["64"] == pytest.approx(0.22)
    assert r["local_ttft_s"]["recompute"]["128"] == pytest.approx(0.11)
    assert r["ratios"]["hit_vs_recompute"]["bulk"] == pytest.approx(0.4)
    assert r["ratios"]["layerwise_vs_bulk"] == {"1": pytest.approx(0.75), "2": pytest.approx(0.5)}
    assert r["ratios"]["layered_vs_local"]["bulk"] == pytest.approx(1.5)
    assert r["headline"]["hit_vs_recompute"] == pytest.approx(0.2) and r["headline"]["length"] == 128
    assert r["pool_load_s"]["layerwise_d2"]["128"] == pytest.approx(0.2 * 1.1 - 0.11)
    assert r["pool_load_s"]["bulk"]["128"] == pytest.approx(0.44 - 0.165)
    assert r["ratios"]["load_layerwise_vs_bulk"]["2"] == pytest.approx(0.11 / 0.275)
    assert r["pool_hit_tokens"]["bulk"]["128"] == 128 and r["pool_hit_tokens"]["save"]["64"] == 64
    assert r["checks"]["pool_hits_ok"] and r["checks"]["local_hits_ok"] and r["checks"]["saved_ok"]
    assert len(r["samples"]["bulk"]["128"]["first"]) == 3


def test_summary_flags_a_pool_miss_and_a_missing_local_hit() -> None:
    cfg = bench_serve._config(_args("--lengths", "64", "--reps", "1", "--depths", "2", "--model", "tiny"))
    modes = ["save", "recompute", "bulk", "layerwise_d2"]
    records = {m: [_rec(m, "meas/64/0/first", 0.5, 64)] + ([_rec(m, "meas/64/0/second", 0.1, 64)] if m != "save" else [])
               for m in modes}
    records["bulk"][0]["pool"] = {"promised_tokens": 32, "loaded_tokens": 32, "failed_blocks": 0}
    records["layerwise_d2"][1]["cached_tokens"] = 0
    ck = bench_serve.summarize(cfg, modes, records)["checks"]
    assert not ck["pool_hits_ok"] and not ck["local_hits_ok"] and ck["saved_ok"]
    assert any("bulk meas/64/0/first" in p for p in ck["problems"])


def test_gdn_config_runs_bf16_on_512_token_blocks_with_prefix_caching_in_every_engine() -> None:
    cfg = bench_serve._config(_args("--model", "gdn", "--reps", "1", "--depths", "2"))
    assert (cfg["dtype"], cfg["block_size"], cfg["lengths"]) == ("bfloat16", 512, [1024, 2048, 3584])
    # Three full-attention layers keep KV per token: K and V, 4 heads of 64, bf16.
    assert cfg["kv_bytes_per_token"] == 3 * 2 * 4 * 64 * 2
    modes = bench_serve._modes(cfg, {"embedded": {"embedded_path": "/dev/shm/x"}})
    assert [n for n, _, _ in modes][:2] == ["save", "recompute"]
    assert all(prefix_caching for _, _, prefix_caching in modes)  # save too: vLLM hands states off
    for argv, needle in ((["--dtype", "float32"], "bfloat16"), (["--lengths", "1000"], "512")):
        with pytest.raises(SystemExit) as ei:
            bench_serve._config(_args("--model", "gdn", *argv))
        assert needle in str(ei.value)


def test_gdn_states_are_the_save_engines_objects_beyond_its_chunks() -> None:
    cfg = bench_serve._config(_args("--model", "gdn", "--lengths", "1024,2048", "--reps", "1"))
    chunks = 2 * (2 + 4)  # warm-up and one measured prefix per length, 512-token chunks
    chunk_bytes = 512 * cfg["kv_bytes_per_token"]
    engine = {"block_size": 512, "groups": [{"kind": "MambaSpec", "dtypes": ["bfloat16", "float32"]},
                                            {"kind": "FullAttentionSpec", "dtype": "bfloat16"}]}
    st = bench_serve._states(cfg, [{"saved_objects": chunks + 4, "saved_bytes": chunks * chunk_bytes + 4 * 1000}],
                             engine)
    assert st == {"chunk_objects": chunks, "objects": 4, "per_prefix": 1.0, "bytes_per_object": 1000,
                  "save_failed_objects": 0, "ssm_dtype": "float32"}  # the engine's recurrent state dtype
