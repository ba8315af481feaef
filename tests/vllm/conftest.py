"""Fixtures for tests on real vLLM (CPU build): engines run in fresh subprocesses via
``python -m lw_dev.engine`` (lw_dev.harness); tiny models are built locally and cached."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

# pool_path: the root conftest's.
