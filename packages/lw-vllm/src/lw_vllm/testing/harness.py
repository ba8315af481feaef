"""Test harness: run engines in fresh processes and compare greedy outputs (the pool's oracle)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import Any

from lw_vllm.testing.engine import RESULT_MARK

ENGINE_TIMEOUT_S = 420


class EngineFailed(RuntimeError):
    def __init__(self, rc: int, output: str):
        super().__init__(f"engine exited with {rc}:\n{output[-4000:]}")
        self.output = output


def random_tokens(seed: int, n: int) -> list[int]:
    """``n`` reproducible token ids inside the tiny models' vocabulary (ids < 3 are special)."""
    r = random.Random(seed)
    return [r.randrange(3, 500) for _ in range(n)]


def run_engine(job: dict[str, Any], *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one engine in a fresh process; raises EngineFailed with its output on failure."""
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run(
        [sys.executable, "-m", "lw_vllm.testing.engine"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        env=e,
    )
    out = p.stdout + p.stderr
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    raise EngineFailed(p.returncode, out)



def assert_same_greedy(ref: dict[str, Any], got: dict[str, Any], *, tie_gap: float = 0.02, lp_tol: float = 2e-3) -> None:
    """Greedy oracle: equal tokens, or a first divergence only at a near-tie (the reference's
    top-2 gap below ``tie_gap`` and ``got`` took the runner-up); log-probs agree before it."""
    rt, gt = ref["tokens"], got["tokens"]
    for i, (a, b) in enumerate(zip(rt, gt)):
        (t1, l1), *rest = ref["top2"][i]
        glp = dict((t, lp) for t, lp in got["top2"][i])
        if a == b:
            assert abs(glp[b] - l1) <= lp_tol, f"position {i}: log-prob {glp[b]} vs {l1} (tokens so far equal)"
            continue
        assert rest, f"position {i}: token {b} != {a} and no runner-up recorded"
        t2, l2 = rest[0]
        gap = l1 - l2
        assert b == t2 and gap < tie_gap, (
            f"position {i}: got token {b}, expected {a} (top-2 {ref['top2'][i]}, gap {gap:.4f}); "
            f"not a near-tie (< {tie_gap})"
        )
        return
    assert len(rt) == len(gt)
