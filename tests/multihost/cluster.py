"""A memcache pool over ``host_tcp`` across two test hosts (network namespaces, lw_dev.netns).

    host A (10.231.0.1): MetaService; engines' clients (DRAM 0)
    host B (10.231.0.2): ``lw-memcache hold`` lending the pool's DRAM; engines' clients (DRAM 0)

Every process gets its own ``mmc-local.conf`` whose data port (``hcom_url``) is on its own host's
address. The MetaService runs with a private ``/tmp`` (its lock file there allows one per machine,
and other test runs on this machine may hold the real one). Huge pages, which host_tcp needs for
lent DRAM, are raised for the holder and restored on close. Everything is stopped on close, also
on failure (the Hosts harness kills what is left in the namespaces).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lw_dev import netns

META_PORT, STORE_PORT, METRICS_PORT = 5000, 6000, 8000
HOLDER_DRAM = 64 << 20
HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
# host_tcp's data port: each client binds this base + its rank in the pool (ranks are unique, a
# restarted client gets a new one), so every client uses the same base.
HCOM_PORT = 7000


class Cluster:
    def __init__(self, workdir: Path | None = None) -> None:
        self.hosts = netns.Hosts(["a", "b"])
        # Not under /tmp: the MetaService sees a private one.
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="lw-multihost-", dir="/var/tmp"))
        self._own_workdir = workdir is None
        self._old_hugepages: str | None = None
        self.meta: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self._since = time.time()
        self.runtime_env: dict[str, str] = {}

    # ----- addresses and files -----

    @property
    def a(self) -> str:
        return self.hosts.addr("a")

    @property
    def b(self) -> str:
        return self.hosts.addr("b")

    def launcher(self, host: str) -> list[str]:
        """argv prefix that starts a process on ``host`` with the memcache runtime's environment
        (LD_LIBRARY_PATH must be set when a host_tcp client process starts)."""
        return self.hosts.argv(host, ["env", *(f"{k}={v}" for k, v in self.runtime_env.items())])

    def client_conf(self, host: str, role: str, dram: int | str = 0) -> Path:
        """An mmc-local.conf for the clients of ``role`` on ``host``."""
        from lw_memcache.conf import write_local_conf

        return write_local_conf(
            self.workdir / f"{role}-{host}.conf",
            meta_url=f"tcp://{self.a}:{META_PORT}",
            config_store_url=f"tcp://{self.a}:{STORE_PORT}",
            protocol="host_tcp",
            dram_size=dram,
            hcom_url=f"tcp://{self.hosts.addr(host)}:{HCOM_PORT}",
        )

    def extra(self, host: str, role: str, **kw: object) -> dict[str, object]:
        """kv_connector_extra_config for an engine on ``host`` using this pool (lending no DRAM)."""
        return {"backend": "memcache", "memcache_protocol": "host_tcp",
                "memcache_config_path": str(self.client_conf(host, role)), **kw}

    # ----- life cycle -----

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Cluster:
        from lw_memcache import standin
        from lw_memcache.conf import write_meta_conf

        home = standin.build()
        standin.ensure_install_info(home)
        self.runtime_env = standin.env(home)
        self.env = {**os.environ, **self.runtime_env}
        try:
            self.hosts.start()
            self._old_hugepages = HUGEPAGES.read_text().strip()
            HUGEPAGES.write_text(str(int(self._old_hugepages) + HOLDER_DRAM // (2 << 20) + 8))
            write_meta_conf(self.workdir / "meta.conf", meta_url=f"tcp://{self.a}:{META_PORT}",
                            config_store_url=f"tcp://{self.a}:{STORE_PORT}",
                            metrics_url=f"http://{self.a}:{METRICS_PORT}", log_level="warn")
            self.client_conf("b", "hold", HOLDER_DRAM)
            self.start_meta()
            self.start_holder()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for p in (self.holder, self.meta):
            if p is not None and p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(45)  # a leaving holder waits out read leases
        self.hosts.close()
        from lw_memcache.machine import cleanup_leftovers

        cleanup_leftovers(self._since)  # the clients' trace files (and any /dev/shm segment) of exited processes
        if self._old_hugepages is not None:
            HUGEPAGES.write_text(self._old_hugepages)
            self._old_hugepages = None
        if self._own_workdir:
            import shutil

            shutil.rmtree(self.workdir, ignore_errors=True)

    # ----- the MetaService (host A) -----

    def start_meta(self, timeout_s: float = 30.0) -> None:
        conf = self.workdir / "meta.conf"
        # A private /tmp (ip netns exec gives the process its own mount namespace). What the process
        # needs from the real /tmp (a checkout or venv there, as in CI's clone) is bound back in.
        orig = self.workdir / "orig-tmp"
        orig.mkdir(exist_ok=True)
        keep = " ".join(shlex.quote(d) for d in self._under_tmp())
        script = (f'mount --bind /tmp {shlex.quote(str(orig))} && mount -t tmpfs lw-meta-tmp /tmp && '
                  f'for d in {keep}; do mkdir -p "/tmp/$d" && mount --bind "{orig}/$d" "/tmp/$d" || exit 1; done; '
                  'exec "$@"')
        argv = ["sh", "-c", script, "sh", sys.executable, "-m", "lw_memcache.cli", "meta", "--config", str(conf)]
        log = open(self.workdir / "meta.log", "ab")
        self.meta = self.hosts.popen("a", argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self.meta_healthy():
            if self.meta.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"MetaService on {self.a} did not start:\n{self.tail('meta.log')}")
            time.sleep(0.2)

    def _under_tmp(self) -> list[str]:
        """Top-level entries of /tmp that the MetaService needs: this checkout, the venv, and any
        path named by the environment (e.g. the stand-in runtime's directory)."""
        paths = [sys.prefix, sys.executable, __file__]
        paths += [p for v in self.env.values() if isinstance(v, str) for p in v.split(":") if p.startswith("/")]
        top = set()
        for p in paths:
            parts = Path(os.path.abspath(p)).parts
            if len(parts) > 2 and parts[1] == "tmp":
                top.add(parts[2])
        return sorted(top)

    def meta_healthy(self) -> bool:
        from lw_memcache.machine import meta_ready

        with self.hosts.entered("a"):
            return meta_ready(self.a, METRICS_PORT)

    def kill_meta(self) -> None:
        if self.meta is not None and self.meta.poll() is None:
            self.meta.kill()
            self.meta.wait(10)

    # ----- the holder (host B) -----

    def start_holder(self, timeout_s: float = 60.0, settle_s: float = 3.0) -> None:
        from lw_memcache.cli import READY_MARK

        path = self.workdir / "holder.log"
        path.write_bytes(b"")
        log = open(path, "ab")
        argv = [sys.executable, "-m", "lw_memcache.cli", "hold", "--config", str(self.workdir / "hold-b.conf")]
        self.holder = self.hosts.popen("b", argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        deadline = time.monotonic() + timeout_s
        while READY_MARK not in path.read_text(errors="replace"):
            if self.holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lw-memcache hold on {self.b} did not get ready:\n{self.tail('holder.log')}")
            time.sleep(0.2)
        time.sleep(settle_s)  # host_tcp: a put right after a rank joined can fail with -2

    def restart_store(self) -> None:
        """A fresh MetaService and holder, for a stack that must not inherit an earlier test's
        faults: after a MetaService restart memcache's holder can keep re-joining under a rank the
        config store still holds ("reconnect rank:N already active, reject" in meta.log), and new
        clients then wait forever to import its entity ("WhiteList FAIL")."""
        self.kill_holder()
        self.kill_meta()
        self.start_meta()
        self.start_holder()

    def kill_holder(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait(10)

    def tail(self, name: str, n: int = 3000) -> str:
        try:
            return (self.workdir / name).read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"
