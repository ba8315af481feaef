"""A Mooncake cluster in two network-namespace hosts: master + holder on B, clients on A and B.

Every Mooncake process binds all addresses of its host, so each runs inside a test host. The
clients of this test process are set up with the calling thread moved into host A's namespace
(``Hosts.entered``). Mooncake's client keeps process-wide I/O threads, created by the first client
in the namespace it was made in: so every in-process client is on host A, and the hosts live for
the whole session (clients on B are processes: the holder, tests/mooncake/mc_putter.py). The hosts
use their own prefix and subnet, so they never collide with another module's ``Hosts``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from mc_cluster import PREFIX, SUBNET, need_mooncake, start_cluster

from lw_dev.netns import Hosts, require_netns


@pytest.fixture(scope="session")
def hosts(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    require_netns()
    need_mooncake()
    h = Hosts(["a", "b"], prefix=PREFIX, subnet=SUBNET)
    request.addfinalizer(h.close)
    h.start()
    yield h


@pytest.fixture(scope="module")
def cluster(hosts):
    c = start_cluster(hosts)
    yield c
    c.stop()


@pytest.fixture
def make_client(hosts):
    """``make_client(cluster, **kw)``: a MooncakeBackend in this process, on host A."""
    from lw_mooncake.backend import MooncakeBackend

    made = []

    def make(cluster, **kw) -> MooncakeBackend:
        with hosts.entered("a"):
            b = MooncakeBackend(cluster.address, local_hostname=hosts.addr("a"), **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close(timeout_s=5)
