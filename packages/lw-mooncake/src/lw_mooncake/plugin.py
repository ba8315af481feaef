"""The ``mooncake`` pool backend as an lw-core plugin (entry point ``lw_pool.backends``).

Its keys sit at the top level of ``kv_connector_extra_config`` and are parsed strictly by lw-core
into ``MooncakeKeys``; the seed's ``mooncake_rpc_port`` (alias ``lookup_rpc_port``) stays a core
key and keeps working with this backend. Loading this module never imports ``mooncake``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from lw_core.backend import Backend
from lw_core.backends.registry import BackendPlugin

if TYPE_CHECKING:  # the store itself is imported only when opened
    from lw_mooncake.handle import MooncakeHandle

MiB = 1 << 20
MAX_SEGMENT = 1 << 40
# host:port with a host name or IPv4 address (Mooncake's master_server_addr).
HostPort = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9.-]*:[0-9]{1,5}$", max_length=260)]
Url = Annotated[str, Meta(pattern=r"^(https?://[^\s]+|P2PHANDSHAKE|etcd://[^\s]+)$", max_length=500)]
HostName = Annotated[str, Meta(pattern=r"^(|[A-Za-z0-9][A-Za-z0-9.-]*)$", max_length=253)]


class MooncakeKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # The master's RPC address, host:port (``lw-mooncake master --host H --port P``). Required.
    mooncake_master: HostPort | None = None
    # Transfer-engine metadata: "P2PHANDSHAKE" (no metadata server: clients exchange it directly),
    # or an http(s):// / etcd:// URL of a metadata server.
    mooncake_metadata_server: Url = "P2PHANDSHAKE"
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_rdma_devices: str = ""
    # The address other clients reach this one at; "" = the local address of the route to the master.
    mooncake_local_hostname: HostName = ""
    # Memory this client lends to the pool (0: lend nothing, store on holders/other clients).
    mooncake_global_segment_size: Annotated[int, Meta(ge=0, le=MAX_SEGMENT)] = 0
    # With a segment lent: puts ask for this client's own segment first, so its own later hits are
    # Mooncake's local memcpy (same process) instead of its transport.
    mooncake_prefer_local_segment: bool = True
    # Mooncake's own client buffer (its internal copies).
    mooncake_local_buffer_size: Annotated[int, Meta(ge=1 * MiB, le=MAX_SEGMENT)] = 16 * MiB
    # Registered staging per direction: one batch of puts or ranged gets moves at most this much.
    mooncake_staging_size: Annotated[int, Meta(ge=1 * MiB, le=1 << 34)] = 64 * MiB
    # How loads read: "per_layer" = one ranged get per layer batch (the layer pipeline overlaps them
    # with compute); "whole" = open fetches whole objects (far fewer calls; see docs/guide/mooncake.md);
    # "auto" = "whole" when an open's objects total at most mooncake_whole_max_bytes (and each fits
    # the staging), else "per_layer".
    mooncake_load: Literal["auto", "per_layer", "whole"] = "auto"
    # "auto" loads: the most bytes one open fetches whole (local copies held until release); 0 = never.
    mooncake_whole_max_bytes: Annotated[int, Meta(ge=0, le=1 << 40)] = 256 * MiB
    # Whole gets land in this much host memory, registered once with Mooncake and (on a GPU) with
    # the device, which then moves their layers by DMA straight from it; an open that does not fit
    # fetches into a buffer of its own. 0 = a buffer per fetch always.
    mooncake_get_arena_bytes: Annotated[int, Meta(ge=0, le=1 << 40)] = 256 * MiB
    # Host memory, registered with Mooncake once, that reservations' local objects live in: puts
    # send from it with no copy into the put staging, and a device copier registers it too and
    # writes each layer into it by DMA. A reservation that does not fit takes an array of its own.
    # 0 = an array per reservation always.
    mooncake_put_arena_bytes: Annotated[int, Meta(ge=0, le=1 << 40)] = 256 * MiB
    # Deadline of every store call; a call past it raises BackendUnavailable (the caller recomputes).
    mooncake_call_timeout_s: Annotated[float, Meta(gt=0, le=600)] = 5.0


NOTES = {
    "mooncake_master": "host:port of `lw-mooncake master` (its --host and --port), e.g. 10.0.0.5:50051",
    "mooncake_metadata_server": "P2PHANDSHAKE (the default: no metadata server), an http(s):// URL or etcd://...",
    "mooncake_local_hostname": '"" = the local address of the route to the master',
    "mooncake_global_segment_size": "bytes; 0 = lend nothing (objects live on holders/other clients)",
    "mooncake_staging_size": "bytes; the largest object must fit",
    "mooncake_whole_max_bytes": 'bytes; with mooncake_load="auto", opens up to this size fetch whole objects',
    "mooncake_get_arena_bytes": "bytes of registered host memory gets land in (whole objects, per-layer ranges); 0 = a buffer per whole fetch, staging for ranges",
    "mooncake_put_arena_bytes": "bytes of registered host memory reservations live in (puts send from it, a device writes into it); 0 = an array per reservation, puts copy into staging",
}


def _check(keys: MooncakeKeys) -> str | None:
    if keys.mooncake_master is None:
        return ("mooncake_master is required with backend='mooncake': the master's host:port, "
                "e.g. \"10.0.0.5:50051\" (see `lw-mooncake master --help`)")
    port = int(keys.mooncake_master.rsplit(":", 1)[1])
    if not 0 < port < 65536:
        return f"mooncake_master={keys.mooncake_master!r}: port must be 1-65535"
    return None


def _open(cfg: Any, **kwargs: Any) -> Backend[MooncakeHandle]:
    from lw_mooncake.backend import MooncakeBackend

    return MooncakeBackend.from_config(cfg, **kwargs)


@contextmanager
def _bench_pool(capacity: int, path: str | None, *, host: str = "127.0.0.1",
                port: int | None = None) -> Iterator[dict[str, Any]]:
    """A master and a holder on ``host`` (``path`` is unused). The holder lends 3x ``capacity``:
    Mooncake evicts on its own schedule (at a watermark), so the bench's puts of fresh keys would
    otherwise fail on a full pool; its puts are measured on a pool with room. Mooncake's clients
    listen on every address of their host: run the bench inside a network namespace, or give
    ``port=0``: the master's RPC and metrics ports are then free ones, chosen here, so the pool
    does not collide with another master on the same host."""
    from lw_mooncake.local import LocalMooncake

    rpc, metrics = (50051, 9003) if port is None else _free_ports(host, 2) if port == 0 else (port, port + 2)
    with LocalMooncake(segment_size=3 * capacity, host=host, port=rpc, metrics_port=metrics) as pool:
        yield pool.extra_config()


def _free_ports(host: str, n: int) -> tuple[int, ...]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return tuple(s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()


PLUGIN = BackendPlugin(name="mooncake", open=_open, keys=MooncakeKeys, check=_check, notes=NOTES,
                       bench_pool=_bench_pool)
