"""Recurrent-state hybrids on real vLLM (CPU): a gated delta-net model (Qwen3-Next style, bf16)
with prefix caching on (vLLM's "align" state mode) saves, besides its attention chunks, the state
vLLM hands off at each retained chunk boundary (state_plan, state_store); a fresh process over the
same pool restores the longest prefix whose attention chunks and boundary state are both there.

One saver engine (chunked prefill of 512 tokens, states retained every block: boundaries 512, 1024
and 1280 of a 1300-token prompt), one loader engine:

* the saved prompt hits up to its last boundary (1280 tokens) with the saver's greedy output;
* a prompt sharing 900 tokens finds three attention chunks (768 tokens) but no state at 768: its
  hit is shorter (512, the last boundary with a state), with the output it gets without the pool;
* a prompt sharing 300 tokens finds one chunk and no state at 256: no hit, computed whole;
* a state that fails to load (the pool's ``open`` fails once) fails the request's load: vLLM
  recomputes it whole, with the saver's output;
* a state read that takes a second (``open`` stalls; it runs beside the receive of the chunks,
  off the forward thread: state_loads) holds the request until it landed: a full hit, the
  saver's output.

The references for the other prompts run in the saver under another ``cache_salt`` (their keys,
and vLLM's own prefix cache, are apart from the unsalted ones the loader uses).
"""

from __future__ import annotations

import pytest

from lw_bench.models import GDN_SPEC
from lw_dev.harness import assert_same_greedy, random_tokens, run_engine, run_faulty
from lw_dev.state_sizes import gdn_state_nbytes

pytestmark = pytest.mark.slow

BLOCK = 256  # vLLM raises the attention block to 256 tokens so a page holds a GDN state
# One block of one full-attention layer: K and V, 2 kv heads of 64 in bf16.
PAGE = 2 * GDN_SPEC["num_key_value_heads"] * GDN_SPEC["head_dim"] * 2 * BLOCK
P = random_tokens(51, 1300)
Q = P[:900] + random_tokens(52, 400)
R = P[:300] + random_tokens(53, 700)
S = random_tokens(54, 600)  # one state, at 512
T = random_tokens(55, 600)  # one state, at 512


def _job(pool_path: str, phases: list) -> dict:
    return {
        "model": "gdn", "max_tokens": 6, "max_model_len": 2048, "phases": phases,
        "engine": {"enable_prefix_caching": True, "max_num_batched_tokens": 512,
                   "prefix_cache_retention_interval": BLOCK},
        "extra": {"embedded_path": pool_path, "embedded_capacity_bytes": 64 << 20, "use_layerwise": True},
    }


def test_gdn_state_saved_and_restored_by_a_fresh_engine(pool_path: str) -> None:
    saver = run_engine(_job(pool_path, [[P, {"ids": Q, "salt": "ref"}, {"ids": R, "salt": "ref"}, S, T]]))
    ref = saver["phases"][0]["outputs"]
    assert ref[0]["stats"]["saved_chunks"] == 1300 // BLOCK, ref[0]["stats"]

    # Only a state load calls the pool's open (chunks stream in through open_streaming).
    res, log = run_faulty(_job(pool_path, [
        {"prompts": [P, Q, R]},
        {"prompts": [S], "rules": [{"op": "open", "action": "fail", "times": 1}]},
        # The state read takes a second: its chunks are in long before, and the request waits for it.
        {"prompts": [T], "rules": [{"op": "open", "action": "stall", "seconds": 1.0, "times": 1}]},
    ]))
    got = res["phases"][0]["outputs"]
    state = gdn_state_nbytes()
    for o, hit in zip(got, (1280, 512, 0)):
        st = o["stats"]
        assert st["promised_tokens"] == hit and st["loaded_tokens"] == hit and st["failed_blocks"] == 0, st
        # Both attention layers' chunks, and the state object at the hit's end.
        assert st["loaded_bytes"] == 2 * (hit // BLOCK) * PAGE + (state if hit else 0), st
    # The connector's counters count the same: 5 + 2 chunk objects, 2 state objects.
    m = [ph["metrics"] for ph in res["phases"]]
    assert m[0]["vllm:lw_pool_loaded_objects"] == 7 + 2, m[0]
    assert m[0]["vllm:lw_pool_loaded_bytes"] == 7 * 2 * PAGE + 2 * state, m[0]
    # A lost state moves this tiny random model's log-probs by a few 1e-3 only (a zeroed one: 3.5e-3
    # at the second token), so the default tolerance would hardly see it; a restored state gives
    # the saver's log-probs bit for bit here (same kernels, same chunk ends).
    for r, o in zip(ref, got):
        assert_same_greedy(r, o, lp_tol=1e-4)

    failed = res["phases"][1]["outputs"][0]
    assert res["phases"][1]["rule_hits"] == [1]
    assert failed["stats"]["promised_tokens"] == 2 * BLOCK and failed["stats"]["loaded_tokens"] == 0, failed["stats"]
    assert failed["stats"]["failed_blocks"] > 0, failed["stats"]
    assert_same_greedy(ref[3], failed, lp_tol=1e-4)
    # The state that did not land counts nowhere; the chunks read beside it before their receive
    # was stopped do (whole layers of at most its 2 chunks), in the request and in the counters.
    moved = failed["stats"]["loaded_bytes"]
    assert moved % PAGE == 0 and moved <= 2 * 2 * PAGE, failed["stats"]
    assert m[1]["vllm:lw_pool_loaded_bytes"] - m[0]["vllm:lw_pool_loaded_bytes"] == moved, m
    assert m[1]["vllm:lw_pool_loaded_objects"] - m[0]["vllm:lw_pool_loaded_objects"] <= 2, m

    slow = res["phases"][2]["outputs"][0]
    assert res["phases"][2]["rule_hits"] == [1]
    st = slow["stats"]
    assert st["promised_tokens"] == st["loaded_tokens"] == 2 * BLOCK and st["failed_blocks"] == 0, st
    assert st["loaded_bytes"] == 2 * 2 * PAGE + state, st
    assert_same_greedy(ref[4], slow, lp_tol=1e-4)
    assert "Traceback" not in log
