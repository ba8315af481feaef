"""The mooncake tests' cluster helpers (a module of its own: test modules import it by name,
and ``conftest`` is not a unique module name when several test directories are collected)."""

from __future__ import annotations

import importlib.util

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
