"""Fault injection for the real-vLLM PD stacks: catch the prefiller mid-prefill (a reservation of
the prompt's chunks is open in the embedded pool, not committed), freeze, kill or resume its whole
process group.

"Mid-prefill" is read from the pool itself: a watcher backend in this process polls the pool's
``reserved_objects`` counter; the moment a reservation appears the prefiller's process group is
stopped (SIGSTOP, checked in ``/proc``), and the open reservations are read: one still short of
its last byte means the prefiller is frozen mid-prefill (streaming publishes layer by layer, so a
reservation can be open with every layer readable; that one does not count). A tiny model's
prefill is over in tens of milliseconds, so a caller retries with a new prompt when the prefill
ended first.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lw_bench.pd.stack import VllmServer, post_json, post_sse
from lw_core.backends.embedded import EmbeddedBackend


def connector_extra(server: VllmServer) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` the server was started with (from its command line)."""
    argv = list(server.proc.popen.args)
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return dict(cfg["kv_connector_extra_config"])


def watcher(server: VllmServer) -> EmbeddedBackend:
    """A backend on the server's embedded pool, for its counters (the caller closes it)."""
    extra = connector_extra(server)
    return EmbeddedBackend(extra["embedded_path"], capacity_bytes=extra["embedded_capacity_bytes"])


def group_pids(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:  # after "pid (comm)": state, ppid, pgrp
            out.append(int(d))
    return out


def _all_stopped(pgid: int) -> bool:
    for pid in group_pids(pgid):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def signal_group(server: VllmServer, sig: signal.Signals) -> None:
    try:
        os.killpg(server.proc.popen.pid, sig)
    except ProcessLookupError:
        pass


def freeze(server: VllmServer, timeout_s: float = 5.0) -> None:
    """SIGSTOP the server's process group and wait until every member is stopped."""
    signal_group(server, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _all_stopped(server.proc.popen.pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.proc.name} did not stop within {timeout_s} s")
        time.sleep(0.001)


def decoder_looks_first(prefill: VllmServer, url: str, body: dict[str, Any], *, wait_s: float = 1.5,
                        timeout_s: float = 60.0) -> tuple[int, Any]:
    """POST ``body`` to ``url`` (a proxy: SSE when ``body`` streams) with the prefiller frozen for
    ``wait_s``, so the decoder has posted to the metaserver and looked at the pool before any of
    the prefill exists (a prefill dispatched with the decoder's request could otherwise commit
    first, and a decoder whose pool holds the prompt neither waits nor streams)."""
    got: dict[str, Any] = {}
    send = post_sse if body.get("stream") else post_json
    call = threading.Thread(target=lambda: got.update(answer=send(url, body)), daemon=True)
    freeze(prefill)
    try:
        call.start()
        time.sleep(wait_s)
    finally:
        signal_group(prefill, signal.SIGCONT)
    call.join(timeout_s)
    assert "answer" in got, f"{url}: no answer within {timeout_s} s"
    return got["answer"]


def _unfinished(pool: EmbeddedBackend) -> set[int]:
    """Ids of the open reservations whose writer has not published all of them yet."""
    return {oid for oid, (_, published, nbytes) in pool.open_reservations().items() if published < nbytes}


def freeze_mid_prefill(server: VllmServer, pool: EmbeddedBackend, done: Callable[[], bool],
                       timeout_s: float) -> bool:
    """Poll the pool until a reservation is open, then freeze the server. True: frozen with a new
    reservation still open AND short of its last published byte (mid-prefill: a streaming reader
    cannot finish either; a reservation whose every layer is published, caught just before its
    commit, would let a streaming decoder complete as if nothing happened); False: ``done()`` (the
    request ended) or the timeout came first, the server left running."""
    base = pool.stats()["reserved_objects"]
    before = _unfinished(pool)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        if pool.stats()["reserved_objects"] > base:
            freeze(server)
            if _unfinished(pool) - before:
                return True
            signal_group(server, signal.SIGCONT)  # committed or fully published already: too late
        time.sleep(0.0005)
    return False


class Call:
    """A request on its own thread: ``answer`` is (status, body) once it ended."""

    def __init__(self, url: str, body: dict[str, Any], timeout_s: float) -> None:
        self.answer: tuple[int, Any] | None = None
        self.t0 = time.monotonic()
        self.took = -1.0
        self._t = threading.Thread(target=self._run, args=(url, body, timeout_s), daemon=True)
        self._t.start()

    def _run(self, url: str, body: dict[str, Any], timeout_s: float) -> None:
        try:
            self.answer = post_json(url, body, timeout=timeout_s)
        except OSError as e:
            self.answer = (0, repr(e))
        self.took = time.monotonic() - self.t0

    def done(self) -> bool:
        return not self._t.is_alive()

    def join(self, timeout_s: float) -> tuple[int, Any]:
        self._t.join(timeout_s)
        assert self.answer is not None, f"no answer within {timeout_s} s"
        return self.answer


def kill(server: VllmServer) -> None:
    signal_group(server, signal.SIGKILL)
    server.proc.popen.wait(30)
    deadline = time.monotonic() + 30
    while group_pids(server.proc.popen.pid) and time.monotonic() < deadline:  # the engine core too
        time.sleep(0.05)
