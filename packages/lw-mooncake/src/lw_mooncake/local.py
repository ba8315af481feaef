"""A master and a holder started as processes: tests and lw-bench.

``popen(argv, **kw)`` starts each process (default ``subprocess.Popen``; tests pass
``lambda argv, **kw: hosts.popen("b", argv, **kw)`` to run them in a namespace host).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from lw_mooncake.cli import master_argv


class LocalMooncake:
    def __init__(self, *, host: str, segment_size: int, port: int = 50051, metrics_port: int = 9003, lease_ttl_ms: int = 10_000, client_ttl_s: int = 3,
                 popen: Callable[..., subprocess.Popen] | None = None, start_timeout_s: float = 60.0) -> None:
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.segment_size, self.lease_ttl_ms, self.client_ttl_s = segment_size, lease_ttl_ms, client_ttl_s
        self._popen = popen or (lambda argv, **kw: subprocess.Popen(argv, start_new_session=True, **kw))
        self.start_timeout_s = start_timeout_s
        self.master: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None
        self.log_dir = tempfile.mkdtemp(prefix="lw-mooncake-")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def extra_config(self) -> dict[str, Any]:
        return {"backend": "mooncake", "mooncake_master": self.address}

    def start_master(self) -> subprocess.Popen:
        argv = master_argv(self.host, self.port, self.metrics_port, self.lease_ttl_ms,
                           self.client_ttl_s, [])
        log = open(os.path.join(self.log_dir, "master.log"), "ab")
        self.master = self._popen(argv, stdout=log, stderr=subprocess.STDOUT)
        return self.master

    def start_holder(self, size: int | None = None) -> subprocess.Popen:
        argv = [sys.executable, "-m", "lw_mooncake.cli", "hold", "--master", self.address, "--host", self.host,
                "--size", str(size or self.segment_size), "--wait-s", str(self.start_timeout_s)]
        log = open(os.path.join(self.log_dir, "holder.log"), "ab")
        p = self._popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
        ready = threading.Event()
        out = p.stdout
        assert out is not None  # stdout=PIPE

        def wait_ready() -> None:
            if out.readline().startswith("ready"):
                ready.set()

        threading.Thread(target=wait_ready, daemon=True).start()
        if not ready.wait(self.start_timeout_s):
            self._stop(p)
            raise RuntimeError(f"lw-mooncake hold did not get ready in {self.start_timeout_s} s (logs in {self.log_dir})")
        self.holder = p
        return p

    def start(self) -> LocalMooncake:
        try:
            self.start_master()
            self.start_holder()
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _stop(p: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)

    def kill_master(self) -> None:
        self._stop(self.master, signal.SIGKILL)

    def kill_holder(self) -> None:
        self._stop(self.holder, signal.SIGKILL)

    def stop(self) -> None:
        self._stop(self.holder)
        self._stop(self.master)

    def __enter__(self) -> LocalMooncake:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
