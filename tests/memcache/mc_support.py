"""What the memcache tests share besides fixtures (those are in conftest.py): whether
memcache_hybrid is installed, the bytes a client writes, polling with a deadline."""

from __future__ import annotations

import importlib.util
import time

import pytest
from mc_client import layer_bytes

HAVE_MEMCACHE = importlib.util.find_spec("memcache_hybrid") is not None
needs_memcache = pytest.mark.skipif(
    not HAVE_MEMCACHE,
    reason="memcache_hybrid is not installed (uv sync --inexact --all-packages --extra store); "
    "its wheels exist only for Linux x86_64/aarch64 CPython 3.10/3.11",
)


def expected(key: str, layer: int, n: int) -> bytes:
    return layer_bytes(key, layer, n).tobytes()


def wait_until(pred, timeout_s: float, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval_s)
