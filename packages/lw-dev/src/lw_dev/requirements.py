"""What the test suite runs against, and how each one is installed.

A test module may skip when one of these is absent (importorskip, skipif) only when the person
running the suite said so: a missing dependency fails the run (tests/conftest.py refuses to start)
rather than shrinking it, unless named in ``LW_TESTS_ALLOW_MISSING=vllm,memcache_hybrid,...``.
"""

from __future__ import annotations

import importlib.util
import os

REQUIRED = {
    "vllm": "vLLM's CPU build: bash scripts/install-vllm.sh",
    "torch": "comes with vLLM: bash scripts/install-vllm.sh",
    "memcache_hybrid": "uv sync --inexact --all-packages --all-extras (lw-memcache[store])",
    "mooncake": "uv sync --inexact --all-packages --all-extras (lw-mooncake[store])",
}


def missing_dependencies(allowed: str | None = None) -> list[str]:
    """The REQUIRED modules that are not installed and not named in LW_TESTS_ALLOW_MISSING."""
    if allowed is None:
        allowed = os.environ.get("LW_TESTS_ALLOW_MISSING", "")
    ok = {a.strip() for a in allowed.split(",") if a.strip()}
    return [m for m in REQUIRED if m not in ok and importlib.util.find_spec(m) is None]
