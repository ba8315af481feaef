"""``lw-mooncake``: Mooncake's master with every bind address explicit, and a memory-lending client.

    lw-mooncake master --host 10.0.0.5 [--port 50051] [--metrics-port 9003] [-- FLAG...]
    lw-mooncake hold   --master 10.0.0.5:50051 --host 10.0.0.6 --size 4GB
    lw-mooncake config --master 10.0.0.5:50051 [--protocol tcp]   # prints kv_connector_extra_config

``master`` runs ``mooncake_master`` (from the mooncake wheel) with its RPC and metrics servers
bound to ``--host`` (its own defaults bind 0.0.0.0). Its built-in HTTP metadata server stays off:
in mooncake 0.3.13 it binds 0.0.0.0 whatever ``--http_metadata_server_host`` says. Clients use
``P2PHANDSHAKE`` metadata instead (exchanged between clients, no server).
``hold`` is a standing client that lends ``--size`` bytes to the pool and nothing else, so
objects outlive the engines that wrote them; it prints ``ready`` once mounted and exits on SIGTERM.
Note: Mooncake's clients (``hold`` and every engine) still accept transfers on all addresses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30,
          "T": 1 << 40, "TB": 1 << 40}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes like 268435456, 256MB or 4GB (units K, M, G, T)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if not 0 < n <= 1 << 40:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 and at most 1TB")
    return n


def master_binary() -> str:
    try:
        import mooncake
    except ImportError as e:
        sys.exit(f"lw-mooncake: the mooncake package is missing ({e}): pip install 'lw-mooncake[store]'")
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        sys.exit(f"lw-mooncake: {path} is missing from the mooncake wheel")
    return str(path)


def master_argv(host: str, port: int, metrics_port: int, lease_ttl_ms: int, client_ttl_s: int,
                extra: list[str]) -> list[str]:
    return [master_binary(), f"--rpc_address={host}", f"--rpc_port={port}", "--enable_http_metadata_server=false",
            f"--metrics_host={host}", f"--metrics_port={metrics_port}",
            f"--default_kv_lease_ttl={lease_ttl_ms}", f"--client_ttl={client_ttl_s}", *extra]


def cmd_master(a: argparse.Namespace) -> int:
    extra = [x for x in a.extra if x != "--"]
    bad = [x for x in extra if re.match(r"--?(rpc_address|metrics_host|http_metadata_server|enable_http_metadata)", x)]
    if bad:
        sys.exit(f"lw-mooncake master: {bad[0]!r}: bind addresses come from --host, and the HTTP metadata "
                 "server stays off (it would bind 0.0.0.0); clients use P2PHANDSHAKE")
    argv = master_argv(a.host, a.port, a.metrics_port, a.lease_ttl_ms, a.client_ttl, extra)
    os.execv(argv[0], argv)
    return 1  # not reached


def cmd_hold(a: argparse.Namespace) -> int:
    from lw_core.backend import BackendError
    from lw_mooncake.backend import MooncakeBackend

    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    deadline = time.monotonic() + a.wait_s
    while True:  # the master may still be starting
        try:
            b = MooncakeBackend(a.master, metadata_server=a.metadata, protocol=a.protocol, local_hostname=a.host,
                                global_segment_size=a.size, staging_size=1 << 20, setup_timeout_s=a.wait_s)
            break
        except BackendError as e:
            if time.monotonic() > deadline or stop.is_set():
                print(f"lw-mooncake hold: {e}", file=sys.stderr)
                return 1
            time.sleep(0.3)
    print(f"ready {a.host} lends {a.size} bytes to {a.master}", flush=True)
    stop.wait()
    b.close(timeout_s=5)
    return 0


def cmd_config(a: argparse.Namespace) -> int:
    extra = {"backend": "mooncake", "mooncake_master": a.master, "mooncake_protocol": a.protocol}
    if a.metadata != "P2PHANDSHAKE":
        extra["mooncake_metadata_server"] = a.metadata
    print(json.dumps(extra))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lw-mooncake", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("master", help="run mooncake_master bound to --host only")
    m.add_argument("--host", required=True, help="address every server of the master binds (RPC, metadata, metrics)")
    m.add_argument("--port", type=int, default=50051, help="RPC port (default 50051)")
    m.add_argument("--metrics-port", type=int, default=9003, help="metrics port (default 9003)")
    m.add_argument("--lease-ttl-ms", type=int, default=10_000, help="how long a read pins an object (default 10000)")
    m.add_argument("--client-ttl", type=int, default=10, help="seconds until a silent client's memory is dropped (default 10)")
    m.add_argument("extra", nargs=argparse.REMAINDER, help="more mooncake_master flags after --")
    m.set_defaults(fn=cmd_master)
    h = sub.add_parser("hold", help="a client that lends --size bytes to the pool until SIGTERM")
    h.add_argument("--master", required=True, help="the master's host:port")
    h.add_argument("--host", required=True, help="this client's address (others transfer to it)")
    h.add_argument("--size", type=parse_size, required=True, help="bytes to lend, e.g. 4GB")
    h.add_argument("--metadata", default="P2PHANDSHAKE", help="metadata server URL (default P2PHANDSHAKE: none)")
    h.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp")
    h.add_argument("--wait-s", type=float, default=30.0, help="how long to wait for the master (default 30)")
    h.set_defaults(fn=cmd_hold)
    c = sub.add_parser("config", help="print the kv_connector_extra_config selecting this pool")
    c.add_argument("--master", required=True)
    c.add_argument("--metadata", default="P2PHANDSHAKE")
    c.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp")
    c.set_defaults(fn=cmd_config)
    a = p.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
