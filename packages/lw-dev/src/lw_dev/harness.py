"""Test harness: run engines (``lw_dev.engine``) in fresh processes and compare greedy outputs (the
pool's oracle)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import uuid
from collections.abc import Sequence
from typing import Any

from lw_dev.engine import RESULT_MARK
from lw_dev.zygote_client import zygote

ENGINE_TIMEOUT_S = 420


class EngineFailed(RuntimeError):
    def __init__(self, rc: int, output: str):
        super().__init__(f"engine exited with {rc}:\n{output[-4000:]}")
        self.output = output


def random_tokens(seed: int, n: int) -> list[int]:
    """``n`` reproducible token ids inside the tiny models' vocabulary (ids < 3 are special)."""
    r = random.Random(seed)
    return [r.randrange(3, 500) for _ in range(n)]


def run_engine(job: dict[str, Any], *, env: dict[str, str] | None = None, launcher: Sequence[str] = ()) -> dict[str, Any]:
    """Run one engine (``lw_dev.engine``) in a fresh process; raises EngineFailed with its output on
    failure. ``launcher``: an argv prefix that runs it elsewhere (e.g. ``ip netns exec HOST``)."""
    return run_engine_with_output(job, env=env, launcher=launcher)[0]


def run_engine_with_output(job: dict[str, Any], *, env: dict[str, str] | None = None, launcher: Sequence[str] = (),
                           timeout_s: float = ENGINE_TIMEOUT_S) -> tuple[dict[str, Any], str]:
    """``run_engine``, also returning the engine's whole output (its log lines are part of what
    some tests check)."""
    e = dict(os.environ)
    e.update(env or {})
    forked = None if launcher else zygote.run(json.dumps(job), e, timeout_s)
    if forked is not None:
        rc, stdout, stderr = forked
    else:
        p = subprocess.run(
            [*launcher, sys.executable, "-m", "lw_dev.engine"],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=e,
        )
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    out = stdout + stderr
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):]), out
    raise EngineFailed(rc, out)


FAULT_TIMEOUT_S = 300


def pool_dir(prefix: str = "lw-fault-pool") -> str:
    """A fresh embedded pool path (not created), on /dev/shm when writable."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
    return f"{base}/{prefix}-{uuid.uuid4().hex[:8]}"


def run_faulty(job: dict[str, Any], *, keep_pool: bool = False) -> tuple[dict[str, Any], str]:
    """One engine whose pool is wrapped in ``lw_dev.faulty_backend`` (``"faults": true``, see
    ``lw_dev.engine``): its result and whole output; the job's embedded pool is removed after
    unless ``keep_pool`` (a later engine of the test reads it; the test's fixture removes it)."""
    try:
        return run_engine_with_output({**job, "faults": True}, timeout_s=FAULT_TIMEOUT_S)
    except EngineFailed as e:
        raise AssertionError(f"fault engine failed: {e}") from None
    finally:
        if not keep_pool:
            shutil.rmtree(job["extra"]["embedded_path"], ignore_errors=True)



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
