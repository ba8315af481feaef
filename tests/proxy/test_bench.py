"""`lw-bench proxy --quick` runs end to end and returns its documented keys (figures are not judged)."""

from __future__ import annotations

import argparse

from lw_bench.proxy import mode as bench


def test_bench_quick_reports_documented_keys():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--quick", "--concurrency", "1", "4"])
    args.json = True
    r = bench.run(args)
    assert r["concurrency"] == [1, 4] and r["duration_s"] == 0.5
    for c in (1, 4):
        row = r[f"c{c}"]
        for target in ("direct", "proxy"):
            s = row[target]
            assert set(s) == {"requests", "errors", "rps", "p50_ms", "p99_ms", "mean_ms"}
            assert s["requests"] > 0 and s["errors"] == 0  # every proxied request completed the PD flow
        assert {"added_p50_ms", "throughput_ratio", "proxy_p99_over_p50"} <= set(row)
    assert set(r["targets"]) == {"added_p50_ms_c1_le_2"}


def test_percentile_matches_numpys_linear_interpolation():
    """The proxy bench's percentile (linear interpolation between closest ranks) is numpy's default one."""
    import random

    import numpy as np

    from lw_bench.proxy.mode import percentile

    r = random.Random(3)
    for n in (1, 2, 7, 100):
        xs = sorted(r.uniform(0, 50) for _ in range(n))
        for q in (0, 50, 99, 100):
            assert abs(percentile(xs, q) - float(np.percentile(xs, q))) < 1e-9, (n, q)
    assert percentile([], 50) != percentile([], 50)  # NaN
