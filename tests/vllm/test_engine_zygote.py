"""``lw_dev.engine_zygote``: engines forked from a process that imported vLLM once behave as fresh
``python -m lw_dev.engine`` processes (their own environment, output and exit code), a child past
its deadline is killed, and the zygote serves the next job after a failure."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from lw_dev.harness import random_tokens
from lw_dev.zygote_client import Zygote

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

pytestmark = pytest.mark.slow

JOB = {"model": "gqa", "max_tokens": 3, "phases": [[random_tokens(5, 40)]], "extra": None,
       "engine": {"enforce_eager": True, "max_model_len": 256, "block_size": 32}}


def _outputs(stdout: str) -> list:
    """Each phase's outputs (tokens, top-2 log-probs, finish reasons; not its wall time)."""
    (line,) = [x for x in stdout.splitlines() if x.startswith("LW-ENGINE-RESULT ")]
    return [ph["outputs"] for ph in json.loads(line.split(" ", 1)[1])["phases"]]


def test_forked_engines_match_a_fresh_process_fail_alone_and_are_killed_past_their_deadline(tmp_path):
    env = dict(os.environ, LW_ENGINE_ZYGOTE="1")
    plain = subprocess.run([os.sys.executable, "-m", "lw_dev.engine"], input=json.dumps(JOB), capture_output=True,
                           text=True, timeout=300, env=env, check=True)
    z = Zygote()
    try:
        rc, out, err = z.run(json.dumps(JOB), env, 300)
        assert rc == 0, err[-2000:]
        assert _outputs(out) == _outputs(plain.stdout)  # same tokens and log-probs

        rc, out, err = z.run("not json", env, 300)  # fails in the child only, as a fresh process would
        assert rc == 1 and "JSONDecodeError" in err and "LW-ENGINE-RESULT" not in out

        with pytest.raises(subprocess.TimeoutExpired):
            z.run(json.dumps(JOB), env, 0.5)

        rc, out, _ = z.run(json.dumps(JOB), env, 300)  # the next job after a kill
        assert rc == 0 and _outputs(out) == _outputs(plain.stdout)
        assert z.run(json.dumps(JOB), dict(env, LW_ENGINE_ZYGOTE="0"), 300) is None  # turned off: a plain process
    finally:
        z.close()
