"""What every "one vLLM engine in a fresh process, JSON job on stdin" runner shares: the engine's
environment (in-process engine core), the connector's per-request stats side channel
(``LW_VLLM_STATS_FILE``, read by lw_vllm.scheduler.request_stats), and the stdout protocol. Used by
``lw_bench.serve.engine`` and by the tests' runner (``lw_dev.engine``)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def in_process_engine(prefix: str, *, force: bool = True) -> str:
    """Set this process up for one in-process vLLM engine whose connector writes a stats line per
    request; returns the stats file's path (the caller unlinks it). ``force=False`` keeps a
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` the caller set (multi-process engines, e.g. TP)."""
    # In-process engine core: the scheduler, the model and the connector share this process (no
    # IPC hop in measured wall times, one backend shared by the connector's two sides).
    if force:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".jsonl")
    os.close(fd)
    os.environ["LW_VLLM_STATS_FILE"] = path
    return path


def read_stats(path: str) -> dict[str, Any]:
    """The connector's per-request stats records in ``path``, by request id."""
    out: dict[str, Any] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if "req_id" in rec:
                    out[rec["req_id"]] = rec
    return out


def read_engine(path: str) -> dict[str, Any] | None:
    """The connector's engine record in ``path`` (lw_vllm.scheduler.engine_facts: block sizes, state dtypes
    and bytes as vLLM decided them on this machine); ``None`` when no connector wrote one."""
    found = None
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                found = rec.get("engine", found)
    return found


def settle(llm: Any, stats_path: str, request_ids: list[str], timeout_s: float = 60.0) -> dict[str, Any]:
    """The stats records of ``request_ids`` once the engine has ended them. ``LLM.generate`` returns
    when the last token is out, but a request whose KV blocks vLLM frees late (the connector's
    background saves) ends, and gets its stats line, in a later step: an in-process engine is
    stepped until its scheduler holds no finished request; a multi-process engine core steps on
    its own, so its lines are awaited (while some request has one at all: a connector runs)."""
    deadline = time.monotonic() + timeout_s
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    sched = getattr(core, "scheduler", None)
    if sched is not None:
        while sched.has_requests() and time.monotonic() < deadline:
            llm.llm_engine.step()
    stats = read_stats(stats_path)
    while stats and any(stats_for(stats, r) is None for r in request_ids) and time.monotonic() < deadline:
        time.sleep(0.02)
        stats = read_stats(stats_path)
    return stats


def stats_for(stats: dict[str, Any], request_id: str) -> Any:
    """The record of ``request_id``; vLLM's engine core appends a random suffix to the caller's id."""
    if request_id in stats:
        return stats[request_id]
    for rid, rec in stats.items():
        if rid.startswith(request_id + "-"):
            return rec
    return None


def emit(line: str) -> None:
    """One protocol line on stdout, on a line of its own (vLLM's log shares the stream)."""
    sys.stdout.write("\n" + line + "\n")
    sys.stdout.flush()


def main(run: Callable[[dict[str, Any]], None]) -> None:
    """Read the job from stdin, run it, exit at once: vLLM's shutdown of an in-process engine can
    linger (stalled daemon threads included), and every result is out already. The pool's backends
    are closed first, as vLLM's shutdown would (the disk tier writes what it has queued, so a
    later engine finds every demoted object); lw_vllm is looked up, not imported, so an engine
    without the connector stays free of it."""
    run(json.loads(sys.stdin.read()))
    pool = sys.modules.get("lw_vllm.pool")
    if pool is not None:
        pool.close_all()
    os._exit(0)
