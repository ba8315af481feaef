"""Fixtures for the network-namespace test hosts (``lw_dev.netns.Hosts``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lw_dev import netns
from lw_dev.netns import require_netns


@pytest.fixture
def two_hosts(request: pytest.FixtureRequest) -> Iterator[netns.Hosts]:
    require_netns()
    h = netns.Hosts(["a", "b"])
    request.addfinalizer(h.close)  # also if start() itself fails half-way
    h.start()
    yield h
