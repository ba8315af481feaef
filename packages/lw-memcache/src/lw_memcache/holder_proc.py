"""``HolderProcess``: a ``lw-memcache hold`` subprocess, the one client that lends its DRAM to a
``LocalMemcache`` pool while the other clients lend none.

Invariants: ``start`` returns only once the holder printed ``READY_MARK`` (else it is stopped and
``LocalMemcacheError`` names its output); ``stop`` is idempotent and waits for the holder to leave
on its own first (leaving, a client waits for read leases on what it holds, up to a lease length),
then kills it. Its output goes to ``log_path``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


class HolderError(RuntimeError):
    pass


class HolderProcess:
    """``lw-memcache hold --config local_conf``, logging to ``log_path``."""

    def __init__(self, local_conf: Path, log_path: Path, *, start_timeout_s: float, stop_timeout_s: float) -> None:
        self.local_conf = local_conf
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        from lw_memcache.cli import READY_MARK

        log = open(self.log_path, "w+b")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lw_memcache.cli", "hold", "--config", str(self.local_conf)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.start_timeout_s
        out = ""
        with log:
            while time.monotonic() < deadline:
                log.seek(0)
                out = log.read().decode(errors="replace")
                if READY_MARK in out:
                    return
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        tail = "\n".join(out.splitlines()[-20:])
        self.stop()
        raise HolderError(f"lw-memcache hold did not get ready within {self.start_timeout_s:.0f} s; output:\n{tail}")

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            # Leaving, a client waits for read leases on what it holds (up to a lease length).
            p.wait(timeout=max(self.stop_timeout_s, 40.0))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
