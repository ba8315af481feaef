"""Tensor parallel 2 on vLLM's CPU build (one worker process per core: ``mp`` executor,
``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``0|1``): a kv_both TP=2 engine saves, a fresh TP=2 engine loads, and
its greedy output equals the same TP=2 engine without the pool.

GQA (2 kv heads: each rank saves and loads its own head under its own rank tag) and MLA (the latent
KV is the same on every rank: rank 0 saves one copy, both ranks load it). One engine pair per model;
the pair covers both modes: GQA saves layerwise and loads in bulk, MLA saves in bulk and loads
layerwise; the loading engine staggers its ranks' host-to-device copies (``h2d_stagger_us``).
Three engines per model (baseline, saver, loader), run one after the other: measured 4 min (MLA) to
8 min (GQA, with other engines running) per model on 2 cores, so 8-13 min for the module.
"""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_bench.pd.stack import cpu_ids  # noqa: E402
from lw_dev.harness import assert_same_greedy, random_tokens, run_engine  # noqa: E402

pytestmark = pytest.mark.slow

TP = 2
# One OpenMP thread per worker, each on its own core of those this process may use (the engine core
# and the pool share them).
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(cpu_ids())}
BLOCK = {"gqa": 32, "mla": 16}
MAX_TOKENS = 8
P1 = random_tokens(31, 167)  # several full chunks and a partial tail
P2 = P1[:64] + random_tokens(32, 50)  # shares its first 64 tokens with P1
P3 = random_tokens(33, 12)  # shorter than a chunk: nothing to load
PROMPTS = [P1, P2, P3]


def _engine(model: str) -> dict:
    e = {"enable_prefix_caching": False, "tensor_parallel_size": TP, "distributed_executor_backend": "mp"}
    if model == "gqa":
        e["block_size"] = 32
    return e


def _run(model: str, prompts: list, extra: dict | None) -> list:
    job = {"model": model, "max_tokens": MAX_TOKENS, "phases": [prompts], "engine": _engine(model), "extra": extra}
    return run_engine(job, env=ENV)["phases"][0]["outputs"]


@pytest.fixture(scope="module", params=["gqa", "mla"])
def tp_runs(request):
    model = request.param
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
    path = f"{base}/lw-test-tp-{uuid.uuid4().hex[:8]}"
    try:
        ref = _run(model, PROMPTS, None)
        save_layerwise = model == "gqa"
        a = _run(model, [P1], {"embedded_path": path, "embedded_capacity_bytes": 64 << 20,
                               "use_layerwise": save_layerwise})
        b = _run(model, PROMPTS, {"embedded_path": path, "embedded_capacity_bytes": 64 << 20,
                                  "use_layerwise": not save_layerwise, "h2d_stagger_us": 300})
        yield model, ref, a, b
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_tp2_saver_output_and_saves(tp_runs) -> None:
    model, ref, a, _ = tp_runs
    assert_same_greedy(ref[0], a[0])
    assert a[0]["stats"]["promised_tokens"] == 0
    assert a[0]["stats"]["saved_chunks"] == len(P1) // BLOCK[model]


def test_tp2_fresh_engine_loads_every_rank_and_matches(tp_runs) -> None:
    model, ref, _, b = tp_runs
    bs = BLOCK[model]
    expected = [(len(P1) - 1) // bs * bs, 64, 0]
    for i, (r, g, hit) in enumerate(zip(ref, b, expected)):
        assert_same_greedy(r, g)
        st = g["stats"]
        assert st["promised_tokens"] == hit, f"prompt {i}: promised {st['promised_tokens']}, expected {hit}"
        assert st["loaded_tokens"] == hit and st["failed_blocks"] == 0, st
