"""Start ``fault_engine.py`` in a fresh process (with a deadline) and return its result."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

ENGINE = Path(__file__).resolve().parent / "fault_engine.py"
RESULT_MARK = "LW-FAULT-RESULT "
TIMEOUT_S = 300


def toks(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 500) for _ in range(n)]


def pool_dir() -> str:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
    return f"{base}/lw-fault-pool-{uuid.uuid4().hex[:8]}"


def run_faulty(job: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Result and the engine's whole output (its log lines are part of what tests check)."""
    try:
        p = subprocess.run([sys.executable, str(ENGINE)], input=json.dumps(job), capture_output=True, text=True,
                           timeout=TIMEOUT_S, env=dict(os.environ))
    finally:
        shutil.rmtree(job["extra"]["embedded_path"], ignore_errors=True)
    out = p.stdout + p.stderr
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):]), out
    raise AssertionError(f"fault engine exited with {p.returncode}:\n{out[-4000:]}")
