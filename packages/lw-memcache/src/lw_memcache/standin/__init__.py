"""The CPU stand-in for the Ascend runtime that memcache_hybrid's PyPI build loads.

The wheels are an Ascend NPU build: even with the host protocols (``host_shm``, ``host_tcp``)
initialising a data client (1) reads the driver version through ``/etc/ascend_install.info``,
(2) dlopens the runtime libraries from ``$ASCEND_HOME_PATH/lib64`` and (3) selects a device.
``ascend_standin.c`` (next to this file) answers those calls on host memory. This module builds it
once with gcc (cached per source and compiler), lays it out like an Ascend install::

    <dir>/lib64/libascendcl.so, libascend_hal.so, ...   (one build, one soname per name)
    <dir>/driver/version.info                            (Innerversion the version check accepts)

and prepares a process to use it. Root-only step: ``/etc/ascend_install.info`` (path hard-coded in
the library) is written only when it is missing, and only by ``ensure_install_info``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Every runtime library name memfabric's core dlopens (from the strings of libmf_hybm_core.so).
LIB_NAMES = (
    "libascendcl.so",
    "libascend_hal.so",
    "libruntime.so",
    "libra.so",
    "libtsdclient.so",
    "libhccl.so",
    "libdcmi.so",
    "libopapi.so",
    "libnnopbase.so",
    "libhcomm.so",
)
# A driver version memfabric 1.3.0 accepts (it refuses to start on older or unparsable ones).
DRIVER_INNERVERSION = "V100R001C23SPC005B219"
INSTALL_INFO = Path("/etc/ascend_install.info")
_MARKER = "lw-memcache-standin"
_SOURCE = Path(__file__).with_name("ascend_standin.c")
_WRITTEN_BY_US = "# written by lw-memcache (CPU stand-in for the Ascend runtime); delete to regenerate"


class StandinError(RuntimeError):
    """The stand-in cannot be built or installed here; the message says what to do."""


def _cache_root() -> Path:
    env = os.environ.get("LW_MEMCACHE_STANDIN_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lw-memcache"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise StandinError(
            "building the Ascend runtime stand-in needs a C compiler: install gcc "
            "(e.g. apt-get install gcc) or set CC"
        )
    return cc


def build(force: bool = False) -> Path:
    """Build (or reuse) the stand-in; returns its ASCEND_HOME_PATH-style directory."""
    cc = _compiler()
    try:
        cc_version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise StandinError(f"cannot run the C compiler {cc!r}: {e}") from e
    digest = hashlib.sha256(_SOURCE.read_bytes() + cc_version.encode()).hexdigest()[:16]
    target = _cache_root() / f"ascend-standin-{digest}"
    if (target / _MARKER).is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place: concurrent builders never see half a build.
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        (tmp / "lib64").mkdir()
        for name in LIB_NAMES:
            cmd = [cc, "-O2", "-shared", "-fPIC", f"-Wl,-soname,{name}", "-o", str(tmp / "lib64" / name), str(_SOURCE)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise StandinError(f"building the Ascend runtime stand-in failed ({' '.join(cmd)}):\n{r.stderr}")
        (tmp / "driver").mkdir()
        (tmp / "driver" / "version.info").write_text(f"Version=stand-in\nInnerversion={DRIVER_INNERVERSION}\n")
        (tmp / _MARKER).write_text(f"built from {_SOURCE} with {cc}\n")
        if force and target.exists():
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / _MARKER).is_file():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def is_standin(ascend_home: str | os.PathLike[str]) -> bool:
    return (Path(ascend_home) / _MARKER).is_file()


def _install_info_driver_path() -> Path | None:
    try:
        text = INSTALL_INFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Driver_Install_Path_Param="):
            return Path(line.split("=", 1)[1].strip())
    return None


def ensure_install_info(home: Path) -> None:
    """Make ``/etc/ascend_install.info`` point at a driver version the library accepts.

    Written only when missing (or when it is our own file pointing at a stand-in that no longer
    exists); a file written by a real Ascend install is never touched.
    """
    driver = _install_info_driver_path()
    if driver is not None and (driver / "driver" / "version.info").is_file():
        return
    ours = INSTALL_INFO.exists() and INSTALL_INFO.read_text().startswith(_WRITTEN_BY_US)
    if INSTALL_INFO.exists() and not ours:
        raise StandinError(
            f"{INSTALL_INFO} exists but its Driver_Install_Path_Param ({driver}) has no driver/version.info; "
            "memcache_hybrid will refuse to start. Fix the Ascend install, or delete the file to let "
            "lw-memcache write one for its CPU stand-in"
        )
    content = f"{_WRITTEN_BY_US}\nDriver_Install_Path_Param={home}\n"
    try:
        INSTALL_INFO.write_text(content)
    except OSError as e:
        raise StandinError(
            f"memcache_hybrid reads the Ascend driver version through {INSTALL_INFO}, which is missing, "
            f"and it cannot be written here ({e}). As root run:\n"
            f"  printf 'Driver_Install_Path_Param={home}\\n' > {INSTALL_INFO}"
        ) from e


def memfabric_lib_dir() -> str | None:
    """Where memfabric_hybrid keeps its bundled libraries (libhcom.so for host_tcp)."""
    import importlib.util

    spec = importlib.util.find_spec("memfabric_hybrid")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "lib")


def env(home: Path) -> dict[str, str]:
    """Environment for a child process (a client or a MetaService) using the stand-in."""
    parts = [str(home / "lib64")]
    mf = memfabric_lib_dir()
    if mf:
        parts.append(mf)
    old = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p and p not in parts]
    parts.extend(old)
    return {
        "ASCEND_HOME_PATH": str(home),
        "LD_LIBRARY_PATH": ":".join(parts),
        # host_tcp: bounds hcom's pre-posted buffers (init 19 s -> 0.4 s); harmless otherwise.
        "MF_HCOM_MAX_SEND_RECV_DATA_CNT": os.environ.get("MF_HCOM_MAX_SEND_RECV_DATA_CNT", "256"),
    }


_PRELOADED: list[ctypes.CDLL] = []


def activate(home: Path | None = None) -> Path:
    """Prepare *this* process: build if needed, write the install info if missing, set the
    environment and preload the libraries (the loader read LD_LIBRARY_PATH at start-up; a library
    already loaded under a soname satisfies later dlopens of that name)."""
    home = home or build()
    ensure_install_info(home)
    os.environ.update(env(home))
    if not _PRELOADED:
        for name in LIB_NAMES:
            _PRELOADED.append(ctypes.CDLL(str(home / "lib64" / name), mode=ctypes.RTLD_GLOBAL))
    return home


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - thin CLI helper
    home = build(force=bool(argv and "--force" in argv))
    print(home)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
