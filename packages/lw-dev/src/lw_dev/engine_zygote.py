"""A process that imports vLLM once and forks a fresh engine process (``lw_dev.engine``) per job.

Importing vLLM and torch takes about 10 s of the 12 s a tiny test engine needs on 2 cores; the
test suite starts well over a hundred. The zygote pays the import once; each job still runs in a
process of its own (forked from one that has run nothing but the imports: no engine, no pool, no
project module), with its own environment, working directory, stdin (the job) and stdout/stderr
(files the harness reads), and ends as ``python -m lw_dev.engine`` does. What a fresh interpreter
would differ in, the child is given: the job's environment plus what importing vLLM set in it.

Protocol (one request at a time, JSON lines): the harness writes ``{"stdin", "stdout", "stderr",
"env", "cwd"}``; the zygote answers ``{"pid": N}`` at the fork and ``{"rc": N}`` when the child
has ended. ``lw_dev.harness`` falls back to a plain subprocess whenever the zygote is busy, absent
or dead, for jobs run elsewhere (a launcher such as ``ip netns exec``), or with
``LW_ENGINE_ZYGOTE=0``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from typing import Any

READY = "LW-ZYGOTE-READY"


def _child(req: dict[str, Any], env_delta: dict[str, str | None]) -> None:
    """In the forked process: become ``python -m lw_dev.engine`` with the request's files and
    environment; never returns."""
    code = 1
    try:
        fds = [os.open(req["stdin"], os.O_RDONLY),
               os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
               os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)]
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 (fd 0 is the job now)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
        env = dict(req["env"])
        for k, v in env_delta.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        os.environ.clear()
        os.environ.update(env)
        os.chdir(req["cwd"])
        import runpy

        sys.argv = [sys.executable, "-m", "lw_dev.engine"]
        runpy.run_module("lw_dev.engine", run_name="__main__", alter_sys=True)  # exits itself on success
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (reported as a fresh interpreter would, then exit 1)
        traceback.print_exc()
        code = 1
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001,S110
                pass
        os._exit(code)


def serve() -> None:
    before = dict(os.environ)
    import torch  # noqa: F401
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    delta: dict[str, str | None] = {k: v for k, v in os.environ.items() if before.get(k) != v}
    delta.update({k: None for k in before if k not in os.environ})
    if threading.active_count() != 1:
        raise SystemExit(f"lw_dev.engine_zygote: {threading.active_count()} Python threads after the imports: not forking")
    reply = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)  # anything the imports print later goes to stderr, never into the protocol
    reply.write(READY + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            reply.close()
            _child(req, delta)
        reply.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    serve()
