"""``lw-memcache``: write memcache configs, start a MetaService, build the CPU runtime stand-in.

    lw-memcache config --out-dir DIR [--protocol host_shm] [--dram-size 1GB] [--host 127.0.0.1] [--hcom-host IP] ...
    lw-memcache meta   [--config DIR/mmc-meta.conf | --host 127.0.0.1 --port 5000 ...]
    lw-memcache hold   --config DIR/mmc-local.conf     # a client that only lends its DRAM to the pool
    lw-memcache standin

``config`` prints the ``kv_connector_extra_config`` keys that select the pool it describes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from lw_memcache.conf import (
    AUTO_HOST,
    LOG_LEVELS,
    PROTOCOLS,
    ConfError,
    check_hugepages,
    write_local_conf,
    write_meta_conf,
)

DEFAULT_PORTS = {"port": 5000, "config_store_port": 6000, "metrics_port": 8000}


def _urls(args: argparse.Namespace) -> dict[str, str]:
    h = args.host
    return {
        "meta_url": f"tcp://{h}:{args.port}",
        "config_store_url": f"tcp://{h}:{args.config_store_port}",
        "metrics_url": f"http://{h}:{args.metrics_port}",
    }


def _address_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address the MetaService binds and clients reach (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORTS["port"], help="meta RPC port (default 5000)")
    p.add_argument("--config-store-port", type=int, default=DEFAULT_PORTS["config_store_port"], help="config store port (default 6000)")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_PORTS["metrics_port"], help="HTTP /health and /metrics port (default 8000)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warn")


def cmd_config(args: argparse.Namespace) -> int:
    urls = _urls(args)
    out = Path(args.out_dir)
    meta = write_meta_conf(
        out / "mmc-meta.conf",
        meta_url=urls["meta_url"],
        config_store_url=urls["config_store_url"],
        metrics_url=urls["metrics_url"],
        log_level=args.log_level,
    )
    hcom_host = args.hcom_host or args.host
    if hcom_host == "auto":
        hcom_host = AUTO_HOST
    hcom = f"tcp://{hcom_host}:{args.hcom_port}" if args.protocol in ("host_tcp", "host_rdma") else None
    local = write_local_conf(
        out / "mmc-local.conf",
        meta_url=urls["meta_url"],
        config_store_url=urls["config_store_url"],
        protocol=args.protocol,
        dram_size=args.dram_size,
        world_size=args.world_size,
        hcom_url=hcom,
        log_level=args.client_log_level,
    )
    print(f"wrote {meta}\nwrote {local}", file=sys.stderr)
    extra = {"backend": "memcache", "memcache_config_path": str(local.resolve()), "memcache_protocol": args.protocol}
    print(json.dumps(extra))
    return 0


def cmd_meta(args: argparse.Namespace) -> int:
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfError(f"--config {path}: no such file (write one with `lw-memcache config`)")
    else:
        urls = _urls(args)
        path = write_meta_conf(
            Path(tempfile.mkdtemp(prefix="lw-memcache-meta-")) / "mmc-meta.conf",
            meta_url=urls["meta_url"],
            config_store_url=urls["config_store_url"],
            metrics_url=urls["metrics_url"],
            log_level=args.log_level,
        )
    os.environ["MMC_META_CONFIG_PATH"] = str(path)
    try:
        from memcache_hybrid import MetaService
    except ImportError:
        from lw_memcache.runtime import INSTALL_HINT

        print(INSTALL_HINT, file=sys.stderr)
        return 2
    print(f"lw-memcache: MetaService with {path} (pid {os.getpid()})", file=sys.stderr, flush=True)
    # Blocks until SIGINT/SIGTERM. Only one per machine: it locks /tmp/mmc_meta_service.lock.
    rc = MetaService.main()
    return 0 if rc in (0, None) else 1


READY_MARK = "lw-memcache hold: ready"


def cmd_hold(args: argparse.Namespace) -> int:
    """A client that adds its DRAM to the pool and does nothing else, so objects outlive the
    engines that write them (an object lives in the memory of the client it was placed on)."""
    import signal
    import threading

    from lw_core.backend import BackendError
    from lw_memcache.backend import MemcacheBackend
    from lw_memcache.conf import parse_size, read_conf

    path = Path(args.config)
    if not path.is_file():
        raise ConfError(f"--config {path}: no such file (write one with `lw-memcache config`)")
    conf = read_conf(path)
    size = parse_size(conf.get("ock.mmc.local_service.dram.size", "0"), "ock.mmc.local_service.dram.size", allow_zero=True)
    if size == 0:
        raise ConfError(f"--config {path}: ock.mmc.local_service.dram.size is 0; a holder must lend memory")
    if conf.get("ock.mmc.local_service.protocol") == "host_tcp":
        check_hugepages(size, f"--config {path}")
    stop = threading.Event()
    try:
        backend = MemcacheBackend(str(path), protocol=conf.get("ock.mmc.local_service.protocol", ""))
    except BackendError as e:
        print(f"lw-memcache hold: {e}", file=sys.stderr)
        return 1
    # After init: the library replaces the handlers at init, the backend gives Python's back.
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    print(f"{READY_MARK} ({size} bytes, pid {os.getpid()})", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        backend.close()
    return 0


def cmd_standin(args: argparse.Namespace) -> int:
    from lw_memcache import standin

    home = standin.build(force=args.force)
    if args.install_info:
        standin.ensure_install_info(home)
    for k, v in standin.env(home).items():
        print(f"export {k}={v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lw-memcache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("config", help="write mmc-meta.conf and mmc-local.conf")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--protocol", choices=PROTOCOLS, default="host_shm")
    p.add_argument("--dram-size", default="1GB", help="DRAM each client contributes, e.g. 256MB, 4GB (max 1TB)")
    p.add_argument("--world-size", type=int, default=64, help="most clients in the pool (default 64)")
    p.add_argument("--hcom-port", type=int, default=7000,
                   help="data port for host_tcp/host_rdma (default 7000); each client on a machine needs its own")
    p.add_argument("--hcom-host", default=None,
                   help="address of THIS machine that the client's host_tcp/host_rdma data port binds and other "
                        "machines reach (default: --host, right only on the MetaService's machine); 'auto': each "
                        "client uses its machine's address on the route to the MetaService (one file for all machines)")
    p.add_argument("--client-log-level", choices=LOG_LEVELS, default="error")
    _address_args(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("meta", help="run a MetaService (blocks; one per machine)")
    p.add_argument("--config", help="an mmc-meta.conf; without it one is written from the address options")
    _address_args(p)
    p.set_defaults(func=cmd_meta)

    p = sub.add_parser("hold", help="lend this machine's DRAM to the pool until SIGTERM (objects outlive engines)")
    p.add_argument("--config", required=True, help="an mmc-local.conf with dram.size > 0")
    p.set_defaults(func=cmd_hold)

    p = sub.add_parser("standin", help="build the CPU stand-in for the Ascend runtime and print its environment")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--install-info", action="store_true", help="also write /etc/ascend_install.info if missing (root)")
    p.set_defaults(func=cmd_standin)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfError as e:
        print(f"lw-memcache {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
