"""kv_both across hosts over memcache host_tcp (GQA): an engine on host A saves a prompt into the
pool (DRAM lent by the holder on host B); a fresh engine on host B then hits every full chunk of
it and gives A's greedy output (A computed the prompt from scratch: it is the single-engine
reference). Slow: two engines, one after the other (~3 min on 2 cores)."""

from __future__ import annotations

import pytest
from cluster import Cluster

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_bench.pd.stack import cpu_ids  # noqa: E402
from lw_dev.harness import assert_same_greedy, random_tokens, run_engine  # noqa: E402

CPUS = cpu_ids()  # the engines' OpenMP CPUs: two this process may use (not 0 and 1 by name)

pytestmark = pytest.mark.slow

BLOCK = 32
P1 = random_tokens(51, 167)  # five full chunks and a partial tail


def _job(cluster: Cluster, host: str, prompts: list[list[int]]) -> dict:
    return {"model": "gqa", "max_tokens": 8, "phases": [prompts], "max_model_len": 512,
            "engine": {"enable_prefix_caching": False, "block_size": BLOCK},
            "extra": cluster.extra(host, "engine", use_layerwise=True)}


def test_kv_both_saved_on_host_a_hits_on_host_b(cluster: Cluster) -> None:
    a = run_engine(_job(cluster, "a", [P1]), env={"VLLM_CPU_OMP_THREADS_BIND": CPUS[0]},
                   launcher=cluster.launcher("a"))["phases"][0]["outputs"]
    assert a[0]["stats"]["promised_tokens"] == 0, a[0]["stats"]
    assert a[0]["stats"]["saved_chunks"] == len(P1) // BLOCK, a[0]["stats"]
    b = run_engine(_job(cluster, "b", [P1]), env={"VLLM_CPU_OMP_THREADS_BIND": CPUS[1]},
                   launcher=cluster.launcher("b"))["phases"][0]["outputs"]
    assert_same_greedy(a[0], b[0])
    st = b[0]["stats"]
    assert st["promised_tokens"] == (len(P1) - 1) // BLOCK * BLOCK, st
    assert st["loaded_tokens"] == st["promised_tokens"] and st["failed_blocks"] == 0, st
