"""kv_both on real vLLM (CPU) over Mooncake across two namespace hosts: an engine on host A
computes a prompt from scratch and saves it (its greedy output is the no-pool reference) into the
holder's memory on host B, over the hosts' link; a fresh engine on host B then hits every full
chunk and gives the same greedy output. Master and holder on B (tests/mooncake/conftest.py).
Slow: two engine starts per case (~1 min together on 2 cores)."""

from __future__ import annotations

import pytest
from mc_cluster import start_cluster

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_bench.pd.stack import cpu_ids  # noqa: E402
from lw_dev.harness import assert_same_greedy, random_tokens, run_engine  # noqa: E402

CPUS = cpu_ids()  # the engines' OpenMP CPUs: two this process may use (not 0 and 1 by name)

pytestmark = pytest.mark.slow
BLOCK = {"gqa": 32, "mla": 16}  # vLLM's CPU MLA forces block 16
P1 = random_tokens(71, 167)  # five full chunks (GQA) and a partial tail


@pytest.fixture(scope="module")
def vllm_cluster(hosts):
    c = start_cluster(hosts, port=50111, segment=256 << 20)
    yield c
    c.stop()


def _job(hosts, cluster, host: str, model: str, layerwise: bool, load: str = "per_layer") -> dict:
    engine = {"enable_prefix_caching": False, **({"block_size": BLOCK["gqa"]} if model == "gqa" else {})}
    extra = {**cluster.extra_config(), "mooncake_local_hostname": hosts.addr(host), "use_layerwise": layerwise,
             "mooncake_load": load}
    return {"model": model, "max_tokens": 8, "phases": [[P1]], "max_model_len": 512, "engine": engine, "extra": extra}


@pytest.fixture(scope="module")
def saved_on_a(hosts, vllm_cluster):
    """``saved_on_a(model)``: engine A's output for P1, computed from scratch and saved layerwise
    (once per model: the pool's objects are the same in bulk and layerwise mode)."""
    done: dict[str, dict] = {}

    def get(model: str) -> dict:
        if model not in done:
            a = run_engine(_job(hosts, vllm_cluster, "a", model, True), env={"VLLM_CPU_OMP_THREADS_BIND": CPUS[0]},
                           launcher=hosts.argv("a", []))["phases"][0]["outputs"][0]
            assert a["stats"]["promised_tokens"] == 0, a["stats"]
            assert a["stats"]["saved_chunks"] == len(P1) // BLOCK[model], a["stats"]
            done[model] = a
        return done[model]

    return get


@pytest.mark.parametrize(("model", "layerwise", "load"),
                         [("gqa", True, "per_layer"), ("mla", True, "per_layer"), ("gqa", False, "whole")],
                         ids=["gqa-layerwise", "mla-layerwise", "gqa-bulk-whole-load"])
def test_kv_both_saved_on_host_a_hits_on_host_b(hosts, vllm_cluster, saved_on_a, model: str, layerwise: bool,
                                                 load: str) -> None:
    bs = BLOCK[model]
    a = saved_on_a(model)
    b = run_engine(_job(hosts, vllm_cluster, "b", model, layerwise, load), env={"VLLM_CPU_OMP_THREADS_BIND": CPUS[1]},
                   launcher=hosts.argv("b", []))["phases"][0]["outputs"][0]
    assert_same_greedy(a, b)
    st = b["stats"]
    assert st["promised_tokens"] == (len(P1) - 1) // bs * bs, st
    assert st["loaded_tokens"] == st["promised_tokens"] and st["failed_blocks"] == 0, st
