"""Fixtures for tests on real vLLM (CPU build): engines run in fresh subprocesses via
``python -m lw_dev.engine`` (lw_dev.harness); tiny models are built locally and cached."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

# pool_path: the root conftest's.


@pytest.fixture(scope="session")
def quick_serve_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One ``lw-bench serve --quick --disk-dir DIR --json`` run on real vLLM (six fresh engines: the
    four default modes, then disk/save and disk/hit), shared by the modules that check its report:
    its JSON result and DIR (empty again once the run has ended)."""
    disk_dir = tmp_path_factory.mktemp("serve-quick-disk")
    p = subprocess.run([sys.executable, "-m", "lw_bench.cli", "serve", "--quick", "--disk-dir", str(disk_dir), "--json"],
                       capture_output=True, text=True, timeout=1500, check=False)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), disk_dir
