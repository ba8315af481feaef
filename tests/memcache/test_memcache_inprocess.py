"""The path lw-bench and the connector take: ``open_backend(parse_config(LocalMemcache extra))`` in
this process, with a writer in another process."""

from __future__ import annotations

import numpy as np
import pytest
from mc_support import expected, needs_memcache

from lw_core.backend import Backend, BackendError
from lw_core.backends.registry import open_backend
from lw_core.config import parse_config

pytestmark = [needs_memcache, pytest.mark.slow]

L, N = 3, 8192


def test_open_backend_in_process_layerwise_round_trip(pool, make_client):
    backend = open_backend(parse_config({**pool.extra_config, "use_layerwise": True}))
    try:
        assert isinstance(backend, Backend) and backend.name == "memcache"
        with pytest.raises(BackendError, match="already open in this process"):
            open_backend(parse_config(pool.extra_config))

        # This process writes layer by layer from one registered staging buffer.
        keys = [f"lw1/inproc/{i}" for i in range(8)]
        staging = np.stack([np.concatenate([np.frombuffer(expected(k, i, N), np.uint8) for i in range(L)]) for k in keys])
        backend.register_buffer(staging)
        handles = backend.reserve(keys, L * N)
        assert all(h is not None for h in handles)
        assert backend.view(handles[0], 0, N) is None
        for layer in range(L):
            backend.write(handles, [layer * N] * len(keys), [row[layer * N:(layer + 1) * N] for row in staging])
        assert backend.lookup(keys) == 0  # not committed yet
        backend.commit(handles)
        assert backend.lookup(keys) == len(keys)

        # Another process reads what this one wrote, and writes objects this one reads.
        other = make_client(pool.extra_config)
        assert all(other.ok("open", keys=keys))
        assert other.read([(k, 2 * N, N) for k in keys]) == [expected(k, 2, N) for k in keys]
        other.ok("release", keys=keys)
        theirs = [f"lw1/inproc/theirs/{i}" for i in range(4)]
        assert all(other.ok("reserve", keys=theirs, layers=L, layer_nbytes=N))
        other.write(theirs, range(L), N)
        other.ok("commit", keys=theirs)

        hs = backend.open(theirs + ["lw1/inproc/none"])
        assert hs[-1] is None and all(h is not None and h.nbytes == L * N for h in hs[:-1])
        dst = np.zeros((len(theirs), L * N), np.uint8)
        for layer in reversed(range(L)):
            backend.read(hs[:-1], [layer * N] * len(theirs), [row[layer * N:(layer + 1) * N] for row in dst])
        assert [row.tobytes() for row in dst] == [b"".join(expected(k, i, N) for i in range(L)) for k in theirs]
        backend.release(hs[:-1])

        s = backend.stats()
        assert s["committed"] == len(keys) and s["opened"] == len(theirs) and s["open_misses"] == 1
        assert s["bytes_written"] == len(keys) * L * N and s["bytes_read"] == len(theirs) * L * N
    finally:
        backend.close()
    with pytest.raises(BackendError, match="closed"):
        backend.lookup(["x"])
