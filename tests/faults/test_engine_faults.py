"""A failing or stalling pool on real vLLM (CPU, tiny models): requests never break, outputs stay right.

Each engine runs in its own process with the pool backend wrapped in FaultyBackend (lw_dev.engine's ``faults`` jobs)
and goes through phases on ONE engine, so recovery is shown without restarting vLLM:

* ``recompute`` policy: a failed read of one layer, a read that misses its deadline, a failed open
  -> the blocks are recomputed and greedy output equals the no-pool output; a failed lookup is a miss.
* saves that fail or stall never fail the request and never hold the step past ``save_timeout_s``;
  what they wrote is never published (the next lookup misses).
* the pool comes back (rules cleared, or its directory wiped and recreated): hits resume.
* ``fail`` policy: only the request whose load failed ends (finish_reason "error"), the log names
  the request and the cause; the other request of the same batch completes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_dev.harness import assert_same_greedy, pool_dir, run_engine, run_faulty  # noqa: E402
from lw_dev.harness import random_tokens as toks  # noqa: E402

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
P1 = toks(1, 100)  # 3 full chunks of 32 tokens
P2 = toks(2, 80)  # 2 chunks
P4 = toks(4, 90)  # never saved before it is used
P5 = toks(5, 70)  # 2 chunks, saved only by the save-fault phases
GQA_ENGINE = {"enable_prefix_caching": False, "block_size": 32}  # every hit comes from the pool
DEADLINE_S = 0.5
STALL_S = 8.0
# A stalled call may cost a few layer deadlines (later layers queue behind it until a fresh worker
# takes over), never the stall itself: compared with the same prompt's healthy phase.
STALL_SLACK_S = 4.0


@pytest.fixture(scope="module")
def baseline() -> dict[str, dict]:
    res = run_engine({"model": "gqa", "max_tokens": MAX_TOKENS, "extra": None, "engine": GQA_ENGINE,
                      "phases": [[P1, P2, P4, P5]]})
    outs = res["phases"][0]["outputs"]
    return {"P1": outs[0], "P2": outs[1], "P4": outs[2], "P5": outs[3]}


def _extra(layerwise: bool, **kw: object) -> dict:
    e = {"embedded_path": pool_dir(), "embedded_capacity_bytes": 64 << 20, "use_layerwise": layerwise,
         "layer_wait_timeout_s": DEADLINE_S, "save_timeout_s": DEADLINE_S}
    e.update(kw)
    return e


def _ph(prompts: list, rules: list | None = None, **kw: object) -> dict:
    return {"prompts": prompts, "rules": rules or [], **kw}


def test_recompute_policy_survives_every_pool_fault_and_recovers(baseline) -> None:
    phases = [
        _ph([P1, P2]),  # 0: healthy, saves
        _ph([P1, P2], [{"op": "read", "layer": 2, "action": "fail"}]),  # 1
        _ph([P1], [{"op": "read", "layer": 1, "action": "stall", "seconds": STALL_S}]),  # 2: deadline miss
        _ph([P1], [{"op": "open", "action": "fail", "error": "missing"}]),  # 3
        _ph([P1], [{"op": "lookup", "action": "fail"}]),  # 4
        _ph([P5], [{"op": "write", "layer": 2, "action": "fail"}]),  # 5
        _ph([P5], [{"op": "write", "layer": 1, "action": "stall", "seconds": STALL_S}]),  # 6
        _ph([P5], [{"op": "commit", "action": "fail"}]),  # 7
        _ph([P5]),  # 8: healthy again: nothing of P5 was published, so a miss; saves now
        _ph([P5]),  # 9: hits resume
        _ph([P1], wipe_pool=True),  # 10: pool restarted empty: a miss, saves again
        _ph([P1]),  # 11: hits resume
    ]
    res, log = run_faulty({"model": "gqa", "max_tokens": MAX_TOKENS, "engine": GQA_ENGINE,
                           "extra": _extra(True), "phases": phases})
    ph = res["phases"]
    names = [["P1", "P2"], ["P1", "P2"], ["P1"], ["P1"], ["P1"], ["P5"], ["P5"], ["P5"], ["P5"], ["P5"], ["P1"], ["P1"]]
    for i, (p, ns) in enumerate(zip(ph, names)):
        assert p["rule_hits"] == [] or all(h > 0 for h in p["rule_hits"]), f"phase {i}: a fault never fired {p['rule_hits']}"
        for out, n in zip(p["outputs"], ns):
            assert out["finish_reason"] == "length", f"phase {i} {n}: {out['finish_reason']}"
            assert_same_greedy(baseline[n], out)

    def st(i: int, j: int = 0) -> dict:
        return ph[i]["outputs"][j]["stats"]

    # 0: saved. 1-3: promised, nothing loaded, every promised block reported failed and recomputed.
    assert st(0)["saved_chunks"] == 3 and st(0, 1)["saved_chunks"] == 2
    for i, j in ((1, 0), (1, 1), (2, 0), (3, 0)):
        s = st(i, j)
        assert s["promised_tokens"] > 0 and s["loaded_tokens"] == 0, (i, s)
        assert s["failed_blocks"] * 32 == s["promised_tokens"], (i, s)
    # A stalled layer costs deadlines, not the stall (phase 11: the same prompt, healthy, hitting).
    assert ph[2]["wall_s"] < ph[11]["wall_s"] + STALL_SLACK_S < STALL_S, (ph[2]["wall_s"], ph[11]["wall_s"])
    # 4: the lookup failed -> a miss, computed.
    assert st(4)["promised_tokens"] == 0
    # 5-7: saves failed or stalled -> nothing published, request fine, step not held past the deadline.
    for i in (5, 6, 7):
        assert st(i)["promised_tokens"] == 0 and st(i)["saved_chunks"] == 0, (i, st(i))
    assert ph[6]["wall_s"] < ph[8]["wall_s"] + STALL_SLACK_S < STALL_S, (ph[6]["wall_s"], ph[8]["wall_s"])
    assert st(8)["promised_tokens"] == 0 and st(8)["saved_chunks"] == 2
    assert st(9)["promised_tokens"] == 64 and st(9)["loaded_tokens"] == 64 and st(9)["failed_blocks"] == 0
    # 10-11: the pool was wiped under the running engine: miss and save, then hits again.
    assert ph[10]["pool_objects"] == 3 and st(10)["promised_tokens"] == 0 and st(10)["saved_chunks"] == 3
    assert st(11)["promised_tokens"] == 96 and st(11)["loaded_tokens"] == 96

    # The same story in the connector's metrics (vLLM's Prometheus registry, cumulative).
    m = [p["metrics"] for p in ph]
    assert m[1]["vllm:lw_pool_load_failed_blocks"] == 5 and m[1]["vllm:lw_pool_loaded_objects"] == 0
    assert m[2]["vllm:lw_pool_load_deadline_misses"] >= 1
    assert m[4]["vllm:lw_pool_lookup_errors"] >= 1
    assert m[5]["vllm:lw_pool_save_failed_objects"] >= 2
    assert m[6]["vllm:lw_pool_save_deadline_misses"] >= 1
    assert m[9]["vllm:lw_pool_loaded_objects"] == 2 and m[9]["vllm:lw_pool_loaded_bytes"] > 0
    assert m[11]["vllm:lw_pool_hit_tokens"] >= 64 + 96 and m[11]["vllm:lw_pool_layer_wait_seconds:count"] > 0
    assert "vLLM recomputes them; cause: layer 2: read of" in log and "injected fault" in log


def test_fail_policy_fails_only_the_affected_request(baseline) -> None:
    phases = [
        _ph([P1]),
        _ph([P1, P4], [{"op": "read", "layer": 0, "action": "fail"}]),
        _ph([P1]),
    ]
    res, log = run_faulty({"model": "gqa", "max_tokens": MAX_TOKENS, "engine": GQA_ENGINE,
                           "extra": _extra(False, kv_load_failure_policy="fail"), "phases": phases})
    ph = res["phases"]
    assert_same_greedy(baseline["P1"], ph[0]["outputs"][0])
    bad, other = ph[1]["outputs"]
    assert ph[1]["rule_hits"][0] > 0
    assert bad["finish_reason"] == "error" and bad["tokens"] == [], bad
    assert other["finish_reason"] == "length"
    assert_same_greedy(baseline["P4"], other)
    # The log names the request and the cause (vLLM itself only says "error" / HTTP 500).
    rid = bad["stats"]["req_id"]
    line = next(x for x in log.splitlines() if "kv_load_failure_policy=fail" in x)
    assert rid in line and "injected fault: read (layer 0) failed" in line, line
    # The engine is fine afterwards: the next request hits and is right.
    ok = ph[2]["outputs"][0]
    assert ok["finish_reason"] == "length" and ok["stats"]["loaded_tokens"] == 96
    assert_same_greedy(baseline["P1"], ok)


def test_mla_recompute_after_a_failed_layer_read() -> None:
    # CPU MLA: block 16, no local prefix cache. The reference is phase 0's output, computed with an
    # empty pool (test_connector_e2e shows that equals a no-connector engine).
    p = toks(7, 70)
    phases = [_ph([p]), _ph([p], [{"op": "read", "layer": 3, "action": "fail"}]),
              _ph([p], [{"op": "read", "layer": 1, "action": "stall", "seconds": STALL_S}]), _ph([p])]
    res, _ = run_faulty({"model": "mla", "max_tokens": MAX_TOKENS, "engine": {}, "extra": _extra(True), "phases": phases})
    ph = res["phases"]
    ref = ph[0]["outputs"][0]
    assert ref["stats"]["promised_tokens"] == 0 and ref["stats"]["saved_chunks"] == 4
    for i in (1, 2):
        g = ph[i]["outputs"][0]
        assert g["stats"]["promised_tokens"] == 64 and g["stats"]["loaded_tokens"] == 0, g["stats"]
        assert_same_greedy(ref, g)
    assert ph[2]["wall_s"] < ph[3]["wall_s"] + STALL_SLACK_S < STALL_S, (ph[2]["wall_s"], ph[3]["wall_s"])
    last = ph[3]["outputs"][0]
    assert last["stats"]["loaded_tokens"] == 64
    assert_same_greedy(ref, last)
