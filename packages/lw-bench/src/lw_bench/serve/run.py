"""Run one ``lw_bench.serve.engine`` process with a deadline, streaming its results."""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lw_bench.serve.engine import DONE, ENGINE, ITEM, METRICS, STARTED


class EngineError(RuntimeError):
    pass


def run_engine(
    job: dict[str, Any],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float,
    on_event: Callable[[str, Any], None] | None = None,
) -> tuple[float, list[dict[str, Any]], dict[str, float], dict[str, Any] | None]:
    """Start the engine, feed it ``job``; returns (engine start seconds, item records, pool counters
    (empty unless the job asked for ``metrics``), the connector's engine record (``None`` without a
    connector): block sizes and state dtypes as vLLM decided them on this machine).

    ``on_event("started" | "item", payload)`` is called as results arrive (for a progress bar).
    Raises EngineError with the tail of the engine's output when it fails or runs past the deadline.
    """
    e = dict(os.environ)
    e.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "lw_bench.serve.engine"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=e,
        start_new_session=True,  # its own process group: a kill on the deadline takes its helpers too
    )
    lines: queue.Queue[str | None] = queue.Queue()
    tail: collections.deque[str] = collections.deque(maxlen=60)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    started, items, done = None, [], False
    metrics: dict[str, float] = {}
    engine: dict[str, Any] | None = None
    try:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        while not done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"no result within {timeout_s:.0f} s; last output:\n" + "".join(tail))
            try:
                line = lines.get(timeout=min(left, 5.0))
            except queue.Empty:
                continue
            if line is None:
                break
            if line.startswith(STARTED):
                started = float(line[len(STARTED):])
                if on_event:
                    on_event("started", started)
            elif line.startswith(ITEM):
                rec = json.loads(line[len(ITEM):])
                items.append(rec)
                if on_event:
                    on_event("item", rec)
            elif line.startswith(METRICS):
                metrics = json.loads(line[len(METRICS):])
            elif line.startswith(ENGINE):
                engine = json.loads(line[len(ENGINE):])
            elif line.startswith(DONE):
                done = True
            else:
                tail.append(line)
        if not done or started is None:
            try:
                rc: Any = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rc = "no exit status"
            raise EngineError(f"engine stopped with {rc} before finishing; last output:\n" + "".join(tail))
        return started, items, metrics, engine
    finally:
        # A finished engine exits on its own (os._exit); anything else is killed, never waited on.
        try:
            proc.wait(timeout=30 if done else 0.1)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
