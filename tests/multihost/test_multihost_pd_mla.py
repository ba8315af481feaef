"""PD across two hosts over memcache host_tcp with the tiny MLA model (CPU_MLA, block 16): the
decoder on host B loads the latent KV the prefiller on host A wrote into the holder's DRAM on B,
and gives the single engine's greedy output. Slow: two engines (~2-4 min on 2 cores)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster import Cluster
from pd_hosts import start_cross_host_stack

from lw_bench.pd.stack import Stack, metric_sum
from lw_dev.pd_flow import assert_remote_prefill_used, baseline, settle, text, through
from lw_dev.pd_oracle import SAMPLING, assert_same, completion_choice

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mla_stack(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("multihost-mla")
    cluster.restart_store()  # the GQA module kills the holder and the MetaService mid-run
    with cluster.hosts.entered("a"):
        s = start_cross_host_stack(cluster, "mla", log_dir, metaserver_timeout_s=30.0)
    try:
        yield s
    finally:
        s.stop()


def test_mla_pd_across_hosts_matches_single_engine(mla_stack: Stack, on_host_a: Cluster) -> None:
    body = {"model": "tiny", "prompt": text(21, 100), "max_tokens": 8, "logprobs": 2, **SAMPLING}
    ref = completion_choice(baseline(mla_stack, "/v1/completions", body)["choices"][0])
    settle(mla_stack)  # the stack's warm-up prefill may still be reporting its saves
    rx0, _ = on_host_a.hosts.link_bytes("b")
    saved0 = metric_sum(mla_stack.prefill.url, "vllm:lw_pool_saved_bytes_total")
    ex = through(mla_stack, "/v1/completions", body)
    assert ex.status == 200, ex.out
    assert_same(ref, completion_choice(ex.out["choices"][0]), "mla across hosts")
    assert_remote_prefill_used(mla_stack, ex, 1)
    assert ex.decode_stats[0]["loaded_tokens"] >= 6 * mla_stack.block_size
    saved = metric_sum(mla_stack.prefill.url, "vllm:lw_pool_saved_bytes_total") - saved0
    rx1, _ = on_host_a.hosts.link_bytes("b")
    assert saved > 0 and rx1 - rx0 >= saved, (saved, rx1 - rx0)
