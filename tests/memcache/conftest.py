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
from mc_support import HAVE_MEMCACHE, needs_memcache, wait_until

from lw_memcache.errors import DIRECTION_MISMATCH

HERE = Path(__file__).parent

# memcache host_tcp rejects copies for a few seconds after a client joined the pool
# (DIRECTION_MISMATCH, -2; memcache-on-cpu notes: "waiting about 3 s after a join
# avoided it"). The pipeline counts such a save as failed and the engine recomputes; a test that
# checks bytes right after starting its clients copies again instead, for up to this long.
JOIN_WINDOW_S = 15.0


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

    def copied(self, op: str, **args):
        """``ok(op)`` for a copy (``write_layers``, ``read``), tried again while the pool still
        rejects copies after a client joined (``JOIN_WINDOW_S``); any other error fails at once."""
        rejected = f"failed with code {DIRECTION_MISMATCH}:"
        replies: list[dict] = []

        def settled() -> bool:
            replies.append(self.call(op, **args))
            return replies[-1]["ok"] or rejected not in replies[-1].get("error", "")

        wait_until(settled, JOIN_WINDOW_S, interval_s=0.5)
        assert replies[-1]["ok"], replies[-1]
        return replies[-1].get("value")

    def write(self, keys: list[str], layers, layer_nbytes: int) -> None:
        """Write ``layers`` of reserved ``keys`` (one batched write per layer, bytes from ``expected``)."""
        self.copied("write_layers", keys=keys, layers=list(layers), layer_nbytes=layer_nbytes)

    def read(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        return [base64.b64decode(v) for v in self.copied("read", ranges=ranges)]

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


