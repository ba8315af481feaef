"""The mooncake tests' cluster helpers (a module of its own: test modules import it by name,
and ``conftest`` is not a unique module name when several test directories are collected)."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lw_dev.netns import Hosts

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
PREFIX, SUBNET = "lwmc", "10.231.7.0/24"
MiB = 1 << 20


def need_mooncake() -> None:
    if not HAVE_MOONCAKE:
        pytest.fail("the mooncake client is not installed: uv sync --all-packages --all-extras "
                    "(and scripts/install-mooncake-deps.sh for libibverbs1)")


def start_cluster(hosts: Hosts, *, port: int = 50051, segment: int = 128 * MiB, **kw):
    """A master and a holder (``segment`` bytes) on host B, started; the caller stops it."""
    from lw_mooncake.local import LocalMooncake

    c = LocalMooncake(host=hosts.addr("b"), segment_size=segment, port=port, metrics_port=port + 2,
                      popen=lambda argv, **k: hosts.popen("b", argv, **k), **kw)
    return c.start()


def freeze(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """SIGSTOP ``proc`` and wait until every one of its threads is stopped: the signal is only
    queued when ``kill`` returns, and on a loaded machine the master may still answer a call or two
    before it stops."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for stat in Path(f"/proc/{proc.pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue
        if states and all(s in ("T", "t", "Z", "X") for s in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {proc.pid} did not stop within {timeout_s} s (thread states {states})")
        time.sleep(0.001)
