"""``lw-bench pipeline --quick``: a smoke run that checks the report's keys (never its timings)."""

from __future__ import annotations

import importlib.util
import json

import msgspec
import pytest

from lw_bench.cli import main
from lw_bench.pipeline_result import PipelineBenchConfig, PipelineBenchResult, decode

KEYS = {
    "config", "t_compute_s", "t_transfer_s", "t_bulk_s", "t_layerwise_s", "hidden_fraction",
    "per_layer_compute_ms", "per_layer_transfer_ms", "transfer_gbps", "layer_wait_ms", "samples",
    "load_failures", "errors", "verified", "t_raw_copy_s", "t_raw_overlap_s", "raw_hidden_fraction",
}  # fmt: skip


@pytest.mark.parametrize("backend", ["embedded", "memory"])
def test_quick_run_reports_every_key_and_loads_exact_bytes(backend, capsys, tmp_path):
    argv = ["pipeline", "--quick", "--json", "--backend", backend]
    if backend == "embedded":
        argv += ["--pool-path", str(tmp_path / "pool")]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= set(r)
    assert set(r["t_layerwise_s"]) == set(r["hidden_fraction"]) == {"1", "2"}
    c = r["config"]
    assert (c["layers"], c["blocks"], c["reps"], c["backend"]) == (4, 8, 1, backend)
    assert c["blas_threads_env"] == {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    assert c["total_bytes"] == 4 * 8 * (16 << 10) and c["matmul_n"] >= 8
    assert all(len(v) == 1 for v in r["samples"].values())
    assert r["verified"] is True and r["load_failures"] == 0 and r["errors"] == []


def test_the_json_is_the_result_struct_and_a_missing_key_is_refused_by_name(capsys):
    assert main(["pipeline", "--quick", "--json", "--backend", "memory"]) == 0
    raw = capsys.readouterr().out.strip().splitlines()[-1]
    r = json.loads(raw)
    # every field but the device bench's and --plot's, and nothing else
    device_only = {"save_s", "mechanism_counts", "rates", "model_shaped", "host_work"}
    assert set(r) == set(PipelineBenchResult.__struct_fields__) - device_only - {"plot"} == KEYS
    assert set(r["config"]) == set(PipelineBenchConfig.__struct_fields__) - {"kv_device", "device_name", "torch", "mechanism"}
    assert decode(raw).config.depths == [1, 2]
    del r["verified"]
    with pytest.raises(msgspec.ValidationError, match="verified"):
        decode(json.dumps(r))


def test_plot_needs_matplotlib_or_writes_a_png(tmp_path, capsys):
    out = tmp_path / "p.png"
    argv = ["pipeline", "--quick", "--json", "--plot", str(out), "--pool-path", str(tmp_path / "pool")]
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(SystemExit, match=r"--plot needs matplotlib: pip install 'lw-bench\[plot\]'"):
            main(argv)
    else:
        assert main(argv) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "extra,match",
    [(["--depths", "1,x"], "--depths='1,x' must be comma-separated"), (["--layers", "0"], "--layers=0 must be >= 1")],
)
def test_bad_options_are_named(extra, match):
    with pytest.raises(SystemExit, match=match):
        main(["pipeline", *extra])
