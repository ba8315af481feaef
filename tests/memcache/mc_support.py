"""What the memcache tests share besides fixtures (those are in conftest.py): whether
memcache_hybrid is installed, the bytes a client writes, polling with a deadline, and a client
in another process driven line by line (``ScriptProcess``)."""

from __future__ import annotations

import importlib.util
import queue
import subprocess
import sys
import threading
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


class ScriptProcess:
    """``python -c script *args`` in a child process, driven by one command per stdin line
    (``do``); the script answers each with a line starting ``ok`` (and says ``ready`` once up).
    Other lines are skipped: the library logs to stdout too. ``stop`` sends ``close`` and waits,
    or kills it."""

    def __init__(self, script: str, *args: str, close: str = "close") -> None:
        self.close = close
        self.p = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.q.put(x) for x in self.p.stdout] + [self.q.put(None)], daemon=True).start()
        assert self._line(60) == "ready"

    def _line(self, timeout_s: float) -> str:
        while True:
            line = self.q.get(timeout=timeout_s)
            if line is None:
                raise RuntimeError(f"writer exited with {self.p.wait(10)}")
            if line.startswith(("ok", "ready")):
                return line.strip()

    def do(self, cmd: str, timeout_s: float = 30) -> str:
        assert self.p.stdin is not None
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self._line(timeout_s)

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                self.do(self.close, 60)
                self.p.wait(30)
            except (RuntimeError, queue.Empty, OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait(10)
