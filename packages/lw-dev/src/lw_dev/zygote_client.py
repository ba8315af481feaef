"""The harness's side of ``lw_dev.engine_zygote``: one zygote per test process, started on first
use, asked for one engine at a time; ``run`` returns None whenever the caller should start a plain
subprocess instead (busy, disabled with ``LW_ENGINE_ZYGOTE=0``, failed to start, or died)."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

from lw_dev.engine_zygote import READY

START_TIMEOUT_S = 120.0


class Zygote:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._broken = False
        self._log = os.path.join(tempfile.gettempdir(), f"lw-engine-zygote-{os.getpid()}.log")

    def _start(self) -> subprocess.Popen[bytes] | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = None
        if self._broken:
            return None
        try:
            with open(self._log, "a") as log:
                p = subprocess.Popen([sys.executable, "-m", "lw_dev.engine_zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, bufsize=0)
            self._buf = b""
            if self._readline(p, START_TIMEOUT_S) != READY:
                p.kill()
                p.wait()
                raise RuntimeError(f"no ready line (see {self._log})")
        except (OSError, RuntimeError) as e:
            print(f"lw_dev: engine zygote unavailable, engines start as plain processes: {e}", file=sys.stderr)
            self._broken = True
            return None
        self._proc = p
        atexit.register(self.close)
        return p

    def _readline(self, p: subprocess.Popen[bytes], timeout_s: float) -> str | None:
        """The zygote's next line, or None past ``timeout_s`` or at its end. Reads the pipe's
        descriptor itself: a buffered reader could hold the next line where select cannot see it."""
        assert p.stdout is not None
        fd, deadline = p.stdout.fileno(), time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode().strip()

    def run(self, job: str, env: dict[str, str], timeout_s: float) -> tuple[int, str, str] | None:
        """(exit code, stdout, stderr) of ``python -m lw_dev.engine`` with ``job`` on stdin, forked
        from the zygote; raises subprocess.TimeoutExpired past ``timeout_s`` (the child killed)."""
        if env.get("LW_ENGINE_ZYGOTE") == "0":  # env: the job's whole environment
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            p = self._start()
            if p is None:
                return None
            with tempfile.TemporaryDirectory(prefix="lw-engine-") as d:
                paths = {k: os.path.join(d, k) for k in ("stdin", "stdout", "stderr")}
                with open(paths["stdin"], "w") as f:
                    f.write(job)
                assert p.stdin is not None
                try:
                    p.stdin.write((json.dumps({**paths, "env": env, "cwd": os.getcwd()}) + "\n").encode())
                except OSError:
                    return None  # the zygote died: a plain process this time (it restarts next time)
                started = self._readline(p, 30.0)
                if started is None:
                    self._kill_zygote()
                    return None
                pid = int(json.loads(started)["pid"])
                deadline = time.monotonic() + timeout_s
                done = self._readline(p, deadline - time.monotonic())
                if done is None:
                    _kill(pid)
                    if p.poll() is not None or time.monotonic() < deadline:  # the zygote ended: run it plainly
                        self._kill_zygote()
                        return None
                    self._readline(p, 30.0)
                    raise subprocess.TimeoutExpired([sys.executable, "-m", "lw_dev.engine"], timeout_s)
                rc = int(json.loads(done)["rc"])
                with open(paths["stdout"], errors="replace") as f:
                    out = f.read()
                with open(paths["stderr"], errors="replace") as f:
                    err = f.read()
                return rc, out, err
        finally:
            self._lock.release()

    def _kill_zygote(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        p, self._proc = self._proc, None
        if p is not None and p.poll() is None:
            assert p.stdin is not None
            try:
                p.stdin.close()
                p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


zygote = Zygote()
