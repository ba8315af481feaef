"""What a memcache-hybrid 1.3.0 MetaService and its clients hold or leave on this machine, and how to
find or clear it: the one-per-machine MetaService lock (``META_LOCK``), the MetaService's ``/health``,
and the ``/dev/shm/memfabric_hybrid_*`` segments and ``ptracer_<pid>.dat`` traces dead clients
leave behind.

Invariants: nothing here starts or stops a process; ``cleanup_leftovers`` removes only what was
made after a given time and belongs to no live process (a segment no process maps, a trace whose
pid is gone).
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
from pathlib import Path

META_LOCK = Path("/tmp/mmc_meta_service.lock")
TRACE_DIR = Path("/var/log/memfabric_hybrid")
SHM_DIR = Path("/dev/shm")


def meta_lock_holder() -> int | None:
    """Pid of the process holding the MetaService lock, or None when it is free."""
    try:
        fd = os.open(META_LOCK, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        ino = os.fstat(fd).st_ino
        with contextlib.suppress(OSError):
            for line in Path("/proc/locks").read_text().splitlines():
                f = line.split()
                # "1: POSIX  ADVISORY  WRITE 18670 fe:00:2146897 0 EOF"
                if len(f) > 5 and f[5].rsplit(":", 1)[-1] == str(ino):
                    return int(f[4])
        return -1
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _mapped_paths() -> set[str]:
    out: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text().splitlines():
                if "/dev/shm/" in line:
                    out.add(line.split(None, 5)[-1].split(" (deleted)")[0])
    return out


def meta_ready(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether the MetaService whose HTTP server is at ``host:port`` says ready on /health."""
    # http.client, not urllib: urllib sends "Connection: close", and this server then never
    # sends the body.
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        return r.status == 200 and bool(json.loads(r.read()).get("service_ready"))
    except (OSError, ValueError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def cleanup_leftovers(since: float) -> list[str]:
    """Remove memfabric leftovers created after ``since`` by processes that are gone."""
    removed = []
    segs = [p for p in SHM_DIR.glob("memfabric_hybrid_*") if _mtime(p) >= since]
    if segs:
        mapped = _mapped_paths()
        for p in segs:
            if str(p) not in mapped:
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(str(p))
    for p in TRACE_DIR.glob("ptracer_*.dat"):
        pid = p.stem.split("_", 1)[1]
        if pid.isdigit() and _mtime(p) >= since and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                p.unlink()
                removed.append(str(p))
    return removed


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0
