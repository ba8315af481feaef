"""``lw-bench pipeline --kv-device``: the device mode's code runs end to end (``cpu-torch`` here,
a real device in scripts/device-check.sh); timings are never checked, only keys and exact bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lw_bench.cli import main

KEYS = {
    "config", "t_compute_s", "t_transfer_s", "t_bulk_s", "t_layerwise_s", "hidden_fraction",
    "per_layer_compute_ms", "per_layer_transfer_ms", "transfer_gbps", "layer_wait_ms", "samples",
    "load_failures", "errors", "verified", "t_raw_copy_s", "t_raw_overlap_s", "raw_hidden_fraction",
}  # fmt: skip


def test_device_mode_reports_every_key_and_loads_exact_bytes(capsys, tmp_path):
    argv = ["pipeline", "--quick", "--json", "--kv-device", "cpu-torch", "--pool-path", str(tmp_path / "pool")]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= set(r)
    assert r["config"]["kv_device"] == "cpu-torch" and set(r["hidden_fraction"]) == {"1", "2"}
    assert r["verified"] is True and r["load_failures"] == 0 and r["errors"] == []


def test_rates_and_model_shaped_cover_every_case_and_mechanism_with_exact_bytes(capsys, tmp_path):
    argv = ["pipeline", "--quick", "--json", "--kv-device", "cpu-torch", "--pool-path", str(tmp_path / "pool"),
            "--mechanism", "batch_dma", "--rates", "--model-shaped", "tiny"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["config"]["mechanism"] == "batch_dma" and r["mechanism_counts"]["batch_dma"] > 0
    assert r["mechanism_counts"]["staged"] == r["mechanism_counts"]["kernel"] == 0
    rows = r["rates"]
    assert {(x["case"], x["mechanism"]) for x in rows} == {
        (c, m) for c in ("16 KiB", "64 KiB", "model") for m in ("staged", "kernel", "batch_dma")}
    for x in rows:  # inline ops offer every mechanism: each row moved by the one it names
        assert x["verified"] and x["used"][x["mechanism"]] > 0 and sum(x["used"].values()) == x["used"][x["mechanism"]]
        assert x["load_of_ceiling"] == pytest.approx(x["load_gbps"] / x["ceiling_load_gbps"])
    model = r["model_shaped"]
    assert [m["tokens"] for m in model] == [128, 256] and {m["shape"] for m in model} == {"tiny"}
    assert set(model[0]["load_over_prefill"]) == {"staged", "kernel", "batch_dma"}


def test_device_only_options_are_refused_on_the_cpu_bench_and_shapes_are_named():
    with pytest.raises(SystemExit, match="need --kv-device"):
        main(["pipeline", "--rates"])
    with pytest.raises(SystemExit, match="--model-shaped='llama9' is not a known shape; accepted: llama3-8b, llama3-70b, tiny"):
        main(["pipeline", "--kv-device", "cpu-torch", "--model-shaped", "llama9"])


@pytest.mark.parametrize("bad", ["gpu!", "cuda:x", "CUDA"])
def test_a_bad_kv_device_is_named(bad):
    with pytest.raises(SystemExit, match=f"--kv-device='{bad}' must be cpu, cpu-torch or a torch device"):
        main(["pipeline", "--kv-device", bad])


def test_the_cpu_bench_does_not_import_torch():
    code = (
        "import sys; from lw_bench import pipeline as pipeline_bench; "
        "assert 'torch' not in sys.modules and 'lw_vllm' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_host_work_times_every_case_and_mechanism_through_the_mechanism_it_names(capsys, tmp_path):
    argv = ["pipeline", "--quick", "--json", "--kv-device", "cpu-torch", "--pool-path", str(tmp_path / "pool"), "--host-work"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = r["host_work"]
    assert {(x["case"], x["mechanism"]) for x in rows} == {
        (c, m) for c in ("16 KiB", "64 KiB", "model") for m in ("kernel", "batch_dma")}
    for x in rows:
        assert x["windows"] == x["layers"] * x["blocks"]
        assert x["used"][x["mechanism"]] > 0 and sum(x["used"].values()) == x["used"][x["mechanism"]]
        assert x["load_ns_per_window"] > 0 and x["save_ns_per_window"] > 0
        assert x["load_bound_gbps"] == pytest.approx(x["segment_bytes"] / x["load_ns_per_window"])
        assert x["save_bound_gbps"] == pytest.approx(x["segment_bytes"] / x["save_ns_per_window"])


def test_host_work_is_refused_without_cpu_torch():
    with pytest.raises(SystemExit, match="--host-work needs --kv-device cpu-torch"):
        main(["pipeline", "--host-work"])
