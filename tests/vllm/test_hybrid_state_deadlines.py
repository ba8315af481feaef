"""A store that stalls on recurrent-state objects only, under a gated delta-net hybrid on real vLLM
(CPU): the state paths keep the chunks' deadlines. One engine (kv_both, prefix caching on), its
pool wrapped in lw_dev.faulty_backend with rules on state keys (``"objects": "state"``), vLLM's own
prefix cache emptied before each fault phase so hits come from the pool:

* a state read that stalls fails its request's load at ``layer_wait_timeout_s`` (vLLM recomputes
  it), and does not hold the state load of the request beside it, which lands;
* a state save that stalls holds its step at most ``save_timeout_s``;
* a state lookup that stalls holds vLLM's scheduler at most ``lookup_timeout_s`` (a miss).

Every output equals the engine's own output for that prompt before any fault, to the oracle's
default tolerance. Each reference is computed alone, so its prefill is split into the same 512-token
chunks as in the fault phases: this bf16 model's recurrent state carries a chunked prefill's split
points into its output, and on an AMX CPU a reference batched with other prompts (split at 424
tokens) moved a log-prob by 0.025; tests/vllm/test_hybrid_state.py checks restored states to 1e-4,
one request at a time. A hit's correctness here is its load counts. The engine's step durations
are recorded (lw_dev.engine ``step_times``); the bounds are generous (a deadline plus a few seconds
for a loaded host), the stall far longer.
"""

from __future__ import annotations

import pytest

from lw_dev.harness import assert_same_greedy, pool_dir, random_tokens, run_faulty

pytestmark = pytest.mark.slow

DEADLINE_S = 1.0
STALL_S = 20.0
SLACK_S = 6.0  # a step's own work on a shared 2-core host, on top of a deadline
A, B, C, D = (random_tokens(60 + i, 600) for i in range(4))


def _stall(op: str) -> dict:
    return {"op": op, "objects": "state", "action": "stall", "seconds": STALL_S, "times": 1}


def test_stalled_state_objects_cost_deadlines_not_the_stall_and_outputs_stay_right() -> None:
    res, log = run_faulty({
        "model": "gdn", "max_tokens": 6, "max_model_len": 2048, "step_times": True,
        "engine": {"enable_prefix_caching": True, "max_num_batched_tokens": 512},
        "extra": {"embedded_path": pool_dir(), "embedded_capacity_bytes": 64 << 20, "use_layerwise": True,
                  "lookup_timeout_s": DEADLINE_S, "save_timeout_s": DEADLINE_S, "layer_wait_timeout_s": DEADLINE_S},
        "phases": [
            # the references, one prompt a phase; A, B, C saved with their states
            [A], [B], [C], [{"ids": D, "salt": "ref"}],
            {"prompts": [B, C], "rules": [_stall("open")], "reset_prefix_cache": True},
            {"prompts": [D], "rules": [_stall("reserve")], "reset_prefix_cache": True},
            {"prompts": [A], "rules": [_stall("lookup")], "reset_prefix_cache": True},
        ],
    })
    refs, (loads, saves, looks) = res["phases"][:4], res["phases"][4:]
    ref = {name: p["outputs"][0] for name, p in zip("ABCD", refs)}
    assert all(ref[name]["stats"]["saved_chunks"] > 0 for name in "ABC"), ref
    for i, p in enumerate((loads, saves, looks)):
        assert p["rule_hits"] == [1], (i, p["rule_hits"])

    # A stuck state read: that request recomputes at the load deadline, the other one's state lands.
    assert loads["wall_s"] < STALL_S, loads["wall_s"]
    for name, o in zip("BC", loads["outputs"]):
        assert_same_greedy(ref[name], o)
    stats = sorted((o["stats"] for o in loads["outputs"]), key=lambda s: s["failed_blocks"])
    assert all(s["promised_tokens"] > 0 for s in stats), stats
    assert stats[0]["failed_blocks"] == 0 and stats[0]["loaded_tokens"] == stats[0]["promised_tokens"], stats
    assert stats[1]["failed_blocks"] > 0 and stats[1]["loaded_tokens"] == 0, stats
    assert loads["metrics"]["vllm:lw_pool_load_deadline_misses"] - refs[-1]["metrics"].get(
        "vllm:lw_pool_load_deadline_misses", 0) >= 1, loads["metrics"]

    # A stuck state save: its step waits the save deadline, not the stall; the request is fine.
    assert saves["max_step_s"] < DEADLINE_S + SLACK_S < STALL_S, saves["max_step_s"]
    assert_same_greedy(ref["D"], saves["outputs"][0])
    assert saves["metrics"]["vllm:lw_pool_save_deadline_misses"] >= 1, saves["metrics"]

    # A stuck state lookup: a miss at the lookup deadline, the prompt computed.
    assert looks["max_step_s"] < DEADLINE_S + SLACK_S < STALL_S, looks["max_step_s"]
    (a,) = looks["outputs"]
    assert a["stats"]["promised_tokens"] == 0, a["stats"]
    assert_same_greedy(ref["A"], a)
    assert looks["metrics"]["vllm:lw_pool_lookup_errors"] >= 1, looks["metrics"]
    assert "Traceback" not in log
