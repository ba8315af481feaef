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
