"""Fixtures for memcache tests: a real MetaService on 127.0.0.1 (``LocalMemcache``) and client
processes driven over pipes (``tests/memcache/mc_client.py``), every exchange under a deadline."""

from __future__ import annotations

import base64
import json
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from mc_support import HAVE_MEMCACHE, needs_memcache

HERE = Path(__file__).parent


class Client:
    """A MemcacheBackend in its own process."""

    def __init__(self, extra: dict, timeout_s: float = 30.0, **kwargs) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "mc_client.py"), json.dumps(extra), json.dumps(kwargs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        hello = self._reply(timeout_s)
        assert hello["ok"], hello
        self.pid = hello["pid"]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._lines.put(line[2:])
        self._lines.put(None)

    def _reply(self, timeout_s: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"client {self.proc.pid} did not answer within {timeout_s} s") from None
        if line is None:
            raise RuntimeError(f"client {self.proc.pid} exited with {self.proc.wait(timeout=10)}")
        return json.loads(line)

    def call(self, op: str, timeout_s: float = 20.0, **args) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout_s)

    def ok(self, op: str, **args):
        r = self.call(op, **args)
        assert r["ok"], r
        return r.get("value")

    def read(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        return [base64.b64decode(v) for v in self.ok("read", ranges=ranges)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("close", timeout_s=60)
                self.proc.wait(timeout=30)
            except (TimeoutError, RuntimeError, OSError, subprocess.TimeoutExpired):
                self.kill()


@pytest.fixture
def make_client(request):
    clients: list[Client] = []

    def make(extra: dict, **kwargs) -> Client:
        c = Client(extra, **kwargs)
        clients.append(c)
        return c

    yield make
    # Close in parallel: each close takes seconds (the library waits on its own timers).
    threads = [threading.Thread(target=c.close) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)


@pytest.fixture
def pool(tmp_path):
    if not HAVE_MEMCACHE:
        pytest.skip(needs_memcache.kwargs["reason"])
    from lw_memcache.local import LocalMemcache

    m = LocalMemcache(dram_size="64MB", workdir=tmp_path / "pool", stop_timeout_s=3)
    m.start()
    yield m
    m.stop()


