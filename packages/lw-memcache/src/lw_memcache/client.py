"""``StoreClient``: this process's memcache client (``memcache_hybrid.DistributedObjectStore``) as
MemcacheBackend's collaborators share it, with the backend's counters; ``read_client_conf``, which
reads and checks an mmc-local.conf, and ``open_store``, which sets a client up from it.

Invariants:

* One client per process (the library's rule; ``MemcacheBackend`` enforces it). ``closed`` turns
  true once, in ``mark_closed``; from then on ``live()`` refuses, while clean-up at close (and the
  reaper's last removals) still reach ``store``.
* ``store`` is read at each call, never cached by a collaborator: replacing it (a test's hook)
  reaches every collaborator at once.
* Every failed store call goes through ``fail``: it counts ``errors`` (and ``unavailable`` for
  codes saying the MetaService is gone) and raises ``errors.error_for``'s exception.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, NoReturn

from lw_core.backend import BackendError
from lw_memcache import errors
from lw_memcache.conf import ConfError, local_config_fields, meta_address, read_conf, resolve_auto_hcom

MEDIA_DRAM = 1  # batch_alloc's medium
# batch_get_key_info flags: 1 = readable objects only, 0 = also objects still being written.
INFO_READABLE, INFO_ANY = 1, 0
# batch_write_finish results: 0 commits the object, 1 drops it.
FINISH_OK, FINISH_FAILED = 0, 1

LEASE_RETRY_PAUSE_S = (0.002, 0.05)  # first and longest pause between tries of a refused lease

COUNTERS = ("lookups", "lookup_hits", "reserved", "reserve_skipped", "committed", "aborted", "opened",
            "open_misses", "released", "bytes_written", "bytes_read", "copy_calls", "errors", "unavailable")


class StoreClient:
    """The store ``store``, whether it is closed, and the counters ``stats`` reports (own lock)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.closed = False
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(COUNTERS, 0)

    def live(self) -> Any:
        """The store, unless the backend is closed."""
        if self.closed:
            raise BackendError("memcache backend is closed")
        return self.store

    def check(self, code: int, what: str) -> None:
        if code != 0:
            self.fail(code, what)

    def fail(self, code: int, what: str) -> NoReturn:
        with self._lock:
            self._stats["errors"] += 1
            if errors.is_unavailable(code):
                self._stats["unavailable"] += 1
        raise errors.error_for(code, what)

    def add_lease(self, names: list[str], lease_ms: int, retry_s: float = 0.0) -> list[int]:
        """``batch_add_lease`` of ``names`` for ``lease_ms``: one code per name (0: leased). Names
        this client refuses for a moment (``errors.LEASE_REFUSED``: it still tracks an earlier
        object's range at that address) are tried again, with growing pauses, for up to
        ``retry_s``; what is still refused then keeps its code."""
        store = self.live()
        res = list(store.batch_add_lease(names, lease_ms))
        if retry_s <= 0 or len(res) != len(names):
            return res
        deadline = time.monotonic() + retry_s
        pause = LEASE_RETRY_PAUSE_S[0]
        while True:
            todo = [i for i, r in enumerate(res) if r == errors.LEASE_REFUSED]
            left = deadline - time.monotonic()
            if not todo or left <= 0:
                return res
            time.sleep(min(pause, left))
            pause = min(pause * 2, LEASE_RETRY_PAUSE_S[1])
            again = list(store.batch_add_lease([names[i] for i in todo], lease_ms))
            if len(again) != len(todo):
                return res
            for i, r in zip(todo, again):
                res[i] = r

    def count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self._stats[k] += v

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def mark_closed(self) -> bool:
        """Close for new calls; False when it was closed already."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            return True


def read_client_conf(config_path: str, protocol: str) -> tuple[dict[str, str], str, int]:
    """The client config at ``config_path`` (``BackendError`` naming the key when it cannot be
    used), with the MetaService's host and port; ``protocol`` must be the file's."""
    if not config_path:
        raise BackendError(
            "kv_connector_extra_config.memcache_config_path is empty: give the mmc-local.conf path "
            "(write one with `lw-memcache config`)"
        )
    try:
        conf = read_conf(config_path)
    except OSError as e:
        raise BackendError(f"kv_connector_extra_config.memcache_config_path={config_path!r}: cannot read it ({e})") from e
    file_protocol = conf.get("ock.mmc.local_service.protocol")
    if file_protocol != protocol:
        raise BackendError(
            f"kv_connector_extra_config.memcache_protocol={protocol!r} but {config_path} sets "
            f"ock.mmc.local_service.protocol = {file_protocol}; make them agree"
        )
    try:
        host, port = meta_address(conf)
        conf = resolve_auto_hcom(conf)
    except ConfError as e:
        raise BackendError(f"{config_path}: {e}") from e
    return conf, host, port


def open_store(mc: Any, conf: dict[str, str], config_path: str, *, protocol: str, device_id: int,
               restore_signals: bool) -> Any:
    """Set up and init a ``DistributedObjectStore`` of module ``mc`` from the parsed ``conf``."""
    local_cfg = _local_config(mc, conf, config_path)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    store = mc.DistributedObjectStore()
    rc = store.setup(local_cfg)
    if rc != 0:
        raise errors.error_for(rc, f"client setup from {config_path}")
    rc = store.init(device_id, True)
    if restore_signals and threading.current_thread() is threading.main_thread():
        # The library replaces SIGINT/SIGTERM handlers; give them back to Python (Ctrl-C,
        # vLLM's own shutdown). close() still runs: from atexit or the owner.
        for s, h in saved.items():
            if h is not None:
                signal.signal(s, h)
    if rc != 0:
        # Exiting without close() after init aborts the process (rc 134): close even on failure.
        try:
            store.close()
        finally:
            raise errors.error_for(rc, f"client init (device {device_id}, {protocol}, {config_path})")
    return store


def _local_config(mc: Any, conf: dict[str, str], path: str) -> Any:
    cfg = mc.LocalConfig()
    known = {a for a in dir(cfg) if not a.startswith("_") and a != "str"}
    try:
        fields = local_config_fields(conf, known)
    except ConfError as e:
        raise BackendError(f"{path}: {e}") from e
    for attr, raw in fields.items():
        cur = getattr(cfg, attr)
        try:
            if isinstance(cur, bool):
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError("expected true or false")
                value: Any = raw.lower() in ("true", "1")
            elif isinstance(cur, int):
                value = int(raw)
            else:
                value = raw
            setattr(cfg, attr, value)
        except (TypeError, ValueError) as e:
            raise BackendError(f"{path}: {attr} = {raw!r} is not valid ({e})") from e
    return cfg
