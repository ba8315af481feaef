"""``StoreClient``: one Mooncake Store client, set up against a master, behind the deadlines of
``lw_mooncake.calls``, and whether it is closed.

Invariants:

* Every call into the client goes through ``calls`` (a deadline; past it ``BackendUnavailable``).
* After ``close`` every call of this module that reaches the store raises ``BackendError``
  (``check_open``); ``close`` itself runs once.
* A client whose setup or close outlived its deadline is never dropped: it stays referenced in
  ``_STUCK`` for the life of the process, as its destructor would block whichever thread drops the
  last reference until Mooncake gives up (a minute or more).
* ``connect`` keeps the host's SIGINT/SIGTERM/SIGHUP handlers (the client installs its own).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Sequence
from typing import Any

from lw_core.backend import BackendError, BackendUnavailable
from lw_mooncake.calls import Deadlines
from lw_mooncake.errors import to_error

log = logging.getLogger(__name__)
INSTALL_HINT = ("pip install 'lw-mooncake[store]' (mooncake-transfer-engine-non-cuda; on CUDA machines "
                "mooncake-transfer-engine instead) and the Debian package libibverbs1 "
                "(scripts/install-mooncake-deps.sh)")
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_STUCK: list[Any] = []


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


class StoreClient:
    """The client ``store``, its calls under ``calls``; ``master``, ``metadata_server`` and
    ``local_hostname`` are what it was set up with."""

    def __init__(self, store: Any, calls: Deadlines, *, master: str, metadata_server: str, local_hostname: str,
                 put_config: Any = None) -> None:
        self.store = store
        self.calls = calls
        # Mooncake's ReplicateConfig for every put (``put_args``); None: its default.
        self.put_config = put_config
        self.master = master
        self.metadata_server = metadata_server
        self.local_hostname = local_hostname
        self.closed = False

    @classmethod
    def connect(cls, master: str, *, metadata_server: str, protocol: str, rdma_devices: str, local_hostname: str,
                global_segment_size: int, local_buffer_size: int, call_timeout_s: float, setup_timeout_s: float,
                restore_signals: bool, prefer_local_segment: bool = False) -> StoreClient:
        """A client set up against ``master`` (host:port); ``BackendUnavailable`` when the master
        cannot be reached or setup fails, ``BackendError`` when Mooncake's client is not installed.
        ``prefer_local_segment`` (with ``global_segment_size`` > 0): puts ask the master for this
        client's own segment first, so this process's later gets of them are Mooncake's local
        memcpy instead of its transport."""
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise BackendError(f"backend='mooncake': the Mooncake client cannot be imported ({e}); {INSTALL_HINT}") from e
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"mooncake_master={master!r}: expected host:port")
        metadata_server = metadata_server or "P2PHANDSHAKE"
        local_hostname = local_hostname or route_address(host, int(port))
        # setup() holds the GIL while it retries an absent master (minutes): no thread-based
        # deadline can interrupt it, so find out first whether the master answers at all.
        try:
            socket.create_connection((host, int(port)), timeout=min(3.0, setup_timeout_s)).close()
        except OSError as e:
            raise BackendUnavailable(f"mooncake setup: master {master} cannot be reached ({e}); "
                                     "is `lw-mooncake master` running there?") from None
        calls = Deadlines(call_timeout_s, f"master {master}")
        store = MooncakeDistributedStore()
        saved = [(s, signal.getsignal(s)) for s in _SIGNALS]
        rc = None
        try:
            rc = calls.call("setup", store.setup, local_hostname, metadata_server, int(global_segment_size),
                            int(local_buffer_size), protocol, rdma_devices, master, timeout_s=setup_timeout_s)
        finally:
            if rc != 0:
                _STUCK.append(store)
            if restore_signals and threading.current_thread() is threading.main_thread():
                for s, h in saved:
                    if h is not None:
                        signal.signal(s, h)
        if rc != 0:
            calls.shutdown()
            raise BackendUnavailable(
                f"mooncake setup failed ({rc}): master {master}, metadata {metadata_server}, "
                f"local address {local_hostname}, protocol {protocol}; is `lw-mooncake master` running there?"
            )
        put_config = None
        if prefer_local_segment and global_segment_size > 0:
            put_config = ReplicateConfig()
            put_config.replica_num = 1
            put_config.preferred_segment = calls.call("get_hostname", store.get_hostname)
        return cls(store, calls, master=master, metadata_server=metadata_server, local_hostname=local_hostname,
                   put_config=put_config)

    def put_args(self) -> tuple[Any, ...]:
        """The trailing arguments of a put call: the put config, when there is one."""
        return () if self.put_config is None else (self.put_config,)

    def check_open(self) -> None:
        if self.closed:
            raise BackendError("the mooncake backend is closed")

    def exist(self, keys: list[str]) -> list[int]:
        """``batch_is_exist``: 1 where stored (whole), 0 where not."""
        self.check_open()
        res = self.calls.call("batch_is_exist", self.store.batch_is_exist, keys)
        for k, r in zip(keys, res):
            if r < 0:
                raise to_error(r, f"batch_is_exist({k!r})")
        return list(res)

    def sizes(self, keys: list[str]) -> dict[str, int]:
        """The sizes of the stored objects among ``keys`` (from their replica descriptors)."""
        self.check_open()
        desc = self.calls.call("batch_get_replica_desc", self.store.batch_get_replica_desc, keys)
        sizes: dict[str, int] = {}
        for k, replicas in desc.items():
            for r in replicas:
                if r.is_memory_replica():
                    sizes[k] = int(r.get_memory_descriptor().buffer_descriptor.size)
                    break
        return sizes

    def remove(self, keys: Sequence[str], *, force: bool) -> list[int]:
        """``batch_remove``: Mooncake's status per key (``force``: also objects under a read lease)."""
        return list(self.calls.call("batch_remove", self.store.batch_remove, list(keys), force))

    def close(self, timeout_s: float) -> None:
        """Closes the client (once); one that does not close in time is left to exit."""
        if self.closed:
            return
        self.closed = True
        try:
            self.calls.call("close", self.store.close, timeout_s=timeout_s)
        except BackendError as e:
            _STUCK.append(self.store)
            log.warning("mooncake client close: %s (left to exit)", e)
        self.calls.shutdown()
