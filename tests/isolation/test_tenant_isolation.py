"""Two tenants (different ``cache_salt``) never share pool objects, shown on real vLLM by content.

One engine (lw_dev.engine with a faulty pool, no faults injected except a tripwire) runs the same prompt as tenant A,
then tenant B: B gets no pool hit, never even opens a pool object (a rule that would fail any
``open`` never fires), computes its output itself (equal to A's computed output), and its KV lands
in objects of its own (the pool's object count doubles). Each tenant then hits only its own objects,
and a request without a salt hits neither.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_dev.harness import assert_same_greedy, pool_dir, run_faulty  # noqa: E402
from lw_dev.harness import random_tokens as toks  # noqa: E402

pytestmark = pytest.mark.slow

P = toks(11, 100)  # 3 full chunks of 32
TRIPWIRE = [{"op": "open", "action": "fail"}]


def test_tenants_with_different_cache_salt_share_nothing() -> None:
    a, b = {"ids": P, "salt": "tenant-a"}, {"ids": P, "salt": "tenant-b"}
    phases = [
        {"prompts": [a]},
        {"prompts": [b], "rules": TRIPWIRE},
        {"prompts": [a]},
        {"prompts": [b]},
        {"prompts": [P], "rules": TRIPWIRE},
    ]
    res, _ = run_faulty({"model": "gqa", "max_tokens": 8, "engine": {"enable_prefix_caching": False, "block_size": 32},
                         "extra": {"embedded_path": pool_dir(), "embedded_capacity_bytes": 64 << 20,
                                   "use_layerwise": True},
                         "phases": phases})
    ph = res["phases"]
    out = [p["outputs"][0] for p in ph]
    st = [o["stats"] for o in out]
    assert st[0]["promised_tokens"] == 0 and st[0]["saved_chunks"] == 3 and ph[0]["pool_objects"] == 3
    # Tenant B: no hit, not one object opened, its own computation, its own objects.
    assert st[1]["promised_tokens"] == 0 and st[1]["loaded_tokens"] == 0
    assert ph[1]["rule_hits"] == [0], "tenant B opened a pool object"
    assert st[1]["saved_chunks"] == 3 and ph[1]["pool_objects"] == 6
    assert_same_greedy(out[0], out[1])
    # Each tenant hits its own objects only (the count stays at 6: nothing new was needed).
    for i in (2, 3):
        assert st[i]["promised_tokens"] == 96 and st[i]["loaded_tokens"] == 96, st[i]
        assert_same_greedy(out[0], out[i])
    assert ph[3]["pool_objects"] == 6
    # No salt: a third key space.
    assert st[4]["promised_tokens"] == 0 and ph[4]["rule_hits"] == [0] and ph[4]["pool_objects"] == 9
    assert_same_greedy(out[0], out[4])
