"""The backend contract tests every backend passes, run on MooncakeBackend against a real master
and holder on host B, with the clients on host A (every byte crosses the hosts' link).

The checks are lw_dev.backend_contract's, which tests/core runs on the memory and embedded
backends. Not run here: the LRU-eviction and lease-expiry checks of tests/core (Mooncake evicts on
the master at a watermark, on its own schedule). Every test runs in both load modes
(``mooncake_load``): "per_layer" (``view`` of a read handle is None, which the protocol allows: the
pipeline reads) and "whole" (open fetches; views serve the loads); writes go through put sessions
(the installed client has them) and, in one more run, as whole objects (``put_sessions=False``).
"""

from __future__ import annotations

import numpy as np
import pytest

from lw_core.plan import ReqLoad, ReqSave
from lw_dev.backend_contract import (
    LAYOUT,
    SAVES,
    BackendContract,
    check_loads_use_zero_copy_views,
    load_all,
    save_all,
    seeded_kv,
)
from lw_mooncake.errors import NO_AVAILABLE_HANDLE

# Slow tier: these tests need a Mooncake master and holder in network-namespace hosts.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[("per_layer", True), ("whole", True), ("per_layer", False)],
                ids=["per_layer-sessions", "whole-sessions", "per_layer-whole_puts"])
def client_a(cluster, hosts, request):
    from lw_mooncake.backend import MooncakeBackend

    load, sessions = request.param
    with hosts.entered("a"):
        b = MooncakeBackend(cluster.address, local_hostname=hosts.addr("a"), load=load, put_sessions=sessions)
    assert (b.writer.sessions is not None) == sessions
    yield b
    b.close(timeout_s=5)


@pytest.fixture
def backend(client_a):
    yield client_a
    # Objects of one test must not be hits in the next (force: reads pin objects for a while).
    assert client_a.store.remove_all(True) >= 0


class TestBackendContract(BackendContract):
    """The whole contract over ``backend``, in both load modes (views only in "whole": see
    test_whole_load_serves_the_pipeline_from_views)."""


def test_views_writable_when_reserved_and_read_handles_by_load_mode(backend):
    (h,) = backend.reserve(["v"], 64)
    v = backend.view(h, 8, 4)
    if backend.writer.sessions is not None:
        assert v is None  # a put session: the bytes go out as they are written
        backend.write([h], [8], [b"abcd"])
    else:
        v[:] = b"abcd"
    backend.commit([h])
    (r,) = backend.open(["v"])
    v = backend.view(r, 8, 4)
    if backend.load == "per_layer":
        assert v is None  # the bytes are on the holder: the pipeline reads them
    else:
        assert bytes(v) == b"abcd" and v.readonly  # fetched whole at open
    out = bytearray(4)
    backend.read([r], [8], [out])
    assert bytes(out) == b"abcd"
    backend.release([r])
    assert backend.view(r, 8, 4) is None


def test_whole_load_serves_the_pipeline_from_views(cluster, make_client):
    b = make_client(cluster, load="whole")
    try:
        check_loads_use_zero_copy_views(b)  # loads never call read(): open fetched the objects
    finally:
        b.store.remove_all(True)


def test_another_client_reads_per_layer_what_one_wrote(cluster, backend, make_client):
    a, b = backend, make_client(cluster, load="per_layer")
    src, dst = seeded_kv(LAYOUT, 11), seeded_kv(LAYOUT, 12)
    assert save_all(a, src, LAYOUT, SAVES, layerwise=True).ok
    assert b.lookup(["a", "b", "c", "d", "zz"]) == 4
    res = load_all(b, dst, LAYOUT, [ReqLoad("x", ["c", "a"], [0, 1])], layerwise=True, prefetch_depth=2)
    assert res.ok, res
    for layer in range(LAYOUT.num_layers):
        assert np.array_equal(dst.kv[layer][0], src.kv[layer][7])
        assert np.array_equal(dst.kv[layer][1], src.kv[layer][2])
    a.store.remove_all(True)


def test_reserved_but_uncommitted_is_never_visible(cluster, backend, make_client):
    a, b = backend, make_client(cluster)
    (h,) = a.reserve(["half"], 1 << 16)
    a.write([h], [0], [np.ones(1 << 15, np.uint8)])
    assert b.lookup(["half"]) == 0 and b.open(["half"]) == [None]
    (hb,) = b.reserve(["half"], 1 << 16)
    if a.writer.sessions is not None:
        assert hb is None  # a put session is a claim on the master: another writer skips the key
    else:
        assert hb is not None  # a local buffer: nobody else sees a claim
        b.abort([hb])
    a.abort([h])
    assert a.lookup(["half"]) == 0
    (hb,) = b.reserve(["half"], 1 << 16)  # aborted (revoked): free at once
    assert hb is not None
    b.abort([hb])


class _OnePutFails:
    """The client, but ``batch_put_from`` (and ``batch_put_session_end``) fails ``key`` alone with
    NO_AVAILABLE_HANDLE (as Mooncake does per object, e.g. when no segment has room for it) and puts
    (ends) the rest."""

    def __init__(self, store, key: str) -> None:
        self._store, self._key = store, key

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def batch_put_from(self, keys, ptrs, sizes):
        keep = [i for i, k in enumerate(keys) if k != self._key]
        res = iter(self._store.batch_put_from([keys[i] for i in keep], [ptrs[i] for i in keep], [sizes[i] for i in keep]))
        return [next(res) if k != self._key else NO_AVAILABLE_HANDLE for k in keys]

    def batch_put_session_end(self, keys):
        res = iter(self._store.batch_put_session_end([k for k in keys if k != self._key]))
        return [next(res) if k != self._key else NO_AVAILABLE_HANDLE for k in keys]


def test_a_batch_with_one_failed_put_reports_only_that_object(backend, monkeypatch):
    """The layer pipeline commits a step's objects in one call and, when that raises, commits them
    again one by one to find the bad ones. An object whose put succeeded in the batch must then
    count as committed (as the memory backend's commit of a committed handle does), not as "not
    reserved": else the prefiller reports every object of the step failed though all but one are
    stored, and the one that failed is invisible in its record."""
    monkeypatch.setattr(backend.client, "store", _OnePutFails(backend.client.store, "bad"))
    src = seeded_kv(LAYOUT, 13)
    res = save_all(backend, src, LAYOUT, SAVES)  # keys a, b, c, d
    assert sorted(res.committed_keys) == ["a", "b", "c", "d"]
    res = save_all(backend, src, LAYOUT, [ReqSave("r", ["e", "bad", "f"], [1, 3, 4])])
    assert sorted(res.committed_keys) == ["e", "f"] and res.failed_keys == ["bad"], res
    assert res.failed_req_ids == ["r"] and any("NO_AVAILABLE_HANDLE" in e for e in res.errors), res
    assert backend.lookup(["e"]) == 1 and backend.lookup(["f"]) == 1 and backend.lookup(["bad"]) == 0
