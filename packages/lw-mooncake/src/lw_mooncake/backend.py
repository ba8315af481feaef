"""``MooncakeBackend``: lw-core's Backend protocol over Mooncake Store's Python client.

Mooncake has no reserve/commit, so one pool object is one Mooncake object put whole at commit:

* ``reserve``: ``batch_is_exist`` skips keys already stored; the rest get a local buffer in this
  process (nothing is sent yet). ``write`` / ``view`` fill it, layer by layer.
* ``commit``: ``batch_put_from`` of the whole objects from registered staging. Mooncake's put
  allocates, transfers, then marks the object complete: ``batch_is_exist`` / gets see it only then.
  So ``lookup``/``open`` only ever see complete chunks, and a writer killed before or during
  ``commit`` leaves nothing visible. ``abort`` drops the local buffer.
* ``open``: ``batch_get_replica_desc`` (the objects' sizes; missing ones are ``None``). Then, by
  ``load`` (key ``mooncake_load``): ``"per_layer"`` -- ``read`` is one ``get_into_ranges`` per
  batch, a ranged get of one layer of every object, into registered staging, then copied out, and
  ``view`` of a read handle is ``None``; ``"whole"`` -- ``open`` fetches the whole objects with
  ``batch_get_into`` into local copies, which ``view``/``read`` then serve (fewer, larger calls:
  Mooncake's cost is per key and call; measured in docs/bench/mooncake.md). ``release`` drops the local
  copies; Mooncake itself pins an object for ``--default_kv_lease_ttl`` after each get.

The writes are ``lw_mooncake.writes``, the reads ``lw_mooncake.reads``; the optional streaming
extension (``streaming=True``, from ``pd_streaming``) is ``lw_mooncake.streaming`` (writer) and
``lw_mooncake.stream_read`` (reader). This module holds the client's set-up, lookups and close. Every call has a deadline (``mooncake_call_timeout_s``); past
it ``BackendUnavailable``. Mooncake loses every object when its master dies (the master holds the only index).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from lw_core.backend import BackendError, BackendUnavailable
from lw_core.backends.segment_stream.collector import Collector
from lw_mooncake.buffers import Staging
from lw_mooncake.calls import Deadlines
from lw_mooncake.errors import to_error
from lw_mooncake.handle import MooncakeHandle
from lw_mooncake.reads import Reads
from lw_mooncake.stream_read import StreamReads
from lw_mooncake.streaming import StreamWrites
from lw_mooncake.writes import Writes

__all__ = ["INSTALL_HINT", "MooncakeBackend", "MooncakeHandle", "route_address"]
log = logging.getLogger(__name__)
INSTALL_HINT = ("pip install 'lw-mooncake[store]' (mooncake-transfer-engine-non-cuda; on CUDA machines "
                "mooncake-transfer-engine instead) and the Debian package libibverbs1 "
                "(scripts/install-mooncake-deps.sh)")
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Clients whose setup or close outlived its deadline: kept alive here, as their destructor would
# block whichever thread drops the last reference until Mooncake gives up (a minute or more).
_STUCK: list[Any] = []


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


class MooncakeBackend(Writes, Reads, StreamWrites, StreamReads):
    name = "mooncake"

    def __init__(self, master: str, *, metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp", rdma_devices: str = "",
                 local_hostname: str = "", global_segment_size: int = 0, local_buffer_size: int = 16 << 20,
                 staging_size: int = 64 << 20, call_timeout_s: float = 5.0, setup_timeout_s: float = 30.0,
                 load: str = "per_layer", restore_signals: bool = True, streaming: bool = False) -> None:
        if load not in ("per_layer", "whole"):
            raise ValueError(f"mooncake_load={load!r}: expected 'per_layer' or 'whole'")
        self.load = load
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise BackendError(f"backend='mooncake': the Mooncake client cannot be imported ({e}); {INSTALL_HINT}") from e
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"mooncake_master={master!r}: expected host:port")
        self.master = master
        self.metadata_server = metadata_server or "P2PHANDSHAKE"
        self.local_hostname = local_hostname or route_address(host, int(port))
        self.staging_size = staging_size
        # setup() holds the GIL while it retries an absent master (minutes): no thread-based
        # deadline can interrupt it, so find out first whether the master answers at all.
        try:
            socket.create_connection((host, int(port)), timeout=min(3.0, setup_timeout_s)).close()
        except OSError as e:
            raise BackendUnavailable(f"mooncake setup: master {master} cannot be reached ({e}); "
                                     "is `lw-mooncake master` running there?") from None
        self.calls = Deadlines(call_timeout_s, f"master {master}")
        self.stats_: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._pending: dict[str, MooncakeHandle] = {}
        self._closed = False
        self._streaming = bool(streaming)  # reservations get heads; publish puts segments
        self._wstreams: dict = {}  # key -> streaming.WriteStream of our open reservations
        # streaming: removals to retry (read leases), markers kept a while, the quiet period after a timeout
        self._collector = Collector("mooncake streaming", self._remove_names)
        self.store = MooncakeDistributedStore()
        saved = [(s, signal.getsignal(s)) for s in _SIGNALS]
        rc = None
        try:
            rc = self.calls.call("setup", self.store.setup, self.local_hostname, self.metadata_server,
                                 int(global_segment_size), int(local_buffer_size), protocol, rdma_devices, master,
                                 timeout_s=setup_timeout_s)
        finally:
            if rc != 0:
                _STUCK.append(self.store)
            # The client installs SIGINT/SIGTERM/SIGHUP handlers of its own; keep the host's.
            if restore_signals and threading.current_thread() is threading.main_thread():
                for s, h in saved:
                    if h is not None:
                        signal.signal(s, h)
        if rc != 0:
            self.calls.shutdown()
            raise BackendUnavailable(
                f"mooncake setup failed ({rc}): master {master}, metadata {self.metadata_server}, "
                f"local address {self.local_hostname}, protocol {protocol}; is `lw-mooncake master` running there?"
            )
        self._puts = Staging(self.store, staging_size, self.calls, "put")
        self._gets = Staging(self.store, staging_size, self.calls, "get")

    @classmethod
    def from_config(cls, cfg: Any, **kwargs: Any) -> MooncakeBackend:
        k = cfg.backend_keys
        kwargs.setdefault("streaming", bool(getattr(cfg, "pd_streaming", False)))
        return cls(k.mooncake_master, metadata_server=k.mooncake_metadata_server, protocol=k.mooncake_protocol,
                   rdma_devices=k.mooncake_rdma_devices, local_hostname=k.mooncake_local_hostname,
                   global_segment_size=k.mooncake_global_segment_size,
                   local_buffer_size=k.mooncake_local_buffer_size, staging_size=k.mooncake_staging_size,
                   call_timeout_s=k.mooncake_call_timeout_s, load=k.mooncake_load, **kwargs)

    # ----- lookups -----

    def _exist(self, keys: list[str]) -> list[int]:
        self._check_open()
        res = self.calls.call("batch_is_exist", self.store.batch_is_exist, keys)
        for k, r in zip(keys, res):
            if r < 0:
                raise to_error(r, f"batch_is_exist({k!r})")
        return list(res)

    def lookup(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        n = 0
        for r in self._exist(list(keys)):
            if r != 1:
                break
            n += 1
        return n

    # ----- misc -----

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.stats_, "pending": len(self._pending), "call_timeouts": self.calls.timeouts,
                    "stream_leftovers": len(self._collector)}

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("the mooncake backend is closed")

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        if self._streaming:
            try:
                self._stream_close()
                self._collect(every_s=0.0)
            except BackendError as e:
                log.debug("mooncake streaming: clean-up at close: %s", e)
        self._closed = True
        with self._lock:
            self._pending.clear()
        try:
            self.calls.call("close", self.store.close, timeout_s=timeout_s)
        except BackendError as e:
            _STUCK.append(self.store)
            log.warning("mooncake client close: %s (left to exit)", e)
        self.calls.shutdown()

    def __enter__(self) -> MooncakeBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
