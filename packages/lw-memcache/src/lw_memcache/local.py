"""``LocalMemcache``: a real memcache pool on 127.0.0.1 for tests, benchmarks and trying things out.

    with LocalMemcache() as extra:          # a MetaService subprocess on free ports
        cfg = lw_core.config.parse_config({**extra, "use_layerwise": True})
        backend = lw_core.backends.registry.open_backend(cfg)   # a client in this process

What it takes care of (facts of memcache-hybrid 1.3.0):

* One MetaService per machine: it locks ``/tmp/mmc_meta_service.lock``. We wait (bounded) for a
  running one to go away and name its pid if it does not.
* Clients block about 80 s per attempt in ``init()`` when the MetaService is down, so ``start``
  returns only once its ports answer and ``/health`` says ready.
* On a CPU-only machine the Ascend runtime stand-in is built and ``/etc/ascend_install.info`` is
  written if missing (root), before any client starts (``lw_memcache.standin``).
* ``holder=True`` also starts ``lw-memcache hold``: one client that lends ``dram_size`` to the
  pool, while the clients of ``extra_config`` lend none (``mmc-client.conf``, DRAM 0). Objects
  live in the memory of the client they were placed on and vanish with it, so engines that come
  and go (tests: engine A saves, a fresh engine B loads) need this.
* ``stop`` ends the holder, then the MetaService (SIGTERM, then SIGKILL after a deadline) and removes what dead
  clients leave behind: ``/dev/shm/memfabric_hybrid_*`` segments no process maps any more and the
  ``/var/log/memfabric_hybrid/ptracer_<pid>.dat`` traces of exited processes, made since start.

The machine's side (the lock, ``/health``, leftovers) is ``lw_memcache.machine``; the holder
subprocess is ``lw_memcache.holder_proc.HolderProcess``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lw_memcache.conf import HOST_PROTOCOLS, PROTOCOLS, write_local_conf, write_meta_conf
from lw_memcache.holder_proc import HolderError, HolderProcess
from lw_memcache.machine import META_LOCK, cleanup_leftovers, meta_lock_holder, meta_ready


class LocalMemcacheError(RuntimeError):
    pass


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalMemcache:
    def __init__(
        self,
        *,
        protocol: str = "host_shm",
        dram_size: str | int = "256MB",
        dram_bytes: int | None = None,
        host: str = "127.0.0.1",
        workdir: str | os.PathLike[str] | None = None,
        log_level: str = "warn",
        client_log_level: str = "error",
        start_timeout_s: float = 30.0,
        lock_wait_s: float = 120.0,
        stop_timeout_s: float = 5.0,
        holder: bool = False,
        hcom_host: str | None = None,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol={protocol!r}; accepted: {', '.join(PROTOCOLS)}")
        self.protocol = protocol
        # DRAM each client adds to the pool; ``dram_bytes`` is the same as a number of bytes.
        self.dram_size = dram_bytes if dram_bytes is not None else dram_size
        self.host = host
        # host_tcp/host_rdma data port address (default ``host``); "0.0.0.0": each client's own
        # address on the route to the MetaService (clients on several hosts share the configs).
        self.hcom_host = hcom_host or host
        self.log_level = log_level
        self.client_log_level = client_log_level
        self.start_timeout_s = start_timeout_s
        self.lock_wait_s = lock_wait_s
        self.stop_timeout_s = stop_timeout_s
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="lw-memcache-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.holder = holder
        self._holder: HolderProcess | None = None
        self._since = time.time()
        self._ports: list[int] | None = None

    # ----- addresses and files -----

    @property
    def meta_url(self) -> str:
        return f"tcp://{self.host}:{self._port(0)}"

    @property
    def config_store_url(self) -> str:
        return f"tcp://{self.host}:{self._port(1)}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self._port(2)}"

    @property
    def meta_conf(self) -> Path:
        return self.workdir / "mmc-meta.conf"

    @property
    def local_conf(self) -> Path:
        return self.workdir / "mmc-local.conf"

    @property
    def client_conf(self) -> Path:
        """Config of the clients ``extra_config`` selects: DRAM 0 when a holder lends the memory."""
        return self.workdir / "mmc-client.conf" if self.holder else self.local_conf

    @property
    def log_path(self) -> Path:
        return self.workdir / "metaservice.log"

    @property
    def extra_config(self) -> dict[str, Any]:
        """``kv_connector_extra_config`` keys selecting this pool."""
        return {"backend": "memcache", "memcache_config_path": str(self.client_conf), "memcache_protocol": self.protocol}

    def _port(self, i: int) -> int:
        if self._ports is None:
            raise LocalMemcacheError("LocalMemcache is not started")
        return self._ports[i]

    # ----- life cycle -----

    def __enter__(self) -> dict[str, Any]:
        self.start()
        return self.extra_config

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> dict[str, Any]:
        if self.protocol in HOST_PROTOCOLS:
            from lw_memcache import runtime, standin

            if runtime.real_runtime() is None:
                # Built here, before any client: a client process would otherwise compile it while
                # timing-sensitive things run, and /etc/ascend_install.info must exist for all.
                standin.ensure_install_info(standin.build())
        self._wait_lock_free()
        last: Exception | None = None
        for _ in range(3):  # free ports can be taken between choosing and binding: retry
            if self._ports is None or last is not None:
                self._ports = free_ports(4, self.host)
                self._write_confs()
            try:
                self._spawn()
                if self.holder:
                    self._spawn_holder()
                return self.extra_config
            except LocalMemcacheError as e:
                last = e
                self._kill_proc()
        raise LocalMemcacheError(f"MetaService did not start: {last}")

    def _write_confs(self) -> None:
        write_meta_conf(
            self.meta_conf,
            meta_url=self.meta_url,
            config_store_url=self.config_store_url,
            metrics_url=self.metrics_url,
            log_level=self.log_level,
        )
        hcom = f"tcp://{self.hcom_host}:{self._port(3)}" if self.protocol in ("host_tcp", "host_rdma") else None
        confs = [(self.local_conf, self.dram_size)] + ([(self.client_conf, 0)] if self.holder else [])
        for path, size in confs:
            write_local_conf(
                path,
                meta_url=self.meta_url,
                config_store_url=self.config_store_url,
                protocol=self.protocol,
                dram_size=size,
                hcom_url=hcom,
                log_level=self.client_log_level,
            )

    def _wait_lock_free(self) -> None:
        deadline = time.monotonic() + self.lock_wait_s
        while (pid := meta_lock_holder()) is not None:
            if time.monotonic() > deadline:
                raise LocalMemcacheError(
                    f"another MetaService (pid {pid}) holds {META_LOCK} after {self.lock_wait_s:.0f} s: memcache_hybrid "
                    "allows one per machine; stop it, or point the pool at it instead of starting one"
                )
            time.sleep(0.2)

    def _spawn(self) -> None:
        env = dict(os.environ, MMC_META_CONFIG_PATH=str(self.meta_conf))
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lw_memcache.cli", "meta", "--config", str(self.meta_conf)],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a Ctrl-C in a test run must not reach it first
            )
        self._wait_ready()

    def _spawn_holder(self) -> None:
        self._holder = HolderProcess(self.local_conf, self.workdir / "holder.log",
                                     start_timeout_s=self.start_timeout_s, stop_timeout_s=self.stop_timeout_s)
        try:
            self._holder.start()
        except HolderError as e:
            self._holder = None
            raise LocalMemcacheError(str(e)) from None

    def _stop_holder(self) -> None:
        h, self._holder = self._holder, None
        if h is not None:
            h.stop()

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LocalMemcacheError(f"MetaService exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
            if self.healthy(timeout_s=0.5):
                return
            time.sleep(0.1)
        raise LocalMemcacheError(f"MetaService not ready after {self.start_timeout_s:.0f} s; log tail:\n{self.log_tail()}")

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """The MetaService says ready on /health (its HTTP server starts after the meta port)."""
        return meta_ready(self.host, self._port(2), timeout_s)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the MetaService (fault injection); ``restart`` brings it back on the same ports."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self._kill_proc()
        self._wait_lock_free()
        self._spawn()

    def _kill_proc(self) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)

    def stop(self) -> None:
        self._stop_holder()
        self._kill_proc()
        cleanup_leftovers(self._since)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
