"""KV saved at one tensor-parallel size, loaded at another, on vLLM's CPU build:
P at TP=1 -> D at TP=2 and P at TP=2 -> D at TP=1, GQA (2 kv heads). The loader finds nothing under
its own TP's keys, finds the saver's objects (every saver rank's), and each of its ranks reads its
heads by byte ranges (``lw_core.tp_split``): one object's half per rank for P1 -> D2, two objects
into one block for P2 -> D1. Nothing is saved twice.

Three engines share one embedded pool, one after the other (kv_both, as a prefiller and a decoder
would be, without the proxy: the lookup across TP sizes is the same for every request):

1. TP=1 computes prompt A (its output is the single-engine reference for A) and saves it at TP=1;
2. TP=2 loads A from the TP=1 objects (P1 -> D2), then computes prompt B (the reference for B)
   and saves it at TP=2;
3. a fresh TP=1 engine loads B from the TP=2 objects (P2 -> D1).

Each loader's greedy output equals the engine that computed the prompt itself (at the other TP size:
the oracle's log-prob tolerance covers the all-reduce's rounding), it loads every full chunk but the
last token's, and its stats name the saver's TP size. Measured ~3.5 min on this 2-core VM (one TP=2
start is ~100 s). MLA needs no split: its keys carry no TP size (``tests/pd/test_pd_tp_mismatch.py``).
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

BLOCK = 32
MAX_TOKENS = 8
A = random_tokens(41, 3 * BLOCK + 7)  # three full chunks and a partial tail
B = random_tokens(42, 2 * BLOCK + 5)
# One OpenMP thread per worker, each on its own core of those this process may use (the engine core
# and the pool share them).
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(cpu_ids())}


def _run(tp: int, prompts: list, pool: str) -> list:
    engine = {"enable_prefix_caching": False, "block_size": BLOCK, "tensor_parallel_size": tp}
    if tp > 1:
        engine["distributed_executor_backend"] = "mp"
    extra = {"embedded_path": pool, "embedded_capacity_bytes": 64 << 20, "use_layerwise": True}
    job = {"model": "gqa", "max_tokens": MAX_TOKENS, "phases": [prompts], "engine": engine, "extra": extra}
    return run_engine(job, env=TP2_ENV if tp > 1 else None)["phases"][0]["outputs"]


@pytest.fixture(scope="module")
def runs():
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
    pool = f"{base}/lw-test-tp-cross-{uuid.uuid4().hex[:8]}"
    try:
        (a1,) = _run(1, [A], pool)
        a2, b2 = _run(2, [A, B], pool)
        (b1,) = _run(1, [B], pool)
        yield {"a1": a1, "a2": a2, "b2": b2, "b1": b1}
    finally:
        shutil.rmtree(pool, ignore_errors=True)


def _full_chunks_but_last_token(prompt: list) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def test_savers_compute_their_prompts(runs) -> None:
    for name, prompt in (("a1", A), ("b2", B)):
        st = runs[name]["stats"]
        assert st["promised_tokens"] == 0 and st["saved_chunks"] == len(prompt) // BLOCK, (name, st)


@pytest.mark.parametrize("loader,saver,prompt,src_tp", [("a2", "a1", A, 1), ("b1", "b2", B, 2)],
                         ids=["P1-D2", "P2-D1"])
def test_loader_at_another_tp_reads_the_savers_heads(runs, loader, saver, prompt, src_tp) -> None:
    got, ref = runs[loader], runs[saver]
    st = got["stats"]
    hit = _full_chunks_but_last_token(prompt)
    assert st["promised_tokens"] == hit and st["loaded_tokens"] == hit and st["failed_blocks"] == 0, st
    assert st["load_src_tp"] == src_tp, st
    assert_same_greedy(ref, got)
