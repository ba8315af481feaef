"""Fixtures for the several-hosts tests: one memcache pool over host_tcp across two network
namespaces (cluster.Cluster), shared by the whole session; engines are module-scoped."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from cluster import Cluster

from lw_dev import netns


def require_cluster() -> None:
    why = netns.available()
    if why:
        pytest.skip(f"the several-hosts tests need network namespaces: {why}")
    if importlib.util.find_spec("memcache_hybrid") is None:
        pytest.skip("memcache_hybrid is not installed (uv sync --inexact --all-packages --extra store); "
                    "its wheels exist only for Linux x86_64/aarch64 CPython 3.10/3.11")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_cluster()
    c = Cluster()
    try:
        c.start()
        yield c
    finally:
        c.close()


@pytest.fixture
def on_host_a(cluster: Cluster) -> Iterator[Cluster]:
    """This test's own HTTP calls go out from host A (the proxy's host)."""
    with cluster.hosts.entered("a"):
        yield cluster
