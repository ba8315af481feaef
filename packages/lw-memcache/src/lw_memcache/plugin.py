"""The ``memcache`` pool backend as an lw-core plugin (entry point ``lw_pool.backends``).

Its keys sit at the top level of ``kv_connector_extra_config`` (``memcache_config_path``,
``memcache_protocol``), parsed strictly by lw-core into ``MemcacheKeys``. Loading this module
never imports memcache_hybrid: that happens when a backend is opened.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from lw_core.backend import Backend
from lw_core.backends.registry import BackendPlugin
from lw_memcache.conf import PROTOCOLS

if TYPE_CHECKING:  # the store itself is imported only when opened
    from lw_memcache.handles import MemcacheHandle


class MemcacheKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Path of the mmc-local.conf the clients read (``lw-memcache config`` writes one).
    memcache_config_path: str = ""
    memcache_protocol: Literal[PROTOCOLS] = "host_shm"  # type: ignore[valid-type]
    # How long a reservation lives unfinished before the MetaService reclaims it (and other writers
    # may take its key over): it must outlast a whole forward pass, from the first layer's write to
    # the commit after the last, plus the save deadline. None: max(120 s, 4 x save_timeout_s).
    memcache_write_lease_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] | None = None


def _open(cfg: Any, **kwargs: Any) -> Backend[MemcacheHandle]:
    from lw_memcache.backend import MemcacheBackend

    return MemcacheBackend.from_config(cfg, **kwargs)


@contextmanager
def _bench_pool(capacity: int, path: str | None, *, protocol: str = "host_shm",
                host: str = "127.0.0.1", holder: bool = False) -> Iterator[dict[str, Any]]:
    """A MetaService on ``host`` and this process's client lending ``capacity`` bytes (``path``
    is unused). With host_tcp on another address (``lw-bench backend --host-tcp-netns``) every
    client's data port is its own host's address, so a reader on another host uses the same file.
    ``holder``: a holder process lends the ``capacity`` bytes instead and the clients lend none, so
    objects outlive the processes that saved them (``lw-bench serve``: one engine saves, a fresh
    engine loads)."""
    from lw_memcache.local import LocalMemcache

    hcom = "0.0.0.0" if protocol in ("host_tcp", "host_rdma") and host != "127.0.0.1" else None
    with LocalMemcache(dram_bytes=capacity, protocol=protocol, host=host, hcom_host=hcom, holder=holder) as extra:
        yield dict(extra)


PLUGIN = BackendPlugin(name="memcache", open=_open, keys=MemcacheKeys, bench_pool=_bench_pool)
