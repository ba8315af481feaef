"""Fixtures for tests on real vLLM (CPU build): engines run in fresh subprocesses via
``python -m lw_vllm.testing.engine`` (lw_vllm.testing.harness); tiny models are built locally and cached."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")


@pytest.fixture
def pool_path(tmp_path_factory: pytest.TempPathFactory):
    """A fresh embedded pool directory on tmpfs when there is one."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path_factory.getbasetemp()
    p = base / f"lw-test-pool-{uuid.uuid4().hex[:8]}"
    yield str(p)
    import shutil

    shutil.rmtree(p, ignore_errors=True)


